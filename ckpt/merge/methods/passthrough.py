"""`passthrough` (mergekit): one input per tensor, copied (times `scale` where given). With `slices:` it stacks
layer ranges of several models into one deeper model (`ckpt.merge.slices`): each slice has exactly one source."""

from __future__ import annotations

from ckpt.merge.methods.base import INPUT, Method, Param


def _merge(job, xs, band, state):
    scale = job.per_input[0].get("scale")
    return xs[0] if scale is None else xs[0] * scale


METHODS = (
    Method("passthrough", (Param("scale", float, INPUT, default=None, help="multiply the tensor by this"),),
           base="optional", models=(1, 1), merge=_merge, summary="copy one model's tensors (slices: stack layers)"),
)
