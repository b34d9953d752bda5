"""`passthrough` (mergekit): one input per tensor, copied (times `scale` where given). With `slices:` it stacks
layer ranges of several models into one deeper model (`ckpt.merge.slices`): each slice has exactly one source."""

from __future__ import annotations

from ckpt.errors import CkptError
from ckpt.merge.methods.base import INPUT, Method, Param


def _merge(job, xs, band, state):
    scale = job.per_input[0].get("scale")
    return xs[0] if scale is None else xs[0] * scale


def _check(recipe, where):
    if recipe.slices is None:
        if len(recipe.refs) != 1:
            raise CkptError(f"{where}: passthrough takes one model (or slices: of one source each), got {len(recipe.refs)}")
        return
    for i, s in enumerate(recipe.slices):
        if len(s.sources) != 1:
            raise CkptError(f"{where}: slices[{i}]: passthrough takes one source per slice, got {len(s.sources)}")


METHODS = (
    Method("passthrough", (Param("scale", float, INPUT, default=None, help="multiply the tensor by this"),),
           base="optional", min_models=1, merge=_merge, check=_check, summary="copy one model's tensors (slices: stack layers)"),
)
