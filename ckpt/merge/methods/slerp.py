"""`slerp` (mergekit): spherical linear interpolation from the base (t = 0) to the other model (t = 1), one angle
per tensor.

The angle is the whole tensor's: the two tensors are taken as two long vectors, each divided by its norm (a norm
of 1e-8 or less is taken as 1), and theta = acos(their dot product, clamped to [-1, 1]). Nearly colinear tensors
(|cos| > 0.9995) are interpolated linearly, as are empty ones. The merged tensor is then

    sin((1 - t) theta) / sin(theta) * base + sin(t theta) / sin(theta) * other

(the coefficients computed in the compute dtype from `t`, as mergekit computes them). It needs a base and exactly
one other model, per tensor group (the models of a slice, with its base).

Streaming: kind "stats". The first pass over the tensor's bands sums the squares and the product of the two
inputs in fp64 (one pass: the dot product of the normalized tensors is the dot product over the product of the
norms), the two coefficients follow, and every band is `ca * base + cb * other`. mergekit sums the same products
in the compute dtype chunk by chunk: the coefficients agree to fp32 rounding, not bit for bit.

"""

from __future__ import annotations

from ckpt.merge.methods.base import SHARED, Method, Param
from ckpt.lazy import torch

DOT_THRESHOLD = 0.9995  # |cos| above this: linear interpolation (mergekit's default, not a parameter there)
NORM_EPS = 1e-8  # a norm at or below this is taken as 1


def _stats(job):
    b, o = job.base, 1 - job.base
    dt = job.compute
    t = torch.tensor(job.shared["t"], dtype=dt)
    sums = torch.zeros(3, dtype=torch.float64)  # sum base^2, sum other^2, sum base*other
    n = 0
    for _, xs in job.passes():
        x, y = xs[b].reshape(-1).double(), xs[o].reshape(-1).double()
        n += x.numel()
        sums += torch.stack([x.dot(x), y.dot(y), x.dot(y)]).cpu()
    if n == 0:
        return 1 - t, t
    norms = sums[:2].sqrt().to(dt)
    norms = torch.where(norms > NORM_EPS, norms, torch.ones_like(norms))
    cos = (sums[2] / (norms[0].double() * norms[1].double())).to(dt).clamp(-1, 1)
    if cos.abs() > DOT_THRESHOLD:
        return 1 - t, t
    theta = torch.acos(cos)
    sin = torch.sin(theta)
    return torch.sin((1 - t) * theta) / sin, torch.sin(t * theta) / sin


def _merge(job, xs, band, state):
    ca, cb = (c.to(xs[0].device) for c in state)
    return ca * xs[job.base] + cb * xs[1 - job.base]


METHODS = (
    Method("slerp", (Param("t", float, SHARED, required=True,
                           help="interpolation factor: 0 is the base, 1 the other model (a gradient over layers)"),),
           base="required", models=(2, 2), kind="stats", stats=_stats, merge=_merge,
           summary="spherical interpolation between the base and one other model"),
)
