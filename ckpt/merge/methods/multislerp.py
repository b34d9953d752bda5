"""`multislerp` (mergekit): barycentric interpolation of any number of models on the hypersphere.

Each model (its difference from the base, when there is one) is taken as one long vector: divided by its norm
(plus `eps`) onto the unit sphere, their weighted mean (weights divided by their sum unless `normalize_weights:
false`) normalized gives the direction, the weighted tangent vectors at that direction are mapped back onto the
sphere, and the result is scaled by the weighted mean of the norms (the base added back). One model alone is
returned as it is. A weighted mean of length under `eps` is linear interpolation for two models and refused for
more (antipodal models whose weights balance out: no direction).

Streaming: kind "stats", two passes over the tensor's bands before the merge: the norms (squares summed in
fp64), then the mean's norm and each unit vector's dot product with the mean (fp64). The tangent vectors sum to
mean - (sum of weight * dot) * mean / |mean|, which is zero up to rounding: its norm is taken from the second pass
(|mean| - sum of weight * dot, in fp64) rather than from a third pass; it enters only as cos(norm + eps) and
sin(norm + eps) / (norm + eps), 1 in fp32 either way. Every band is then combined as mergekit combines it. One
model alone is kind "rows".

Deviations: mergekit divides by a weight sum of 0 (normalize_weights) and writes NaN; ckpt refuses it for the
tensor the weights are resolved for, before anything is written. `eps` must be above 0: at 0 a task vector of zeros
(a model equal to the base) is 0 / 0, NaN in every value (mergekit takes it).
"""

from __future__ import annotations

from ckpt.errors import CkptError
from ckpt.merge.methods.base import NON_BASE, SHARED, Method, Param
from ckpt.merge.methods.linear import sums_to_zero
from ckpt.lazy import torch


def _kind(job) -> str:
    return "rows" if len(job.non_base) == 1 else "stats"


def _deltas(job, xs):
    """[models, elements]: the non-base inputs (minus the base) as flat vectors in the compute dtype."""
    d = torch.stack([xs[i] for i in job.non_base]).reshape(len(job.non_base), -1)
    return d - xs[job.base].reshape(1, -1) if job.base is not None else d


def _check(job):
    """Planning: weights that sum to 0 cannot be normalized."""
    if job.shared["normalize_weights"] and sums_to_zero([job.per_input[i]["weight"] for i in job.non_base],
                                                        job.compute):
        raise CkptError(f"{job.source}: multislerp's weights sum to 0 for {job.names[0]}: normalize_weights divides "
                        "by their sum; give weights with another sum, or normalize_weights: false")


def _stats(job):
    dt = job.compute
    eps = job.shared["eps"]
    w = torch.tensor([job.per_input[i]["weight"] for i in job.non_base], dtype=dt)
    if job.shared["normalize_weights"]:
        w = w / w.sum()  # not 0: refused as the tensor was planned (_check)
    k = len(job.non_base)
    sq = torch.zeros(k, dtype=torch.float64)
    for _, xs in job.passes():
        d = _deltas(job, xs).double()
        sq += (d * d).sum(1).cpu()
    norms = sq.sqrt().to(dt)
    denom = norms + eps
    mm = torch.zeros((), dtype=torch.float64)
    dots = torch.zeros(k, dtype=torch.float64)
    for _, xs in job.passes():
        units = _deltas(job, xs) / denom.to(xs[0].device).view(-1, 1)
        mean = (units * w.to(units.device).view(-1, 1)).sum(0)
        m = mean.double()
        mm += m.dot(m).cpu()
        dots += (units.double() @ m).cpu()
    mean_norm = mm.sqrt()
    state = {"w": w, "denom": denom}
    if mean_norm.to(dt) < eps:
        if k == 2:
            return {**state, "lerp": True}
        raise CkptError(f"{job.name}: multislerp's weighted mean of the models' directions is zero (antipodal models "
                        "whose weights balance out have no direction); give other weights")
    dots = dots / mean_norm
    tangent_norm = (mean_norm - (w.double() * dots).sum()).abs() + eps
    return {**state, "lerp": False, "mean_norm": mean_norm.to(dt), "dots": dots.to(dt),
            "tangent_norm": tangent_norm.to(dt), "avg_norm": (norms * w).sum()}


def _merge(job, xs, band, state):
    if len(job.non_base) == 1:
        return xs[job.non_base[0]]
    dev = xs[0].device
    d = _deltas(job, xs)
    w = state["w"].to(dev).view(-1, 1)
    if state["lerp"]:
        out = d[0] * w[0] + d[1] * w[1]
    else:
        units = d / state["denom"].to(dev).view(-1, 1)
        mean = (units * w).sum(0) / state["mean_norm"].to(dev)
        tangent = ((units - state["dots"].to(dev).view(-1, 1) * mean) * w).sum(0)
        tn = state["tangent_norm"].to(dev)
        out = (mean * torch.cos(tn) + tangent * (torch.sin(tn) / tn)) * state["avg_norm"].to(dev)
    out = out.reshape(xs[0].shape)
    return out if job.base is None else out + xs[job.base]


METHODS = (
    Method("multislerp", (Param("weight", float, NON_BASE, required=True, help="each model's weight"),
                          Param("normalize_weights", bool, SHARED, default=True,
                                help="divide the weights by their sum"),
                          Param("eps", float, SHARED, default=1e-8, low=0.0, low_open=True,
                                why="eps keeps a model equal to the base from dividing 0 by 0",
                                help="added to norms against division by zero")),
           base="optional", others=(1, None), kind="stats", kind_of=_kind, stats=_stats, merge=_merge, check_job=_check,
           summary="spherical barycentric interpolation of several models (of their task vectors from a base)"),
)
