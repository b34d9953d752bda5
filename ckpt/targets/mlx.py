"""`--to mlx-q2|mlx-q3|mlx-q4|mlx-q5|mlx-q6|mlx-q8 [--group-size 32|64|128]`: an MLX model folder, what
`mlx_lm.convert -q --q-bits N --q-group-size G` writes of a Hugging Face LLM folder (affine mode, mlx-lm's
default group 64), planned by `ckpt.targets.planners.mlx_out`. The bit widths are mlx-lm's affine ones; its other
`--q-mode`s (mxfp4, nvfp4, mxfp8) are not written (nothing but MLX reads them, and mlx-lm makes them only on
request)."""

from __future__ import annotations

from ckpt.errors import CkptError
from ckpt.targets.base import Target

ORDER = 45
DEFAULT_GROUP = 64  # mlx_lm.convert's affine default


class Mlx(Target):
    group_sizes = (32, 64, 128)
    decodes = True

    def __init__(self, bits: int):
        super().__init__(f"mlx-q{bits}", label=f"MLX {bits}-bit")
        self.bits = bits

    def output_format(self, opts, out, ckpt=None, default: str = "safetensors") -> str:
        """Safetensors in a folder, as mlx-lm writes: -o names a folder, never one weight file."""
        from pathlib import Path

        if getattr(opts, "format", None) not in (None, "safetensors"):
            raise CkptError(f"--format {opts.format}: --to {self.name} writes an MLX folder of safetensors")
        if out and Path(out).suffix.lower() in (".safetensors", ".gguf", ".pt", ".pth", ".bin", ".ckpt"):
            raise CkptError(f"{out}: --to {self.name} writes an MLX model folder; -o names a folder")
        return "safetensors"

    def check(self, opts) -> None:
        super().check(opts)
        if opts.layout is not None:
            raise CkptError(f"--layout does not apply to --to {self.name} (mlx-lm's layout is the model's own)")
        if opts.max_shard_size:
            raise CkptError(f"--max-shard-size does not apply to --to {self.name} (mlx-lm shards at 5 GiB)")

    def plan(self, ckpt, views, opts, report, file_format: str, operation: str):
        from ckpt.targets.planners.mlx_out import plan_mlx

        group = getattr(opts, "group_size", None) or DEFAULT_GROUP
        plan = plan_mlx(ckpt, views, self.bits, group, report, operation, self.name)
        plan.busy_stage = "compute"
        return plan

    def heavy(self, opts, views) -> bool:
        return True  # encoding


TARGETS = tuple(Mlx(b) for b in (2, 3, 4, 5, 6, 8))
HELP = (f"an MLX folder ({', '.join(t.name for t in TARGETS)}: mlx_lm.convert -q's affine quantization, "
        "--group-size 32, 64 or 128)")
