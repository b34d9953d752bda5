"""Benchmark `ckpt dequant` against the optimum-quanto way, on synthetic quanto checkpoints.

Cases: qint8 with bf16 scales, qint4 with fp16 scales (grouped by 128, float shifts). Each source is an
optimum-quanto save folder (`model.safetensors` + `quanto_qmap.json`) of a Flux-like model (benchlib's
`model_specs`; `--size-gb` is the model's size in bf16), written header-first in a subprocess with
valid quanto encodings (random codes, positive scales), without ckpt code.

Two commands write the same plain bf16/fp16 state dict, each timed as a subprocess with its peak RSS
(`os.wait4`, see benchlib.py):

- ckpt:   `ckpt dequant SRC -o OUT -q` (streams tensor by tensor, fsyncs its output);
- quanto: the optimum-quanto way: build the model on the meta device, `safetensors.torch.load_file`
          + `optimum.quanto.requantize` (what `QuantizedDiffusersModel.from_pretrained` does), then
          `.dequantize()` every quantized weight, `save_file` and fsync.

Each case also times `cp` + `sync` of ckpt's output (the yardstick: ckpt's wall time is printed as a
ratio of it) and checks ckpt's peak RSS against import baseline (`python -c "import torch"`, with a CUDA
context for `--device cuda`) + 2x the largest tensor + the pipeline's buffers + 300 MB. `--device`
runs ckpt on cpu or cuda; `--workdir` (alias `--work`) chooses tmpfs (/dev/shm) or a disk.

The outputs are compared bit for bit (exit 1 if they differ). fp16 scales for qint4 because on CPU
optimum-quanto re-packs bf16 qint4 weights for TinyGemm, whose bf16 shift round trip is lossy: the
quanto way would then not reproduce the stored values. The page cache is warmed by reading each source
once before timing (dropping it needs root). `--quanto-way SRC DST --size-gb X` is the internal entry
point of the baseline; `--generate` that of the generator. Only the standard library is imported here.
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

CASES = {"qint8-bf16": ("qint8", "bf16"), "qint4-fp16": ("qint4", "fp16")}
ST = {"bf16": "BF16", "fp16": "F16", "I8": "I8", "U8": "U8"}
SIZE = {"BF16": 2, "F16": 2, "I8": 1, "U8": 1}


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def params_for(size_gb: float) -> int:
    return int(size_gb * 1e9 / 2)


# ------------------------------------------------------------------------------- synthetic source

def quanto_entries(model, qtype: str, dt: str) -> list[tuple[str, str, tuple[int, ...], str]]:
    """(name, safetensors dtype, shape, kind) of an optimum-quanto state dict (FORMATS.md)."""
    out = []
    for s in model.specs:
        if s.role != "linear":
            out.append((s.name, ST[dt], s.shape, "plain"))
            continue
        rows, cols = s.shape
        stem = s.name[: -len(".weight")]
        if qtype == "qint8":
            out += [(s.name + "._data", "I8", s.shape, "codes"), (s.name + "._scale", ST[dt], (rows, 1), "scale")]
        else:
            g = next((g for g in (128, 96, 64, 32) if cols > 128 and cols % g == 0), None)
            urows, inner = ((rows * cols // g), g) if g else (rows, cols)
            out += [(s.name + "._data._data", "U8", (-(-urows // 2), inner), "codes"),
                    (s.name + "._scale", ST[dt], (urows, 1), "scale"), (s.name + "._shift", ST[dt], (urows, 1), "shift")]
        out += [(stem + ".input_scale", ST[dt], (), "one"), (stem + ".output_scale", ST[dt], (), "one")]
    return out


def write_source(folder: str, size_gb: float, qtype: str, dt: str) -> dict:
    import torch

    tdt = {"BF16": torch.bfloat16, "F16": torch.float16}
    model = bl.model_specs(params_for(size_gb))
    entries = quanto_entries(model, qtype, dt)
    g = torch.Generator().manual_seed(0)
    base = torch.randn(1 << 22, generator=g)
    pools = {
        "codes": (torch.randint(0, 256, (1 << 22,), generator=g, dtype=torch.uint8) if qtype == "qint4"
                  else torch.randint(-127, 128, (1 << 22,), generator=g, dtype=torch.int8).view(torch.uint8)),
        "plain": base * 0.02,
        "scale": base.abs() * 0.02 / 64 + 1e-5,
        "shift": base * 0.02,
        "one": torch.ones(1 << 22),
    }
    raw = {}
    ordered = sorted(entries, key=lambda e: (-SIZE[e[1]], e[0]))
    header, pos = {"__metadata__": {"format": "pt", "generator": "ckpt scripts/bench_dequant.py"}}, 0
    for name, sdt, shape, kind in ordered:
        n = 1
        for d in shape:
            n *= d
        header[name] = {"dtype": sdt, "shape": list(shape), "data_offsets": [pos, pos + n * SIZE[sdt]]}
        pos += n * SIZE[sdt]
    js = json.dumps(header, separators=(",", ":")).encode()
    js += b" " * (-(8 + len(js)) % 8)
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, "model.safetensors")
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(js)) + js)
        for i, (name, sdt, shape, kind) in enumerate(ordered):
            key = (kind, sdt)
            if key not in raw:
                v = pools[kind]
                v = v if kind == "codes" else v.to(tdt[sdt])
                b = v.view(torch.uint8).numpy().tobytes()
                raw[key] = memoryview(b + b)
            pool = raw[key]
            plen = len(pool) // 2
            size = header[name]["data_offsets"][1] - header[name]["data_offsets"][0]
            start = 0 if kind == "one" else (i * 104729 * SIZE[sdt]) % plen
            while size:
                take = min(size, plen)
                f.write(pool[start:start + take])
                start = (start + take) % plen
                size -= take
    qmap = {s.name[: -len(".weight")]: {"weights": qtype, "activations": "none"} for s in model.specs if s.role == "linear"}
    Path(folder, "quanto_qmap.json").write_text(json.dumps(qmap, indent=1))
    big = model.largest
    return {"bytes": os.path.getsize(path), "tensors": len(entries), "params": model.params,
            "largest": big.name, "largest_shape": list(big.shape), "largest_numel": big.numel}


# ------------------------------------------------------------------------------ the quanto way

def quanto_way(src: str, dst: str, size_gb: float) -> None:
    import torch
    from optimum.quanto import QModuleMixin, requantize
    from safetensors.torch import load_file, save_file

    model_specs = bl.model_specs(params_for(size_gb))
    with torch.device("meta"):
        root = torch.nn.Module()
        for s in model_specs.specs:
            path, attr = s.name.rsplit(".", 1)
            parent = root
            parts = path.split(".")
            for i, part in enumerate(parts):
                if not hasattr(parent, part):
                    last = i == len(parts) - 1
                    if last and s.role == "linear":
                        parent.add_module(part, torch.nn.Linear(s.shape[1], s.shape[0]))
                    else:
                        parent.add_module(part, torch.nn.Module())
                parent = getattr(parent, part)
            if not (s.role == "linear" or (s.role == "bias" and isinstance(parent, torch.nn.Linear))):
                parent.register_parameter(attr, torch.nn.Parameter(torch.empty(s.shape)))
    state_dict = load_file(os.path.join(src, "model.safetensors"))
    qmap = json.loads(Path(src, "quanto_qmap.json").read_text())
    dtype = next(v.dtype for k, v in state_dict.items() if k.endswith("._scale"))
    root.to(dtype)
    requantize(root, state_dict=state_dict, quantization_map=qmap, device=torch.device("cpu"))
    out = {}
    with torch.no_grad():
        for name, m in root.named_modules():
            if isinstance(m, QModuleMixin):
                out[name + ".weight"] = m.weight.dequantize().contiguous()
                out[name + ".bias"] = m.bias.detach()
        for name, p in root.named_parameters():
            if name not in out:
                out[name] = p.detach()
    os.makedirs(dst, exist_ok=True)
    path = os.path.join(dst, "model.safetensors")
    save_file(out, path, metadata={"format": "pt"})
    fd = os.open(path, os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)


# ------------------------------------------------------------------------------------- driver

def warm(path: Path) -> None:
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(16 << 20)
        while f.readinto(buf):
            pass


def run_case(name: str, size_gb: float, work: Path, verify: bool, device: str = "cpu",
             baseline: bl.Measurement | None = None) -> tuple[list[list], dict]:
    qtype, dt = CASES[name]
    src = work / f"{name}-src"
    log(f"[{name}] generating {size_gb} GB (bf16-equivalent) quanto {qtype} source ...")
    gen = bl.run_py(__file__, "--generate", src, "--size-gb", size_gb, "--qtype", qtype, "--dtype", dt)
    info = json.loads(gen.stdout.strip().splitlines()[-1])
    warm(src / "model.safetensors")
    rows, outs, verdict = [], {}, {}
    for variant in ("ckpt", "quanto"):
        dst = work / f"{name}-{variant}"
        argv = (bl.ckpt_argv("dequant", src, "-o", dst, "--device", device, "-q") if variant == "ckpt" else
                [sys.executable, __file__, "--quanto-way", src, dst, "--size-gb", size_gb])
        log(f"[{name}] {variant} ...")
        m = bl.measure(argv)
        outs[variant] = dst / "model.safetensors"
        out_bytes = outs[variant].stat().st_size
        rows.append([name, bl.fmt_gb(info["bytes"]), bl.fmt_gb(out_bytes), variant, f"{m.seconds:.1f}",
                     bl.fmt_mb(m.peak_rss), bl.gbps(out_bytes, m.seconds)])
        if variant == "ckpt":
            log(f"[{name}] cp + sync of the output ...")
            cp = bl.cp_baseline(outs[variant], work / f"{name}-cp.safetensors")
            rows.append([name, "-", bl.fmt_gb(out_bytes), "cp + sync", f"{cp.seconds:.1f}", bl.fmt_mb(cp.peak_rss),
                         bl.gbps(out_bytes, cp.seconds)])
            if baseline is not None:
                src_item = 1 if qtype == "qint8" else 0.5
                lines, vals = bl.verdict_lines(name, m, cp, out_bytes, baseline, info["largest_numel"] * 2,
                                               int(bl.pipeline_bytes(src_item, 2)))
                verdict = {"lines": lines, **vals}
    same = bl.compare(outs["ckpt"], outs["quanto"]) if verify else {"equal": None}
    for variant in ("ckpt", "quanto"):
        shutil.rmtree(work / f"{name}-{variant}", ignore_errors=True)
    shutil.rmtree(src, ignore_errors=True)
    return rows, {"case": name, "source": info, "identical": same, "verdict": verdict}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-gb", type=float, default=0.3, help="model size in bf16 (default 0.3)")
    ap.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, from {', '.join(CASES)}")
    bl.add_run_args(ap, workdir_alias="--work")
    ap.add_argument("--no-verify", action="store_true", help="skip the bitwise comparison of the outputs")
    ap.add_argument("--json", help="also write the results as JSON here")
    ap.add_argument("--generate", metavar="FOLDER", help=argparse.SUPPRESS)
    ap.add_argument("--quanto-way", nargs=2, metavar=("SRC", "DST"), help=argparse.SUPPRESS)
    ap.add_argument("--qtype", default="qint8", help=argparse.SUPPRESS)
    ap.add_argument("--dtype", default="bf16", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.generate:
        print(json.dumps(write_source(a.generate, a.size_gb, a.qtype, a.dtype)))
        return 0
    if a.quanto_way:
        quanto_way(a.quanto_way[0], a.quanto_way[1], a.size_gb)
        return 0
    cases = [c.strip() for c in a.cases.split(",") if c.strip()]
    unknown = [c for c in cases if c not in CASES]
    if unknown:
        ap.error(f"unknown case(s) {unknown}; choose from {', '.join(CASES)}")
    floor = bl.launcher_floor()
    baseline = bl.import_baseline(a.device)
    if a.workdir:  # a folder that does not exist yet is made, as bench_convert/bench_merge do
        Path(a.workdir).mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=a.workdir) as tmp:
        work = Path(tmp)
        rows, results = [], []
        for c in cases:
            r, res = run_case(c, a.size_gb, work, not a.no_verify, a.device, baseline)
            rows += r
            results.append(res)
    print("\n".join(bl.machine_lines()))
    print(f"device: {a.device}; files in {a.workdir or tempfile.gettempdir()} ({bl.where(a.workdir or tempfile.gettempdir())})")
    print(f"launcher RSS floor (every peak below includes it): {bl.fmt_mb(floor)} MB\n")
    print(bl.markdown_table(["case", "source GB", "output GB", "tool", "seconds", "peak RSS MB", "output GB/s"], rows))
    print()
    bad = False
    for res in results:
        same = res["identical"]["equal"]
        print(f"{res['case']}: largest tensor {res['source']['largest']} {res['source']['largest_shape']}; "
              f"outputs identical: {'not checked' if same is None else same}"
              + (f" ({res['identical']['problem']})" if same is False else ""))
        bad |= same is False
        for line in res["verdict"].get("lines", []):
            print(line)
    if a.json:
        Path(a.json).write_text(json.dumps({"rows": rows, "results": results, "floor": floor}, indent=1))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
