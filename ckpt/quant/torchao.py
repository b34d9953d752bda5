"""torchao weight-only checkpoints (transformers' `TorchAoConfig` saves) decoded back to plain weights.

transformers 5.x saves a torchao-quantized model to safetensors through torchao's
`flatten_tensor_state_dict` (torchao.prototype.safetensors): each tensor subclass `X.weight` is stored as its
plain data tensors `X._weight_<name>` (name in the subclass's `tensor_data_names`: `qdata`, `scale`,
`zero_point`, ...), and `__metadata__` holds, per parameter, a JSON object `{"_type": <class>, "_data":
{block_size, dtype, ...}, "_tensor_data_names": [...]}` (plain tensors: `{"_type": "Tensor"}`) plus
`tensor_names`, the list of every parameter. The metadata is what says which keys belong together and what
they mean, so it is what this decoder reads (transformers' `unflatten_tensor_state_dict` does the same).

Decoded, as torchao 0.18's own `dequantize()` computes them (same operations, same dtypes, so bit for bit):
- `Int8Tensor` (`Int8WeightOnlyConfig`, per row / tensor / group; also the weight of
  `Int8DynamicActivationInt8WeightConfig`) and `IntxUnpackedToInt8Tensor` (`IntxWeightOnlyConfig`, int1..int8
  codes stored one per int8, the weight of `Int8DynamicActivationIntxWeightConfig`): `dequantize_affine`:
  `((q.to(dt) - zero_point.to(dt)) * scale).to(dt)`, dt the stored `dtype`, the scale/zero point one per
  `block_size` block (the subtraction is skipped without a zero point; the product is in the promoted dtype,
  fp32 for fp32 scales, then rounded once);
- `Float8Tensor` (`Float8WeightOnlyConfig`, also the weight of `Float8DynamicActivationFloat8WeightConfig`):
  `(q.to(fp32) * scale).to(dt)`.
Activation settings (`act_quant_kwargs`, `activation_quantization`, static `act_quant_scale` /
`act_quant_zero_point`) only configure inference and are dropped with the reason; an `act_pre_scale`
(AWQ / SmoothQuant smoothing, which the weight alone does not include) is refused rather than dropped.

Refused, in one line naming the layout: `Int4TilePackedTo4dTensor` (tinygemm's tiled int4 packing, whose
only unpacking is a CUDA kernel), `Int4Tensor` (the mslk "plain" int4 packing: torchao has no dequantize
for it and its quantizer runs only in mslk's CUDA kernels, so there is no reference to be exact against),
`Int4PlainInt32Tensor` (XPU/NPU kernel packings), `MXTensor` / `NVFP4Tensor` (not decoded yet), any other
class; flattened torchao keys with no metadata describing them; config.json naming torchao with no
torchao metadata in the safetensors (pickled tensor subclasses in a .bin are refused by the pickle reader).

Bands: rows [a, b) along dim 0 read the matching rows of qdata and the scale/zero-point rows of the blocks
covering them; the broadcast is element-wise, so a band equals the same rows of the whole.
"""

from __future__ import annotations

import json
import math
import re
from typing import NamedTuple

from ckpt.lazy import torch

from ckpt.errors import CkptError
from ckpt.io.tensors import Tensor
from ckpt.io.wrapper import Wrapper
from ckpt.quant.common import DecodeContext, Decoded, companion, float_scale, quant_config, refuse
from ckpt.quant.encoding import NoEncoder
from ckpt.quant.formats import Format

AFFINE = ("Int8Tensor", "IntxUnpackedToInt8Tensor")
DECODED = (*AFFINE, "Float8Tensor")
REFUSED = {
    "Int4TilePackedTo4dTensor": "tinygemm's tiled int4 packing (Int4WeightOnlyConfig tile_packed_to_4d), which "
                                "only a CUDA kernel unpacks",
    "Int4Tensor": "the mslk int4 packing (Int4WeightOnlyConfig plain): torchao has no dequantize for it and its "
                  "quantizer runs only in mslk's CUDA kernels, so there is no reference to decode it against",
    "Int4PlainInt32Tensor": "an XPU/NPU int4 kernel packing (Int4WeightOnlyConfig plain_int32)",
    "Int4PreshuffledTensor": "mslk's preshuffled int4 packing (CUDA only)",
    "MXTensor": "an MX (microscaling) tensor, which ckpt does not decode from torchao yet",
    "NVFP4Tensor": "an NVFP4 tensor, which ckpt does not decode from torchao yet",
}


class Subclass(NamedTuple):
    """What differs between the decoded subclasses; everything else (metadata, blocks, scales) is shared.
    dtypes are torch dtype names (torch is imported lazily)."""

    codes: str  # what the stored qdata is, as refusals name it
    code_dtypes: tuple[str, ...]  # qdata's dtypes
    zero_dtypes: tuple[str, ...]  # a zero point's dtypes; () where the subclass has none
    intx: bool  # the codes' real width is `_data.target_dtype` (int1..int8 stored one per int8)
    block_from_scale: bool  # a missing block_size is inferred from the scale's shape, as torchao does


SUBCLASSES = {
    "Int8Tensor": Subclass("int8", ("int8",), ("int8",), False, False),
    "IntxUnpackedToInt8Tensor": Subclass("int8", ("int8",), ("int8", "float32", "float16", "bfloat16"), True, False),
    "Float8Tensor": Subclass("float8", ("float8_e4m3fn", "float8_e5m2"), (), False, True),
}
ACTIVATION_SETTINGS = ("act_quant_kwargs", "activation_quantization")  # metadata only: how inputs are quantized
FLOATS = {"float32", "float16", "bfloat16"}
INTX_TARGETS = {f"int{b}" for b in range(1, 9)}  # IntxUnpackedToInt8Tensor's target_dtype: int1..int8 codes
INFERENCE_DATA = {"act_quant_scale": "torchao static activation scale (inference only)",
                  "act_quant_zero_point": "torchao static activation zero point (inference only)"}
# a flattened subclass datum: X._weight_qdata, X._gate_up_proj_scale, ...
FLAT_KEY = re.compile(r"(^|\.)_[A-Za-z]\w*?_(qdata|scale|zero_point|scale_and_zero|per_tensor_scale|act_pre_scale|"
                      r"act_quant_scale|act_quant_zero_point|group_scale|group_zero|row_scale)$")

_NO_ENCODER = NoEncoder("torchao", "torchao is decoded only: ckpt has no torchao encoder (merge without "
                                   "--keep-format for a plain file)")


class TorchaoWeight(Wrapper):
    """One decoded torchao tensor: `base` is the stored codes (`qdata`), `scale` / `zero` one value per block
    of `block` elements."""

    encoding = _NO_ENCODER

    def __init__(self, name, kind, qdata: Tensor, scale: Tensor, zero: Tensor | None, block, dtype, codes: str):
        self.name, self.kind, self.base, self.scale, self.zero = name, kind, qdata, scale, zero
        self.codes = codes  # what a code is: "int8", "int4" (an intx target_dtype), "float8_e4m3fn", ...
        self.shape, self.home, self.block = tuple(qdata.shape), qdata.home, tuple(block)
        self.dtype = self.natural = dtype
        self.row_align = qdata.row_align
        self.qkey = qdata.name

    @property
    def source_bytes(self):
        return self.base.source_bytes + self.scale.source_bytes + (self.zero.source_bytes if self.zero else 0)

    def _blocks(self, t: Tensor, start, stop, device) -> torch.Tensor:
        """The per-block values `t` repeated over rows [start, stop) of the element grid."""
        if t.numel == 1:
            return t.read_all(device).reshape([1] * len(self.shape))
        b0 = self.block[0]
        a, b = start // b0, -(-stop // b0)
        v = t.read(a, b, device) if t.row_align is not None else t.read_all(device)[a:b]
        v = v.repeat_interleave(b0, dim=0)[start - a * b0: stop - a * b0]
        for d in range(1, len(self.shape)):
            if self.block[d] != 1:
                v = v.repeat_interleave(self.block[d], dim=d)
        return v

    def read(self, start, stop, device, scratch=None):
        q = self.base.read(start, stop, device)
        scale = self._blocks(self.scale, start, stop, device)
        if self.kind == "Float8Tensor":  # torchao _dequantize_affine_float8
            return (q.to(torch.float32) * scale).to(self.dtype)
        w = q.to(self.dtype, copy=True)  # torchao _dequantize_affine_no_dtype_check
        if self.zero is not None:
            w = w - self._blocks(self.zero, start, stop, device).to(self.dtype)
        return (w * scale).to(self.dtype)


def _where(ctx: DecodeContext):
    """The file a refusal about the metadata as a whole names (the first safetensors file)."""
    return ctx.component.files[0].path if ctx.component.files else ctx.component.where


def _entries(ctx: DecodeContext) -> dict[str, dict] | None:
    """{parameter name: its torchao metadata object} for every tensor subclass `tensor_names` lists; None
    when the metadata is not torchao's."""
    names = ctx.metadata.get("tensor_names")
    if names is None:
        return None
    where = _where(ctx)
    try:
        names = json.loads(names)
    except (TypeError, ValueError):
        return None
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        return None
    out = {}
    for n in names:
        raw = ctx.metadata.get(n)
        try:
            meta = json.loads(raw) if isinstance(raw, str) else None
        except ValueError:
            meta = None
        if not isinstance(meta, dict) or not isinstance(meta.get("_type"), str):
            raise CkptError(f"{where}: torchao metadata for {n!r} is missing or not a JSON object with a _type "
                            "(torchao's flatten_tensor_state_dict writes one per tensor_names entry); nothing "
                            "was written")
        if meta["_type"] != "Tensor":
            out[n] = meta
    return out


def _dtype_of(value, what, ctx, key):
    if isinstance(value, dict) and value.get("_type") == "torch.dtype" and isinstance(value.get("_data"), str):
        return value["_data"]
    raise refuse(ctx, key, f"torchao {what} is {value!r}; expected a torch.dtype object")


def _dtypes(names: tuple[str, ...]) -> tuple:
    """The torch dtypes a `SUBCLASSES` row names (torch is imported lazily, so the table holds names)."""
    return tuple(getattr(torch, n) for n in names)


def _prefix(name: str) -> str:
    """What torchao's flattening puts before each datum of parameter `name`: `X.w` -> `X._w_`."""
    module, _, param = name.rpartition(".")
    return f"{module}._{param}_" if module else f"_{param}_"


def _refuse_class(ctx: DecodeContext, name: str, kind: str, qkey: str) -> None:
    """A subclass ckpt does not decode is refused by name, saying why (`REFUSED`), before anything of it is
    read: its data would read as numbers and decode to garbage."""
    if kind in REFUSED or kind not in DECODED:
        why = REFUSED.get(kind, "a torchao tensor subclass ckpt does not know")
        raise refuse(ctx, qkey if qkey in ctx.remaining else name,
                     f"torchao {name!r} ({qkey!r}, ...) is stored as {kind}: {why}; ckpt cannot decode it")


def _metadata_parts(ctx: DecodeContext, name: str, meta: dict, qkey: str) -> tuple[dict, list]:
    """(`_data`, `_tensor_data_names`) of a subclass's metadata: the settings and the list of its stored
    data, which every later check reads."""
    data = meta.get("_data")
    names = meta.get("_tensor_data_names")
    if not isinstance(data, dict) or not isinstance(names, list):
        raise refuse(ctx, qkey, f"torchao metadata for {name!r} has no _data object or _tensor_data_names list")
    return data, names


def _check_stored_keys(ctx: DecodeContext, name: str, kind: str, names: list, prefix: str) -> None:
    """The stored keys of `name` are exactly the data its metadata lists: a datum it does not list, or the
    parameter also stored plain, means the file is not what the metadata says."""
    stray = [k for k in ctx.remaining if k.startswith(prefix) and k[len(prefix):] not in names]
    if stray:
        raise refuse(ctx, stray[0], f"torchao {stray[0]!r} is not among the tensor data of {name!r} ({names}) "
                                    "its metadata lists")
    if name in ctx.remaining:
        raise refuse(ctx, name, f"torchao {name!r} is stored both plain and as {kind} data ({prefix + 'qdata'!r})")


def _check_data_names(ctx: DecodeContext, name: str, kind: str, names: list, prefix: str) -> None:
    """Every listed datum is one ckpt decodes for this subclass: an `act_pre_scale` changes what the weight
    means (smoothing the weight alone lacks), and an unknown datum or a zero point of a subclass without one
    would be silently left out of the value."""
    if "act_pre_scale" in names:
        raise refuse(ctx, prefix + "act_pre_scale",
                     f"torchao {name!r} has an act_pre_scale {prefix + 'act_pre_scale'!r} (AWQ/SmoothQuant smoothing applied to the input), "
                     "which its dequantized weight does not include; ckpt does not fold it in")
    unknown = [n for n in names if n not in ("qdata", "scale", "zero_point", *INFERENCE_DATA)]
    if unknown or (not SUBCLASSES[kind].zero_dtypes and "zero_point" in names):
        raise refuse(ctx, prefix + (unknown or ["zero_point"])[0],
                     f"torchao {name!r} ({kind}, {prefix + 'qdata'!r}, ...) lists tensor data {names}, which ckpt "
                     "does not decode")


def _float_dtype(ctx: DecodeContext, name: str, data: dict, qkey: str) -> str:
    """The parameter's dtype (`_data.dtype`), the one torchao dequantizes to: a float."""
    dtype = _dtype_of(data.get("dtype"), f"dtype of {name!r}", ctx, qkey)
    if dtype not in FLOATS:
        raise refuse(ctx, qkey, f"torchao dtype of {name!r} is {dtype!r}; expected one of {sorted(FLOATS)}")
    return dtype


def _intx_target(ctx: DecodeContext, name: str, data: dict, qkey: str) -> str:
    """The real width of intx codes stored one per int8 (`_data.target_dtype`): int1..int8."""
    target = _dtype_of(data.get("target_dtype"), f"target_dtype of {name!r}", ctx, qkey)
    if target not in INTX_TARGETS:
        raise refuse(ctx, qkey, f"torchao target_dtype of {name!r} is {target!r}; expected int1..int8")
    return target


def _block_from_scale(ctx: DecodeContext, name: str, shape: tuple, skey: str) -> list:
    """A Float8Tensor's block_size where its metadata has none: torchao infers it from the scale's shape (one
    scale: the whole tensor; otherwise each dimension an exact multiple of the scale's)."""
    s = companion(ctx, skey, f"torchao scale of {name!r}", dtypes=float_scale)
    if s.numel == 1:
        return list(shape)
    if len(s.shape) == len(shape) and all(d and n % d == 0 for n, d in zip(shape, s.shape)):
        return [n // d for n, d in zip(shape, s.shape)]
    raise refuse(ctx, skey, f"torchao scale {skey!r} has shape {list(s.shape)}, which fits no block "
                            f"layout of {name!r} {list(shape)}")


def _check_block(ctx: DecodeContext, name: str, block, shape: tuple, qkey: str) -> None:
    """block_size tiles the codes exactly (one positive size per dimension, each dividing it): each scale
    covers whole blocks, or the broadcast would misalign."""
    if (not isinstance(block, list) or len(block) != len(shape) or not shape
            or not all(type(b) is int and b > 0 and n % b == 0 for n, b in zip(shape, block))):
        raise refuse(ctx, qkey, f"torchao block_size of {name!r} is {block!r}, which does not tile its codes "
                                f"{qkey!r} {list(shape)}")


def _scale(ctx: DecodeContext, name: str, shape: tuple, block: list, skey: str) -> Tensor:
    """One float scale per block; a single per-tensor scale may be stored with fewer dimensions (torchao
    keeps it as it computed it)."""
    blocks = tuple(n // b for n, b in zip(shape, block))
    s = ctx.remaining.get(skey)
    if s is not None and len(s.shape) != len(shape) and s.numel == math.prod(blocks) == 1:
        return companion(ctx, skey, f"torchao scale of {name!r}", dtypes=float_scale, numel=1)
    return companion(ctx, skey, f"torchao scale of {name!r}", dtypes=float_scale, shape=blocks)


def _zero_point(ctx: DecodeContext, name: str, kind: str, names: list, scale: Tensor, prefix: str,
                consumed: dict) -> Tensor | None:
    """The zero points where the metadata lists them: one per scale, of a dtype the subclass stores them in
    (`SUBCLASSES`)."""
    if "zero_point" not in names:
        return None
    key = prefix + "zero_point"
    zero = companion(ctx, key, f"torchao zero point of {name!r}", dtypes=_dtypes(SUBCLASSES[kind].zero_dtypes),
                     shape=tuple(scale.shape))
    consumed[key] = f"torchao zero points of {name}"
    return zero


def _inference_data(ctx: DecodeContext, name: str, names: list, prefix: str, consumed: dict) -> None:
    """Static activation scales / zero points: present as listed, then dropped (they only configure inference)."""
    for n, why in INFERENCE_DATA.items():
        if n in names:
            companion(ctx, prefix + n, f"torchao {n} of {name!r}")
            consumed[prefix + n] = why


def _layer(ctx: DecodeContext, name: str, meta: dict, consumed: dict) -> TorchaoWeight:
    """One tensor subclass decoded, every stored datum checked against its metadata before anything is read:
    its class, its metadata and data names, its dtype, its codes, its blocks, scales and zero points, in that
    order (so the first problem is the one refused). What differs between subclasses is `SUBCLASSES`'s row."""
    kind = meta["_type"]
    prefix = _prefix(name)
    qkey, skey = prefix + "qdata", prefix + "scale"
    _refuse_class(ctx, name, kind, qkey)
    sub = SUBCLASSES[kind]
    data, names = _metadata_parts(ctx, name, meta, qkey)
    _check_stored_keys(ctx, name, kind, names, prefix)
    _check_data_names(ctx, name, kind, names, prefix)
    dt = getattr(torch, _float_dtype(ctx, name, data, qkey))
    q = companion(ctx, qkey, f"torchao {sub.codes} codes of {name!r}", dtypes=_dtypes(sub.code_dtypes))
    shape = tuple(q.shape)
    codes = _intx_target(ctx, name, data, qkey) if sub.intx else str(q.dtype).replace("torch.", "")
    block = data.get("block_size")
    if block is None and sub.block_from_scale:
        block = _block_from_scale(ctx, name, shape, skey)
    _check_block(ctx, name, block, shape, qkey)
    scale = _scale(ctx, name, shape, block, skey)
    zero = _zero_point(ctx, name, kind, names, scale, prefix, consumed)
    _inference_data(ctx, name, names, prefix, consumed)
    consumed[qkey] = f"torchao {kind} codes of {name}"
    consumed[skey] = f"torchao scales of {name}"
    return TorchaoWeight(name, kind, q, scale, zero, block, dt, codes)


def _flat_keys(ctx: DecodeContext, consumed=()) -> list[str]:
    """Stored keys shaped like flattened torchao data that `consumed` does not hold, the codes first (they say
    which tensor)."""
    return sorted((k for k in ctx.remaining if FLAT_KEY.search(k) and k not in consumed),
                  key=lambda k: not k.endswith("_qdata"))


def _refuse_flat(ctx: DecodeContext, flat: list[str]) -> None:
    """Flattened torchao data no metadata entry describes: nothing says what it is, so nothing is guessed."""
    if flat:
        raise refuse(ctx, flat[0], f"{flat[0]!r} looks like flattened torchao tensor data, but no torchao "
                                   "__metadata__ entry (tensor_names) describes it")


def _refuse_undescribed(ctx: DecodeContext, entries: dict | None, named: bool) -> None:
    """No tensor subclass is described: flattened torchao keys (unless they can be another format's, beside
    `.qweight` keys, with no torchao metadata or config at all), or a config naming torchao over weights with
    no torchao metadata, are refused rather than written as they are."""
    flat = _flat_keys(ctx)
    if flat and (entries is not None or named or not any(k.endswith(".qweight") for k in ctx.remaining)):
        _refuse_flat(ctx, flat)
    if named and entries is None:
        raise CkptError(f"{_where(ctx)}: config.json quantization_config names torchao, but the weights carry no "
                        "torchao safetensors metadata (tensor_names); torchao tensor subclasses stored "
                        "another way (pickled) cannot be decoded; nothing was written")


def _notes(entries: dict, tensors: dict) -> list[str]:
    """The summary's lines: what was decoded, and which activation settings were dropped."""
    kinds = sorted({t.kind for t in tensors.values()})
    n = len(tensors)
    notes = [f"torchao: decoded {n} tensor{'s' if n != 1 else ''} ({', '.join(kinds)})"] if n else []
    acts = [k for k, m in entries.items() if any((m.get("_data") or {}).get(a) for a in ACTIVATION_SETTINGS)]
    if acts:
        notes.append(f"torchao: activation quantization settings of {len(acts)} tensor{'s' if len(acts) != 1 else ''} "
                     "dropped (they only configure inference kernels)")
    return notes


def decode(ctx: DecodeContext) -> Decoded | None:
    """Every tensor subclass the safetensors metadata lists becomes its plain parameter, its data keys
    consumed, each checked before anything is written."""
    entries = _entries(ctx)
    named = str(quant_config(ctx).get("quant_method", "")).lower() == "torchao"
    if not entries:
        _refuse_undescribed(ctx, entries, named)
        if not named:
            return None
    tensors, consumed, anchors = {}, {}, {}
    for name, meta in entries.items():
        t = _layer(ctx, name, meta, consumed)
        tensors[name] = t
        anchors[t.qkey] = name
    _refuse_flat(ctx, _flat_keys(ctx, consumed))
    drop = {"tensor_names", *json.loads(ctx.metadata["tensor_names"])}
    return Decoded("torchao", tensors, consumed, drop_metadata=drop, notes=_notes(entries, tensors), anchors=anchors,
                   dequantized=bool(tensors) or named)


def inspect_settings(t: TorchaoWeight, config) -> dict:
    """What `ckpt inspect` says of a decoded torchao weight: its code type and bits, the granularity its
    block_size means (the whole tensor, one row, or groups of a row) and, for integer codes, the mapping."""
    shape, block = t.shape, t.block
    if tuple(block) == tuple(shape):
        strategy = "tensor"
    elif len(shape) >= 2 and all(b == 1 for b in block[:-1]) and block[-1] == shape[-1]:
        strategy = "channel"
    elif len(shape) >= 2 and all(b == 1 for b in block[:-1]):
        strategy = "group"
    else:
        strategy = "block"
    bits = int(t.codes[len("float"):].split("_")[0]) if t.codes.startswith("float") else int(t.codes[len("int"):])
    s = {"format": "torchao", "type": t.codes, "bits": bits, "packing": t.kind, "strategy": strategy}
    if strategy == "group":
        s["group_size"] = block[-1]
    if strategy == "block":
        s["block"] = list(block)
    if t.codes.startswith("int"):  # torchao stores a zero point of zeros for its symmetric mappings too
        s["sym"] = t.zero is None or not bool(t.zero.read_all(torch.device("cpu")).any())
    return s

FORMAT = Format("torchao", "torchao", 20, (decode,), weights=(TorchaoWeight,), settings=inspect_settings,
                llm=True)
