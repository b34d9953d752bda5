"""HQQ (Half-Quadratic Quantization, mobiusml `hqq`) layers decoded back to plain Linear weights.

`HQQLinear.state_dict()` (and transformers' HQQ save, which is the model's state dict with each HQQLinear's
flattened under its prefix) stores a Linear `X` (shape [out, in]) as
- `X.W_q`: the codes of W viewed as [R, C] = [out * in / g, g] (axis 1) or [g, out * in / g] (axis 0), g the
  group size, packed along dim 0 by `packing`: `8bit_u8` (one code per byte: 8, 6 and 5 bits), `4bit_u8`
  (rows r and r + R / 2 in the high and low nibble), `2bit_u8` (four quarters, highest bits first), `1bit_u8`
  (eight eighths), `3bit_32` (int32 words of ten 3-bit fields, rows padded to a multiple of 10, the first
  tenth in bits 27..29); with `view_as_float` the packed words are stored viewed as the compute dtype;
- `X.scale`, `X.zero`: [R, 1] (axis 1) or [1, C] (axis 0), one per group, in the compute dtype;
- metadata as tensors (hqq's `encode_safetensor_type`): `nbits`, `group_size`, `axis` (int32), `shape` (int64
  [2]), `packing`, `unpack_view_dtype`, `compute_dtype` (strings as uint8 character codes), and the flags
  `view_as_float`, `quant_scale`, `quant_zero`, `offload_meta`, `encoded_state_dict`, `stores_quant_config`,
  `channel_wise`, `optimize`, `round_zero` (uint8 0/1);
- `X.bias`, when the Linear has one: plain (in the compute dtype), left as it is.
W = ((unpack(W_q) - zero) * scale).reshape(shape), computed as hqq 0.2.8's `Quantizer.dequantize` computes it:
the codes in the compute dtype, then one subtraction and one multiplication in that dtype (two roundings in
fp16/bf16: the zero points are not integers), scale and zero first converted to the compute dtype (hqq's
`to_inplace` on load). The decoded weight has the stored `compute_dtype` (hqq's default, fp16, when it is not
stored); another `--to` casts those values once. (An `HQQLinear` that loads the file computes in its own
constructor's dtype, which transformers sets to the model's: the stored one unless asked otherwise.)

Every metadata key is consumed with its reason; the settings that only describe how the codes were found
(`channel_wise`, `optimize`, `round_zero`) and where they run (`offload_meta`) are checked for what hqq can
serialize. Refused by name: quantized scale/zero meta (`quant_scale` / `quant_zero`, `zero_q`, `scale_q`,
`zero_scale`: deprecated in hqq, which refuses to serialize them itself), `channel_wise` false, an unknown
packing, an nbits the packing does not hold, and any shape that disagrees with `shape` / `group_size` / `axis`.

Bands: output rows [a, b) are the flat elements [a in, b in) of W, i.e. rows of the [R, C] view; each view row
lives in one packed row (row r in row r mod R/k, field r div R/k), so a band reads those packed rows only.
`row_align` is the number of output rows per view row (axis 0: out / g), so bands start on whole view rows.
"""

from __future__ import annotations

import math

from ckpt.lazy import torch

from ckpt.io.tensors import Tensor
from ckpt.io.wrapper import Wrapper
from ckpt.quant.common import DecodeContext, Decoded, companion, float_scale, refuse, st_name
from ckpt.quant.encoding import NoEncoder
from ckpt.quant.formats import Format

# packing -> (bits per field, fields per word, word dtype name, nbits it holds): hqq's bit_to_packing
PACKINGS = {"8bit_u8": (8, 1, "uint8", (8, 6, 5)), "4bit_u8": (4, 2, "uint8", (4,)),
            "3bit_32": (3, 10, "int32", (3,)), "2bit_u8": (2, 4, "uint8", (2, 1.58)), "1bit_u8": (1, 8, "uint8", (1,))}
COMPUTE = ("float16", "bfloat16", "float32")
FLAGS = {"view_as_float": "whether the packed codes are stored viewed as the compute dtype",
         "quant_scale": "HQQ flag: scales not quantized", "quant_zero": "HQQ flag: zero points not quantized",
         "offload_meta": "HQQ inference setting (meta-data offload)",
         "encoded_state_dict": "HQQ marker (metadata encoded as tensors)",
         "stores_quant_config": "HQQ marker (the quant config is stored per layer)",
         "channel_wise": "HQQ quantizer setting (per-group scales)",
         "optimize": "HQQ quantizer setting (how the codes were found)",
         "round_zero": "HQQ quantizer setting (how the zero points were found)"}
SETTINGS = ("nbits", "group_size", "shape", "axis", "packing", "unpack_view_dtype", "compute_dtype")
QUANTIZED_META = ("zero_q", "scale_q", "zero_scale", "meta_zero", "meta_scale")  # hqq cannot serialize them
SUFFIXES = ("W_q", "scale", "zero", *SETTINGS, *FLAGS, *QUANTIZED_META)

_NO_ENCODER = NoEncoder("HQQ", "HQQ is decoded only: ckpt has no HQQ encoder yet (merge without --keep-format "
                               "for a plain file)")


class HqqWeight(Wrapper):
    """W [out, in] of one HQQLinear; `base` is `W_q` (packed rows of the [R, C] view)."""

    encoding = _NO_ENCODER

    def __init__(self, name, wq: Tensor, scale: Tensor, zero: Tensor, shape, view, axis, packing, word_dtype,
                 floats: bool, compute):
        self.name, self.base, self.scale, self.zero, self.home = name, wq, scale, zero, wq.home
        self.shape, self.view, self.axis = tuple(shape), view, axis
        self.bits, self.per = PACKINGS[packing][:2]
        self.step = wq.shape[0]  # packed rows: each holds `per` view rows, step apart
        self.word_dtype, self.floats = word_dtype, floats
        self.dtype = self.natural = compute
        cols, inn = view[1], self.shape[1]
        self.row_align = cols // math.gcd(cols, inn)

    @property
    def source_bytes(self):
        return self.base.source_bytes + self.scale.source_bytes + self.zero.source_bytes

    def read(self, start, stop, device, scratch=None):
        inn = self.shape[1]
        cols = self.view[1]
        f0, f1 = start * inn, stop * inn
        v0, v1 = f0 // cols, -(-f1 // cols)
        parts, mask = [], (1 << self.bits) - 1
        for s in range(self.per):
            lo, hi = max(v0, s * self.step), min(v1, (s + 1) * self.step)
            if lo < hi:
                words = self.base.read(lo - s * self.step, hi - s * self.step, device)
                if self.floats:
                    words = words.view(self.word_dtype)
                parts.append((words >> (self.bits * (self.per - 1 - s))) & mask)
        codes = (torch.cat(parts) if len(parts) > 1 else parts[0]).to(self.dtype)
        if self.axis == 1:
            zero, scale = self.zero.read(v0, v1, device), self.scale.read(v0, v1, device)
        else:
            zero, scale = self.zero.read_all(device), self.scale.read_all(device)
        w = (codes - zero.to(self.dtype)) * scale.to(self.dtype)
        return w.reshape(-1)[f0 - v0 * cols: f1 - v0 * cols].reshape(stop - start, inn)


# ---------------------------------------------------------------------------------------------------
# reading the per-layer metadata


def _value(ctx, key: str, what: str):
    """The small metadata tensor `key` read whole (a Python list or scalar)."""
    t = ctx.remaining.get(key)
    if t is None:
        raise refuse(ctx, key, f"HQQ {what} {key!r} is missing")
    if t.numel > 64:
        raise refuse(ctx, key, f"HQQ {what} {key!r} is {st_name(t.dtype)} {list(t.shape)}; expected a small "
                               "metadata tensor")
    return t.read_all(torch.device("cpu")).tolist()


def _int(ctx, key, what) -> int:
    companion(ctx, key, f"HQQ {what}", dtypes=(torch.int32, torch.int64, torch.int16, torch.uint8), numel=1)
    v = _value(ctx, key, what)
    return int(v[0] if isinstance(v, list) else v)


def _string(ctx, key, what) -> str:
    companion(ctx, key, f"HQQ {what}", dtypes=(torch.uint8,))
    v = _value(ctx, key, what)
    codes = v if isinstance(v, list) else [v]
    return "".join(chr(c) for c in codes)


def _flag(ctx, key, what) -> bool | None:
    if key not in ctx.remaining:
        return None
    companion(ctx, key, f"HQQ {what}", dtypes=(torch.uint8, torch.bool, torch.int32, torch.int64), numel=1)
    v = _value(ctx, key, what)
    return bool(v[0] if isinstance(v, list) else v)


def _nbits(ctx, key):
    companion(ctx, key, "HQQ nbits", dtypes=(torch.int32, torch.int64, torch.float32, torch.float64), numel=1)
    v = _value(ctx, key, "nbits")
    v = v[0] if isinstance(v, list) else v
    return int(v) if float(v).is_integer() else round(float(v), 4)  # 1.58 is stored as float32


def _layer(ctx: DecodeContext, layer: str, consumed: dict) -> HqqWeight:
    k = (lambda n: f"{layer}.{n}") if layer else (lambda n: n)
    for n in QUANTIZED_META:
        if k(n) in ctx.remaining:
            raise refuse(ctx, k(n), f"HQQ {k(n)!r} is quantized or offloaded scale/zero meta-data, which hqq itself "
                                    "does not serialize (deprecated); ckpt cannot decode it")
    flags = {n: _flag(ctx, k(n), n) for n in FLAGS}
    for n in ("quant_scale", "quant_zero"):
        if flags[n]:
            raise refuse(ctx, k(n), f"HQQ {k(n)!r} is set: quantized scale/zero meta-data is not serializable by hqq "
                                    "(deprecated); ckpt cannot decode it")
    if flags["channel_wise"] is False:
        raise refuse(ctx, k("channel_wise"), f"HQQ {k('channel_wise')!r} is false (one scale for the whole "
                                             "tensor), which transformers' and hqq's configs never write; ckpt "
                                             "does not decode it")
    packing = _string(ctx, k("packing"), "packing")
    if packing not in PACKINGS:
        raise refuse(ctx, k("packing"), f"HQQ packing {packing!r} is not one ckpt decodes ({', '.join(PACKINGS)})")
    bits, per, word_name, nbits_held = PACKINGS[packing]
    nbits = _nbits(ctx, k("nbits"))
    if nbits not in nbits_held:
        raise refuse(ctx, k("nbits"), f"HQQ nbits {nbits} is not stored with packing {packing!r} (hqq packs "
                                      f"{' / '.join(map(str, nbits_held))} bits so)")
    word_dtype = getattr(torch, word_name)
    if k("unpack_view_dtype") in ctx.remaining:
        uvd = _string(ctx, k("unpack_view_dtype"), "unpack_view_dtype")
        if uvd != f"torch.{word_name}":
            raise refuse(ctx, k("unpack_view_dtype"), f"HQQ unpack_view_dtype {uvd!r} is not the word type of "
                                                      f"packing {packing!r} (torch.{word_name})")
    compute = torch.float16
    if k("compute_dtype") in ctx.remaining:
        cd = _string(ctx, k("compute_dtype"), "compute_dtype")
        if cd.removeprefix("torch.") not in COMPUTE:
            raise refuse(ctx, k("compute_dtype"), f"HQQ compute_dtype {cd!r} is not one of "
                                                  f"{', '.join('torch.' + c for c in COMPUTE)}")
        compute = getattr(torch, cd.removeprefix("torch."))
    group = _int(ctx, k("group_size"), "group_size")
    axis = _int(ctx, k("axis"), "axis")
    if axis not in (0, 1):
        raise refuse(ctx, k("axis"), f"HQQ axis {axis} is neither 0 nor 1")
    companion(ctx, k("shape"), "HQQ shape", dtypes=(torch.int64, torch.int32), numel=2)
    shape = [int(v) for v in _value(ctx, k("shape"), "shape")]
    numel = shape[0] * shape[1]
    if min(shape) <= 0 or group <= 0 or numel % group:
        raise refuse(ctx, k("group_size"), f"HQQ {layer!r}: shape {shape} is not whole groups of {group}")
    view = (numel // group, group) if axis == 1 else (group, numel // group)
    rows = view[0]
    if packing == "3bit_32":
        step = -(-rows // per)
    elif rows % per:
        raise refuse(ctx, k("W_q"), f"HQQ {layer!r}: {rows} rows of codes do not pack {per} to a word")
    else:
        step = rows // per
    floats = bool(flags["view_as_float"])
    if floats:
        wq = companion(ctx, k("W_q"), "HQQ packed codes", dtypes=(compute,),
                       shape=(step, view[1] * word_dtype.itemsize // compute.itemsize))
    else:
        wq = companion(ctx, k("W_q"), "HQQ packed codes", dtypes=(word_dtype,), shape=(step, view[1]))
    meta_shape = (view[0], 1) if axis == 1 else (1, view[1])
    scale = companion(ctx, k("scale"), f"HQQ scales of {layer!r}", dtypes=float_scale, shape=meta_shape)
    zero = companion(ctx, k("zero"), f"HQQ zero points of {layer!r}", dtypes=float_scale, shape=meta_shape)
    name = k("weight")
    if name in ctx.remaining:
        raise refuse(ctx, name, f"HQQ layer {layer!r} has both a plain {name!r} and packed {k('W_q')!r}")
    consumed[k("W_q")] = f"HQQ {nbits}-bit codes of {name}"
    consumed[k("scale")] = f"HQQ scales of {name}"
    consumed[k("zero")] = f"HQQ zero points of {name}"
    for n in SETTINGS:
        if k(n) in ctx.remaining:
            consumed[k(n)] = f"HQQ {n} of {name} (used to decode it)"
    for n, why in FLAGS.items():
        if flags[n] is not None:
            consumed[k(n)] = why
    return HqqWeight(name, wq, scale, zero, shape, view, axis, packing, word_dtype, floats, compute)


def decode(ctx: DecodeContext) -> Decoded | None:
    """Every `X.W_q` becomes `X.weight`, its scale, zero and metadata keys consumed, each checked before
    anything is written."""
    layers = [k[: -len("W_q")].rstrip(".") for k in ctx.remaining if k == "W_q" or k.endswith(".W_q")]
    if not layers:
        return None
    known = set(layers)
    for key in ctx.remaining:
        stem, _, last = key.rpartition(".")
        if last in SUFFIXES and last not in ("scale", "zero", "shape") and stem not in known:
            raise refuse(ctx, key, f"HQQ {key!r} has no {(stem + '.' if stem else '') + 'W_q'!r}")
    tensors, consumed, anchors = {}, {}, {}
    for layer in layers:
        t = _layer(ctx, layer, consumed)
        tensors[t.name] = t
        anchors[f"{layer}.W_q" if layer else "W_q"] = t.name
    n = len(tensors)
    dtypes = sorted({str(t.dtype).removeprefix("torch.") for t in tensors.values()})
    notes = [f"HQQ: decoded {n} layer{'s' if n != 1 else ''} (compute dtype {', '.join(dtypes)})"]
    return Decoded("HQQ", tensors, consumed, notes=notes, anchors=anchors)


def inspect_settings(t, config) -> dict:
    return {"format": "HQQ", "bits": t.bits, "group_size": t.view[0] if t.axis == 0 else t.view[1], "axis": t.axis}

FORMAT = Format("hqq", "HQQ", 120, (decode,), weights=(HqqWeight,), settings=inspect_settings, llm=True)
