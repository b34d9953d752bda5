"""The references of the `merge-lora --keep-format` tests: a kohya LoRA file, ckpt's own fp32 merge (the
value each changed tensor is re-encoded from), the relative RMS error and the one the report states."""

from __future__ import annotations

import json
import math

import torch
from safetensors.torch import load_file, save_file


def kohya_lora(path, modules: dict[str, tuple[int, int]], rank=4, alpha=2.0, seed=0):
    """A kohya LoRA on `modules` {name: (out, in)} (LoRA names `lora_unet_<name, . -> _>`)."""
    g = torch.Generator().manual_seed(seed)
    sd = {}
    for name, (out, inn) in modules.items():
        k = "lora_unet_" + name.replace(".", "_")
        sd[f"{k}.lora_down.weight"] = torch.randn(rank, inn, generator=g) * 0.1
        sd[f"{k}.lora_up.weight"] = torch.randn(out, rank, generator=g) * 0.1
        sd[f"{k}.alpha"] = torch.tensor(alpha)
    save_file(sd, path)
    return path


def attention_lora_base(folder, shape: tuple[int, int], seed: int):
    """A bf16 base `folder`/base.safetensors of three blocks (q, k, v, mlp weights of `shape`, a norm as wide as
    their inputs) and a kohya LoRA on the q and v weights (`folder`/l.safetensors): (base state dict, the LoRA's
    modules, the LoRA's path). What a merge-lora changes (the attention) beside what it copies."""
    g = torch.Generator().manual_seed(seed)
    shapes = {f"blocks.{i}.{m}": shape for i in range(3) for m in ("q", "k", "v", "mlp")}
    sd = {f"{k}.weight": torch.randn(s, generator=g).bfloat16() for k, s in shapes.items()}
    sd |= {f"blocks.{i}.norm.weight": torch.randn(shape[1], generator=g).bfloat16() for i in range(3)}
    save_file(sd, folder / "base.safetensors")
    attention = {k: s for k, s in shapes.items() if k.endswith((".q", ".v"))}
    return sd, attention, kohya_lora(folder / "l.safetensors", attention)


def plain_merge(run_ckpt, base, lora, tmp_path, name="plain.safetensors") -> dict[str, torch.Tensor]:
    """ckpt's own fp32 merge: the value each changed tensor is re-encoded from."""
    out = tmp_path / name
    code, _, err = run_ckpt("merge-lora", base, lora, "--to", "fp32", "-o", out, "-q")
    assert code == 0, err
    if out.is_dir():
        return {k: v for f in sorted(out.glob("*.safetensors")) for k, v in load_file(f).items()}
    return load_file(out)


def rel_rms(decoded: torch.Tensor, merged: torch.Tensor) -> float:
    d, m = decoded.double(), merged.double()
    return math.sqrt(float(((d - m) ** 2).sum()) / float((m * m).sum()))


def reported(path) -> dict[str, float]:
    rep = json.loads(path.read_text())
    return {k: v["rel_rms"] for k, v in rep["requantization"]["tensors"].items()}


def recording_value(x: torch.Tensor, home: str):
    """A merged value `x` as an encoder reads it, recording the row bands [start, stop) read (`.reads`)."""
    from ckpt.io.tensors import Tensor

    class Value(Tensor):
        def __init__(self):
            self.x, self.home, self.name, self.dtype, self.shape = x, home, "v", torch.float32, tuple(x.shape)
            self.reads = []

        def read(self, start, stop, device, scratch=None):
            self.reads.append((start, stop))
            return self.x[start:stop].to(device)

    return Value()
