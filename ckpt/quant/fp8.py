"""FP8 storage layouts decoded to plain values (float32, exact products), see docs/format-facts.md "FP8".

Plain fp8 tensors need no decoder: they are read as they are and cast exactly by the caster.
Scaled layouts become `ScaledTensor`s: W = w.float() * scale, computed in fp32 and rounded once by the
caller's cast. Every layout is one decoder function in `DECODERS`, most specific first (ComfyUI's
`comfy_quant` layers, fp8 ones included, are `ckpt.quant.comfy_quant`, which runs before these):

- ComfyUI legacy scaled fp8 (`scaled_fp8` marker, `X.scale_weight`, `X.scale_input`)
- kohya / musubi-tuner `fp8_scaled` (`X.scale_weight` [1], [out,1], [out,nb,1], `X.scale_weight_tensor`)
- HF fine-grained / DeepSeek block FP8 (`X.weight_scale_inv`, 128x128 blocks, fp32 or E8M0)
- compressed-tensors, FBGEMM, ModelOpt, AutoFP8 (`X.weight_scale`), Mistral (`X.qscale_weight`)
- activation-only scales (`input_scale`, `k_scale`, ...): meaningless once weights are plain, dropped
- anything scale-like left over: refused by name, before any output exists
"""

from __future__ import annotations

from ckpt.lazy import torch

from ckpt.dtypes import FP8, ST_FP8, is_float
from ckpt.quant.common import (ACTIVATION_SCALES, DEFAULT_BLOCK, DecodeContext, Decoded, activation_keys, companion,
                               ScaledTensor, float_scale, model_dtype, quant_config, refuse, scaled, st_name,
                               weight_key)
from ckpt.quant.encoding import NoEncoder
from ckpt.quant.fp8_encode import ComfyScaledFP8Encoding, KohyaFP8Encoding
from ckpt.report import plural
from ckpt.quant.formats import Format

# Suffixes of keys that only make sense next to a quantized weight; one left unclaimed is refused.
WEIGHT_SCALE_SUFFIXES = (".weight_scale", ".weight_scale_inv", ".scale_weight", ".scale_weight_tensor",
                         ".qscale_weight", ".weight_scale_2", ".weight_zero_point", ".comfy_quant")


# ---------------------------------------------------------------------------------------------------
# helpers of these decoders (those every decoder shares are `ckpt.quant.common`)


def _layer(key: str, suffix: str) -> str:
    """`a.b.weight_scale` -> `a.b` (suffix given with its leading dot)."""
    return key[: -len(suffix)]


def _require_fp8_weight(ctx, wkey, skey, what: str):
    w = ctx.remaining.get(wkey)
    if w is None:
        raise refuse(ctx, skey, f"{what} scale {skey!r} has no weight {wkey!r} to pair with")
    if w.dtype not in FP8:
        raise refuse(ctx, skey, f"{wkey!r} is {st_name(w.dtype)}, not FP8, yet has the {what} scale {skey!r}: "
                                f"{_other_format(ctx, wkey, w)}")
    return w


def _other_format(ctx, wkey, w) -> str:
    layer = wkey[: -len(".weight")]
    if f"{layer}.weight_scale_2" in ctx.remaining:
        return ("NVFP4 outside ComfyUI's comfy_quant layout (4-bit packs with weight_scale_2, e.g. ModelOpt), "
                "which ckpt cannot decode")
    if w.dtype in (torch.int8, torch.uint8, torch.int32):
        return "integer quantization (int8 / packed ints), which ckpt cannot decode"
    return "ckpt cannot pair a scale with a non-FP8 weight"


def _no_unscaled(ctx: DecodeContext, tensors: dict, what: str) -> None:
    """In a layout whose every FP8 weight carries its scale (kohya fp8_scaled, HF block FP8, weight_scale
    FP8), an FP8 `.weight` without one has lost it: casting its codes as plain values would be garbage
    written with exit 0, so it is refused (a plain FP8 file, where no weight has a scale, is cast as is)."""
    for key, t in ctx.remaining.items():
        if (key == "weight" or key.endswith(".weight")) and t.dtype in FP8 and key not in tensors:
            raise refuse(ctx, key, f"FP8 weight {key!r} has no scale, yet {plural(len(tensors), 'other FP8 weight')} "
                                   f"of this {what} checkpoint {'has' if len(tensors) == 1 else 'have'} one: its "
                                   "codes cannot be decoded")


# ---------------------------------------------------------------------------------------------------
# decoders, most specific first


def comfy_legacy(ctx: DecodeContext) -> Decoded | None:
    """ComfyUI legacy scaled fp8: marker `<prefix>scaled_fp8` (its dtype names the fp8 type), per layer
    `X.scale_weight` (fp32 scalar), optional `X.scale_input`. Like ComfyUI, W = w * scale_weight for any
    layer with a scale, high-precision layers with a dummy scale included."""
    markers = [k for k in ctx.remaining if k == "scaled_fp8" or k.endswith(".scaled_fp8")]
    if not markers:
        return None
    natural = model_dtype(ctx)
    tensors, consumed = {}, {m: "ComfyUI scaled-fp8 marker" for m in markers}
    for key in list(ctx.remaining):
        if key.endswith(".scale_weight"):
            wkey = weight_key(_layer(key, ".scale_weight"))
            w = ctx.remaining.get(wkey)
            if w is None or not is_float(w.dtype):
                raise refuse(ctx, key, f"scale {key!r} has no floating weight {wkey!r} to pair with")
            tensors[wkey] = scaled(ctx, wkey, w, key, ctx.remaining[key], natural if w.dtype in FP8 else w.dtype)
            tensors[wkey].encoding = ComfyScaledFP8Encoding(wkey, w, key, ctx.remaining[key])
            consumed[key] = f"scale of {wkey}"
        elif key.endswith(".scale_input"):
            consumed[key] = "activation scale (inference only)"
    return Decoded("comfy-scaled-fp8", tensors, consumed)


def kohya_scaled(ctx: DecodeContext) -> Decoded | None:
    """kohya sd-scripts / musubi-tuner `fp8_scaled`: `X.scale_weight` shaped [1] (tensor), [out, 1]
    (channel) or [out, nb, 1] (blocks along the input dim), optional `X.scale_weight_tensor` (second-level
    scalar: total scale = block scale * tensor scale). The scale's dtype is the model's original dtype."""
    keys = [k for k in ctx.remaining if k.endswith(".scale_weight")]
    if not keys:
        return None
    tensors, consumed = {}, {}
    for key in keys:
        wkey = weight_key(_layer(key, ".scale_weight"))
        w = _require_fp8_weight(ctx, wkey, key, "kohya fp8_scaled")
        s = ctx.remaining[key]
        tkey = _layer(key, ".scale_weight") + ".scale_weight_tensor"
        extra = ctx.remaining.get(tkey)
        if extra is not None:  # read as one scalar: anything else broadcast wrongly or failed mid-write
            companion(ctx, tkey, f"tensor-level scale of {wkey!r}", dtypes=float_scale, numel=1)
        natural = s.dtype if s.dtype in (torch.float16, torch.bfloat16, torch.float32) else model_dtype(ctx)
        tensors[wkey] = scaled(ctx, wkey, w, key, s, natural, extra=extra)
        tensors[wkey].encoding = KohyaFP8Encoding(wkey, w, key, s, tensors[wkey].layout,
                                                  tkey if extra is not None else None, extra)
        consumed[key] = f"scale of {wkey}"
        if extra is not None:
            consumed[tkey] = f"tensor-level scale of {wkey}"
    _no_unscaled(ctx, tensors, "kohya fp8_scaled")
    return Decoded("kohya-fp8-scaled", tensors, consumed)


def _block_size(ctx: DecodeContext) -> tuple[int, int] | None:
    qc = quant_config(ctx)
    bs = qc.get("weight_block_size")
    if bs is None:  # compressed-tensors: config_groups.<g>.weights.block_structure
        for group in (qc.get("config_groups") or {}).values():
            bs = ((group or {}).get("weights") or {}).get("block_structure") or bs
    if isinstance(bs, (list, tuple)) and len(bs) == 2 and all(isinstance(x, int) and x > 0 for x in bs):
        return bs[0], bs[1]
    return None


def hf_block_fp8(ctx: DecodeContext) -> Decoded | None:
    """HF fine-grained FP8 / DeepSeek-V3 / Qwen3-FP8: `X.weight_scale_inv` ([ceil(out/128),
    ceil(in/128)], fp32 or E8M0, leading expert dims possible) multiplies its 128x128 block of `X.weight`;
    the block size comes from config.json `quantization_config.weight_block_size`."""
    keys = [k for k in ctx.remaining if k.endswith(".weight_scale_inv")]
    if not keys:
        return None
    block = _block_size(ctx) or DEFAULT_BLOCK
    natural, tensors, consumed = model_dtype(ctx), {}, {}
    for key in keys:
        layer = _layer(key, ".weight_scale_inv")
        wkey = weight_key(layer)
        w = _require_fp8_weight(ctx, wkey, key, "block FP8")
        if len(w.shape) < 2:
            raise refuse(ctx, wkey, f"block FP8 weight {wkey!r} is {list(w.shape)}: blocks tile the last two "
                                    "dimensions of a matrix (or a bank of them)")
        tensors[wkey] = scaled(ctx, wkey, w, key, ctx.remaining[key], natural, block)
        if tensors[wkey].layout.kind not in ("block", "tensor"):  # a per-row or group fit is no block scale
            need = [*w.shape[:-2], -(-w.shape[-2] // block[0]), -(-w.shape[-1] // block[1])]
            raise refuse(ctx, key, f"block scale {key!r} has shape {list(ctx.remaining[key].shape)}; {wkey!r} "
                                   f"{list(w.shape)} in blocks of {list(block)} needs {need}")
        tensors[wkey].encoding = NoEncoder("HF block FP8", "ckpt decodes HF fine-grained / DeepSeek block FP8 "
                                                           "but has no encoder for it")
        consumed[key] = f"block scale of {wkey}"
        consumed.update(activation_keys(ctx, layer))
    _no_unscaled(ctx, tensors, "block FP8")
    return Decoded("hf-block-fp8", tensors, consumed)


def weight_scale(ctx: DecodeContext) -> Decoded | None:
    """compressed-tensors (float-quantized), FBGEMM, ModelOpt and AutoFP8/vLLM: `X.weight_scale` per tensor,
    per channel ([out] or [out, 1]), per group or per block; Mistral native `X.qscale_weight`."""
    keys = [k for k in ctx.remaining if k.endswith(".weight_scale") or k.endswith(".qscale_weight")]
    if not keys:
        return None
    block = _block_size(ctx)
    natural, tensors, consumed = model_dtype(ctx), {}, {}
    for key in keys:
        suffix = ".weight_scale" if key.endswith(".weight_scale") else ".qscale_weight"
        layer = _layer(key, suffix)
        wkey = weight_key(layer)
        if f"{layer}.weight_packed" in ctx.remaining:
            raise refuse(ctx, key, f"{layer!r} is compressed-tensors pack-quantized (integer packs), which ckpt "
                                   "cannot decode")
        w = _require_fp8_weight(ctx, wkey, key, "FP8")
        zkey = f"{layer}.weight_zero_point"
        if zkey in ctx.remaining:
            z = ctx.remaining[zkey].read_all(torch.device("cpu"))
            if z.numel() and bool((z.float() != 0).any()):
                raise refuse(ctx, zkey, f"{zkey!r} is a non-zero zero point (asymmetric FP8), which ckpt cannot decode")
            consumed[zkey] = f"zero point of {wkey} (all zero)"
        tensors[wkey] = scaled(ctx, wkey, w, key, ctx.remaining[key], natural, block)
        tensors[wkey].encoding = NoEncoder("FP8 weight_scale", "ckpt decodes compressed-tensors / FBGEMM / ModelOpt / "
                                                               "AutoFP8 / Mistral FP8 but has no encoder for them")
        consumed[key] = f"scale of {wkey}"
        consumed.update(activation_keys(ctx, layer))
    _no_unscaled(ctx, tensors, "scaled FP8")
    method = str(quant_config(ctx).get("quant_method") or "")
    if any(k.endswith(".qscale_weight") for k in keys):
        fmt = "mistral-fp8"
    else:
        fmt = method if "fp8" in method else f"{method or 'per-tensor/channel'}-fp8"
    return Decoded(fmt, tensors, consumed)


_FP8_METHODS = {"fp8", "fbgemm_fp8", "compressed-tensors", "modelopt", "fp8_e4m3"}


def activation_scales(ctx: DecodeContext) -> Decoded | None:
    """Activation / KV-cache scales of an FP8 checkpoint (layers left plain, attention k/v scales): they
    configure inference kernels and mean nothing for plain weights, so they are dropped (and listed).
    Also marks a folder whose config names an FP8 method as dequantized, scales or not."""
    fp8_config = str(quant_config(ctx).get("quant_method", "")).lower() in _FP8_METHODS
    fp8_model = fp8_config or any(
        t.dtype_name in ST_FP8 and (k == "weight" or k.endswith(".weight")) for k, t in ctx.component.tensors.items())
    if not fp8_model:
        return None
    consumed = {k: "activation scale (inference only)" for k in ctx.remaining
                if k.rsplit(".", 1)[-1] in ACTIVATION_SCALES}
    if consumed:
        return Decoded("fp8-activation-scales", {}, consumed, dequantized=fp8_config)
    if fp8_config and not any(k.endswith(WEIGHT_SCALE_SUFFIXES) for k in ctx.component.tensors):
        # FP8 config over unscaled fp8 weights: the config no longer describes the (cast) output.
        return Decoded("plain-fp8", {}, {})
    return None


def unpaired_scales(ctx: DecodeContext) -> None:
    """Scale-like keys no decoder claimed: refused by name rather than copied as if they were weights."""
    for key in ctx.remaining:
        if key == "scaled_fp8" or key.endswith(".scaled_fp8") or key.endswith(WEIGHT_SCALE_SUFFIXES):
            raise refuse(ctx, key, f"quantization key {key!r} does not pair with any FP8 weight ckpt can decode")
    return None


def inspect_settings(t, config) -> dict | None:
    """What `ckpt inspect` says of a decoded FP8 weight: the compressed-tensors scheme that holds it (its config
    group is the one place the strategy and activation scheme are written down: `compressed_tensors.float_settings`);
    None for the other FP8 layouts, which the storage line names."""
    from ckpt.quant.compressed_tensors import float_settings

    return float_settings(t, config)


FORMAT = Format("fp8", "scaled FP8", 70, (comfy_legacy, kohya_scaled, hf_block_fp8, weight_scale, activation_scales,
                                        unpaired_scales), weights=(ScaledTensor,), settings=inspect_settings)
