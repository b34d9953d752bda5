"""FP8 storage layouts decoded to plain values (float32, exact products), see FORMATS.md "FP8".

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

import math

from ckpt.lazy import torch

from ckpt.cast import fp8_upcast
from ckpt.dtypes import FP8, ST_FP8, TORCH_TO_ST, config_dtype, is_float
from ckpt.errors import CkptError
from ckpt.io.tensors import Tensor
from ckpt.quant.encoding import NoEncoder
from ckpt.quant.fp8_encode import ComfyScaledFP8Encoding, KohyaFP8Encoding
from ckpt.quant.view import DecodeContext, Decoded
from ckpt.report import plural

DEFAULT_BLOCK = (128, 128)  # HF fine-grained FP8 / DeepSeek-V3 default weight_block_size

# Last name segment of scales that only quantize activations (or the KV cache) at inference time.
ACTIVATION_SCALES = {"input_scale", "activation_scale", "output_scale", "input_scale_ub", "qscale_act",
                     "scale_input", "k_scale", "v_scale", "q_scale", "kv_scale", "prob_scale"}
# Suffixes of keys that only make sense next to a quantized weight; one left unclaimed is refused.
WEIGHT_SCALE_SUFFIXES = (".weight_scale", ".weight_scale_inv", ".scale_weight", ".scale_weight_tensor",
                         ".qscale_weight", ".weight_scale_2", ".weight_zero_point", ".comfy_quant")


class ScaleLayout:
    """How a scale tensor broadcasts over its weight.

    kind: "tensor" (one value), "row" (one per dim-0 row), "group" ([rows, ng] or [rows, ng, 1]: ng equal
    groups along the input dim, kohya block-64), "block" ([*lead, ceil(out/bo), ceil(in/bi)], 2-D tiles
    of the last two dims, cropped at the edges).
    """

    def __init__(self, kind: str, groups: int = 0, block: tuple[int, int] = (0, 0)):
        self.kind, self.groups, self.block = kind, groups, block

    def __repr__(self):
        return f"ScaleLayout({self.kind}, groups={self.groups}, block={self.block})"


def infer_layout(wshape, sshape, block: tuple[int, int] | None = None) -> ScaleLayout | None:
    """The layout that makes a scale of shape `sshape` fit a weight of shape `wshape`, or None."""
    wshape, sshape = tuple(wshape), tuple(sshape)
    n = math.prod(sshape)
    if n == 1:
        return ScaleLayout("tensor")
    if len(wshape) >= 2:
        *lead, out, inn = wshape
        for bo, bi in [block] if block else [DEFAULT_BLOCK]:
            if sshape == (*lead, -(-out // bo), -(-inn // bi)):
                return ScaleLayout("block", block=(bo, bi))
    if wshape and sshape and sshape[0] == wshape[0] and n == wshape[0]:
        return ScaleLayout("row")
    if len(wshape) == 2 and len(sshape) in (2, 3) and sshape[0] == wshape[0] and (len(sshape) == 2 or sshape[2] == 1):
        if sshape[1] and wshape[1] % sshape[1] == 0:
            return ScaleLayout("group", groups=sshape[1])
    return None


def _codes_to_float(x: torch.Tensor) -> torch.Tensor:
    """Stored values as a fresh float32 tensor (never a view of the source: it is scaled in place)."""
    if x.dtype in FP8:
        y = fp8_upcast(x, torch.float32, None)
        return y if y.data_ptr() != x.data_ptr() else y.clone()
    return x.to(torch.float32, copy=True)


class ScaledTensor(Tensor):
    """W = w.float() * s (* extra), with s broadcast per `layout`; float32 values, rounded once later.

    Bands: rows [start, stop) along dim 0 read the matching slice of the scale only. 2-D block layouts
    want bands that start on a block boundary (`row_align` = block rows) but any start is handled.
    """

    def __init__(self, weight: Tensor, scale: Tensor, natural: torch.dtype | None = None,
                 layout: ScaleLayout | None = None, extra: Tensor | None = None):
        self.weight, self.scale, self.extra = weight, scale, extra
        self.name, self.shape, self.home = weight.name, weight.shape, weight.home
        self.dtype = torch.float32
        self._natural = torch.bfloat16 if natural is None else natural
        self.layout = layout or infer_layout(weight.shape, scale.shape)
        if self.layout is None:
            raise ValueError(f"{scale.name}: shape {list(scale.shape)} does not fit {weight.name} {list(weight.shape)}")
        if self.layout.kind == "block" and len(self.shape) == 2:
            self.row_align = self.layout.block[0]
        else:
            self.row_align = weight.row_align

    @property
    def natural_dtype(self):
        return self._natural

    @property
    def source_bytes(self):
        return self.weight.source_bytes

    def read(self, start, stop, device, scratch=None):
        w = _codes_to_float(self.weight.read(start, stop, device, scratch))  # a fresh fp32 tensor
        lay = self.layout
        if lay.kind == "tensor":
            s = self._scale_rows(0, 1, device).reshape(())
            return w.mul_(s)
        rows = stop - start
        if lay.kind == "row":
            s = self._scale_rows(start, stop, device)
            return w.mul_(s.reshape(rows, *([1] * (w.dim() - 1))))
        if lay.kind == "group":
            s = self._scale_rows(start, stop, device).reshape(rows, lay.groups, 1)
            w.view(rows, lay.groups, -1).mul_(s)
            return w
        bo, bi = lay.block
        if w.dim() == 2:  # rows of one matrix: scale rows covering [start, stop)
            s = self._scale_rows(start // bo, -(-stop // bo), device).unsqueeze(0)
            _mul_blocks(w.unsqueeze(0), s, bo, bi, start)
        else:  # leading (expert) dims: whole matrices per band
            out_rows, inn = w.shape[-2:]
            s = self._scale_rows(start, stop, device)
            _mul_blocks(w.view(-1, out_rows, inn), s.reshape(-1, *s.shape[-2:]), bo, bi, 0)
        return w

    def _scale_rows(self, a, b, device) -> torch.Tensor:
        sliceable = self.scale.shape and self.scale.row_align is not None
        s = (self.scale.read(a, b, device) if sliceable else self.scale.read_all(device)).float()
        if self.extra is not None:
            s = s * self.extra.read_all(device).float().reshape(())
        return s


def _mul_blocks(w: torch.Tensor, s: torch.Tensor, bo: int, bi: int, row0: int) -> None:
    """w: (L, R, C) = rows row0.. of L matrices; s: (L, nbo, nbi) scales from block row row0 // bo."""
    cols = w.shape[-1]
    s_cols = s.repeat_interleave(bi, dim=-1)[..., :cols]  # (L, nbo, C): small, one row per block row
    r, rows = 0, w.shape[1]
    while r < rows:
        blk = (row0 + r) // bo
        end = min(rows, (blk + 1) * bo - row0)
        w[:, r:end].mul_(s_cols[:, blk - row0 // bo: blk - row0 // bo + 1])
        r = end


# ---------------------------------------------------------------------------------------------------
# helpers shared by the decoders


def _file_of(ctx: DecodeContext, key: str):
    t = ctx.component.tensors.get(key)
    for f in ctx.component.files:
        if t is not None and f.relpath == t.home:
            return f.path
    return ctx.component.where


def _refuse(ctx: DecodeContext, key: str, problem: str) -> CkptError:
    return CkptError(f"{_file_of(ctx, key)}: {problem}; nothing was written")


def _st(dtype) -> str:
    return TORCH_TO_ST.get(dtype, str(dtype))


def float_scale(dtype) -> bool:
    """A scale stored as a plain float (fp32/fp16/bf16/fp64): what every scaled layout writes. An fp8 scale
    is a block scale of another format (NVFP4's e4m3), e8m0 an exponent-only one: each layout that takes
    those says so itself."""
    return dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def companion(ctx: DecodeContext, key: str, what: str, dtypes=None, shape=None, numel: int | None = None) -> Tensor:
    """The stored tensor `key` a decoder consumes beside its codes (a scale, absmax, shift, code table,
    JSON config), refused unless it has one of `dtypes` (a tuple of dtypes, or `float_scale`), the
    `shape` and `numel` values (each checked only when given).

    Why one checker: a companion of the wrong dtype or shape still reads as numbers, and a decoder that
    only checked that it exists wrote garbage with exit 0 (an int64 nested absmax, packed codes stored as
    float32). Every decoder (bitsandbytes, comfy_quant, the FP8 layouts, optimum-quanto) calls this for
    every key it consumes, so each refusal is worded the same: the key, what it is, what was found, what
    was expected."""
    t = ctx.remaining.get(key)
    if t is None:
        raise _refuse(ctx, key, f"{what} {key!r} is missing")
    problems, wanted = [], []
    if dtypes is float_scale:
        wanted.append("a floating dtype")
        problems.append(not float_scale(t.dtype))
    elif dtypes is not None:
        wanted.append(" or ".join(_st(d) for d in dtypes))
        problems.append(t.dtype not in dtypes)
    if shape is not None:
        wanted.append(f"shape {list(shape)}")
        problems.append(tuple(t.shape) != tuple(shape))
    if numel is not None:
        wanted.append(plural(numel, "value"))
        problems.append(t.numel != numel)
    if any(problems):
        raise _refuse(ctx, key, f"{what} {key!r} is {_st(t.dtype)} {list(t.shape)}; expected {', '.join(wanted)}")
    return t


def quant_config(ctx: DecodeContext) -> dict:
    """config.json's `quantization_config`: {} when there is none or it is not an object."""
    qc = (ctx.config or {}).get("quantization_config")
    return qc if isinstance(qc, dict) else {}


def _natural(ctx: DecodeContext) -> torch.dtype:
    """The model's dtype before quantization: config.json `torch_dtype`/`dtype`, else bf16."""
    return config_dtype(ctx.config) or torch.bfloat16


def _layer(key: str, suffix: str) -> str:
    """`a.b.weight_scale` -> `a.b` (suffix given with its leading dot)."""
    return key[: -len(suffix)]


def _weight_key(layer: str) -> str:
    return f"{layer}.weight" if layer else "weight"


def _activation_keys(ctx: DecodeContext, layer: str) -> dict[str, str]:
    return {f"{layer}.{n}": "activation scale (inference only)" for n in ACTIVATION_SCALES
            if f"{layer}.{n}" in ctx.remaining}


def _scaled(ctx, wkey, w, skey, s, natural, block=None, extra=None) -> ScaledTensor:
    layout = infer_layout(w.shape, s.shape, block)
    if layout is None:
        raise _refuse(ctx, skey, f"scale {skey!r} has shape {list(s.shape)}, which fits no known layout for "
                                 f"{wkey!r} {list(w.shape)}")
    if not (float_scale(s.dtype) or s.dtype == torch.float8_e8m0fnu):
        raise _refuse(ctx, skey, f"scale {skey!r} is stored as {_st(s.dtype)} (packed/swizzled block scales, e.g. "
                                 "MXFP8 or NVFP4), which ckpt cannot decode")
    return ScaledTensor(w, s, natural, layout, extra)


def _require_fp8_weight(ctx, wkey, skey, what: str):
    w = ctx.remaining.get(wkey)
    if w is None:
        raise _refuse(ctx, skey, f"{what} scale {skey!r} has no weight {wkey!r} to pair with")
    if w.dtype not in FP8:
        raise _refuse(ctx, skey, f"{wkey!r} is {_st(w.dtype)}, not FP8, yet has the {what} scale {skey!r}: "
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
            raise _refuse(ctx, key, f"FP8 weight {key!r} has no scale, yet {plural(len(tensors), 'other FP8 weight')} "
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
    natural = _natural(ctx)
    tensors, consumed = {}, {m: "ComfyUI scaled-fp8 marker" for m in markers}
    for key in list(ctx.remaining):
        if key.endswith(".scale_weight"):
            wkey = _weight_key(_layer(key, ".scale_weight"))
            w = ctx.remaining.get(wkey)
            if w is None or not is_float(w.dtype):
                raise _refuse(ctx, key, f"scale {key!r} has no floating weight {wkey!r} to pair with")
            tensors[wkey] = _scaled(ctx, wkey, w, key, ctx.remaining[key], natural if w.dtype in FP8 else w.dtype)
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
        wkey = _weight_key(_layer(key, ".scale_weight"))
        w = _require_fp8_weight(ctx, wkey, key, "kohya fp8_scaled")
        s = ctx.remaining[key]
        tkey = _layer(key, ".scale_weight") + ".scale_weight_tensor"
        extra = ctx.remaining.get(tkey)
        if extra is not None:  # read as one scalar: anything else broadcast wrongly or failed mid-write
            companion(ctx, tkey, f"tensor-level scale of {wkey!r}", dtypes=float_scale, numel=1)
        natural = s.dtype if s.dtype in (torch.float16, torch.bfloat16, torch.float32) else _natural(ctx)
        tensors[wkey] = _scaled(ctx, wkey, w, key, s, natural, extra=extra)
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
    natural, tensors, consumed = _natural(ctx), {}, {}
    for key in keys:
        layer = _layer(key, ".weight_scale_inv")
        wkey = _weight_key(layer)
        w = _require_fp8_weight(ctx, wkey, key, "block FP8")
        if len(w.shape) < 2:
            raise _refuse(ctx, wkey, f"block FP8 weight {wkey!r} is {list(w.shape)}: blocks tile the last two "
                                     "dimensions of a matrix (or a bank of them)")
        tensors[wkey] = _scaled(ctx, wkey, w, key, ctx.remaining[key], natural, block)
        if tensors[wkey].layout.kind not in ("block", "tensor"):  # a per-row or group fit is no block scale
            need = [*w.shape[:-2], -(-w.shape[-2] // block[0]), -(-w.shape[-1] // block[1])]
            raise _refuse(ctx, key, f"block scale {key!r} has shape {list(ctx.remaining[key].shape)}; {wkey!r} "
                                    f"{list(w.shape)} in blocks of {list(block)} needs {need}")
        tensors[wkey].encoding = NoEncoder("HF block FP8", "ckpt decodes HF fine-grained / DeepSeek block FP8 "
                                                           "but has no encoder for it")
        consumed[key] = f"block scale of {wkey}"
        consumed.update(_activation_keys(ctx, layer))
    _no_unscaled(ctx, tensors, "block FP8")
    return Decoded("hf-block-fp8", tensors, consumed)


def weight_scale(ctx: DecodeContext) -> Decoded | None:
    """compressed-tensors (float-quantized), FBGEMM, ModelOpt and AutoFP8/vLLM: `X.weight_scale` per tensor,
    per channel ([out] or [out, 1]), per group or per block; Mistral native `X.qscale_weight`."""
    keys = [k for k in ctx.remaining if k.endswith(".weight_scale") or k.endswith(".qscale_weight")]
    if not keys:
        return None
    block = _block_size(ctx)
    natural, tensors, consumed = _natural(ctx), {}, {}
    for key in keys:
        suffix = ".weight_scale" if key.endswith(".weight_scale") else ".qscale_weight"
        layer = _layer(key, suffix)
        wkey = _weight_key(layer)
        if f"{layer}.weight_packed" in ctx.remaining:
            raise _refuse(ctx, key, f"{layer!r} is compressed-tensors pack-quantized (integer packs), which ckpt "
                                    "cannot decode")
        w = _require_fp8_weight(ctx, wkey, key, "FP8")
        zkey = f"{layer}.weight_zero_point"
        if zkey in ctx.remaining:
            z = ctx.remaining[zkey].read_all(torch.device("cpu"))
            if z.numel() and bool((z.float() != 0).any()):
                raise _refuse(ctx, zkey, f"{zkey!r} is a non-zero zero point (asymmetric FP8), which ckpt cannot decode")
            consumed[zkey] = f"zero point of {wkey} (all zero)"
        tensors[wkey] = _scaled(ctx, wkey, w, key, ctx.remaining[key], natural, block)
        tensors[wkey].encoding = NoEncoder("FP8 weight_scale", "ckpt decodes compressed-tensors / FBGEMM / ModelOpt / "
                                                               "AutoFP8 / Mistral FP8 but has no encoder for them")
        consumed[key] = f"scale of {wkey}"
        consumed.update(_activation_keys(ctx, layer))
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
            raise _refuse(ctx, key, f"quantization key {key!r} does not pair with any FP8 weight ckpt can decode")
    return None


DECODERS = [comfy_legacy, kohya_scaled, hf_block_fp8, weight_scale, activation_scales, unpaired_scales]
