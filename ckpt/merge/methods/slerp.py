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

`input_groups` and `check_counts` (also used by nuslerp and multislerp) check a recipe's input counts per group,
as mergekit checks them per tensor: a slices: config is several groups.
"""

from __future__ import annotations

from ckpt.errors import CkptError
from ckpt.merge.methods.base import SHARED, Method, Param

DOT_THRESHOLD = 0.9995  # |cos| above this: linear interpolation (mergekit's default, not a parameter there)
NORM_EPS = 1e-8  # a norm at or below this is taken as 1


def input_groups(recipe):
    """(where, inputs, base) for every group of inputs one output tensor merges: the models with the base, or each
    slice's sources with its base (the slice's, else the global one)."""
    glob = recipe.base_model.text if recipe.base_model is not None else None
    if recipe.slices is None:
        yield "", [r.text for r in recipe.refs], glob
        return
    for i, sl in enumerate(recipe.slices):
        order: list[str] = []
        for s in sl.sources:
            if s.model.text not in order:
                order.append(s.model.text)
        base = sl.base_model.text if sl.base_model is not None else glob
        if base is not None and base not in order:
            order.append(base)
        yield f"slices[{i}]: ", order, base


def check_counts(recipe, where: str, name: str, *, total: int | None = None,
                 non_base: tuple[int, int | None] | None = None, need_base: bool = False) -> None:
    """Refuse a group with the wrong number of inputs: `total` counts the base, `non_base` is (min, max or None)
    of the others."""
    for at, order, base in input_groups(recipe):
        if need_base and base is None:
            raise CkptError(f"{where}: {at}{name} needs a base_model (it interpolates from the base to the other "
                            "model)")
        if total is not None and len(order) != total:
            raise CkptError(f"{where}: {at}{name} merges exactly {total} models (counting the base), got {len(order)}")
        if non_base is not None:
            n = len(order) - (base is not None)
            lo, hi = non_base
            if n < lo or (hi is not None and n > hi):
                want = f"exactly {lo}" if hi == lo else f"at least {lo}" if hi is None else f"{lo} to {hi}"
                many = "model" if (hi if hi is not None else lo) == 1 else "models"
                raise CkptError(f"{where}: {at}{name} merges {want} {many} besides the base, got {n}")


def _check(recipe, where):
    check_counts(recipe, where, "slerp", total=2, need_base=True)


def _stats(job):
    import torch

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
           base="required", min_models=2, kind="stats", stats=_stats, merge=_merge, check=_check,
           summary="spherical interpolation between the base and one other model"),
)
