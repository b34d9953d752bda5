"""`ram` and `ramplus_tl` (mergekit): Reinforced Agent Merging (arXiv 2601.13572).

Each model's task vector d_i = x_i - base; an element counts for model i where |d_i| > `epsilon`. Per element,
with c the number of models it counts for: where c == 1 that model's d_i is taken whole (a "unique" element),
where c > 1 the d_i that count are averaged (their sum divided by c), where c == 0 nothing is added. The result is
the base plus that.

`ramplus_tl` (tensor-local RAM+) boosts the unique elements: per model and per tensor, rho_i = (elements that
count for model i and at least one other) / max(elements that count for model i alone, epsilon), and model i's
unique elements are multiplied by lambda_i = 1 + r * clamp(rho_i, 0, alpha).

Streaming: `ram` is elementwise, kind "rows", band by band bit for bit as mergekit computes the whole tensor.
`ramplus_tl`'s counts span the tensor: kind "stats", one pass counts them per model (exact integers), lambda_i is
computed from them as mergekit computes it, then every band is combined as `ram` combines it. mergekit flattens
the stacked task vectors and sums over the models; a band's sum is the same per element, so `ramplus_tl` agrees
bitwise too.
"""

from __future__ import annotations

from ckpt.merge.methods.base import SHARED, Method, Param
from ckpt.lazy import torch


def _vectors(job, xs):
    """The stacked task vectors, flattened per model [n, elements], and which elements count for which model."""
    base = xs[job.base]
    tv = torch.stack([xs[i] - base for i in job.non_base]).reshape(len(job.non_base), -1)
    counts = tv.abs() > job.shared["epsilon"]
    return tv, counts


def _combine(job, xs, unique_scale):
    base = xs[job.base]
    if not job.non_base:
        return base.clone()
    tv, nonzero = _vectors(job, xs)
    contrib = nonzero.sum(dim=0, keepdim=True)
    overlap, unique = contrib > 1, contrib == 1
    tv_z = tv * nonzero
    uniq = tv_z * unique
    if unique_scale is not None:
        uniq = uniq * unique_scale.to(tv.device).unsqueeze(-1)
    merged = (uniq + tv_z * overlap / contrib.clamp(min=1)).sum(dim=0, keepdim=True)
    return base + merged.reshape(base.shape)


def _ram(job, xs, band, state):
    return _combine(job, xs, None)


def _plus_stats(job):
    """lambda_i per model, from the whole tensor's shared and unique counts."""
    n = len(job.non_base)
    if not n:
        return None
    shared = torch.zeros(n, dtype=torch.int64)
    unique = torch.zeros(n, dtype=torch.int64)
    for _, xs in job.passes():
        _, nonzero = _vectors(job, xs)
        contrib = nonzero.sum(dim=0, keepdim=True)
        shared += (nonzero & (contrib > 1)).sum(dim=1).cpu()
        unique += (nonzero & (contrib == 1)).sum(dim=1).cpu()
    eps, r, alpha = job.shared["epsilon"], job.shared["r"], job.shared["alpha"]
    rho = shared / unique.clamp(min=eps)  # int counts: torch's default float dtype, as mergekit's
    return 1 + r * rho.clamp(min=0, max=alpha)


def _plus(job, xs, band, state):
    return _combine(job, xs, state)


def _epsilon(low_open: bool) -> Param:
    why = ("epsilon is the magnitude a change must exceed to count; at 0 a model that leaves a tensor unchanged "
           "divides 0 by 0 (mergekit writes NaN there)") if low_open else \
        "epsilon is the magnitude a change must exceed to count"
    return Param("epsilon", float, SHARED, default=1e-5, low=0.0, low_open=low_open, why=why,
                 help="a change counts where its magnitude exceeds this")


METHODS = (
    Method("ram", (_epsilon(False),), base="required", kind="rows", merge=_ram,
           summary="base + task vectors: unique changes taken whole, overlapping ones averaged"),
    Method("ramplus_tl", (Param("r", float, SHARED, default=0.1, low=0.0,
                                why="r scales the boost of a model's unique changes",
                                help="boost of unique changes: lambda = 1 + r * clamp(rho, 0, alpha)"),
                          Param("alpha", float, SHARED, default=0.2, low=0.0,
                                why="rho is clamped to [0, alpha]",
                                help="upper bound of the shared/unique ratio rho"),
                          _epsilon(True)),
           base="required", kind="stats", stats=_plus_stats, merge=_plus,
           summary="ram with each model's unique changes boosted by its tensor's shared/unique ratio"),
)
