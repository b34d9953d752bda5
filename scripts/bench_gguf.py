"""Benchmark GGUF both ways against the ComfyUI-GGUF / llama.cpp Python way, on a synthetic Flux model.

Source: a Flux-shaped model in the original (BFL) layout, bf16 (`double_blocks.N.img_attn.qkv`,
`single_blocks.N.linear1`, ... at Flux's width 3072 once the size allows it; `--size-gb` is its bf16
size), written header-first in a subprocess without ckpt code. Two cases, each run by two tools as
subprocesses timed with their peak RSS (`os.wait4`, see benchlib.py), all outputs fsynced:

- bf16 -> GGUF Q8_0
  ckpt:     `ckpt convert SRC --to gguf-q8_0 -o OUT -q` (tensor by tensor, band by band);
  baseline: what ComfyUI-GGUF's tools/convert.py and llama.cpp's convert_hf_to_gguf.py do in Python:
            `safetensors.torch.load_file` (whole model), `gguf.quants.quantize` per tensor with the same
            per-tensor types (Flux rules: 1-D and <= 1024 values F32, input/output layers BF16, rows
            not a multiple of 32 BF16, other 2-D weights Q8_0), `gguf.GGUFWriter` (holds every
            quantized tensor until it writes).
  check:    the two files hold the same tensors, types, shapes and bytes (gguf's reader).
- GGUF Q8_0 -> bf16 (the Q8_0 file ckpt just wrote)
  ckpt:     `ckpt convert SRC.gguf --to bf16 -o OUT.safetensors -q`;
  baseline: `gguf.GGUFReader` + `gguf.quants.dequantize` of every tensor into memory (how ComfyUI-GGUF
            and transformers load a GGUF), cast to bf16, `save_file`.
  check:    the two safetensors files are identical tensor by tensor.

Each case also times `cp` + `sync` of ckpt's output (ckpt's wall time is printed as a ratio of it) and
checks ckpt's peak RSS against import baseline (`python -c "import torch"`, with a CUDA context for
`--device cuda`) + 2x the largest tensor + the pipeline's buffers + 300 MB. `--device` is passed to ckpt
(GGUF quantization itself runs on the CPU in either case); `--workdir` (alias `--work`) chooses tmpfs
(/dev/shm) or a disk.

Only the standard library is imported here (benchlib); `--generate`, `--to-gguf` and `--from-gguf` are
the internal entry points of the generator and the baselines.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import struct
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib as bl  # noqa: E402

KEEP = ("txt_in.", "img_in.", "time_in.", "vector_in.", "guidance_in.", "final_layer.")  # ComfyUI-GGUF, Flux


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------- synthetic source

def flux_specs(size_gb: float) -> list[tuple[str, tuple[int, ...]]]:
    """Flux's tensor list (BFL names); double and single blocks in Flux's 19:38 ratio, as many as fit."""
    params = size_gb * 1e9 / 2
    h = next(w for w in (3072, 2048, 1536, 1024, 768, 512, 256) if 3 * 66 * w * w <= params or w == 256)
    hd = 128 if h >= 1024 else 64
    top = [("img_in.weight", (h, 64)), ("img_in.bias", (h,)), ("txt_in.weight", (h, 4096)), ("txt_in.bias", (h,)),
           ("time_in.in_layer.weight", (h, 256)), ("time_in.in_layer.bias", (h,)),
           ("time_in.out_layer.weight", (h, h)), ("time_in.out_layer.bias", (h,)),
           ("vector_in.in_layer.weight", (h, 768)), ("vector_in.in_layer.bias", (h,)),
           ("vector_in.out_layer.weight", (h, h)), ("vector_in.out_layer.bias", (h,)),
           ("guidance_in.in_layer.weight", (h, 256)), ("guidance_in.in_layer.bias", (h,)),
           ("guidance_in.out_layer.weight", (h, h)), ("guidance_in.out_layer.bias", (h,)),
           ("final_layer.adaLN_modulation.1.weight", (2 * h, h)), ("final_layer.adaLN_modulation.1.bias", (2 * h,)),
           ("final_layer.linear.weight", (64, h)), ("final_layer.linear.bias", (64,))]

    def double(i):
        p, out = f"double_blocks.{i}.", []
        for s in ("img", "txt"):
            for name, shape in ((f"{s}_mod.lin", (6 * h, h)), (f"{s}_attn.qkv", (3 * h, h)), (f"{s}_attn.proj", (h, h)),
                                (f"{s}_mlp.0", (4 * h, h)), (f"{s}_mlp.2", (h, 4 * h))):
                out += [(p + name + ".weight", shape), (p + name + ".bias", (shape[0],))]
            out += [(p + f"{s}_attn.norm.query_norm.scale", (hd,)), (p + f"{s}_attn.norm.key_norm.scale", (hd,))]
        return out

    def single(i):
        p = f"single_blocks.{i}."
        return [(p + "linear1.weight", (7 * h, h)), (p + "linear1.bias", (7 * h,)),
                (p + "linear2.weight", (h, 5 * h)), (p + "linear2.bias", (h,)),
                (p + "modulation.lin.weight", (3 * h, h)), (p + "modulation.lin.bias", (3 * h,)),
                (p + "norm.query_norm.scale", (hd,)), (p + "norm.key_norm.scale", (hd,))]

    per_pair = 36 * h * h + 2 * 15 * h * h  # one double block (36 h^2) + two single blocks (15 h^2 each), 19:38
    n = max(1, round((params - sum(_numel(s) for _, s in top)) / per_pair))
    specs = list(top)
    for i in range(n):
        specs += double(i)
    for i in range(2 * n):
        specs += single(i)
    return specs


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def write_source(path: str, size_gb: float) -> dict:
    import torch

    specs = flux_specs(size_gb)
    g = torch.Generator().manual_seed(0)
    raw = (torch.randn(1 << 22, generator=g) * 0.02).to(torch.bfloat16).view(torch.uint8).numpy().tobytes()
    pool = memoryview(raw + raw)
    plen = len(pool) // 2
    header, pos = {"__metadata__": {"format": "pt", "generator": "ckpt scripts/bench_gguf.py"}}, 0
    for name, shape in sorted(specs):
        size = 2 * _numel(shape)
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [pos, pos + size]}
        pos += size
    js = json.dumps(header, separators=(",", ":")).encode()
    js += b" " * (-(8 + len(js)) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(js)) + js)
        for i, (name, shape) in enumerate(sorted(specs)):
            size, start = 2 * _numel(shape), (i * 104729 * 2) % plen
            while size:
                take = min(size, plen)
                f.write(pool[start:start + take])
                start = (start + take) % plen
                size -= take
    big = max(specs, key=lambda s: _numel(s[1]))
    return {"bytes": os.path.getsize(path), "tensors": len(specs), "params": sum(_numel(s) for _, s in specs),
            "largest": big[0], "largest_shape": list(big[1])}


# ------------------------------------------------------------------------------------ baselines

def baseline_type(name: str, shape) -> str:
    n = _numel(shape)
    if len(shape) == 1 or n <= 1024:
        t1 = "F32"
    else:
        t1 = "BF16"
    quantize = name.endswith("weight") and len(shape) == 2 and not any(k in name for k in KEEP) and shape[-1] % 32 == 0
    return "Q8_0" if quantize else t1


def to_gguf_baseline(src: str, dst: str) -> None:
    import gguf
    from safetensors.torch import load_file

    sd = load_file(src)  # the whole model, as convert.py does
    w = gguf.GGUFWriter(dst, arch="flux")
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0)
    for name, t in sd.items():
        qt = gguf.GGMLQuantizationType[baseline_type(name, tuple(t.shape))]
        w.add_tensor(name, gguf.quants.quantize(t.float().numpy(), qt), raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    _fsync(dst)


def from_gguf_baseline(src: str, dst: str) -> None:
    import gguf
    import torch
    from safetensors.torch import save_file

    r = gguf.GGUFReader(src)
    out = {}
    for t in r.tensors:  # everything dequantized into memory, as a full load does
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        out[t.name] = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).reshape(shape)).to(torch.bfloat16)
    save_file(out, dst, metadata={"format": "pt"})
    _fsync(dst)


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)


def compare_gguf(a: str, b: str) -> dict:
    import gguf
    import numpy as np

    ta = {t.name: t for t in gguf.GGUFReader(a).tensors}
    tb = {t.name: t for t in gguf.GGUFReader(b).tensors}
    if set(ta) != set(tb):
        return {"equal": False, "problem": f"names differ: {sorted(set(ta) ^ set(tb))[:5]}"}
    for n in ta:
        x, y = ta[n], tb[n]
        if x.tensor_type != y.tensor_type or x.shape.tolist() != y.shape.tolist():
            return {"equal": False, "problem": f"{n}: {x.tensor_type.name}{x.shape.tolist()} vs "
                                               f"{y.tensor_type.name}{y.shape.tolist()}"}
        if not np.array_equal(np.asarray(x.data).view(np.uint8), np.asarray(y.data).view(np.uint8)):
            return {"equal": False, "problem": f"{n}: bytes differ"}
    return {"equal": True, "problem": None, "tensors": len(ta)}


# ------------------------------------------------------------------------------------- driver

def warm(path: Path) -> None:
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(16 << 20)
        while f.readinto(buf):
            pass


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-gb", type=float, default=0.3, help="model size in bf16 (default 0.3)")
    bl.add_run_args(ap, workdir_alias="--work")
    ap.add_argument("--no-verify", action="store_true", help="skip comparing the outputs")
    ap.add_argument("--json", help="also write the results as JSON here")
    ap.add_argument("--generate", metavar="PATH", help=argparse.SUPPRESS)
    ap.add_argument("--to-gguf", nargs=2, metavar=("SRC", "DST"), help=argparse.SUPPRESS)
    ap.add_argument("--from-gguf", nargs=2, metavar=("SRC", "DST"), help=argparse.SUPPRESS)
    ap.add_argument("--compare-gguf", nargs=2, metavar=("A", "B"), help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.generate:
        print(json.dumps(write_source(a.generate, a.size_gb)))
        return 0
    if a.to_gguf:
        to_gguf_baseline(*a.to_gguf)
        return 0
    if a.from_gguf:
        from_gguf_baseline(*a.from_gguf)
        return 0
    if a.compare_gguf:
        print(json.dumps(compare_gguf(*a.compare_gguf)))
        return 0
    floor = bl.launcher_floor()
    baseline = bl.import_baseline(a.device)
    dev = ["--device", a.device]
    rows, checks, verdicts = [], {}, {}

    def yardstick(case: str, m, out: Path, largest_bytes: int) -> None:
        cp = bl.cp_baseline(out, out.with_name("cp-" + out.name))
        rows.append([case, "cp + sync", bl.fmt_gb(out.stat().st_size), f"{cp.seconds:.1f}", bl.fmt_mb(cp.peak_rss)])
        lines, vals = bl.verdict_lines(case, m, cp, out.stat().st_size, baseline, largest_bytes, bl.pipeline_bytes(2, 2))
        verdicts[case] = {"lines": lines, **vals}

    if a.workdir:  # a folder that does not exist yet is made, as bench_convert/bench_merge do
        Path(a.workdir).mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=a.workdir) as tmp:
        work = Path(tmp)
        src = work / "flux-bf16.safetensors"
        log(f"generating a {a.size_gb} GB bf16 Flux-shaped source ...")
        info = json.loads(bl.run_py(__file__, "--generate", src, "--size-gb", a.size_gb).stdout.strip().splitlines()[-1])
        warm(src)
        outs = {}
        for tool in ("ckpt", "baseline"):
            dst = work / f"{tool}-Q8_0.gguf"
            argv = (bl.ckpt_argv("convert", src, "--to", "gguf-q8_0", "-o", dst, *dev, "-q") if tool == "ckpt"
                    else [sys.executable, __file__, "--to-gguf", src, dst])
            log(f"bf16 -> GGUF Q8_0: {tool} ...")
            m = bl.measure(argv)
            outs[tool] = dst
            rows.append(["bf16 -> GGUF Q8_0", tool, bl.fmt_gb(dst.stat().st_size), f"{m.seconds:.1f}",
                         bl.fmt_mb(m.peak_rss)])
            if tool == "ckpt":
                yardstick("bf16 -> GGUF Q8_0", m, dst, 2 * _numel(info["largest_shape"]))
        if not a.no_verify:
            checks["to_gguf"] = json.loads(bl.run_py(__file__, "--compare-gguf", outs["ckpt"], outs["baseline"],
                                                     check=False).stdout.strip().splitlines()[-1])
        gguf_src = outs["ckpt"]
        outs["baseline"].unlink()
        warm(gguf_src)
        back = {}
        for tool in ("ckpt", "baseline"):
            dst = work / f"{tool}-bf16.safetensors"
            argv = (bl.ckpt_argv("convert", gguf_src, "--to", "bf16", "-o", dst, *dev, "-q") if tool == "ckpt"
                    else [sys.executable, __file__, "--from-gguf", gguf_src, dst])
            log(f"GGUF Q8_0 -> bf16: {tool} ...")
            m = bl.measure(argv)
            back[tool] = dst
            rows.append(["GGUF Q8_0 -> bf16", tool, bl.fmt_gb(dst.stat().st_size), f"{m.seconds:.1f}",
                         bl.fmt_mb(m.peak_rss)])
            if tool == "ckpt":
                yardstick("GGUF Q8_0 -> bf16", m, dst, 2 * _numel(info["largest_shape"]))
        if not a.no_verify:
            checks["from_gguf"] = bl.compare(back["ckpt"], back["baseline"])
        shutil.rmtree(work, ignore_errors=True)
    print("\n".join(bl.machine_lines()))
    print(f"device: {a.device}; files in {a.workdir or tempfile.gettempdir()} ({bl.where(a.workdir or tempfile.gettempdir())})")
    print(f"launcher RSS floor (every peak below includes it): {bl.fmt_mb(floor)} MB")
    print(f"source: {bl.fmt_gb(info['bytes'])} GB bf16, {info['tensors']} tensors, {info['params'] / 1e9:.2f} G "
          f"parameters, largest {info['largest']} {info['largest_shape']}\n")
    print(bl.markdown_table(["case", "tool", "output GB", "seconds", "peak RSS MB"], rows))
    print()
    for v in verdicts.values():
        print("\n".join(v["lines"]))
    bad = False
    for case, res in checks.items():
        print(f"{case}: outputs identical: {res['equal']}" + (f" ({res['problem']})" if res.get("problem") else ""))
        bad |= not res["equal"]
    if a.json:
        Path(a.json).write_text(json.dumps({"rows": rows, "checks": checks, "source": info, "floor": floor, "verdicts": verdicts}, indent=1))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
