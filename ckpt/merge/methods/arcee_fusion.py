"""`arcee_fusion` (mergekit): the base takes the other model's changes where they matter most.

Exactly two inputs, the base b and a model p. Per row along the last dimension, kl = sum(P log(P / Q)) with
P = softmax(p) + 1e-8 and Q = softmax(b) + 1e-8 over that row; an element's importance is |p - b| * kl of its
row. Over the whole tensor, the threshold is median + 1.5 * (q3 - q1) of the importances (q1, median, q3: the
values at sorted positions (n - 1) / 4, (n - 1) / 2, 3 (n - 1) / 4, rounded down), and the result is p where
the importance reaches the threshold, b elsewhere.

Streaming, per tensor (`kind_of`): the rows lie inside a band, but the quantiles span the tensor: kind "stats".
Two passes (four at `dtype: float64`) of radix selection over the importances find the three values exactly:
a histogram of the top 16 bits of every importance's order-preserving key, then of the next 16 bits inside the
bins holding the three positions (one pass serves all three). Every band then recomputes its importances (as
mergekit computes them, row by row, bit for bit) and compares. A 1-D tensor is one row, its softmax the whole
tensor: kind "whole", computed as mergekit computes it (the tensor is one row of the streaming unit anyway).

Deviation: above 1,000,000 elements mergekit estimates the quantiles from a random sample of 1,000,000 (drawn
with replacement from the global RNG, so runs differ); ckpt takes the exact quantiles of every element. At or
below that size they are the same values.
"""

from __future__ import annotations

from ckpt.merge.methods.base import Method
from ckpt.lazy import torch

EPS = 1e-8  # added to both softmaxes
QUARTILES = (1, 2, 3)  # q1, median, q3: positions k (n - 1) // 4 of the sorted importances


def _kind(job) -> str:
    return "stats" if len(job.shape) >= 2 else "whole"


def _importance(base, other):
    F = torch.nn.functional

    diff = (other - base).abs()
    p = F.softmax(other, dim=-1) + EPS
    q = F.softmax(base, dim=-1) + EPS
    kl = torch.sum(p * torch.log(p / q), dim=-1, keepdim=True)
    return diff * kl


def _pair(job, xs):
    return xs[job.base], xs[job.non_base[0]]


def _positions(n: int) -> list[int]:
    return [k * (n - 1) // 4 for k in QUARTILES]


def _threshold(values, dtype):
    """median + 1.5 (q3 - q1), in the compute dtype."""
    q1, median, q3 = torch.as_tensor(values, dtype=dtype)
    return median + 1.5 * (q3 - q1)


def _keys(x):
    """Signed int64 keys ordering as the float values do (-0 before +0, every NaN after +inf), and their width."""
    x = x.reshape(-1)
    x = torch.where(torch.isnan(x), torch.full_like(x, float("nan")), x)  # one (positive) NaN: sorts last
    if x.dtype == torch.float64:
        b, width = x.view(torch.int64), 64
    else:
        b, width = x.to(torch.float32).view(torch.int32).to(torch.int64), 32
    return b ^ ((b >> (width - 1)) & ((1 << (width - 1)) - 1)), width


def _float_of(key: int, width: int, dtype):
    """The value whose key is `key` (the key map is its own inverse)."""
    bits = key ^ ((key >> (width - 1)) & ((1 << (width - 1)) - 1))
    t = torch.tensor([bits], dtype=torch.int64 if width == 64 else torch.int32)
    return t.view(torch.float64 if width == 64 else torch.float32).to(dtype).item()


def values_at(passes, positions, dtype) -> list[float]:
    """The values at ascending sorted `positions` of the scores `passes()` yields (band by band, afresh on every
    call), found by radix selection on 16-bit digits: one pass per digit, every position at once."""
    BINS = 1 << 16
    prefix = [0] * len(positions)  # the key's digits found so far, as the signed value of the key's top bits
    rank = list(positions)  # the position among the keys sharing that prefix
    level, width = 0, None
    while True:
        slots = sorted(set(prefix)) if level else [0]  # one histogram per distinct prefix
        hist = None
        for s in passes():
            keys, width = _keys(s)
            shift = width - 16 * (level + 1)
            digit = (keys >> shift) & 0xFFFF
            if level == 0:
                digit = digit ^ 0x8000  # the top digit carries the sign
            else:
                top = keys >> (shift + 16)
                digit = torch.cat([digit[top == p] + j * BINS for j, p in enumerate(slots)])
            if hist is None:
                hist = torch.zeros(len(slots) * BINS, dtype=torch.int64, device=digit.device)
            hist.index_add_(0, digit, torch.ones_like(digit))  # O(band), whatever the band's size
        if hist is None:
            raise RuntimeError("radix selection: no scores to select from")
        hist = hist.cpu()
        for i in range(len(positions)):
            j = slots.index(prefix[i]) if level else 0
            cum = torch.cumsum(hist[j * BINS:(j + 1) * BINS], 0)
            d = int((cum > rank[i]).nonzero()[0])
            rank[i] -= int(cum[d - 1]) if d else 0
            prefix[i] = d - 0x8000 if level == 0 else (prefix[i] << 16) | d
        level += 1
        if 16 * level == width:
            return [_float_of(p, width, dtype) for p in prefix]


def _stats(job):
    n = 1
    for s in job.shape:
        n *= s
    if not n:
        return None

    def scores():
        for _, xs in job.passes():
            yield _importance(*_pair(job, xs))

    return _threshold(values_at(scores, _positions(n), job.compute), job.compute)


def _merge(job, xs, band, state):
    base, other = _pair(job, xs)
    if not base.numel():
        return base.clone()
    importance = _importance(base, other)
    if state is None:  # kind "whole": the tensor is here
        ordered = torch.sort(importance.reshape(-1)).values
        state = _threshold([float(ordered[i]) for i in _positions(ordered.numel())], importance.dtype)
    mask = (importance >= state.to(importance.device)).to(base.dtype)
    return base + (other - base) * mask


METHODS = (
    Method("arcee_fusion", (), base="required", others=(1, 1), kind="stats", kind_of=_kind,
           stats=_stats, merge=_merge,
           summary="the base with one model's changes where their importance (|change| x the row's KL) is an "
                   "outlier"),
)
