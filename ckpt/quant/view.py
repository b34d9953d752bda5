"""The logical view of one component: plain tensors, with scale and marker keys consumed.

Each decoder module exposes `decode(ctx) -> Decoded | None`. Decoders run in `DECODERS` order over the
keys no earlier decoder claimed; what a decoder consumes is recorded with the reason, so nothing
disappears silently. Afterwards, keys that still look like quantization data the decoders did not
understand stop the run with an error naming the format (before any output exists).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from ckpt.errors import CkptError
from ckpt.io.checkpoint import Component
from ckpt.io.tensors import Tensor
from ckpt.quant.common import DecodeContext, quant_config


@dataclass
class View:
    tensors: dict[str, Tensor]
    consumed: dict[str, str]
    formats: list[str]
    drop_metadata: set[str]
    dequantized: bool
    notes: list[str]
    config: dict | None = None  # config.json made from the stored encoding (written beside the weights)
    anchors: dict[str, str] = field(default_factory=dict)  # consumed stored key -> logical name it holds


def _decoders():
    from ckpt.quant import awq, bnb, comfy_quant, compressed_tensors, fp8, gguf, gptq, hqq, modelopt, mxfp4, quanto
    from ckpt.quant import torchao

    return list(gguf.DECODERS) + list(torchao.DECODERS) + list(comfy_quant.DECODERS) + list(bnb.DECODERS) \
        + list(compressed_tensors.DECODERS) + list(modelopt.DECODERS) + list(fp8.DECODERS) \
        + list(quanto.DECODERS) + list(gptq.DECODERS) + list(awq.DECODERS) \
        + list(mxfp4.DECODERS) + list(hqq.DECODERS) \
        + list(compressed_tensors.LAST)


# Stored-key patterns no decoder claimed: name -> (regex on a key, what is wrong). Decoded today: GGUF,
# ComfyUI comfy_quant (fp8, int8, nvfp4, mxfp8), bitsandbytes NF4/FP4/LLM.int8, every FP8 layout, quanto,
# compressed-tensors, ModelOpt NVFP4, gpt-oss MXFP4, HQQ, GPTQ and AWQ (when config.json, quantize_config.json
# or quant_config.json names the method): int packs left over have no config saying which they are.
UNSUPPORTED = {
    "bitsandbytes": (re.compile(r"\.(absmax|quant_map|nested_absmax|nested_quant_map|quant_state\.[\w]+|SCB)$"),
                     "data without the quant state or weight it belongs to"),
    "GPTQ/AWQ int packs": (re.compile(r"\.(qweight|qzeros|g_idx)$"),
                           "no config.json quantization_config (or AutoGPTQ's quantize_config.json, AutoAWQ's "
                           "quant_config.json) names quant_method gptq or awq, and the packs alone do not say which"),
}


# Stored data a decoder reads only when the config names its method (or, for MXFP4 without one, gpt-oss's own
# names): format -> (is `key` its data, given the keys left, the quant_method that decodes it). Left over while
# quantization_config names another method, the config contradicts the tensors: said in one line, rather than
# "nothing quantized" or the packed bytes copied as if they were weights.
CONFIGURED = {
    "MXFP4 blocks": (lambda key, keys: key.endswith("_blocks") and key[: -len("_blocks")] + "_scales" in keys,
                     "mxfp4"),
    "GPTQ/AWQ int packs": (lambda key, keys: key.endswith((".qweight", ".qzeros", ".g_idx")), "gptq or awq"),
}


def _contradiction(component: Component, ctx: DecodeContext) -> None:
    """Refuse stored data of one format under a quantization_config naming another (`CONFIGURED`)."""
    qc = quant_config(ctx)
    if not qc:  # no quantization_config: the decoders go by the tensors' own names
        return
    method = qc.get("quant_method")
    for key in ctx.remaining:
        for fmt, (found, decoded_by) in CONFIGURED.items():
            if not found(key, ctx.remaining):
                continue
            if method is None:
                raise CkptError(f"{component.where}: config.json's quantization_config names no quant_method, but "
                                f"the tensors are {fmt} ({key!r}; quant_method {decoded_by}); nothing was written")
            shown = str(method) if len(str(method)) <= 40 else str(method)[:40] + "..."
            raise CkptError(f"{component.where}: config.json's quant_method {shown!r} contradicts the tensors, "
                            f"which are {fmt} ({key!r}; quant_method {decoded_by}); nothing was written")


def logical_view(component: Component, options: dict | None = None) -> View:
    metadata: dict[str, str] = {}
    for f in component.files:
        metadata.update(f.metadata)
    ctx = DecodeContext(component, dict(component.tensors), metadata, component.config, options or {})
    tensors: dict[str, Tensor] = {}
    consumed: dict[str, str] = {}
    formats, notes, drop_meta = [], list(component.notes), set()
    dequantized = False
    anchors: dict[str, str] = {}
    config = None
    for decode in _decoders():
        d = decode(ctx)
        if d is None:
            continue
        formats.append(d.format)
        notes += d.notes
        drop_meta |= d.drop_metadata
        dequantized |= d.dequantized
        for key in d.consumed:
            ctx.remaining.pop(key, None)
        for name in d.tensors:
            ctx.remaining.pop(name, None)
        consumed.update(d.consumed)
        tensors.update(d.tensors)
        anchors.update(d.anchors)
        config = d.config if d.config is not None else config
    _contradiction(component, ctx)
    for key in ctx.remaining:
        for fmt, (pattern, why) in UNSUPPORTED.items():
            if pattern.search(key):
                raise CkptError(f"{component.where}: {fmt} quantization ({key!r}): {why}; nothing was written")
    # Keep the stored order: decoded tensors take the place of the key they decode.
    ordered = {}
    for key, t in component.tensors.items():
        if key in tensors:
            ordered[key] = tensors.pop(key)
        elif key in ctx.remaining:
            ordered[key] = ctx.remaining[key]
        elif anchors.get(key) in tensors:
            ordered[anchors[key]] = tensors.pop(anchors[key])
    ordered.update(tensors)  # decoded names with no stored key of their own (e.g. quanto X.weight)
    return View(ordered, consumed, formats, drop_meta, dequantized, notes, config, anchors)
