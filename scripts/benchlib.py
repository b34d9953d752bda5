"""Shared helpers for the benchmark scripts (bench_convert.py, and the merge / dequant benches).

Why the shape of this module:

- Peak RSS is measured with `os.wait4` (the child's `ru_maxrss`, which also covers grandchildren it
  waited for, e.g. `cp` under `sh -c`). On Linux a child's `ru_maxrss` starts at the RSS high-water mark
  of the process that spawned it (fork/vfork + exec carries the old mm's high-water mark over), so the
  process that launches measured commands must stay small. This module therefore imports only the
  standard library at module level; everything that needs torch (generating checkpoints, comparing
  outputs, the "naive" baselines) runs in a subprocess. `launcher_floor()` reports the resulting floor.
- Synthetic checkpoints have realistic tensor sizes (a Flux/MMDiT-like mix: a few large matrices,
  many medium ones, small norms and biases) and are written header-first, tensor by tensor, in chunks
  tiled from a pool of random values, so generating a multi-GB file needs little memory and no ckpt
  code (the benchmark must not depend on the code it measures to build its inputs).

Public API (stdlib-only; safe to import in a benchmark's parent process):
    machine_info(), machine_lines()         cores, RAM, CPU model, versions
    measure(argv) -> Measurement            wall seconds + peak RSS of a subprocess
    launcher_floor()                        the RSS every measured child inherits from us
    ckpt_argv(*args)                        argv running the real `ckpt` CLI
    model_specs(params) -> Model            Flux-like tensor list with about `params` elements
    generate(path, params, dtype, layout)   write a synthetic checkpoint (in a subprocess)
    compare(a, b)                           bitwise comparison of two safetensors files (subprocess)
    markdown_table(headers, rows)           a table ready to paste into docs/benchmarks.md
    add_run_args(ap)                        --device cpu|cuda (bench_lora: |auto) and --workdir, the same in every bench
    where(path)                             "tmpfs" / "disk (ext4)": what --workdir measures
    cp_baseline(src, dst)                   `cp` + `sync` of the output's bytes (the speed yardstick)
    import_baseline(device)                 `python -c "import torch"` (+ a CUDA context on cuda)
    llama_folder(path, size_mb, tokenizer)  a bf16 Llama HF folder of about size_mb MiB (subprocess), read once
    rss_bound(...) / verdict_lines(...)     the issue's RSS bound and the ratio lines every bench prints
    fmt_gb / fmt_mb / gbps                  number formatting

Run as a script for the subprocess side: `python benchlib.py generate OUT --params N --dtype bf16
[--layout comfy-scaled-fp8]` and `python benchlib.py compare A B`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import struct
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from importlib import metadata as _md
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

ITEMSIZE = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8_e4m3fn": 1}
ST_DTYPE = {"fp32": "F32", "bf16": "BF16", "fp16": "F16", "fp8_e4m3fn": "F8_E4M3"}
LAYOUTS = ("plain", "comfy-scaled-fp8", "flux2-bfl")


class BenchError(RuntimeError):
    """A measured command or a helper subprocess failed; the message carries its stderr tail."""


# ----------------------------------------------------------------------------------------- machine

def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _mem_total() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _version(dist: str) -> str:
    try:
        return _md.version(dist)
    except _md.PackageNotFoundError:
        return "not installed"


def machine_info() -> dict:
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {
        "cpu": _cpu_model(),
        "cores": os.cpu_count(),
        "usable_cores": usable,
        "ram": _mem_total(),
        "os": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
        "torch": _version("torch"),
        "safetensors": _version("safetensors"),
        "ckpt": _version("ckpt-toolkit"),
    }


def machine_lines() -> list[str]:
    m = machine_info()
    return [
        f"machine: {m['cpu']}, {m['cores']} cores ({m['usable_cores']} usable), {fmt_gb(m['ram'])} GB RAM, {m['os']}",
        f"software: python {m['python']}, torch {m['torch']}, safetensors {m['safetensors']}, ckpt {m['ckpt']}",
    ]


# --------------------------------------------------------------------------------------- measuring

@dataclass
class Measurement:
    argv: list[str]
    seconds: float
    peak_rss: int  # bytes, max over the child and the descendants it waited for
    returncode: int
    stdout: str
    stderr: str
    floor: int = 0  # our own peak RSS at spawn: peak_rss is never below it (see the module docstring)


def _maxrss_bytes(ru_maxrss: int) -> int:
    return ru_maxrss if sys.platform == "darwin" else ru_maxrss * 1024  # Linux reports KiB


def own_peak_rss() -> int:
    return _maxrss_bytes(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)


def measure(argv: list[str], *, cwd=None, env=None, check: bool = True) -> Measurement:
    """Run argv to completion; wall time from spawn to reap, peak RSS from `wait4`'s rusage.

    Output goes to temporary files (not pipes), so nothing has to be drained while we wait. Dirty pages
    left by earlier steps (generating sources, a previous variant's output) are flushed first, untimed,
    so that no variant pays for another's writeback."""
    argv = [str(a) for a in argv]
    os.sync()
    floor = own_peak_rss()
    with tempfile.TemporaryFile() as fo, tempfile.TemporaryFile() as fe:
        t0 = time.perf_counter()
        p = subprocess.Popen(argv, stdout=fo, stderr=fe, cwd=cwd, env=env)
        _, status, ru = os.wait4(p.pid, 0)
        seconds = time.perf_counter() - t0
        p.returncode = rc = os.waitstatus_to_exitcode(status)  # reaped here; tell Popen
        fo.seek(0), fe.seek(0)
        out, err = fo.read().decode(errors="replace"), fe.read().decode(errors="replace")
    m = Measurement(argv, seconds, _maxrss_bytes(ru.ru_maxrss), rc, out, err, floor)
    if check and rc != 0:
        tail = "\n".join((err or out).strip().splitlines()[-15:])
        raise BenchError(f"command failed (exit {rc}): {' '.join(argv)}\n{tail}")
    return m


def launcher_floor() -> int:
    """Peak RSS reported for `true`: the part of every measured child's figure inherited from us."""
    return measure(["true"]).peak_rss


def ckpt_argv(*args) -> list[str]:
    """The real CLI: the `ckpt` console script beside this interpreter, else `python -m ckpt.cli`."""
    exe = Path(sys.executable).parent / "ckpt"
    head = [str(exe)] if exe.exists() else [sys.executable, "-m", "ckpt.cli"]
    return head + [str(a) for a in args]


def run_py(*args, check: bool = True) -> Measurement:
    """Run this module (or another script) as a subprocess with the current interpreter."""
    return measure([sys.executable, *map(str, args)], check=check)


# ----------------------------------------------------------------------------------- model shapes

@dataclass(frozen=True)
class Spec:
    name: str
    shape: tuple[int, ...]
    role: str  # "linear" (a matrix; fp8-quantized in scaled layouts), "bias", "norm"

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass
class Model:
    hidden: int
    blocks: int
    specs: list[Spec] = field(default_factory=list)

    @property
    def params(self) -> int:
        return sum(s.numel for s in self.specs)

    @property
    def largest(self) -> Spec:
        return max(self.specs, key=lambda s: s.numel)


WIDTHS = (3072, 2048, 1536, 1024, 768, 512, 256, 128, 64)
PER_BLOCK = 18  # block params ~ 18 * hidden^2 (see _block)


def _block(i: int, h: int) -> list[Spec]:
    """One MMDiT/Flux-like block: modulation (the largest matrix, like Flux's 18432x3072), fused qkv,
    output projection, a 4x MLP, their biases, RMSNorm scales of the attention heads (head dim 128)
    and two layer norms."""
    p = f"blocks.{i}."
    mats = {"mod.lin": (6 * h, h), "attn.qkv": (3 * h, h), "attn.proj": (h, h), "mlp.fc1": (4 * h, h),
            "mlp.fc2": (h, 4 * h)}
    out = []
    for name, shape in mats.items():
        out.append(Spec(p + name + ".weight", shape, "linear"))
        out.append(Spec(p + name + ".bias", (shape[0],), "bias"))
    hd = min(128, h)
    out += [Spec(p + "attn.norm.query_norm.scale", (hd,), "norm"), Spec(p + "attn.norm.key_norm.scale", (hd,), "norm"),
            Spec(p + "norm1.weight", (h,), "norm"), Spec(p + "norm2.weight", (h,), "norm")]
    return out


def model_specs(params: int) -> Model:
    """A Flux-like model of about `params` elements: the widest hidden size (3072 at most) that still
    gives at least 4 blocks, then as many blocks as fit, plus input/time/final layers."""
    h = next((w for w in WIDTHS if 4 * PER_BLOCK * w * w <= params), WIDTHS[-1])
    n = max(1, round(params / (PER_BLOCK * h * h)))
    m = Model(h, n)
    m.specs += [Spec("img_in.weight", (h, 64), "linear"), Spec("img_in.bias", (h,), "bias"),
                Spec("time_in.in_layer.weight", (h, 256), "linear"), Spec("time_in.in_layer.bias", (h,), "bias"),
                Spec("time_in.out_layer.weight", (h, h), "linear"), Spec("time_in.out_layer.bias", (h,), "bias")]
    for i in range(n):
        m.specs += _block(i, h)
    m.specs += [Spec("final_layer.norm.weight", (h,), "norm"), Spec("final_layer.linear.weight", (64, h), "linear"),
                Spec("final_layer.linear.bias", (64,), "bias")]
    return m


def flux2_specs(params: int) -> Model:
    """A Flux.2-like model in its original (BFL) layout, real names and proportions: heads of 128, gated
    MLPs of 3x width, fused `qkv` in double blocks, fused qkv + MLP `linear1` (9 x width rows, the largest
    tensor) in single blocks, 6 single blocks per double block (Flux.2 dev: 8 and 48), no biases."""
    unit = 26 + 6 * 13  # params of one double block and six single blocks, in hidden^2
    h = next((w for w in WIDTHS if unit * w * w <= params), WIDTHS[-1])
    n = max(1, round(params / (unit * h * h)))
    m = Model(h, 7 * n)
    hd = min(128, h)
    m.specs += [Spec("img_in.weight", (h, 128), "linear"), Spec("txt_in.weight", (h, h), "linear"),
                Spec("time_in.in_layer.weight", (h, 256), "linear"), Spec("time_in.out_layer.weight", (h, h), "linear"),
                Spec("guidance_in.in_layer.weight", (h, 256), "linear"),
                Spec("guidance_in.out_layer.weight", (h, h), "linear"),
                Spec("double_stream_modulation_img.lin.weight", (6 * h, h), "linear"),
                Spec("double_stream_modulation_txt.lin.weight", (6 * h, h), "linear"),
                Spec("single_stream_modulation.lin.weight", (3 * h, h), "linear"),
                Spec("final_layer.linear.weight", (128, h), "linear"),
                Spec("final_layer.adaLN_modulation.1.weight", (2 * h, h), "linear")]
    for i in range(n):
        for s in ("img", "txt"):
            b = f"double_blocks.{i}.{s}"
            m.specs += [Spec(f"{b}_attn.qkv.weight", (3 * h, h), "linear"), Spec(f"{b}_attn.proj.weight", (h, h), "linear"),
                        Spec(f"{b}_attn.norm.query_norm.scale", (hd,), "norm"),
                        Spec(f"{b}_attn.norm.key_norm.scale", (hd,), "norm"),
                        Spec(f"{b}_mlp.0.weight", (6 * h, h), "linear"), Spec(f"{b}_mlp.2.weight", (h, 3 * h), "linear")]
    for j in range(6 * n):
        b = f"single_blocks.{j}"
        m.specs += [Spec(f"{b}.linear1.weight", (9 * h, h), "linear"), Spec(f"{b}.linear2.weight", (h, 4 * h), "linear"),
                    Spec(f"{b}.norm.query_norm.scale", (hd,), "norm"), Spec(f"{b}.norm.key_norm.scale", (hd,), "norm")]
    return m


def specs_for(layout: str, params: int) -> Model:
    return flux2_specs(params) if layout == "flux2-bfl" else model_specs(params)


def stored_entries(model: Model, dtype: str, layout: str) -> list[tuple[str, str, tuple[int, ...]]]:
    """(name, dtype key, shape) of every stored tensor. comfy-scaled-fp8: matrices in fp8 e4m3fn with
    an fp32 scalar `scale_weight` and `scale_input` each, other tensors in bf16, plus the
    `scaled_fp8` marker (an empty fp8 tensor), as in ComfyUI's scaled-fp8 files (docs/format-facts.md "FP8")."""
    if layout in ("plain", "flux2-bfl"):
        return [(s.name, dtype, s.shape) for s in model.specs]
    if layout != "comfy-scaled-fp8":
        raise ValueError(f"unknown layout {layout}")
    out = [("scaled_fp8", "fp8_e4m3fn", (0,))]
    for s in model.specs:
        if s.role == "linear":
            stem = s.name[: -len(".weight")]
            out += [(s.name, "fp8_e4m3fn", s.shape), (stem + ".scale_weight", "fp32", ()),
                    (stem + ".scale_input", "fp32", ())]
        else:
            out.append((s.name, "bf16", s.shape))
    return out


def entries_nbytes(entries) -> int:
    total = 0
    for _, dt, shape in entries:
        n = 1
        for d in shape:
            n *= d
        total += n * ITEMSIZE[dt]
    return total


# ------------------------------------------------------------------------- subprocess-side helpers

def generate(path, params: int, dtype: str, layout: str = "plain", seed: int = 0) -> dict:
    """Write a synthetic checkpoint (in a subprocess, so torch never loads here); returns its summary."""
    m = run_py(__file__, "generate", path, "--params", params, "--dtype", dtype, "--layout", layout, "--seed", seed)
    return json.loads(m.stdout.strip().splitlines()[-1])


def compare(a, b) -> dict:
    """Bitwise comparison of two safetensors files, tensor by tensor (in a subprocess)."""
    m = run_py(__file__, "compare", a, b, check=False)
    if m.returncode not in (0, 1):
        raise BenchError(f"compare failed: {m.stderr.strip()[-2000:]}")
    return json.loads(m.stdout.strip().splitlines()[-1])


def _write_synthetic(path: str, params: int, dtype: str, layout: str, seed: int) -> dict:
    import torch

    tdt = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp8_e4m3fn": torch.float8_e4m3fn}
    model = specs_for(layout, params)
    entries = stored_entries(model, dtype, layout)
    g = torch.Generator().manual_seed(seed)
    pool_elems = 1 << 22
    base = torch.randn(pool_elems, generator=g)
    pools = {}
    for key in {dt for _, dt, _ in entries}:
        # weights ~ N(0, 0.02); fp8 codes spread over the e4m3fn range (the scale brings them back)
        vals = (base * 100).clamp(-448, 448) if key == "fp8_e4m3fn" else base * 0.02
        raw = vals.to(tdt[key]).view(torch.uint8).numpy().tobytes()
        pools[key] = memoryview(raw + raw)  # doubled: any window of pool length is one slice

    # header-first: descending itemsize keeps every tensor aligned; header padded with spaces to 8
    ordered = sorted(entries, key=lambda e: (-ITEMSIZE[e[1]], e[0]))
    header, pos = {"__metadata__": {"generator": "ckpt scripts/benchlib.py", "layout": layout}}, 0
    for name, dt, shape in ordered:
        n = 1
        for d in shape:
            n *= d
        header[name] = {"dtype": ST_DTYPE[dt], "shape": list(shape), "data_offsets": [pos, pos + n * ITEMSIZE[dt]]}
        pos += n * ITEMSIZE[dt]
    js = json.dumps(header, separators=(",", ":")).encode()
    js += b" " * (-(8 + len(js)) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(js)) + js)
        for i, (name, dt, shape) in enumerate(ordered):
            size = header[name]["data_offsets"][1] - header[name]["data_offsets"][0]
            if name.endswith(".scale_weight") or name.endswith(".scale_input"):
                # per-layer scale: map codes (|w| up to 448) back to weights of about N(0, 0.02)
                f.write(struct.pack("<f", 0.02 / 100 * (1 + (i % 17) / 16)))
                continue
            pool = pools[dt]
            plen = len(pool) // 2
            start = (i * 104729 * ITEMSIZE[dt]) % plen  # a different window per tensor
            while size:
                take = min(size, plen)
                f.write(pool[start:start + take])
                start = (start + take) % plen
                size -= take
    big = model.largest
    return {"path": str(path), "bytes": os.path.getsize(path), "tensors": len(entries), "params": model.params,
            "hidden": model.hidden, "blocks": model.blocks, "largest": big.name, "largest_shape": list(big.shape),
            "largest_numel": big.numel, "layout": layout, "dtype": dtype}


def _compare(a: str, b: str) -> dict:
    import torch
    from safetensors import safe_open

    with safe_open(a, "pt") as fa, safe_open(b, "pt") as fb:
        ka, kb = set(fa.keys()), set(fb.keys())
        if ka != kb:
            return {"equal": False, "tensors": len(ka), "problem":
                    f"keys differ: only in A {sorted(ka - kb)[:5]}, only in B {sorted(kb - ka)[:5]}"}
        for k in sorted(ka):
            x, y = fa.get_tensor(k), fb.get_tensor(k)
            if x.dtype != y.dtype or x.shape != y.shape:
                return {"equal": False, "tensors": len(ka), "problem": f"{k}: {x.dtype}{list(x.shape)} vs {y.dtype}{list(y.shape)}"}
            if x.numel() and not torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8)):
                return {"equal": False, "tensors": len(ka), "problem": f"{k}: values differ"}
    return {"equal": True, "tensors": len(ka), "problem": None}


# ------------------------------------------------------------------------- common bench yardsticks

# Mirrors of ckpt.io.write_stages.DEPTH and ckpt.io.output.BAND_ELEMS (this module must not import ckpt or
# torch; tests/test_scripts.py checks that they agree): the write stages' buffers are a function of them.
PIPELINE_DEPTH = 3
BAND_ELEMS = 8 << 20
RSS_SLACK = 300e6  # the "+ 300 MB" of the bound


def add_run_args(ap, *, workdir_alias: str | None = None, auto_help: str | None = None) -> None:
    """`--device` (passed to every ckpt command) and `--workdir` (tmpfs such as /dev/shm to take the disk
    out of the figures, or a folder on a real disk). A bench that times ckpt on both devices (bench_lora:
    its CUDA row against the CPU one) gives `auto_help`: `--device` then also takes `auto`, its default."""
    if auto_help:
        ap.add_argument("--device", choices=("cpu", "cuda", "auto"), default="auto", help=auto_help)
    else:
        ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="--device of every ckpt command (default cpu); cuda needs a CUDA build of torch")
    names = ["--workdir"] + ([workdir_alias] if workdir_alias else [])
    ap.add_argument(*names, dest="workdir",
                    help="folder for sources and outputs: a tmpfs (/dev/shm) or a disk (default: a temp dir under /tmp)")


def where(path) -> str:
    """The filesystem `path` lies on, as the report states it: "tmpfs" or "disk (ext4, /dev/nvme0n1p2)"."""
    best, fs, dev = "", "?", "?"
    p = str(Path(path).resolve())
    try:
        for line in Path("/proc/mounts").read_text().splitlines():
            d, mnt, typ = line.split()[:3]
            mnt = mnt.replace("\\040", " ")
            if (p == mnt or p.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best):
                best, fs, dev = mnt, typ, d
    except OSError:
        return "unknown filesystem"
    return fs if fs in ("tmpfs", "ramfs") else f"disk ({fs}, {dev})"


def shares_extents(path) -> bool:
    """Whether `path` is on a filesystem whose copies may share blocks (what ckpt.io.byte_copy.SHARING lists):
    there `cp` (coreutils 9: --reflink=auto) and ckpt's byte copies share blocks instead of copying them."""
    return where(path).startswith(tuple(f"disk ({fs}," for fs in ("xfs", "btrfs", "bcachefs", "zfs")))


def fsync_path(path) -> None:
    """fsync the file at `path`: a baseline's output made durable, as ckpt's is (every variant pays it)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def warm(path) -> None:
    """Read `path` once (untimed) so that a timed copy of it reads from the page cache, as ckpt's runs read
    their warm sources: ckpt writes most outputs with O_DIRECT, which leaves them out of the cache."""
    subprocess.run(["cat", "--", str(path)], stdout=subprocess.DEVNULL, check=True)  # not here: this process's
    # peak RSS is where every measured child's starts


def cp_baseline(src, dst) -> Measurement:
    """`cp` of `src` (a file of the output's bytes, read once first: `warm`) then `sync` of the copy: the
    least any tool that writes those bytes durably can take on this machine and filesystem. The copy is
    removed afterwards."""
    warm(src)
    try:
        return measure(["sh", "-c", 'cp -- "$1" "$2" && sync -- "$2"', "sh", str(src), str(dst)])
    finally:
        Path(dst).unlink(missing_ok=True)


def import_baseline(device: str = "cpu") -> Measurement:
    """The process every ckpt command starts as: `python -c "import torch"`, plus the CUDA context that
    any GPU run creates (a fixed few hundred MB of host memory) when `device` is cuda."""
    code = "import torch" + ("; torch.zeros(1, device='cuda')" if device == "cuda" else "")
    m = measure([sys.executable, "-c", code], check=False)
    if m.returncode != 0:
        raise SystemExit(f"error: --device {device}: torch cannot use it here ({(m.stderr.strip().splitlines() or ['?'])[-1]})")
    return m


LLAMA_SCRIPT = r"""
import json, sys, torch
from pathlib import Path
from safetensors.torch import save_file
import transformers

out, layers, tokenizer = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "tokenizer"
cfg = transformers.LlamaConfig(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=layers,
                               num_attention_heads=16, num_key_value_heads=4, tie_word_embeddings=False)
with torch.device("meta"):
    model = transformers.LlamaForCausalLM(cfg)
g = torch.Generator().manual_seed(0)
sd = {n: (torch.randn(p.shape, generator=g) * (0.02 if p.dim() == 2 else 1)).to(torch.bfloat16)
      for n, p in model.state_dict().items()}
out.mkdir(parents=True)
save_file(sd, out / "model.safetensors", metadata={"format": "pt"})
(out / "config.json").write_text(json.dumps(cfg.to_dict() | {"architectures": ["LlamaForCausalLM"],
                                                             "dtype": "bfloat16"}, indent=2))
if tokenizer:
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(["the quick brown fox jumps over the lazy dog"] * 10,
                            trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                show_progress=False))
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="dog").save_pretrained(out)
"""


def llama_folder(path, size_mb: int, tokenizer: bool = False) -> tuple[int, int]:
    """A synthetic bf16 Llama HF folder at `path` (hidden 1024, GQA, vocab 32000, untied lm_head) with as many
    layers as make about `size_mb` MiB, written in a subprocess (torch and transformers stay out of this one:
    see the module docstring) and read once (`warm`); `tokenizer`: with a tiny byte-level BPE tokenizer (tools
    that convert a whole folder need one; its size does not matter). Returns (layers, bytes of safetensors).
    The serving benches (bench_mlx.py, bench_serve.py) compare ckpt with another tool on it."""
    per_layer = 2 * (2 * 1024 * 1024 + 2 * 1024 * 256 + 3 * 1024 * 2816)
    fixed = 2 * 2 * 32000 * 1024
    layers = max(1, round((size_mb * (1 << 20) - fixed) / per_layer))
    run_py("-c", LLAMA_SCRIPT, path, layers, "tokenizer" if tokenizer else "-")
    warm(Path(path) / "model.safetensors")
    return layers, sum(p.stat().st_size for p in Path(path).glob("*.safetensors"))


def pipeline_bytes(in_itemsize: int, out_itemsize: int) -> int:
    """Buffers of the write stages: DEPTH bands in flight, each holding its input band, its output band
    and one fp32 intermediate (a decode's or a merge's); on CUDA the pinned in/out buffers take the place
    of the CPU ones."""
    return PIPELINE_DEPTH * BAND_ELEMS * (in_itemsize + out_itemsize + 4)


def rss_bound(baseline_rss: int, largest_bytes: int, pipeline: int, extra: int = 0) -> int:
    """The issue's bound: import baseline + 2 x largest tensor + pipeline buffers + 300 MB (+ `extra`, e.g.
    a LoRA file held whole)."""
    return int(baseline_rss + 2 * largest_bytes + pipeline + RSS_SLACK + extra)


def verdict_lines(label: str, ckpt: Measurement, cp: Measurement, out_bytes: int, baseline: Measurement,
                  largest_bytes: int, pipeline: int, extra: int = 0, extra_what: str = "") -> tuple[list[str], dict]:
    """The two figures every bench prints per case: wall time against cp + sync of the same bytes (same
    run), and peak RSS against the bound. Returns (lines, values for --json)."""
    bound = rss_bound(baseline.peak_rss, largest_bytes, pipeline, extra)
    ratio = ckpt.seconds / cp.seconds if cp.seconds > 0 else float("inf")
    rss_ok = ckpt.peak_rss <= bound
    plus = f" + {extra_what} {fmt_mb(extra)}" if extra else ""
    lines = [f"{label}: {ckpt.seconds:.2f} s = {ratio:.2f}x cp + sync of the {fmt_gb(out_bytes)} GB output "
             f"({cp.seconds:.2f} s)",
             f"{label}: peak RSS {fmt_mb(ckpt.peak_rss)} MB <= import baseline {fmt_mb(baseline.peak_rss)} + 2 x largest "
             f"{fmt_mb(largest_bytes)} + pipeline {fmt_mb(pipeline)}{plus} + 300 = {fmt_mb(bound)} MB: "
             f"{'met' if rss_ok else 'NOT met'}"]
    return lines, {"seconds": ckpt.seconds, "cp_seconds": cp.seconds, "vs_cp": ratio, "peak_rss": ckpt.peak_rss,
                   "rss_bound": bound, "rss_ok": rss_ok, "import_baseline_rss": baseline.peak_rss}


# ------------------------------------------------------------------------------------ formatting

def fmt_gb(n: float) -> str:
    return f"{n / 1e9:.2f}"


def fmt_mb(n: float) -> str:
    return f"{n / 1e6:.0f}"


def gbps(nbytes: float, seconds: float) -> str:
    return f"{nbytes / 1e9 / seconds:.2f}" if seconds > 0 else "-"


def markdown_table(headers: list[str], rows: list[list]) -> str:
    cells = [[str(h) for h in headers]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    line = lambda r: "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |"
    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(cells[0]), sep] + [line(r) for r in cells[1:]])


def _main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="subprocess side of the benchmark helpers")
    sub = ap.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("generate", help="write a synthetic Flux-like checkpoint")
    g.add_argument("out")
    g.add_argument("--params", type=int, required=True)
    g.add_argument("--dtype", choices=sorted(ITEMSIZE), default="bf16")
    g.add_argument("--layout", choices=LAYOUTS, default="plain")
    g.add_argument("--seed", type=int, default=0)
    c = sub.add_parser("compare", help="bitwise comparison of two safetensors files")
    c.add_argument("a")
    c.add_argument("b")
    a = ap.parse_args(argv)
    if a.cmd == "generate":
        print(json.dumps(_write_synthetic(a.out, a.params, a.dtype, a.layout, a.seed)))
        return 0
    res = _compare(a.a, a.b)
    print(json.dumps(res))
    return 0 if res["equal"] else 1


if __name__ == "__main__":
    sys.exit(_main())
