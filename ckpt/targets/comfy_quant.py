"""`--to nvfp4|mxfp8|int8|int8_rowwise|int8_convrot|convrot_w4a4|asym_w4a8_int8`: ComfyUI `comfy_quant`
checkpoints, the model's transformer-block Linear weights quantized, the rest kept
(`ckpt.targets.planners.comfy_quant_out`). The ConvRot targets use comfy-kitchen's default group sizes
(rotation group 256, W4A8 group 16) unless `--group-size N` names another: the rotation group of int8_convrot and
convrot_w4a4 (16, 64 or 256: every power of 4 decodes, but these are the sizes comfy-kitchen's CUDA and HIP kernels
run, HIP's int8 linear refusing any other), the W4A8 group of asym_w4a8_int8 (4 to 256 in powers of two: the
sizes comfy-kitchen accepts, 4, 8, 16 or a multiple of 16, that divide the rotation group; the rotation stays
256). A layer whose input width the group does not divide is kept in high precision and said, as every
comfy_quant target keeps the weights its layout cannot store."""

from __future__ import annotations

from ckpt.targets.base import Target

ORDER = 30


class ComfyQuant(Target):
    """`spec_format`/`rowwise`: the `ckpt.quant.comfy_quant.QuantSpec` the weights are encoded with."""

    saturates = True

    def __init__(self, name: str, spec_format: str, rowwise: bool = False):
        super().__init__(name)
        self.spec_format, self.rowwise = spec_format, rowwise

    def spec(self, opts=None):
        from ckpt.quant.comfy_quant import QuantSpec

        return QuantSpec(self.spec_format, rowwise=self.rowwise)

    def outputs(self, views, opts, report):
        from ckpt.targets.planners.comfy_quant_out import comfy_quant_outputs

        return comfy_quant_outputs(self.spec(opts), report, opts.keep, views, opts.layout)

    def heavy(self, opts, views) -> bool:
        return True  # encoding


class ConvRot(ComfyQuant):
    """A ConvRot format (`ckpt.quant.convrot.ConvRotSpec`): comfy-kitchen's default parameters, or --group-size's
    (`group_sizes`, the module docstring) as the rotation group or, for W4A8, the quantization group."""

    ROTATION_GROUPS = (16, 64, 256)
    W4A8_GROUPS = (4, 8, 16, 32, 64, 128, 256)

    def __init__(self, name: str, spec_format: str):
        super().__init__(name, spec_format)
        self.group_sizes = self.W4A8_GROUPS if spec_format == "asym_w4a8_int8" else self.ROTATION_GROUPS

    def spec(self, opts=None):
        from ckpt.quant.convrot import ConvRotSpec

        n = getattr(opts, "group_size", None)
        if n is None:
            return ConvRotSpec(self.spec_format)
        if self.spec_format == "asym_w4a8_int8":
            return ConvRotSpec(self.spec_format, group_size=n)
        return ConvRotSpec(self.spec_format, convrot_groupsize=n)


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
