"""optimum-quanto weights decoded back to plain tensors (docs/format-facts.md "optimum-quanto state dicts").

optimum-quanto (and diffusers/transformers `QuantoConfig`, SimpleTuner) save a quantized weight `P` as
`P._data` (int8 / fp8, 8-bit qtypes) or `P._data._data` (packed uint8, qint4 / qint2) with `P._scale`
and, for 4/2 bits, `P._shift` (`P._zeropoint` in optimum-quanto <= 0.2.2 pickles). Every quantized
module also stores `M.input_scale` / `M.output_scale`, which a plain model does not have.

The values are computed exactly as optimum-quanto's `.dequantize()` computes them, with the same
operations in the scale's dtype, so the output is bit-identical to it:

- qint8: `scale * data`; qfloat8: `scale * data.to(scale.dtype)` (the fp8 upcast is exact);
- qint4 / qint2: unpack, then `scale * data - shift` (float shift) or `scale * (data - shift)`.

What the state dict does not store (the 4/2-bit qtype, whether data was grouped, the original shape)
is taken, in this order, from the legacy string entries, `quanto_qmap.json` / `quantization_config`,
`--qtype`, the tensors themselves where that is unambiguous, `--shapes-from`, a bias (diffusers and
transformers only quantize Linear layers), the model class of config.json built on the meta device,
and finally a bias assuming a Linear layer. Anything still ambiguous stops the run before any output
exists, naming the keys and the option that settles them.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

from ckpt.lazy import torch

from ckpt.cast import fp8_upcast
from ckpt.dtypes import FP8
from ckpt.errors import CkptError
from ckpt.io.tensors import Tensor
from ckpt.quant.common import DecodeContext, Decoded, companion
from ckpt.quant.formats import Format

QMAP_NAME = "quanto_qmap.json"
FLOAT8_QTYPES = {  # qtype -> the safetensors name of its data's dtype
    "qfloat8_e4m3fn": "F8_E4M3",
    "qfloat8_e5m2": "F8_E5M2",
    "qfloat8_e4m3fnuz": "F8_E4M3FNUZ",
}
BITS = {"qint8": 8, "qint4": 4, "qint2": 2, **{k: 8 for k in FLOAT8_QTYPES}}
# Spellings used by diffusers (`weights_dtype`), transformers (`weights`) and optimum-quanto itself.
ALIASES = {"int8": "qint8", "int4": "qint4", "int2": "qint2", "float8": "qfloat8_e4m3fn",
           "qfloat8": "qfloat8_e4m3fn", "fp8": "qfloat8_e4m3fn"}
QTYPE_CHOICES = sorted(set(BITS) | set(ALIASES))
GROUP_SIZES = (128, 96, 64, 32)  # optimum-quanto's QModuleMixin tries these, in this order
SUFFIXES = ("._data._data", "._data", "._scale", "._shift", "._zeropoint")


def canonical_qtype(name: str) -> str:
    q = ALIASES.get(name.strip().lower(), name.strip().lower())
    if q not in BITS:
        raise CkptError(f"unknown quanto qtype {name!r} (choose {', '.join(QTYPE_CHOICES)})")
    return q


def group_size_for(in_features: int) -> int | None:
    """optimum-quanto's rule for 2/4-bit weights: groups only when in_features > 128, of the first
    size among 128, 96, 64, 32 that divides in_features."""
    if in_features <= 128:
        return None
    return next((g for g in GROUP_SIZES if in_features % g == 0), None)


def _rows_of(t: Tensor, start: int, stop: int, rows: int, device) -> torch.Tensor:
    """Scale/shift values for data rows [start, stop): sliced when stored per row, else broadcast."""
    if t.shape and t.shape[0] == rows and rows > 1:
        return t.read(start, stop, device)
    return t.read_all(device)


class QBytesWeight(Tensor):
    """qint8 / qfloat8: W = scale * data, computed in the scale's dtype; bands of rows."""

    row_align = 1

    def __init__(self, name: str, data: Tensor, scale: Tensor):
        self.name, self.data, self.scale = name, data, scale
        self.shape, self.home, self.dtype = data.shape, data.home, scale.dtype

    @property
    def source_bytes(self):
        return self.data.source_bytes

    @property
    def encoding(self):
        from ckpt.quant.quanto_encode import QuantoBytesEncoding

        return QuantoBytesEncoding(self)

    def read(self, start, stop, device, scratch=None):
        d = self.data.read(start, stop, device, scratch)
        s = _rows_of(self.scale, start, stop, self.rows, device)
        if s.numel() == 1:
            s = s.reshape(())  # one scale, whatever its stored rank
        elif s.dim() < d.dim():
            s = s.reshape(s.shape + (1,) * (d.dim() - s.dim()))
        bufs = scratch if device.type == "cpu" else None
        if d.dtype in FP8:
            y = fp8_upcast(d, self.dtype, bufs, role="y").mul_(s)  # the upcast is exact, as `data.to(scale.dtype)`
        else:
            y = bufs.typed("y", self.dtype, d.shape) if bufs else torch.empty(d.shape, dtype=self.dtype, device=device)
            torch.mul(d, s, out=y)  # int8 * scale promotes to the scale dtype, as quanto's `scale * data`
        return y


class QBitsWeight(Tensor):
    """qint4 / qint2: packed rows unpacked, W = scale * data - shift (float shift) or
    scale * (data - shift) (integer shift / legacy zero-point), reshaped to the original shape.

    Unpacked row j lives in bit field j // rows_p of packed row j % rows_p, so any range of unpacked
    rows is a few contiguous ranges of packed rows: output rows are read in bands. Grouping along axis
    0 is a plain reshape, so output row r is unpacked rows [r*q, (r+1)*q) with q = in_features / group.
    """

    def __init__(self, name: str, packed: Tensor, scale: Tensor, shift: Tensor, bits: int, shape: tuple[int, ...]):
        self.name, self.packed, self.scale, self.shift, self.bits = name, packed, scale, shift, bits
        self.shape, self.home, self.dtype = tuple(shape), packed.home, scale.dtype
        self.urows = scale.shape[0] if scale.shape else 1  # unpacked (grouped) rows
        self.inner = tuple(packed.shape[1:])
        per = math.prod(self.inner)
        if self.urows * per != math.prod(self.shape):
            shown = list(self.shape) if len(self.shape) <= 8 else \
                "[" + ", ".join(map(str, self.shape[:6])) + f", ... ({len(self.shape)} dims)]"
            raise CkptError(f"{name}: {self.urows} x {list(self.inner)} quantized values do not fill the shape {shown}")
        rows = self.shape[0] if self.shape else 1
        self.q = self.urows // rows if rows and self.urows % rows == 0 else None
        self.row_align = 1 if self.q is not None else None

    @property
    def source_bytes(self):
        return self.packed.source_bytes

    @property
    def encoding(self):
        from ckpt.quant.quanto_encode import QuantoBitsEncoding

        return QuantoBitsEncoding(self)

    def read(self, start, stop, device, scratch=None):
        if self.q is None:
            start, stop, ga, gb = 0, self.rows, 0, self.urows
        else:
            ga, gb = start * self.q, stop * self.q
        bufs = scratch if device.type == "cpu" else None
        n = (gb - ga, *self.inner)
        u = bufs.typed("u", torch.uint8, n) if bufs else torch.empty(n, dtype=torch.uint8, device=device)
        rp = self.packed.rows
        for i in range(8 // self.bits):
            lo, hi = max(ga, i * rp), min(gb, (i + 1) * rp)
            if lo >= hi:
                continue
            seg = u[lo - ga: hi - ga]
            p = self.packed.read(lo - i * rp, hi - i * rp, device, scratch)  # used before the next read
            if i:
                torch.bitwise_right_shift(p, self.bits * i, out=seg)
                seg.bitwise_and_((1 << self.bits) - 1)
            else:
                torch.bitwise_and(p, (1 << self.bits) - 1, out=seg)
        s = _rows_of(self.scale, ga, gb, self.urows, device)
        z = _rows_of(self.shift, ga, gb, self.urows, device)
        y = bufs.typed("y", self.dtype, n) if bufs else torch.empty(n, dtype=self.dtype, device=device)
        if z.dtype.is_floating_point:
            torch.mul(s, u, out=y)  # the same two roundings as quanto: `scale * data`, then `-= shift`
            y.sub_(z)
        else:
            torch.mul(s, u.to(torch.int8).sub_(z.to(torch.int8)), out=y)
        return y.reshape((stop - start, *self.shape[1:]) if self.shape else ())


@dataclass
class _Entry:
    """One quantized weight `P` as stored."""

    prefix: str
    data: Tensor
    data_key: str
    packed: bool
    scale: Tensor | None
    shift: Tensor | None
    shift_key: str | None

    @property
    def module(self) -> str:
        return self.prefix[: -len(".weight")] if self.prefix.endswith(".weight") else self.prefix


def stored_entries(remaining: dict[str, Tensor]) -> dict[str, _Entry]:
    """The quantized weights among stored keys, by weight name (`P` of `P._data`); also used by inspect."""
    out: dict[str, _Entry] = {}
    for key, t in remaining.items():
        if key.endswith("._data._data"):
            p, packed = key[: -len("._data._data")], True
        elif key.endswith("._data"):
            p, packed = key[: -len("._data")], False
            if p + "._data._data" in remaining:
                continue
        else:
            continue
        shift_key = next((p + s for s in ("._shift", "._zeropoint") if p + s in remaining), None)
        out[p] = _Entry(p, t, key, packed, remaining.get(p + "._scale"), remaining.get(shift_key) if shift_key else None,
                        shift_key)
    return out


def _read_qmap(ctx: DecodeContext) -> dict:
    p = ctx.component.files[0].path.parent / QMAP_NAME
    if not p.is_file():
        return {}
    try:
        qmap = json.loads(p.read_text())
        assert isinstance(qmap, dict) and all(isinstance(v, dict) for v in qmap.values())
        return qmap
    except (json.JSONDecodeError, UnicodeDecodeError, AssertionError):
        raise CkptError(f"{p}: not a valid optimum-quanto quantization map (expected a JSON object of "
                        "{module: {\"weights\": ..., \"activations\": ...}})") from None


def _config_qtype(ctx: DecodeContext) -> str | None:
    qc = (ctx.config or {}).get("quantization_config")
    if not isinstance(qc, dict) or str(qc.get("quant_method", "")).lower() != "quanto":
        return None
    w = qc.get("weights_dtype", qc.get("weights"))
    return str(w) if w else ""  # "": quanto, qtype unsaid; made canonical per weight, where errors name the file


def _legacy_strings(ctx: DecodeContext, prefixes) -> dict[str, str]:
    """optimum-quanto <= 0.2.2 pickles store qtype/size/bits as strings beside the tensors; the
    component keeps tensors only, so read the strings again (safely, weights_only)."""
    from ckpt.io.pickles import NESTED, flatten, load

    out: dict[str, str] = {}
    for f in ctx.component.files:
        if f.kind != "pickle":
            continue
        obj = load(f.path)  # the component loader already read this file the same safe way
        dicts = [obj] + [obj[k] for k in NESTED if isinstance(obj, dict) and isinstance(obj.get(k), dict)]
        for d in dicts:
            d = flatten(d, f.path) if isinstance(d, dict) else d  # nested dicts named as the loader names them
            if isinstance(d, dict):
                out.update({str(k): v for k, v in d.items() if isinstance(v, str)
                            and any(str(k).startswith(p + ".") for p in prefixes)})
    return out


_SIZE = re.compile(r"\s*(?:torch\.Size\(\s*)?[\[(]\s*((?:\d{1,18}\s*,\s*)*\d{0,18})\s*,?\s*[\])]\s*\)?\s*")


def _legacy_size(text: str, key: str, where: str) -> tuple[int, ...]:
    """A legacy `X.weight.size` string (`"[32, 256]"`, `"torch.Size([32, 256])"`) as a shape; anything
    else is an error naming the key (never evaluated: it is data from the file)."""
    m = _SIZE.fullmatch(text) if len(text) <= 1000 else None
    if m is None:
        raise CkptError(f"{where}: {key!r} = {text[:60]!r} is not a shape (expected e.g. \"[32, 256]\"); "
                        "nothing was written")
    return tuple(int(d) for d in re.findall(r"\d+", m[1]))


def decode(ctx: DecodeContext) -> Decoded | None:
    entries = stored_entries(ctx.remaining)
    qmap = _read_qmap(ctx)
    cfg_qtype = _config_qtype(ctx)
    if not entries and not qmap and cfg_qtype is None:
        _refuse_stray(ctx, set())
        return None
    where = str(ctx.component.where)
    opt_qtype = ctx.options.get("qtype")
    opt_qtype = canonical_qtype(opt_qtype) if opt_qtype else None
    legacy = _legacy_strings(ctx, entries) if any(e.shift_key and e.shift_key.endswith("._zeropoint")
                                                  for e in entries.values()) else {}
    resolver = _ShapeResolver(ctx, cfg_qtype is not None)
    tensors: dict[str, Tensor] = {}
    consumed: dict[str, str] = {}
    anchors: dict[str, str] = {}
    no_bits, no_shape, qtypes_seen = [], [], {}
    for p, e in entries.items():
        if e.scale is None or (e.packed and e.shift is None):
            missing = p + "._scale" if e.scale is None else p + "._shift"
            raise CkptError(f"{where}: incomplete optimum-quanto weight {p!r}: {e.data_key!r} has no {missing!r}; "
                            "nothing was written")
        if p in ctx.remaining:
            raise CkptError(f"{where}: {p!r} is stored both plain and quantized ({e.data_key!r}); nothing was written")
        declared = _declared_qtype(p, e, legacy, qmap, cfg_qtype, opt_qtype, where)
        _check_shapes(e, where)
        # quanto computes in the scale's dtype, the module's: an fp8 or fp64 scale is no quanto file
        companion(ctx, p + "._scale", f"scale of {p!r}", dtypes=(torch.float32, torch.float16, torch.bfloat16))
        if e.shift is not None:  # float (the scale's dtype: `scale * data - shift`) or integer zero point
            companion(ctx, e.shift_key, f"shift of {p!r}", dtypes=(e.scale.dtype, torch.uint8, torch.int8))
        if not e.packed:
            qtype = _bytes_qtype(e, declared, where)
            tensors[p] = QBytesWeight(p, e.data, e.scale)
        else:
            bits = _packed_bits(e, declared, where)
            if bits is None:
                no_bits.append(e.data_key)
                continue
            qtype = f"qint{bits}"
            shape = _legacy_size(legacy[p + ".size"], p + ".size", where) if p + ".size" in legacy \
                else resolver.shape(e)
            if shape is None:
                no_shape.append(e.data_key)
                continue
            try:
                tensors[p] = QBitsWeight(p, e.data, e.scale, e.shift, bits, tuple(shape))
            except CkptError as err:
                raise CkptError(f"{where}: {err}; nothing was written") from None
        qtypes_seen[qtype] = qtypes_seen.get(qtype, 0) + 1
        anchors[e.data_key] = p
        consumed[e.data_key] = f"quantized data of {p} ({qtype})"
        consumed[p + "._scale"] = f"scale of {p}"
        if e.shift_key:
            consumed[e.shift_key] = f"shift of {p}"
    if no_bits:
        raise CkptError(f"{where}: cannot tell qint4 from qint2 for {_keys(no_bits)} (at most 2 rows, and no "
                        f"{QMAP_NAME} or quantization_config says); pass --qtype qint4 or --qtype qint2; "
                        "nothing was written")
    if no_shape:
        raise CkptError(f"{where}: the original shape of grouped 4/2-bit weights {_keys(no_shape)} is not stored "
                        "(no bias, no config.json model class to build); pass --shapes-from REF (the original "
                        "model, a local checkpoint or hub id); nothing was written")
    modules = {e.module for e in entries.values()} | set(qmap)
    for key, t in ctx.remaining.items():
        for s in (".input_scale", ".output_scale"):
            if key.endswith(s) and (key[: -len(s)] in modules or (not t.shape and t.numel == 1)):
                consumed[key] = "optimum-quanto activation scale (inference only)"
    for key in legacy:
        consumed[key] = "optimum-quanto <= 0.2.2 metadata string"
    _refuse_stray(ctx, set(consumed))
    summary = ", ".join(f"{n} {q}" for q, n in sorted(qtypes_seen.items())) or "no quantized weights"
    where_note = f"{ctx.component.subdir}: " if ctx.component.subdir else ""
    notes = [f"{where_note}optimum-quanto: dequantized {summary}"] + resolver.notes
    return Decoded("optimum-quanto", tensors, consumed, notes=notes, anchors=anchors)


def _keys(keys: list[str]) -> str:
    return ", ".join(repr(k) for k in keys[:4]) + (f" and {len(keys) - 4} more" if len(keys) > 4 else "")


def _refuse_stray(ctx: DecodeContext, consumed: set[str]) -> None:
    """Quanto-looking keys that are not part of a complete weight must not pass through silently."""
    for key in ctx.remaining:
        if key not in consumed and key.endswith(SUFFIXES):
            raise CkptError(f"{str(ctx.component.where)}: {key!r} looks like part of an optimum-quanto weight, but its "
                            "companions (._data / ._scale / ._shift) are missing; nothing was written")


def _declared_qtype(p, e, legacy, qmap, cfg_qtype, opt_qtype, where) -> str | None:
    found = []
    if p + ".qtype" in legacy:
        found.append(("the stored metadata", legacy[p + ".qtype"]))
    w = (qmap.get(e.module) or {}).get("weights")
    if w and w != "none":
        found.append((QMAP_NAME, w))
    if cfg_qtype:
        found.append(("config.json quantization_config", cfg_qtype))
    try:
        found = [(src, canonical_qtype(str(q))) for src, q in found]
    except CkptError as err:
        raise CkptError(f"{where}: {p!r}: {err}; nothing was written") from None
    if opt_qtype:
        if found and found[0][1] != opt_qtype:
            raise CkptError(f"{where}: --qtype {opt_qtype} conflicts with {found[0][0]}, which says {found[0][1]} "
                            f"for {p!r}; nothing was written")
        found.append(("--qtype", opt_qtype))
    return found[0][1] if found else None


def _check_shapes(e: _Entry, where: str) -> None:
    """Scale (and shift) shapes must broadcast over the data the way the decoders apply them without
    changing its shape, checked while planning (a scale that broadcasts wider would make a band larger
    than planned). optimum-quanto writes one scale, one per row ([rows, 1]), or, for a one-row weight,
    one per column; 8-bit scales are aligned to the data's leading dims, 4/2-bit ones and shifts have
    the unpacked data's rank ([rows, 1] for data [rows, in])."""
    s, d = tuple(e.scale.shape), tuple(e.data.shape)
    if not e.scale.dtype.is_floating_point:
        raise CkptError(f"{where}: {e.prefix}._scale is {e.scale.dtype}, expected a float scale; nothing was written")
    if not e.packed:
        # same rank (quanto's own [rows, 1]), or a 1-D [rows]: a scale of another lower rank is aligned to the
        # leading dims here but to the trailing ones by quanto's `scale * data`, so its values are ambiguous
        if math.prod(s) == 1 or (len(s) in (1, len(d)) and len(s) <= len(d)
                                 and all(a in (1, b) for a, b in zip(s, d))):
            return
        raise CkptError(f"{where}: {e.prefix}._scale {list(s)} does not fit {e.data_key!r} {list(d)} (optimum-quanto "
                        f"stores one scale, or one per row: [{d[0] if d else 1}, 1]); nothing was written")
    unpacked = ((s[0] if s else 1), *d[1:])
    for key, t in ((e.prefix + "._scale", e.scale), (e.shift_key, e.shift)):
        z = tuple(t.shape)
        if math.prod(z) != 1 and not (len(z) == len(unpacked) and z[0] == unpacked[0]
                                      and all(a in (1, b) for a, b in zip(z[1:], unpacked[1:]))):
            raise CkptError(f"{where}: {key!r} {list(z)} does not fit {e.data_key!r} {list(d)}, unpacked "
                            f"[{unpacked[0]}, ...] (optimum-quanto stores one value per row: [rows, 1]); "
                            "nothing was written")


def _bytes_qtype(e: _Entry, declared: str | None, where: str) -> str:
    d = e.data.dtype
    if d == torch.int8:
        qtype = "qint8"
    else:
        qtype = next((q for q, fd in FLOAT8_QTYPES.items() if fd == e.data.dtype_name), None)
        if qtype is None:
            raise CkptError(f"{where}: {e.data_key!r} is {d}, not an optimum-quanto 8-bit data type "
                            "(int8 or float8); nothing was written")
    if declared is not None and BITS[declared] != 8:
        raise CkptError(f"{where}: {e.data_key!r} holds unpacked 8-bit {qtype} data, but the quantization "
                        f"map/config says {declared}; nothing was written")
    if not e.scale.dtype.is_floating_point:
        raise CkptError(f"{where}: {e.prefix}._scale is {e.scale.dtype}, expected a float scale; nothing was written")
    return qtype


def _packed_bits(e: _Entry, declared: str | None, where: str) -> int | None:
    if e.data.dtype != torch.uint8 or not e.data.shape:
        raise CkptError(f"{where}: {e.data_key!r} is {e.data.dtype} {list(e.data.shape)}, expected packed uint8 "
                        "rows; nothing was written")
    rows = e.scale.shape[0] if e.scale.shape else 1
    rp = e.data.shape[0]
    fits = [b for b in (4, 2) if -(-rows // (8 // b)) == rp]
    if declared is not None:
        bits = BITS[declared]
        if bits not in fits:
            raise CkptError(f"{where}: {e.data_key!r} has {rp} packed rows for {rows} rows, which does not fit "
                            f"{declared} (the quantization map/config/--qtype says so); nothing was written")
        return bits
    if not fits:
        raise CkptError(f"{where}: {e.data_key!r} has {rp} packed rows for {rows} scale rows: not an "
                        "optimum-quanto qint4/qint2 packing; nothing was written")
    return fits[0] if len(fits) == 1 else None


def grouped_candidates(rows: int, g: int) -> list[tuple[int, int]]:
    """(out, in) of every layer whose grouped data would be `rows` x `g`: in = g*k with k dividing
    `rows`, in > 128, and optimum-quanto's rule choosing g for it."""
    ks = set()
    for d in range(1, math.isqrt(rows) + 1):
        if rows % d == 0:
            ks |= {d, rows // d}
    return [(rows // k, g * k) for k in sorted(ks) if g * k > 128 and group_size_for(g * k) == g]


class _ShapeResolver:
    """Original shapes of packed weights, from the cheapest source that settles them."""

    def __init__(self, ctx: DecodeContext, linear_only: bool):
        self.ctx, self.linear_only = ctx, linear_only
        self.ref = ctx.options.get("shape_of")  # callable(subdir, name) -> shape | None (--shapes-from)
        self._meta = None
        self.notes: list[str] = []
        self._assumed = 0

    def shape(self, e: _Entry):
        rows = e.scale.shape[0] if e.scale.shape else 1
        inner = tuple(e.data.shape[1:])
        numel = rows * math.prod(inner)
        if len(inner) != 1 or inner[0] not in GROUP_SIZES:
            return (rows, *inner)  # never grouped: grouped data is (numel / g, g) with g in GROUP_SIZES
        g = inner[0]
        if not grouped_candidates(rows, g):
            return (rows, g)  # no grouped layer gives these values: a Linear with in_features == g
        if self.ref is not None:
            s = self.ref(self.ctx.component.subdir, e.prefix)
            if s is not None:
                return self._check(e, s, numel, g, "--shapes-from")
        out = self._bias_rows(e)
        if out is not None and self.linear_only:
            return self._from_bias(e, out, rows, numel, g)
        s = self._meta_shape(e.prefix)
        if s is not None:
            return self._check(e, s, numel, g, "the config.json model class")
        if out is not None:
            self._assumed += 1
            if self._assumed == 1:
                self.notes.append("optimum-quanto: grouped 4/2-bit shapes taken from biases assuming Linear layers "
                                  "(a Conv needs --shapes-from)")
            return self._from_bias(e, out, rows, numel, g)
        return None

    def _bias_rows(self, e: _Entry) -> int | None:
        b = self.ctx.remaining.get(e.module + ".bias")
        return b.shape[0] if b is not None and len(b.shape) == 1 else None

    def _from_bias(self, e, out, rows, numel, g):
        if out == rows:
            return (rows, g)
        if numel % out or group_size_for(numel // out) != g:
            raise CkptError(f"{str(self.ctx.component.where)}: {e.data_key!r} ({numel} values in groups of {g}) does not fit "
                            f"{e.module}.bias ({out} outputs); nothing was written")
        return (out, numel // out)

    def _check(self, e, s, numel, g, source):
        s = tuple(int(x) for x in s)
        in_features = math.prod(s[1:]) if s else 1
        ok = math.prod(s) == numel and (group_size_for(in_features) == g or (in_features == g and s[0] == numel // g))
        if not ok:
            raise CkptError(f"{str(self.ctx.component.where)}: {source} gives {e.prefix} the shape {list(s)}, which does not "
                            f"match the stored {numel} values in groups of {g}; nothing was written")
        return s

    def _meta_shape(self, name: str):
        if self._meta is None:
            self._meta = _meta_model_shapes(self.ctx.config) or {}
            if self._meta:
                self.notes.append("optimum-quanto: grouped 4/2-bit shapes taken from the config.json model class "
                                  "built on the meta device")
        return self._meta.get(name)


def _meta_model_shapes(config: dict | None) -> dict[str, tuple[int, ...]]:
    """name -> shape of every parameter/buffer of config.json's model class, built on the meta device
    (no memory, no weights). Empty when the class or its library is not available."""
    if not config:
        return {}
    cfg = {k: v for k, v in config.items() if k not in ("quantization_config", "_pre_quantization_dtype")}
    try:
        if "_class_name" in cfg:
            import diffusers

            cls = getattr(diffusers, cfg["_class_name"], None)
            if cls is None:
                return {}
            with torch.device("meta"):
                model = cls.from_config(cfg)
        elif cfg.get("architectures") and cfg.get("model_type"):
            import transformers

            cls = getattr(transformers, cfg["architectures"][0], None)
            if cls is None:
                return {}
            conf = transformers.AutoConfig.for_model(**cfg)
            with torch.device("meta"):
                model = cls._from_config(conf)
        else:
            return {}
    except Exception:  # a missing library or a config this version cannot build: not a source, then
        return {}
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def shapes_from(spec: str):
    """`--shapes-from REF`: the original shapes from a local checkpoint's headers, or a hub repository's:
    from the local Hugging Face cache first (also offline), else its safetensors headers read over the
    network (range requests; no weights are downloaded). Returns lookup(subdir, name)."""
    from ckpt.io.hub import cached_snapshot, looks_like_repo_id, remote_safetensors_shapes

    p = Path(spec).expanduser()
    if not p.exists():
        if not looks_like_repo_id(spec):
            raise CkptError(f"--shapes-from {spec}: no such file or directory, and not a hub id")
        p = cached_snapshot(spec)
    if p is not None:
        from ckpt.io.checkpoint import open_checkpoint

        with open_checkpoint(str(p)) as ref:
            by_sub = {c.subdir: {n: tuple(t.shape) for n, t in c.tensors.items()} for c in ref.components}
    else:
        by_sub = remote_safetensors_shapes(spec, "--shapes-from")
    everywhere: dict[str, tuple] = {}
    for shapes in by_sub.values():
        for n, s in shapes.items():
            everywhere.setdefault(n, s)

    def lookup(subdir: str, name: str):
        own = by_sub.get(subdir)
        if own is not None and name in own:
            return own[name]
        return everywhere.get(name)

    return lookup


FORMAT = Format("quanto", "optimum-quanto", 80, (decode,), weights=(QBytesWeight, QBitsWeight))
