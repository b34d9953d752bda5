"""The batch tests' tiny trees and checks: fp32 files, their fp16 casts compared bit for bit with torch's
own, the manifest's lines, leftover temp outputs."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file


def st(path: Path, seed: int = 0, metadata=None, **shapes) -> dict[str, torch.Tensor]:
    """A tiny fp32 safetensors file; returns what it holds."""
    path.parent.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    tensors = {k: torch.randn(*s, generator=g) for k, s in (shapes or {"w": (8, 4), "b": (4,)}).items()}
    save_file(tensors, path, metadata=metadata)
    return tensors


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1).view(torch.uint8)


def assert_fp16_of(path: Path, original: dict[str, torch.Tensor]) -> None:
    got = load_file(path)
    assert set(got) == set(original)
    for k, v in original.items():
        assert got[k].dtype == torch.float16 and torch.equal(bits(got[k]), bits(v.to(torch.float16))), k


def no_temp_files(*roots: Path) -> bool:
    return not any(".ckpt-tmp-" in p.name for r in roots if r.exists() for p in r.rglob("*"))


def manifest_lines(path: Path, started: bool = False) -> list[dict]:
    """The manifest's result lines (and, with `started`, also the line written as each job starts)."""
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    return [r for r in lines if started or r["status"] != "started"]


def small_models(root: Path) -> dict[str, dict]:
    return {
        "a.safetensors": st(root / "a.safetensors", 1),
        "sub/b.safetensors": st(root / "sub" / "b.safetensors", 2),
        "sub/c.safetensors": st(root / "sub" / "c.safetensors", 3),
    }
