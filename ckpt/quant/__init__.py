"""Stored encodings decoded into plain logical tensors, and the encoders that write them.

Each quantized format is one module declaring `FORMAT = Format(...)` (`ckpt.quant.formats`: its decoders with
their priority, the weight classes they make, its label, its inspect settings, its refusals and config
contradictions), found by the registry: the FP8 layouts, ComfyUI's comfy_quant (nvfp4, mxfp8, int8),
bitsandbytes, optimum-quanto, GGUF (image and LLM), GPTQ, AWQ, compressed-tensors, ModelOpt NVFP4, gpt-oss
MXFP4, HQQ, torchao. `ckpt.quant.view.logical_view(component)` runs them: every command reads checkpoints
through it (imported from there: this package imports nothing, so the registry can list it). The encoders
(`*_encode`, `kquants`) serve the `--to` targets (`ckpt.targets`) and `--keep-format`.
"""
