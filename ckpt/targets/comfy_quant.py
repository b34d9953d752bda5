"""`--to nvfp4|mxfp8|int8|int8_rowwise|int8_convrot|convrot_w4a4|asym_w4a8_int8`: ComfyUI `comfy_quant`
checkpoints, the model's transformer-block Linear weights quantized, the rest kept
(`ckpt.targets.planners.comfy_quant_out`). The ConvRot targets use comfy-kitchen's default group sizes
(rotation group 256, W4A8 group 16): ckpt has no group-size option."""

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


class ConvRot(ComfyQuant):
    """A ConvRot format (`ckpt.quant.convrot.ConvRotSpec`, comfy-kitchen's default parameters)."""

    def spec(self):
        from ckpt.quant.convrot import ConvRotSpec

        return ConvRotSpec(self.spec_format)


TARGETS = (
    ComfyQuant("nvfp4", "nvfp4"),
    ComfyQuant("mxfp8", "mxfp8"),
    ComfyQuant("int8", "int8_tensorwise"),  # one scale per tensor: the layout's default
    ComfyQuant("int8_rowwise", "int8_tensorwise", rowwise=True),  # one scale per output row
    ConvRot("int8_convrot", "int8_tensorwise"),  # W8A8, Hadamard-rotated, one scale per output channel
    ConvRot("convrot_w4a4", "convrot_w4a4"),  # W4A4: signed int4, one scale per row
    ConvRot("asym_w4a8_int8", "asym_w4a8_int8"),  # W4A8: 4-bit codebook codes, e4m3 scale per 16 inputs
)
HELP = (f"a ComfyUI quantized format ({', '.join(t.name for t in TARGETS)}: transformer-block Linear weights "
        "quantized, the rest kept)")
