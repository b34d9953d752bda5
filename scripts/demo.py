"""`make demo`: ckpt end to end on two tiny checkpoints, in a few seconds, checked against the formulas.

1. Writes a ComfyUI-style scaled-fp8 checkpoint (fp8 e4m3fn weights, fp32 `scale_weight` and
   `scale_input` per layer, bf16 biases and norms, the `scaled_fp8` marker, `model.diffusion_model.`
   prefix) and a plain fp32 one, in a temp folder.
2. Runs the real CLI: `ckpt inspect` on the fp8 file, `ckpt convert --to fp16` on both.
3. Loads the results with safetensors and prints a before/after summary: dtypes, sizes, and the max
   abs difference against the formula computed here with torch (fp8: (w.float() * scale).half(),
   fp32: x.half()), which must be 0.

Exits non-zero if any command fails or any value differs from its formula. `--keep DIR` writes the files into
DIR (created; it must not exist yet) and leaves them there; without it they go to a temp folder that is removed.

It needs the runtime (`pip install .`) and safetensors, the independent reader the results are checked with:
`make demo` installs just that.
"""

from __future__ import annotations

import argparse
import contextlib
import shlex
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

PREFIX = "model.diffusion_model."


def ckpt_argv(*args) -> list[str]:
    exe = Path(sys.executable).parent / "ckpt"
    head = [str(exe)] if exe.exists() else [sys.executable, "-m", "ckpt.cli"]
    return head + [str(a) for a in args]


def run(*args, allow_missing_command: bool = False) -> subprocess.CompletedProcess | None:
    argv = ckpt_argv(*args)
    print(f"\n$ ckpt {shlex.join(argv[-len(args):])}", flush=True)
    p = subprocess.run(argv, capture_output=True, text=True)
    if allow_missing_command and p.returncode != 0 and "No such command" in p.stderr:
        print(f"(skipped: this ckpt has no `{args[0]}` command yet)")
        return None
    print((p.stdout + p.stderr).rstrip())
    if p.returncode != 0:
        raise SystemExit(f"demo failed: `ckpt {shlex.join(map(str, args))}` exited with {p.returncode}")
    return p


def make_scaled_fp8(path: Path, g: torch.Generator) -> dict:
    """ComfyUI legacy scaled fp8: W ~ N(0, 0.02) stored as w = fp8(W / s), s = max|W| / 448."""
    sd, originals = {PREFIX + "scaled_fp8": torch.empty(0, dtype=torch.float8_e4m3fn)}, {}
    for name, (o, i) in {"double_blocks.0.img_attn.qkv": (192, 64), "double_blocks.0.img_attn.proj": (64, 64),
                         "double_blocks.0.img_mlp.0": (256, 64), "double_blocks.0.img_mlp.2": (64, 256)}.items():
        w = torch.randn(o, i, generator=g) * 0.02
        s = w.abs().max() / 448
        sd[PREFIX + name + ".weight"] = (w / s).to(torch.float8_e4m3fn)
        sd[PREFIX + name + ".scale_weight"] = s.reshape(()).float()
        sd[PREFIX + name + ".scale_input"] = torch.tensor(1.0)
        sd[PREFIX + name + ".bias"] = (torch.randn(o, generator=g) * 0.01).bfloat16()
        originals[PREFIX + name + ".weight"] = w
    sd[PREFIX + "double_blocks.0.img_attn.norm.query_norm.scale"] = (1 + 0.1 * torch.randn(64, generator=g)).bfloat16()
    save_file(sd, path)
    return originals


def make_plain_fp32(path: Path, g: torch.Generator) -> None:
    save_file({"encoder.layers.0.attn.q_proj.weight": torch.randn(128, 128, generator=g) * 0.02,
               "encoder.layers.0.attn.q_proj.bias": torch.zeros(128),
               "encoder.layers.0.norm.weight": torch.ones(128),
               "encoder.position_ids": torch.arange(77).reshape(1, 77)}, path)


def dtype_summary(sd: dict) -> str:
    counts = Counter(str(v.dtype).replace("torch.", "") for v in sd.values())
    return ", ".join(f"{n} {d}" for d, n in sorted(counts.items()))


def expected_fp16(src: dict) -> dict:
    """What `convert --to fp16` must produce, from the format definitions (docs/format-facts.md "FP8")."""
    scaled = any(k.endswith("scaled_fp8") for k in src)
    want = {}
    for k, v in src.items():
        if scaled and k.endswith(("scaled_fp8", ".scale_weight", ".scale_input")):
            continue
        scale = src.get(k[: -len(".weight")] + ".scale_weight") if scaled and k.endswith(".weight") else None
        if scale is not None:
            v = v.float() * scale
        want[k] = v.half() if v.is_floating_point() else v
    return want


def check(name: str, src_path: Path, out_path: Path) -> bool:
    src, out = load_file(src_path), load_file(out_path)
    want = expected_fp16(src)
    print(f"\n{name}")
    print(f"  before: {src_path.stat().st_size:>7} bytes, {len(src)} tensors: {dtype_summary(src)}")
    print(f"  after:  {out_path.stat().st_size:>7} bytes, {len(out)} tensors: {dtype_summary(out)}")
    dropped = sorted(set(src) - set(out))
    if dropped:
        print(f"  consumed (scales/marker): {len(dropped)}, e.g. {dropped[0]}")
    ok = set(out) == set(want)
    if not ok:
        print(f"  MISMATCH: keys differ: {sorted(set(out) ^ set(want))[:5]}")
        return False
    worst = 0.0
    for k, w in want.items():
        if out[k].dtype != w.dtype or out[k].shape != w.shape:
            print(f"  MISMATCH: {k}: {out[k].dtype}{list(out[k].shape)}, expected {w.dtype}{list(w.shape)}")
            return False
        if w.is_floating_point() and w.numel():
            worst = max(worst, (out[k].float() - w.float()).abs().max().item())
        if not torch.equal(out[k].reshape(-1).view(torch.uint8), w.reshape(-1).view(torch.uint8)):
            print(f"  MISMATCH: {k}: stored bits differ from the formula")
            return False
    formula = "(w.float() * scale_weight).half()" if dropped else "x.half()"
    print(f"  max |output - {formula}| = {worst:g}")
    return worst == 0.0


@contextlib.contextmanager
def workdir(keep: str | None):
    """The folder the demo writes in: `keep` (made here, kept) or a temp folder removed afterwards."""
    if keep is None:
        with tempfile.TemporaryDirectory(prefix="ckpt-demo-") as tmp:
            yield Path(tmp)
        return
    folder = Path(keep).expanduser()
    try:
        folder.mkdir(parents=True)
    except FileExistsError:
        raise SystemExit(f"error: --keep {keep}: already exists; name a new folder") from None
    except OSError as e:
        raise SystemExit(f"error: --keep {keep}: cannot create it ({e.strerror})") from None
    yield folder


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--keep", metavar="DIR", help="write the demo's files into DIR (a new folder) and keep them")
    args = ap.parse_args(argv)
    g = torch.Generator().manual_seed(0)
    with workdir(args.keep) as tmp:
        fp8, fp32 = tmp / "flux-fp8-scaled.safetensors", tmp / "encoder-fp32.safetensors"
        originals = make_scaled_fp8(fp8, g)
        make_plain_fp32(fp32, g)
        print(f"demo files in {tmp}: {fp8.name} (ComfyUI scaled fp8), {fp32.name} (plain fp32)")

        run("inspect", fp8, allow_missing_command=True)
        run("convert", fp8, "--to", "fp16")
        run("convert", fp32, "--to", "fp16", "-o", tmp / "encoder-fp16.safetensors")

        ok = check("flux-fp8-scaled -> fp16", fp8, tmp / "flux-fp8-scaled-fp16.safetensors")
        out = load_file(tmp / "flux-fp8-scaled-fp16.safetensors")
        q = max((out[k].float() - w).abs().max().item() for k, w in originals.items())
        print(f"  (fp8 quantization error vs the original fp32 weights, for scale: max {q:.2e})")
        ok = check("encoder-fp32 -> fp16", fp32, tmp / "encoder-fp16.safetensors") and ok
        if args.keep:
            print(f"\nthe files are kept in {tmp}")
    if not ok:
        print("\ndemo FAILED: an output differs from its formula", file=sys.stderr)
        return 1
    print("\ndemo OK: every output tensor equals the formula bit for bit")
    return 0


if __name__ == "__main__":
    sys.exit(main())
