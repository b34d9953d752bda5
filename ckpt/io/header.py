"""Reading and validating a safetensors header without touching tensor data.

The rules are the safetensors reader's own (u64 length, JSON object, offsets tiling the data region
exactly, no trailing bytes), checked here so that each violation becomes one clear `CkptError` naming
the file, before any output exists.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path

from ckpt.dtypes import ST_ITEMSIZE, ST_TO_TORCH, ST_UNSUPPORTED
from ckpt.errors import file_error
from ckpt.report import plural

MAX_HEADER = 100_000_000  # safetensors' own cap
MAX_DEPTH = 127  # serde_json's recursion limit: the deepest nesting of objects/arrays it reads
U64 = (1 << 64) - 1  # safetensors sizes and offsets are usize
I64 = (1 << 63) - 1  # torch sizes and strides are int64


@dataclass(frozen=True)
class TensorInfo:
    """Where one stored tensor's bytes are: `path` from absolute byte `start` to `end`. `st_dtype` is the
    safetensors dtype name (plain data: reading headers needs no torch); `dtype` the torch dtype."""

    name: str
    st_dtype: str
    shape: tuple[int, ...]
    path: Path
    start: int
    end: int

    @property
    def dtype(self) -> torch.dtype:
        return ST_TO_TORCH[self.st_dtype]

    @property
    def nbytes(self) -> int:
        return self.end - self.start


@dataclass
class Header:
    path: Path
    tensors: dict[str, TensorInfo]  # in file order (ascending offset)
    metadata: dict[str, str]
    data_start: int


def read_header(path: Path) -> Header:
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) == 0:
                raise file_error(path, "empty file, not a safetensors file")
            if len(head) < 8:
                raise file_error(path, "truncated: shorter than the 8-byte header length")
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER:
                raise file_error(path, f"header length {n} exceeds the 100 MB limit (not a safetensors file?)")
            if 8 + n > size:
                raise file_error(path, f"header length {n} runs past the end of the file ({size} bytes)")
            raw = f.read(n)
    except OSError as e:
        raise file_error(path, f"cannot read: {e.strerror or e}") from None
    return parse_header(path, raw, size)


class _BadJSON(Exception):
    """A header that Python's json module reads but safetensors' reader (serde_json) refuses."""


def _unique_keys(pairs):
    """json object hook: a repeated key is an error (json.loads would silently keep the last one;
    serde keeps the last one too, except for the fields of a tensor entry: ckpt refuses every repeat)."""
    obj = {}
    for k, v in pairs:
        if k in obj:
            raise _BadJSON(f"header names {k!r} twice")
        obj[k] = v
    return obj


def _json_int(text: str):
    """Integers as serde_json reads them: u64 / i64 stay integers; `-0` and anything larger become
    floats (so a shape or offset written that way is refused, as safetensors refuses it); a float
    that overflows is an error."""
    v = int(text)
    if v == 0 and text.startswith("-"):
        return -0.0
    if -(1 << 63) <= v <= U64:
        return v
    return _json_float(text)


def _json_float(text: str) -> float:
    f = float(text)
    if math.isinf(f):
        raise _BadJSON(f"number out of range ({text[:20]}{'...' if len(text) > 20 else ''})")
    return f


def _json_constant(text: str):
    raise _BadJSON(f"{text} is not valid JSON")


def _check_value(value, depth: int) -> None:
    """Refuse what serde_json refuses anywhere in the document, for values ckpt does not otherwise
    look into (unknown fields of a tensor entry): nesting deeper than its recursion limit, and lone
    surrogates (`"\\ud800"`), which Python accepts and no UTF-8 writer can write back."""
    stack = [(value, depth)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, (dict, list)):
            if d + 1 > MAX_DEPTH:
                raise _BadJSON(f"nested deeper than {MAX_DEPTH} levels")
            items = v.items() if isinstance(v, dict) else ((None, x) for x in v)
            for k, x in items:
                if k is not None:
                    _check_text(k)
                stack.append((x, d + 1))
        elif isinstance(v, str):
            _check_text(v)


def _check_text(s: str) -> None:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        raise _BadJSON(f"string {s[:40]!r} holds a lone UTF-16 surrogate (not valid UTF-8)") from None


def parse_header(path: Path, raw: bytes, file_size: int) -> Header:
    """Validate exactly as safetensors' reader does (its Rust `read_metadata` and serde_json), so that
    ckpt opens a file iff `safetensors.safe_open` does. Deliberately stricter, each with a message:
    a key repeated in any JSON object, the packed F4/F6 dtypes (not decoded), and shapes torch cannot
    hold (a dimension or a contiguous stride beyond int64). Everything is checked before any loop
    over tensor data or bands; tests/test_io_header.py compares the two readers on mutated files."""
    try:
        obj = json.loads(raw.decode("utf-8"), object_pairs_hook=_unique_keys, parse_int=_json_int,
                         parse_float=_json_float, parse_constant=_json_constant)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise file_error(path, f"header is not valid JSON ({e})") from None
    except RecursionError:
        raise file_error(path, f"header is not valid JSON (nested deeper than {MAX_DEPTH} levels)") from None
    except _BadJSON as e:
        raise file_error(path, f"header is not valid JSON ({e})" if "twice" not in str(e) else str(e)) from None
    except ValueError as e:  # an integer too long for int(): serde reads it as an out-of-range float
        raise file_error(path, f"header is not valid JSON ({e})") from None
    if not isinstance(obj, dict):
        raise file_error(path, "header is not a JSON object")
    data_start = 8 + len(raw)
    metadata = obj.pop("__metadata__", None)
    if metadata is None:
        metadata = {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise file_error(path, "__metadata__ must map strings to strings")
    infos = []
    try:
        for k, v in metadata.items():
            _check_text(k)
            _check_text(v)
        for name, entry in obj.items():
            _check_text(name)
            infos.append(_entry(path, name, entry, data_start))
    except _BadJSON as e:
        raise file_error(path, f"header is not valid JSON ({e})") from None
    infos.sort(key=lambda t: (t.start, t.end))
    pos = data_start
    for t in infos:
        if t.start != pos:
            what = "overlaps the previous tensor" if t.start < pos else "leaves a gap after the previous tensor"
            raise file_error(path, f"tensor {t.name!r}: data region {what} (invalid offsets)")
        pos = t.end
    if pos > file_size:
        raise file_error(
            path, f"truncated: tensor data ends at byte {pos} but the file has {file_size} bytes"
        )
    if pos < file_size:
        raise file_error(path, f"{plural(file_size - pos, 'trailing byte')} after the last tensor (invalid offsets)")
    return Header(path, {t.name: t for t in infos}, dict(metadata), data_start)


FIELDS = ("dtype", "shape", "data_offsets")


def _entry(path: Path, name: str, entry, data_start: int) -> TensorInfo:
    if isinstance(entry, list) and len(entry) == len(FIELDS):
        entry = dict(zip(FIELDS, entry))  # serde also reads a struct from a sequence of its fields in order
    if not isinstance(entry, dict) or not set(FIELDS) <= entry.keys():
        raise file_error(path, f"tensor {name!r}: entry needs dtype, shape and data_offsets")
    for k, v in entry.items():
        if k not in FIELDS:
            _check_text(k)
            _check_value(v, 2)  # top object, entry: unknown fields are read (and depth-checked) all the same
    st = entry["dtype"]
    if not isinstance(st, str):
        raise file_error(path, f"tensor {name!r}: dtype {st!r} is not a dtype name")
    if st in ST_UNSUPPORTED:
        raise file_error(path, f"tensor {name!r}: dtype {st} ({ST_UNSUPPORTED[st]}) is not supported")
    if st not in ST_ITEMSIZE:
        hint = " (the safetensors name is F8_E4M3)" if st == "F8_E4M3FN" else ""
        raise file_error(path, f"tensor {name!r}: unknown dtype {st!r}{hint}")
    shape, offs = entry["shape"], entry["data_offsets"]
    if not (isinstance(shape, list) and all(type(d) is int and 0 <= d <= U64 for d in shape)):
        raise file_error(path, f"tensor {name!r}: invalid shape {_short(shape)}")
    if not (isinstance(offs, list) and len(offs) == 2 and all(type(o) is int and 0 <= o <= U64 for o in offs)):
        raise file_error(path, f"tensor {name!r}: invalid data_offsets {_short(offs)}")
    itemsize = ST_ITEMSIZE[st]
    n = 1
    for d in shape:  # safetensors: the element count folded left to right in u64, then times the bit size
        n *= d
        if n > U64:
            raise file_error(path, f"tensor {name!r}: shape {_short(shape)} overflows (more than 2**64 elements)")
    if n * itemsize * 8 > U64:
        raise file_error(path, f"tensor {name!r}: shape {_short(shape)} overflows (more than 2**64 bits)")
    stride = 1
    for d in shape:  # torch's sizes and contiguous strides are int64 (an empty tensor's too)
        stride *= max(d, 1)
        if d > I64 or stride > I64:
            raise file_error(path, f"tensor {name!r}: shape {_short(shape)} is valid for safetensors but too large "
                             "for torch (a dimension or stride beyond int64)")
    want = n * itemsize
    if offs[1] - offs[0] != want:
        raise file_error(
            path, f"tensor {name!r}: data_offsets {offs} hold {offs[1] - offs[0]} bytes, "
            f"{st}{_short(shape)} needs {want} (invalid offsets)"
        )
    return TensorInfo(name, st, tuple(shape), path, data_start + offs[0], data_start + offs[1])


def _short(v) -> str:
    """repr of a shape or offsets for a message: long lists abbreviated (a shape may have 100,000 dims)."""
    if isinstance(v, list) and len(v) > 8:
        return "[" + ", ".join(repr(x) for x in v[:6]) + f", ... ({len(v)} entries)]"
    text = repr(v)
    return text if len(text) <= 200 else text[:200] + "..."


def read_into(fd: int, buf: memoryview, offset: int, path) -> None:
    """Fill `buf` from `fd` at `offset`; a short read means the file changed under us."""
    got = 0
    while got < len(buf):
        try:
            n = os.preadv(fd, [buf[got:]], offset + got)
        except OSError as e:  # an input error, not the "write failed" of the output side
            raise file_error(path, f"cannot read tensor data: {e.strerror or e}") from None
        if n == 0:
            raise file_error(path, "unexpected end of file while reading tensor data")
        got += n
