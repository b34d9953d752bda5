"""`sce` (mergekit): Select, Calculate, Erase (arXiv 2408.07990), a weighted merge of the task vectors.

Task vectors d_i = x_i - base. Select: with `select_topk` below 1, only the elements where the task vectors vary
most across models are kept: the variance over models (population variance) of every element, and the
k = int(nonzero * select_topk) largest of the tensor (nonzero: the elements of nonzero variance) stay; the rest of
every d_i is zeroed. Calculate: model i's weight is the mean of its selected d_i squared over the tensor, divided
by the sum of the weights (equal weights when that sum is below 1e-6). Erase: per element, the majority sign is
the sign of sum_i d_i (>= 0 counts as +), and the d_i of the other sign (and the zeros) are dropped. The result is
base + sum_i(w_i d_i) / max(sum_i w_i, 1e-6) over the d_i kept at each element.

Streaming: kind "stats". The selection is whole-tensor: one pass counts the elements of nonzero variance, then
`ckpt.merge.select.kth_largest` finds the k-th largest variance exactly (radix selection, 2 or 3 passes; ties at
the threshold are kept in flat index order, where mergekit's topk keeps an unspecified few). One more pass sums
every model's selected squares in fp64 for the weights. Every band then recomputes its variances (as mergekit
computes them, elementwise, bit for bit), applies the threshold and combines. mergekit's weights are fp32 means
over the tensor: they agree to fp32 rounding. `int8_mask` (mergekit's mask dtype, a memory saving) is accepted
and changes nothing. With `dtype: float64` the variances are ranked at fp32 precision (kth_largest's keys).
"""

from __future__ import annotations

from ckpt.merge.methods.base import SHARED, Method, Param
from ckpt.lazy import torch

WEIGHT_SUM_MIN = 1e-6  # weights summing to less than this in magnitude are replaced by equal ones
DIVISOR_MIN = 1e-6  # the sum of the kept weights at an element is at least this


def _deltas(job, xs):
    base = xs[job.base]
    return torch.stack([xs[i] - base for i in job.non_base])


def _variance(tvs):
    return torch.var(tvs, dim=0, unbiased=False)


def _selected(job, xs, band, select):
    """The task vectors of a band with the unselected elements zeroed (`select`: None keeps all, False none,
    else the Threshold)."""
    tvs = _deltas(job, xs)
    if select is None:
        return tvs
    if select is False:
        mask = torch.zeros_like(tvs[0])
    else:
        var = _variance(tvs)
        mask = select.mask(var.abs(), band.offset).to(tvs.dtype)
    return tvs * mask.unsqueeze(0)


def _stats(job):
    """(selection, per-model weights in the compute dtype)."""
    from ckpt.merge.select import kth_largest

    n = len(job.non_base)
    if not n:
        return None
    topk = job.shared["select_topk"]
    select = None
    if topk < 1:
        nonzero = 0
        for _, xs in job.passes():
            nonzero += int(torch.count_nonzero(_variance(_deltas(job, xs))))
        k = int(torch.tensor(nonzero, dtype=torch.int64) * topk)  # fp32 product, as mergekit's
        if k == 0:
            select = False
        else:
            numel = 1
            for s in job.shape:
                numel *= s

            def scores():
                for band, xs in job.passes():
                    yield band.offset, _variance(_deltas(job, xs)).abs()

            select = kth_largest(scores, k, numel)
    sq = torch.zeros(n, dtype=torch.float64)
    count = 0
    for band, xs in job.passes():
        tvs = _selected(job, xs, band, select).reshape(n, -1).double()
        sq += tvs.square().sum(dim=1).cpu()
        count += tvs.shape[1]
    weights = (sq / max(count, 1)).to(job.compute)
    total = torch.sum(weights).item()
    if abs(total) < WEIGHT_SUM_MIN:
        weights = torch.ones_like(weights) / weights.shape[0]
    else:
        weights = weights / total
    return select, weights


def _merge(job, xs, band, state):
    base = xs[job.base]
    if state is None:
        return base.clone()
    select, weights = state
    tvs = _selected(job, xs, band, select)
    sign = tvs.sign()
    majority = (tvs.sum(dim=0) >= 0).to(tvs.dtype) * 2 - 1
    keep = sign == majority
    w = weights.to(tvs.device).reshape((-1,) + (1,) * (tvs.dim() - 1)) * keep
    merged = (tvs * w).sum(dim=0)
    return base + merged / w.sum(dim=0).clamp(min=DIVISOR_MIN)


METHODS = (
    Method("sce", (Param("select_topk", float, SHARED, default=1.0, low=0.0, high=1.0, low_open=True,
                         why="select_topk is the fraction of elements kept; 0 keeps none and returns the base",
                         help="fraction of elements (those of largest variance across the models) kept"),
                   Param("int8_mask", bool, SHARED, default=False,
                         help="mergekit's int8 masks (a memory saving): accepted, changes nothing here")),
           base="required", kind="stats", stats=_stats, merge=_merge,
           summary="task vectors selected by variance, weighted by their energy, sign-erased, added to the base"),
)
