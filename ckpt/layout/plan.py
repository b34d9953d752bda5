"""`--layout diffusers|original`: which of the layout library's planners a checkpoint takes (a diffusers pipeline
folder and an all-in-one file are `ckpt.layout.pipeline`'s, one model is `ckpt.layout.relayout`'s). The one entry
`convert` and `merge` call; its own module so that the two planners need not know each other."""

from __future__ import annotations

from ckpt.errors import CkptError
from ckpt.families import DIFFUSERS, ORIGINAL
from ckpt.io.plan import Plan
from ckpt.layout import pipeline
from ckpt.layout.relayout import plan_model_layout, refuse_lora


def plan_layout(ckpt, views, make, *, layout: str, operation: str, config_ref: str | None = None,
                max_shard_size: int | None = None, file_format: str = "safetensors") -> Plan:
    """The plan of `convert --layout`: `views` are the components' logical views, `make` turns each
    output tensor into OutTensors (the dtype choice)."""
    if layout not in (DIFFUSERS, ORIGINAL):
        raise CkptError(f"--layout {layout}: choose diffusers or original")
    refuse_lora(ckpt, layout)
    kind = pipeline.pipeline_kind(ckpt)
    if kind is not None:
        if layout == DIFFUSERS:
            raise CkptError(f"{ckpt.path}: already a diffusers pipeline")
        return pipeline.plan_pipeline_to_file(ckpt, views, make, kind, operation, file_format, max_shard_size)
    if len(ckpt.components) == 1:
        kind = pipeline.single_file_kind(views[0].tensors)
        if kind is not None:
            if layout == ORIGINAL:
                raise CkptError(f"{ckpt.components[0].where}: already an all-in-one {kind} file (original layout)")
            if file_format != "safetensors":
                raise CkptError("--layout diffusers writes safetensors (diffusers folders hold no torch pickles)")
            return pipeline.plan_file_to_pipeline(ckpt, views, make, kind, operation, config_ref, max_shard_size)
    return plan_model_layout(ckpt, views, make, layout=layout, operation=operation, config_ref=config_ref,
                             max_shard_size=max_shard_size, file_format=file_format)
