"""bitsandbytes weights decoded back to plain tensors: 4-bit NF4/FP4 and LLM.int8.

4-bit (transformers / diffusers `BitsAndBytesConfig(load_in_4bit=True)` saves, Forge's NF4 single files;
`bnb.nn.Params4bit` as it serializes itself), for a parameter `P` (e.g. `X.weight`):
- `P`: the codes, packed two per byte (the even element in the high nibble) over the flattened tensor,
  stored as uint8 [(n + 1) / 2, 1] (or another `quant_storage` dtype holding the same bytes);
- `P.absmax`: one scale per `blocksize` consecutive elements of the flattened tensor (float32), or, with
  nested ("double") quantization, uint8 codes of them: absmax = nested_quant_map[code] *
  `P.nested_absmax`[block / nested_blocksize] + nested_offset;
- `P.quant_map` (the 16-value code table), `P.nested_quant_map` (the 256-value dynamic map);
- `P.quant_state.bitsandbytes__nf4` / `__fp4`: UTF-8 JSON bytes {quant_type, blocksize, dtype, shape,
  nested_blocksize, nested_dtype, nested_offset}.
W = table[code] * absmax[element / blocksize], computed in float32 exactly as bitsandbytes' CPU
`dequantize_4bit` computes it (its own table, which every file's `quant_map` must equal), then rounded once.
Two deliberate choices where bitsandbytes 0.50.2's CPU paths disagree with each other: blocks run over
the flattened tensor (as quantize_4bit, its scalar C path and its PyTorch reference do; its AVX-512 path
indexes absmax per row, which decodes rows that are not a whole number of blocks wrongly), and FP4 code 8
(negative zero) decodes to +0.0 (its code table, AVX-512 path and PyTorch reference; the scalar C path
gives -0.0).

LLM.int8 (`load_in_8bit=True`): `X.weight` int8 [out, in], `X.SCB` float32 [out] row absmax,
`X.weight_format` (0 = "row", the only layout saved): W = weight * SCB[:, None] * (1 / 127), bitsandbytes'
`int8_vectorwise_dequant`.

Decoding drops `quantization_config` from config.json (the output is no longer quantized). The natural
dtype is the quant state's `dtype` (4-bit) or the config's dtype (LLM.int8, default bf16).
"""

from __future__ import annotations

import json
import math
import re

from ckpt.lazy import torch

from ckpt.dtypes import is_float
from ckpt.io.tensors import Tensor
from ckpt.io.wrapper import Wrapper
from ckpt.quant.common import DecodeContext, Decoded, companion, model_dtype, quant_config, refuse, st_name
from ckpt.quant.encoding import NoEncoder
from ckpt.quant.formats import Format

QUANT_STATE = re.compile(r"^(.+)\.quant_state\.bitsandbytes__(nf4|fp4)$")
# bitsandbytes' code tables (functional.get_4bit_type), in float32: the values its kernels use.
_TABLES = {
    "nf4": [-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
            -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
            0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
            0.7229568362236023, 1.0],
    "fp4": [0.0, 0.0625, 8.0, 12.0, 4.0, 6.0, 2.0, 3.0, 0.0, -0.0625, -8.0, -12.0, -4.0, -6.0, -2.0, -3.0],
}
BLOCKSIZES = (32, 64, 128, 256, 512, 1024, 2048, 4096)
INT8_RECIPROCAL = 7.874015718698502e-3  # 1 / 127 as bitsandbytes writes it
_TABLE_CACHE: dict[tuple, torch.Tensor] = {}


def code_table(quant_type: str, device="cpu") -> torch.Tensor:
    key = (quant_type, str(device))
    if key not in _TABLE_CACHE:
        t = torch.tensor(_TABLES[quant_type], dtype=torch.float32)
        _TABLE_CACHE[key] = (t / t.abs().max()).to(device)  # bitsandbytes normalizes to [-1, 1]
    return _TABLE_CACHE[key]


def _pair_table(quant_type: str, device) -> torch.Tensor:
    """256 entries: byte b -> (table[b >> 4], table[b & 15]) as one int64 (one lookup per byte)."""
    key = (quant_type + "-pairs", str(device))
    if key not in _TABLE_CACHE:
        t = code_table(quant_type)
        pairs = torch.stack((t.repeat_interleave(16), t.repeat(16)), dim=-1).contiguous()
        _TABLE_CACHE[key] = pairs.view(torch.int64).reshape(256).to(device)
    return _TABLE_CACHE[key]


_NO_ENCODER = NoEncoder("bitsandbytes", "bitsandbytes is decoded only: ckpt has no encoder for NF4/FP4/LLM.int8 "
                                        "(merge without --keep-format for a plain file)")


class Bnb4bitWeight(Wrapper):
    """A 4-bit weight: any band of rows is a range of the flattened codes (`base`, the packed tensor), read
    with the absmax blocks covering it (and their nested codes). `natural`: the model's dtype."""

    encoding = _NO_ENCODER

    row_align = 1

    def __init__(self, name, packed: Tensor, absmax: Tensor, quant_type: str, blocksize: int, shape, natural,
                 nested: tuple[Tensor, Tensor, int, float] | None = None):
        self.name, self.base, self.absmax, self.quant_type = name, packed, absmax, quant_type
        self.blocksize, self.nested = blocksize, nested
        self.shape, self.home, self.dtype = tuple(shape), packed.home, torch.float32
        self.natural = natural
        self.n = math.prod(self.shape)
        self.row_elems = self.n // self.shape[0] if self.shape and self.shape[0] else self.n
        # bytes per stored row of the packed tensor (its dtype may be any `quant_storage`)
        self.row_bytes = packed.numel // max(packed.rows, 1) * packed.dtype.itemsize if packed.shape else packed.dtype.itemsize

    @property
    def source_bytes(self):
        return (self.n + 1) // 2  # the codes, two per byte, whatever `quant_storage` dtype holds them

    def read(self, start, stop, device, scratch=None):
        if not self.shape:
            start, stop = 0, 1
        e0, e1 = start * self.row_elems, stop * self.row_elems
        bs = self.blocksize
        b0, b1 = e0 // bs, -(-e1 // bs)  # absmax blocks covering the band
        E0, E1 = b0 * bs, min(self.n, b1 * bs)  # block-aligned element range (E0 is even: bs is)
        raw = self._bytes(E0 // 2, (E1 + 1) // 2, device)
        pairs = torch.index_select(_pair_table(self.quant_type, device), 0, raw.to(torch.int32))
        vals = pairs.view(torch.float32)[: E1 - E0]
        vals = torch.nn.functional.pad(vals, (0, (b1 - b0) * bs - (E1 - E0)))  # a last, partial block
        y = (vals.view(-1, bs) * self._absmax(b0, b1, device).view(-1, 1)).view(-1)
        y = y[e0 - E0: e1 - E0]
        return y.reshape((stop - start, *self.shape[1:]) if self.shape else ())

    def _bytes(self, byte0: int, byte1: int, device) -> torch.Tensor:
        """Bytes [byte0, byte1) of the packed data (two codes each, the even element high)."""
        rb = self.row_bytes
        r0, r1 = byte0 // rb, -(-byte1 // rb)
        raw = self.base.read(r0, r1, device) if self.base.shape else self.base.read_all(device)
        return raw.contiguous().view(torch.uint8).reshape(-1)[byte0 - r0 * rb: byte1 - r0 * rb]

    def _absmax(self, b0: int, b1: int, device) -> torch.Tensor:
        a = self.absmax.read(b0, b1, device)
        if self.nested is None:
            return a.to(torch.float32)
        n_absmax, n_map, n_bs, offset = self.nested
        j0, j1 = b0 // n_bs, -(-b1 // n_bs)
        scales = n_absmax.read(j0, j1, device).to(torch.float32)
        idx = torch.arange(b0, b1, device=device) // n_bs - j0
        f = n_map.read_all(device).to(torch.float32)[a.long()] * scales[idx]  # dequantize_blockwise
        return f + torch.tensor(offset, dtype=torch.float32, device=device)  # absmax += offset


class Int8RowWeight(Wrapper):
    """LLM.int8: W = weight * SCB[:, None] * (1 / 127) in float32, as `int8_vectorwise_dequant`; `base` is
    the int8 weight, `natural` the model's dtype."""

    encoding = _NO_ENCODER

    row_align = 1

    def __init__(self, name, weight: Tensor, scb: Tensor, natural):
        self.name, self.base, self.scb = name, weight, scb
        self.shape, self.home, self.dtype, self.natural = weight.shape, weight.home, torch.float32, natural

    def read(self, start, stop, device, scratch=None):
        q = self.base.read(start, stop, device, scratch)
        s = self.scb.read(start, stop, device).to(torch.float32)
        return q * s.view(-1, *([1] * (q.dim() - 1))) * INT8_RECIPROCAL


def _state(ctx, key) -> dict:
    companion(ctx, key, "bitsandbytes quant state", dtypes=(torch.uint8,))  # UTF-8 JSON bytes
    try:
        st = json.loads(ctx.remaining[key].read_all(torch.device("cpu")).numpy().tobytes())
        if not isinstance(st, dict):
            raise TypeError
    except (ValueError, TypeError, RuntimeError):
        raise refuse(ctx, key, f"{key!r} is not a bitsandbytes quant state (JSON bytes)") from None
    return st


def decode_4bit(ctx: DecodeContext) -> Decoded | None:
    """Every key of a Params4bit is checked against what bitsandbytes writes (`companion`): the packed
    codes hold exactly the bytes the shape needs, absmax is F32 [blocks] (or U8 [blocks] codes with F32
    nested absmax and a 256-entry F32 nested code table), the code table F32 [16]."""
    found = [(m.group(1), m.group(2), k) for k in ctx.remaining if (m := QUANT_STATE.match(k))]
    if not found:
        return None
    tensors, consumed, kinds = {}, {}, set()
    for p, qt, skey in found:
        st = _state(ctx, skey)
        shape, bs, dtype_name = st.get("shape"), st.get("blocksize"), st.get("dtype")
        if st.get("quant_type", qt) != qt or bs not in BLOCKSIZES or not isinstance(shape, list) \
                or not all(isinstance(d, int) and d >= 0 for d in shape) \
                or not isinstance(getattr(torch, str(dtype_name), None), torch.dtype):
            raise refuse(ctx, skey, f"{skey!r} does not describe a {qt} weight (quant_type, blocksize, dtype, "
                                    f"shape): {st}")
        natural = getattr(torch, dtype_name)
        w = ctx.remaining.get(p)
        if w is None:
            raise refuse(ctx, skey, f"bitsandbytes quant state {skey!r} has no packed weight {p!r}")
        n = math.prod(shape)
        _check_packed(ctx, p, w, qt, shape, n)
        aux = {s: f"{p}.{s}" for s in ("absmax", "quant_map", "nested_absmax", "nested_quant_map")}
        absmax = ctx.remaining.get(aux["absmax"])
        blocks = -(-n // bs)
        if absmax is None or absmax.numel != blocks:
            raise refuse(ctx, p, f"{p!r} ({qt}, {n} values in blocks of {bs}) needs {blocks} absmax values in "
                                 f"{aux['absmax']!r}" + ("" if absmax is None else f", not {absmax.numel}"))
        qmap = ctx.remaining.get(aux["quant_map"])
        if qmap is not None:
            companion(ctx, aux["quant_map"], f"{qt} code table of {p!r}", dtypes=(torch.float32,), shape=(16,))
            if not torch.equal(qmap.read_all(torch.device("cpu")).reshape(-1), code_table(qt)):
                raise refuse(ctx, aux["quant_map"], f"{aux['quant_map']!r} is not bitsandbytes' {qt} code table")
            consumed[aux["quant_map"]] = f"code table of {p}"
        nested = None
        if "nested_offset" in st or aux["nested_absmax"] in ctx.remaining or aux["nested_quant_map"] in ctx.remaining:
            nested = _nested(ctx, p, st, aux, absmax, blocks)
            consumed[aux["nested_absmax"]] = f"nested absmax of {p}"
            consumed[aux["nested_quant_map"]] = f"nested code table of {p}"
        elif not is_float(absmax.dtype):
            raise refuse(ctx, aux["absmax"], f"{aux['absmax']!r} is {st_name(absmax.dtype)} but {skey!r} names no "
                                              "nested quantization")
        else:  # read per block: [blocks] exactly (a reshaped absmax would be read by the wrong rows)
            companion(ctx, aux["absmax"], f"block absmax of {p!r}", dtypes=(torch.float32,), shape=(blocks,))
        consumed[aux["absmax"]] = f"block absmax of {p}"
        consumed[skey] = f"bitsandbytes quant state of {p}"
        tensors[p] = Bnb4bitWeight(p, w, absmax, qt, bs, shape, natural, nested)
        kinds.add(qt)
    return Decoded("bitsandbytes " + "+".join(sorted(kinds)), tensors, consumed)


def _check_packed(ctx, p, w, qt, shape, n):
    """The packed codes: two per byte, (n + 1) // 2 bytes, in uint8 or another `quant_storage` dtype
    holding those bytes (rounded up to whole elements), shaped [elements, 1] as Params4bit stores them.
    A tensor holding more bytes is not packed codes (e.g. the uint8 codes cast to float32: four times the
    bytes, decoded to garbage before)."""
    need = (n + 1) // 2
    isz = w.dtype.itemsize
    have = w.numel * isz
    if have < need:
        raise refuse(ctx, p, f"{p!r} holds {have} bytes; the {qt} weight of shape {shape} needs {need} "
                             "(truncated packed data)")
    if have != -(-need // isz) * isz or len(w.shape) != 2 or w.shape[1] != 1:
        raise refuse(ctx, p, f"packed {qt} codes {p!r} are {st_name(w.dtype)} {list(w.shape)} ({have} bytes); expected "
                             f"{need} bytes for the shape {shape} (two 4-bit codes per byte: U8 [{need}, 1] as "
                             "bitsandbytes saves them, or the same bytes in its quant_storage dtype)")


def _nested(ctx, p, st, aux, absmax, blocks):
    n_absmax, n_map = ctx.remaining.get(aux["nested_absmax"]), ctx.remaining.get(aux["nested_quant_map"])
    n_bs, offset = st.get("nested_blocksize"), st.get("nested_offset")
    if n_absmax is None or n_map is None or n_bs not in BLOCKSIZES or not isinstance(offset, (int, float)) \
            or isinstance(offset, bool) or not math.isfinite(offset):
        raise refuse(ctx, p, f"{p!r} is nested-quantized but lacks {aux['nested_absmax']!r}, "
                             f"{aux['nested_quant_map']!r} or nested_blocksize/nested_offset in its quant state")
    if absmax.dtype != torch.uint8 or n_map.numel != 256 or n_absmax.numel != -(-blocks // n_bs):
        raise refuse(ctx, p, f"nested absmax of {p!r} does not fit: {aux['absmax']!r} {st_name(absmax.dtype)} "
                             f"{list(absmax.shape)}, {aux['nested_absmax']!r} {list(n_absmax.shape)}, "
                             f"{aux['nested_quant_map']!r} {list(n_map.shape)} (blocks of {n_bs})")
    companion(ctx, aux["absmax"], f"nested absmax codes of {p!r}", dtypes=(torch.uint8,), shape=(blocks,))
    companion(ctx, aux["nested_absmax"], f"nested absmax of {p!r}", dtypes=(torch.float32,),
              shape=(-(-blocks // n_bs),))
    companion(ctx, aux["nested_quant_map"], f"nested code table of {p!r}", dtypes=(torch.float32,), shape=(256,))
    return n_absmax, n_map, n_bs, float(offset)


def decode_int8(ctx: DecodeContext) -> Decoded | None:
    """LLM.int8: `X.SCB` F32 [out] beside an int8 `X.weight`. An int8 weight that has lost its SCB is
    refused rather than written as if its codes were values: one whose `X.weight_format` is still there,
    or any int8 `.weight` when other layers carry SCB or config.json says load_in_8bit."""
    keys = [k for k in ctx.remaining if k == "SCB" or k.endswith(".SCB")]
    qc = quant_config(ctx)
    int8_config = str(qc.get("quant_method", "")).lower() == "bitsandbytes" and bool(qc.get("load_in_8bit"))
    for key in ctx.remaining:
        if key == "weight_format" or key.endswith(".weight_format"):
            layer = key[: -len("weight_format")]
            if f"{layer}SCB" not in ctx.remaining and f"{layer}weight" in ctx.remaining:
                raise refuse(ctx, key, f"LLM.int8 layer {layer[:-1]!r} has {key!r} but no row scales "
                                       f"{layer + 'SCB'!r}: its int8 codes cannot be decoded")
    if keys or int8_config:
        for key, t in ctx.remaining.items():
            layer = key[: -len("weight")]
            is_weight = key == "weight" or key.endswith(".weight")
            if is_weight and t.dtype == torch.int8 and f"{layer}SCB" not in ctx.remaining:
                raise refuse(ctx, key, f"{key!r} is an int8 weight without row scales {layer + 'SCB'!r} in an "
                                       "LLM.int8 checkpoint: its codes cannot be decoded")
    if not keys:
        return None
    natural, tensors, consumed = model_dtype(ctx), {}, {}
    for key in keys:
        layer = key[: -len("SCB")]
        wkey, fkey = f"{layer}weight", f"{layer}weight_format"
        w, scb = ctx.remaining.get(wkey), ctx.remaining[key]
        if w is None or w.dtype != torch.int8 or len(w.shape) != 2:
            raise refuse(ctx, key, f"LLM.int8 scale {key!r} needs an int8 matrix {wkey!r}"
                                   + ("" if w is None else f", not {st_name(w.dtype)} {list(w.shape)}"))
        if scb.numel != w.shape[0] or not is_float(scb.dtype):
            raise refuse(ctx, key, f"LLM.int8 scale {key!r} {st_name(scb.dtype)} {list(scb.shape)} is not one value "
                                   f"per row of {wkey!r} {list(w.shape)}")
        companion(ctx, key, f"LLM.int8 row scales of {wkey!r}", dtypes=(torch.float32,), shape=(w.shape[0],))
        if fkey in ctx.remaining:
            companion(ctx, fkey, f"LLM.int8 layout of {wkey!r}", numel=1,
                      dtypes=(torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64))
            f = ctx.remaining[fkey].read_all(torch.device("cpu"))
            if int(f.reshape(-1)[0]) != 0:
                raise refuse(ctx, fkey, f"{fkey!r} is not the row layout (0) that bitsandbytes saves")
            consumed[fkey] = f"layout of {wkey} (row)"
        tensors[wkey] = Int8RowWeight(wkey, w, scb, natural)
        consumed[key] = f"row scales of {wkey}"
    return Decoded("bitsandbytes int8", tensors, consumed)


FORMAT = Format("bitsandbytes", "bitsandbytes", 40, (decode_4bit, decode_int8), weights=(Bnb4bitWeight, Int8RowWeight),
                refusals={"bitsandbytes": (re.compile(r"\.(absmax|quant_map|nested_absmax|nested_quant_map|quant_state\.[\w]+|SCB)$"),
                                           "data without the quant state or weight it belongs to")})
