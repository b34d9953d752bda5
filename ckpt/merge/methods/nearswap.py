"""`nearswap` (mergekit): interpolate from the base towards one other model where they are close.

Per element, with a the base and b the other model: weight = clamp(t / max(|a - b|, 1e-6), 0, 1) and the result
is weight * b + (1 - weight) * a. Where the two models differ by less than `t` the other model's value is taken
whole; where they differ more, only a share t / |a - b| of the way. Exactly two inputs, one of them the base.

Elementwise: kind "rows", computed band by band as mergekit computes the whole tensor (bit for bit).
"""

from __future__ import annotations

from ckpt.errors import CkptError
from ckpt.merge.methods.base import SHARED, Method, Param

ABSDIFF_MIN = 1e-6  # |a - b| is at least this in the division


def _merge(job, xs, band, state):
    a = xs[job.base]
    b = xs[job.non_base[0]]
    t = job.shared["t"]
    # t / tensor is torch's reciprocal(tensor) * t: written the same way, the values agree with mergekit's bitwise
    weight = (t / (a - b).abs().clamp(min=ABSDIFF_MIN)).clamp(min=0, max=1)
    return weight * b + (1 - weight) * a


def check_non_base(recipe, where: str, name: str, low: int, high: int | None) -> None:
    """Refuse a group of inputs (the models, or one slice's sources) with fewer than `low` or more than `high`
    models besides its base (mergekit checks each group so; the base itself `Method.base` requires)."""
    glob = recipe.base_model.text if recipe.base_model is not None else None
    if recipe.slices is None:
        groups = [("", [r.text for r in recipe.refs], glob)]
    else:
        groups = [(f"slices[{i}]: ", [s.model.text for s in sl.sources],
                   sl.base_model.text if sl.base_model is not None else glob) for i, sl in enumerate(recipe.slices)]
    for at, order, base in groups:
        n = len(set(order) - {base})
        if n < low or (high is not None and n > high):
            want = f"exactly {low}" if high == low else f"at least {low}" if high is None else f"{low} to {high}"
            raise CkptError(f"{where}: {at}{name} merges {want} model{'s' if want != 'exactly 1' else ''} besides "
                            f"the base, got {n}")


def _check(recipe, where):
    check_non_base(recipe, where, "nearswap", 1, 1)


METHODS = (
    Method("nearswap", (Param("t", float, SHARED, required=True, low=0.0,
                              why="t is the distance below which the other model's value is taken; below 0 it "
                                  "takes nothing, as 0 does",
                              help="similarity distance: elements closer than t take the other model's value"),),
           base="required", min_models=2, kind="rows", merge=_merge, check=_check,
           summary="the base moved towards one model where they are within t"),
)
