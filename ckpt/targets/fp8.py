"""`--to fp8_e4m3fn`: a plain cast; with --scaled, ComfyUI's scaled-fp8 layout (per-tensor scales on the
Linear weights, `ckpt.targets.planners.fp8_out`). --scaled is a variant of this one target, not a name of its own."""

from __future__ import annotations

from ckpt.targets.base import Target
from ckpt.targets.casts import Cast

ORDER = 20
HELP = ""  # a dtype: the casts' clause describes it


class ScaledFP8(Target):
    is_scaled = True

    def outputs(self, views, opts, report):
        from ckpt.targets.planners.fp8_out import scaled_fp8_outputs

        return scaled_fp8_outputs(report, opts.keep), None

    def heavy(self, opts, views) -> bool:
        return True  # amax and encoding of every scaled weight


FP8 = Cast("fp8_e4m3fn", "float8_e4m3fn")
FP8.scaled_variant = ScaledFP8("fp8_e4m3fn", suffix="fp8_e4m3fn-scaled", label="fp8_e4m3fn")
TARGETS = (FP8,)
