"""`nuslerp` (mergekit): slerp between exactly two models with weights, optionally of their task vectors.

t = weight_2 / (weight_1 + weight_2) (0.5 when the weights sum to less than 1e-6 in magnitude). With a base, the
two models' differences from it are interpolated and the base added back; without one, the models themselves.
Each vector v0, v1 is divided by its norm (at least 1e-7), cos = their dot product clamped to [-1, 1], theta =
acos(cos), and the result is (sin((1 - t) theta) v0 + sin(t theta) v1) / sin(theta) of the raw vectors, or
(1 - t) v0 + t v1 where they are colinear (1 - cos^2 <= 1e-16).

Which vectors: `nuslerp_flatten: true` (the default) takes the whole tensor as one vector; else each row along the
last dimension (`nuslerp_row_wise: false`) or each column, along the first dimension (`nuslerp_row_wise: true`).
A 1-D tensor is one vector either way.

Streaming, per tensor (`kind_of`): vectors along the last dimension lie inside a band: kind "rows", computed
band by band exactly as mergekit computes them. The whole tensor or its columns span every band: kind "stats", a
first pass sums the squares and the product of the two vectors in fp64 (one number each, or one per column), the
coefficients follow, then every band is combined. mergekit sums the normalized products in the compute dtype:
the angles agree to fp32 rounding.
"""

from __future__ import annotations

import math

from ckpt.merge.methods.base import NON_BASE, SHARED, Method, Param
from ckpt.lazy import torch

NORM_MIN = 1e-7  # a vector is divided by max(its norm, this)
COLINEAR_EPS = 1e-8  # colinear when 1 - cos^2 <= COLINEAR_EPS^2


def _mode(job) -> str:
    """Which vectors: "flat" one (the whole tensor); "cols" along dim 0, one per element of a row; "last" along
    the last dimension (inside every row)."""
    if job.shared["nuslerp_flatten"] or len(job.shape) <= 1:
        return "flat"
    return "cols" if job.shared["nuslerp_row_wise"] else "last"


def _kind(job) -> str:
    return "rows" if _mode(job) == "last" else "stats"


def _t(job) -> float:
    w = [job.per_input[i]["weight"] for i in job.non_base]
    total = w[0] + w[1]
    return 0.5 if abs(total) < 1e-6 else w[1] / total


def _vectors(job, xs):
    """The two vectors nuslerp interpolates: the models, or their differences from the base."""
    a, b = (xs[i] for i in job.non_base)
    if job.base is None:
        return a, b
    return a - xs[job.base], b - xs[job.base]


def _combine(t: float, v0, v1, cos):
    """The interpolation of v0 and v1 given cos (broadcasting against them)."""
    colinear = (1 - cos.square()) <= COLINEAR_EPS ** 2
    theta = torch.acos(torch.where(colinear, torch.zeros_like(cos), cos))
    sph = (torch.sin((1 - t) * theta) * v0 + torch.sin(t * theta) * v1) / torch.sin(theta)
    return torch.where(colinear, (1 - t) * v0 + t * v1, sph)


def _stats(job):
    cols = _mode(job) == "cols"
    width = max(1, math.prod(job.shape[1:])) if cols else 1
    sums = torch.zeros(3, width, dtype=torch.float64)  # v0^2, v1^2, v0*v1 per vector
    for band, xs in job.passes():
        v0, v1 = _vectors(job, xs)
        v0, v1 = v0.reshape(-1, width).double(), v1.reshape(-1, width).double()
        sums += torch.stack([(v0 * v0).sum(0), (v1 * v1).sum(0), (v0 * v1).sum(0)]).cpu()
    dt = job.compute
    norms = sums[:2].sqrt().to(dt).clamp(min=NORM_MIN).double()
    cos = (sums[2] / (norms[0] * norms[1])).to(dt).clamp(-1, 1)
    return cos


def _merge(job, xs, band, state):
    t = _t(job)
    v0, v1 = _vectors(job, xs)
    shape = v0.shape
    mode = _mode(job)
    if mode == "last":
        n = shape[-1] if len(shape) else 1
        v0, v1 = v0.reshape(-1, n), v1.reshape(-1, n)
        u0 = v0 / torch.norm(v0, dim=-1, keepdim=True).clamp(min=NORM_MIN)
        u1 = v1 / torch.norm(v1, dim=-1, keepdim=True).clamp(min=NORM_MIN)
        cos = (u0 * u1).sum(dim=-1, keepdim=True).clamp(-1, 1)
    else:
        width = state.numel()
        v0, v1 = v0.reshape(-1, width), v1.reshape(-1, width)
        cos = state.to(v0.device).reshape(1, width)
    out = _combine(t, v0, v1, cos).reshape(shape)
    return out if job.base is None else xs[job.base] + out


METHODS = (
    Method("nuslerp", (Param("weight", float, NON_BASE, required=True,
                             help="each model's weight: t = w2 / (w1 + w2)"),
                       Param("nuslerp_row_wise", bool, SHARED, default=False,
                             help="with nuslerp_flatten false: slerp columns (along dim 0) instead of rows"),
                       Param("nuslerp_flatten", bool, SHARED, default=True,
                             help="slerp the whole tensor as one vector (else per row or column)")),
           base="optional", others=(2, 2), kind="stats", kind_of=_kind, stats=_stats, merge=_merge,
           summary="slerp of two weighted models, or of their task vectors from a base"),
)
