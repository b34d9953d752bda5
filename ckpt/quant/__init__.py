"""Storage encodings decoded into plain logical tensors (FP8 layouts, ComfyUI comfy_quant nvfp4/mxfp8/int8,
bitsandbytes, optimum-quanto), and the comfy_quant encoders.

`logical_view(component)` is the one place that knows them: convert, merge-lora and dequant all read
checkpoints through it.
"""

from ckpt.quant.view import View, logical_view  # noqa: F401
