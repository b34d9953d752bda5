"""`nearswap` (mergekit): interpolate from the base towards one other model where they are close.

Per element, with a the base and b the other model: weight = clamp(t / max(|a - b|, 1e-6), 0, 1) and the result
is weight * b + (1 - weight) * a. Where the two models differ by less than `t` the other model's value is taken
whole; where they differ more, only a share t / |a - b| of the way. Exactly two inputs, one of them the base.

Elementwise: kind "rows", computed band by band as mergekit computes the whole tensor (bit for bit).
"""

from __future__ import annotations

from ckpt.merge.methods.base import SHARED, Method, Param

ABSDIFF_MIN = 1e-6  # |a - b| is at least this in the division


def _merge(job, xs, band, state):
    a = xs[job.base]
    b = xs[job.non_base[0]]
    t = job.shared["t"]
    # t / tensor is torch's reciprocal(tensor) * t: written the same way, the values agree with mergekit's bitwise
    weight = (t / (a - b).abs().clamp(min=ABSDIFF_MIN)).clamp(min=0, max=1)
    return weight * b + (1 - weight) * a


METHODS = (
    Method("nearswap", (Param("t", float, SHARED, required=True, low=0.0,
                              why="t is the distance below which the other model's value is taken; below 0 it "
                                  "takes nothing, as 0 does",
                              help="similarity distance: elements closer than t take the other model's value"),),
           base="required", models=(2, None), others=(1, 1), kind="rows", merge=_merge,
           summary="the base moved towards one model where they are within t"),
)
