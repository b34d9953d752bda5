"""`model_stock` (mergekit): Model Stock (arXiv 2403.19522), the base and the average of N >= 2 fine-tunes
interpolated by how much the fine-tunes agree.

The fine-tunes' offsets from the base o_i = x_i - base; cos = the mean over pairs i < j of
clamp(o_i . o_j / max(|o_i| |o_j|, 1e-6), -1, 1); t = N cos / (1 + (N - 1) cos), or 0 where the denominator is
below 1e-6 in magnitude (the base is kept there rather than opposing updates amplified); the result is
t * mean(x_i) + (1 - t) * base. By default the offsets are whole tensors (one t per tensor); `filter_wise: true`
takes one t per row along the last dimension (a 1-D tensor is one row).

Streaming, per tensor (`kind_of`): rows along the last dimension lie inside a band, so `filter_wise` on a tensor
of 2 or more dimensions is kind "rows", computed band by band as mergekit computes it. Whole-tensor offsets are
kind "stats": one pass sums every offset's squares and every pair's products in fp64, cos follows (then t, in
the compute dtype, as mergekit's), and every band is combined. mergekit sums in the compute dtype, so t agrees
to fp32 rounding.
"""

from __future__ import annotations

from ckpt.merge.methods.base import SHARED, Method, Param
from ckpt.lazy import torch

NORM_MIN = 1e-6  # the product of two offsets' norms is at least this
SINGULAR = 1e-6  # |1 + (N - 1) cos| below this keeps the base


def _whole(job) -> bool:
    return not job.shared["filter_wise"] or len(job.shape) < 2


def _kind(job) -> str:
    return "stats" if _whole(job) else "rows"


def _pairs(n):
    return [(a, b) for a in range(n) for b in range(a + 1, n)]


def _t(cos, count):
    """t from the mean cosine (a tensor), as mergekit computes it."""
    denominator = 1 + (count - 1) * cos
    singular = denominator.abs() < SINGULAR
    safe = torch.where(singular, torch.ones_like(denominator), denominator)
    return torch.where(singular, torch.zeros_like(cos), (count * cos) / safe)


def _stats(job):
    """The tensor's t: a one-element tensor in the compute dtype."""
    n = len(job.non_base)
    pairs = _pairs(n)
    sq = torch.zeros(n, dtype=torch.float64)
    dots = torch.zeros(len(pairs), dtype=torch.float64)
    for _, xs in job.passes():
        base = xs[job.base].reshape(-1).double()
        offs = [xs[i].reshape(-1).double() - base for i in job.non_base]
        sq += torch.stack([(o * o).sum() for o in offs]).cpu()
        dots += torch.stack([(offs[a] * offs[b]).sum() for a, b in pairs]).cpu()
    norms = sq.sqrt()
    cos = torch.stack([(dots[p] / (norms[a] * norms[b]).clamp(min=NORM_MIN)).clamp(-1, 1)
                       for p, (a, b) in enumerate(pairs)])
    return _t(cos.mean(dim=0).to(job.compute).reshape(1), n)


def _row_t(job, xs):
    """One t per row along the last dimension of the band (shape [..., 1])."""
    base = xs[job.base]
    offs = [xs[i] - base for i in job.non_base]
    cos = []
    for a, b in _pairs(len(offs)):
        norm_product = torch.norm(offs[a], dim=-1) * torch.norm(offs[b], dim=-1)
        cos.append(((offs[a] * offs[b]).sum(dim=-1) / norm_product.clamp(min=NORM_MIN)).clamp(-1, 1))
    return _t(torch.stack(cos).mean(dim=0).unsqueeze(-1), len(offs))


def _merge(job, xs, band, state):
    base = xs[job.base]
    ws = [xs[i] for i in job.non_base]
    t = state.to(base.device) if _whole(job) else _row_t(job, xs)
    average = sum(ws) / len(ws)
    return (t * average + (1 - t) * base).reshape(base.shape)


METHODS = (
    Method("model_stock", (Param("filter_wise", bool, SHARED, default=False,
                                 help="one interpolation factor per row (along the last dimension) instead of per "
                                      "tensor"),),
           base="required", models=(3, None), others=(2, None), kind="stats", kind_of=_kind, stats=_stats, merge=_merge,
           summary="base and the fine-tunes' average, interpolated by how much the fine-tunes agree"),
)
