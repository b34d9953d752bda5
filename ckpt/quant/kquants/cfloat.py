"""ggml's C float32 arithmetic, as torch ops that give the same bits: what the encoders of this package share.

Byte identity with `ggml-quants.c` needs each operation rounded as C rounds it: sums accumulated in the C loop's
order (`tensor.sum` reduces in another order and flips rounding decisions), true divisions (torch computes
`scalar / tensor` as a reciprocal times the scalar), ggml's `nearest_int` bit trick, and fp16 scales rounded to
nearest even.
"""

from __future__ import annotations

from ckpt.lazy import torch


def div(a, b) -> torch.Tensor:
    """a / b correctly rounded in float32, both operands full tensors (a Python-scalar operand would be turned into a
    multiplication by its reciprocal)."""
    if not torch.is_tensor(a):
        a = torch.full_like(b, float(a))
    elif not torch.is_tensor(b):
        b = torch.full_like(a, float(b))
    return torch.div(a, b)


def nearest_int(v: torch.Tensor) -> torch.Tensor:
    """ggml's `nearest_int`: the low mantissa bits of v + 12582912.f (round half to even for |v| <= 4194303), int32."""
    return ((v + 12582912.0).view(torch.int32) & 0x007FFFFF) - 0x00400000


def rounded(v: torch.Tensor, lo: float, hi: float) -> torch.Tensor:
    """`nearest_int(v)` clamped to [lo, hi], as float32, for v known to satisfy |v| <= 4194303 (the callers bound it):
    there the bit trick's sum v + 1.5 * 2**23 is v rounded half to even plus an even integer, so subtracting that
    integer again is exact: two float ops (torch.round is several times slower on the CPU) and no int tensor."""
    r = v + 12582912.0
    return r.sub_(12582912.0).clamp_(lo, hi)


SAFE_ROUND = 4194303.0  # |v| up to which nearest_int is round-half-to-even


def seq_sum(t: torch.Tensor) -> torch.Tensor:
    """`float s = 0; for (i...) s += t[i];` over dim 0, in that order."""
    acc = torch.zeros_like(t[0])
    for i in range(t.shape[0]):
        acc.add_(t[i])
    return acc


def fp16_bytes(d: torch.Tensor) -> torch.Tensor:
    """[n] values -> the little-endian bytes of GGML_FP32_TO_FP16 (round to nearest even), uint8 [n, 2]."""
    h = d.to(torch.float16).contiguous().view(torch.int16).to(torch.int32)
    return torch.stack([h & 0xFF, (h >> 8) & 0xFF], dim=1).to(torch.uint8)
