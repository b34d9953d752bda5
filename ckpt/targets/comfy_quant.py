"""`--to nvfp4|mxfp8|int8|int8_rowwise`: ComfyUI `comfy_quant` checkpoints, the model's transformer-block
Linear weights quantized, the rest kept (`ckpt.targets.planners.comfy_quant_out`)."""

from __future__ import annotations

from ckpt.targets.base import Target

ORDER = 30


class ComfyQuant(Target):
    """`spec_format`/`rowwise`: the `ckpt.quant.comfy_quant.QuantSpec` the weights are encoded with."""

    saturates = True

    def __init__(self, name: str, spec_format: str, rowwise: bool = False):
        super().__init__(name)
        self.spec_format, self.rowwise = spec_format, rowwise

    def spec(self):
        from ckpt.quant.comfy_quant import QuantSpec

        return QuantSpec(self.spec_format, rowwise=self.rowwise)

    def outputs(self, views, opts, report):
        from ckpt.targets.planners.comfy_quant_out import comfy_quant_outputs

        return comfy_quant_outputs(self.spec(), report, opts.keep, views, opts.layout)

    def heavy(self, opts, views) -> bool:
        return True  # encoding


TARGETS = (
    ComfyQuant("nvfp4", "nvfp4"),
    ComfyQuant("mxfp8", "mxfp8"),
    ComfyQuant("int8", "int8_tensorwise"),  # one scale per tensor: the layout's default
    ComfyQuant("int8_rowwise", "int8_tensorwise", rowwise=True),  # one scale per output row
)
HELP = (f"a ComfyUI quantized format ({', '.join(t.name for t in TARGETS)}: transformer-block Linear weights "
        "quantized, the rest kept)")
