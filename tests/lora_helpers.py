"""Helpers shared by the `ckpt lora` tests: random tensors, exact low-rank deltas, reading the per-module
report the CLI prints, and a LoRA file's modules as (up, down, scale) in fp32."""

from __future__ import annotations

import math

import torch
from safetensors.torch import load_file

_seed = [1000]


def rnd(*shape, scale=1.0):
    _seed[0] += 1
    return torch.randn(*shape, generator=torch.Generator().manual_seed(_seed[0])) * scale


def low_rank(shape, r, scale=0.1):
    """A delta of exact rank r in the 2-D row view of `shape` ([out, in * kh * kw])."""
    out, cols = shape[0], math.prod(shape[1:])
    return (rnd(out, r) @ rnd(r, cols) * scale / math.sqrt(r)).reshape(shape)


def report_rows(stdout: str) -> dict[str, tuple[int, float]]:
    """module -> (rank, reported relative error) from the per-module table."""
    rows = {}
    lines = stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("module "))
    for line in lines[start + 1:]:
        parts = line.split()
        if len(parts) < 4 or "x" not in parts[1]:
            break
        rank = int(parts[2].split("->")[-1])
        rows[parts[0]] = (rank, float(parts[3]))
    return rows


def kohya_modules(path) -> dict[str, tuple[torch.Tensor, torch.Tensor, float]]:
    """name -> (up 2-D, down 2-D, scale) of a kohya file, fp32."""
    sd = load_file(path)
    out = {}
    for k, down in sd.items():
        if k.endswith(".lora_down.weight"):
            name = k[: -len(".lora_down.weight")]
            up = sd[name + ".lora_up.weight"].float()
            r = down.shape[0]
            alpha = float(sd[name + ".alpha"]) if name + ".alpha" in sd else r
            out[name] = (up.reshape(up.shape[0], -1), down.float().reshape(r, -1), alpha / r)
    return out


def rel_error(delta: torch.Tensor, approx: torch.Tensor) -> float:
    d = delta.double().reshape(delta.shape[0], -1)
    return float((d - approx.double().reshape(d.shape)).norm() / d.norm())


def truncated(delta: torch.Tensor, k: int) -> torch.Tensor:
    """The best rank-k approximation (Eckart-Young), in fp64: the oracle of every SVD cut."""
    d = delta.double().reshape(delta.shape[0], -1)
    U, S, Vh = torch.linalg.svd(d, full_matrices=False)
    return (U[:, :k] * S[:k]) @ Vh[:k]


# kohya sd-scripts networks/resize_lora.py, the rank rules (the reference the dynamic ranks follow).
def kohya_rank(S: torch.Tensor, method: str, t: float, cap: int) -> int:
    S = S.double()
    if method == "sv_ratio":
        index = int(torch.sum(S > S[0] / t).item()) - 1
    elif method == "sv_cumulative":
        index = int(torch.searchsorted(torch.cumsum(S, 0) / S.sum(), torch.tensor(t, dtype=S.dtype)))
    else:
        sq = S.pow(2)
        index = int(torch.searchsorted(torch.cumsum(sq, 0) / sq.sum(), torch.tensor(t * t, dtype=S.dtype)))
    index = max(0, min(index, len(S) - 1))
    new_rank = index + 1
    if S[0] <= 1e-6:
        return 1
    return min(new_rank, cap)


def close(got: torch.Tensor, want: torch.Tensor, rel: float = 1e-5) -> bool:
    """Relative Frobenius distance below `rel` (fp32 factors against an fp64 oracle)."""
    w = want.double().reshape(want.shape[0], -1)
    return float((got.double().reshape(w.shape) - w).norm()) <= rel * float(w.norm())


def refused(run_ckpt, tmp_path, args, culprit, problem):
    """Bad input: one `error: CULPRIT...` line naming PROBLEM, exit 2, nothing written (the existing
    `assert_refused`), and every input file byte for byte as it was."""
    from helpers.refusals import assert_refused

    before = {p: p.read_bytes() for p in sorted(tmp_path.rglob("*")) if p.is_file()}
    assert_refused(run_ckpt, tmp_path, args, culprit, problem)
    assert {p: p.read_bytes() for p in sorted(tmp_path.rglob("*")) if p.is_file()} == before
