"""Header-first GGUF writer: the whole header planned from (name, GGML type, shape) and typed metadata,
then each tensor's blocks streamed in bands with pwrite, like the safetensors and torch-zip writers.

GGUF (llama.cpp's ggml/docs/gguf.md, version 3, little-endian): magic "GGUF", u32 version, u64 tensor
count, u64 key-value count, the key-values (u64-length string key, u32 value type, value; arrays are u32
element type, u64 count, elements), the tensor infos (name, u32 n_dims, u64 dims innermost first, u32
GGML type, u64 offset relative to the data section), padding to `general.alignment` (32 by default),
then each tensor's data at its offset, every offset a multiple of the alignment. The bytes are those
`gguf.GGUFWriter` writes for the same key-values and tensors in the same order (tests compare them),
without holding every tensor in memory as it must.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from ckpt.dtypes import as_torch
from ckpt.io.gguf import SCALAR_FORMATS
from ckpt.io.writer import Entry, RegionWriter

ALIGNMENT = 32  # GGUF_DEFAULT_ALIGNMENT
VERSION = 3


def _gguf():
    import gguf

    return gguf


@dataclass(frozen=True)
class Field:
    """One metadata key-value: `vtype` a gguf.GGUFValueType; arrays give `sub_type` and a list value."""

    key: str
    value: object
    vtype: int
    sub_type: int | None = None


def string(key: str, value: str) -> Field:
    return Field(key, value, _gguf().GGUFValueType.STRING)


def uint32(key: str, value: int) -> Field:
    return Field(key, int(value), _gguf().GGUFValueType.UINT32)


def int32_array(key: str, values) -> Field:
    V = _gguf().GGUFValueType
    return Field(key, [int(v) for v in values], V.ARRAY, V.INT32)


def from_gguf_writer(writer) -> list[Field]:
    """The key-values an in-memory `gguf.GGUFWriter` (path None) was given, in the order it was given them, as
    Fields: an exporter makes the same `add_*` calls llama.cpp's converter makes (exact key names and value
    types), then writes them with this header-first writer. Array element types as gguf's writer infers them."""
    V = _gguf().GGUFValueType
    out = []
    for key, v in writer.kv_data[0].items():
        value, sub = v.value, v.sub_type
        if v.type == V.ARRAY:
            value = list(value)
            if sub is None:
                sub = V.get_type(value[0])
        out.append(Field(key, value, V(v.type), sub))
    return out


def _pack_value(value, vtype, sub_type=None) -> bytes:
    V = _gguf().GGUFValueType
    vtype = V(vtype)
    if vtype == V.STRING:
        raw = value.encode("utf-8") if isinstance(value, str) else bytes(value)
        return struct.pack("<Q", len(raw)) + raw
    if vtype == V.ARRAY:  # an empty one is valid GGUF (gguf's reader reads it; its writer will not write one)
        if sub_type is None:
            raise ValueError("a GGUF array needs an element type")
        return struct.pack("<IQ", int(sub_type), len(value)) + b"".join(_pack_value(v, sub_type) for v in value)
    return struct.pack(SCALAR_FORMATS[vtype], value)


def ggml_type(e: Entry) -> int:
    """The GGML type of an entry: its block type, or the plain type of its dtype."""
    if e.gguf_type is not None:
        return e.gguf_type
    from ckpt.io.ggml_types import plain_types

    for t, dtype in plain_types().items():
        if dtype == as_torch(e.dtype):
            return int(t)
    raise ValueError(f"{e.name}: GGUF has no type for {e.dtype}")


def _pad(n: int, align: int) -> int:
    return -(-n // align) * align


def fields_from(header) -> list[Field]:
    """Every metadata key-value of a GGUF read by `ckpt.io.gguf` (a `GGUFHeader`), with its exact value
    types, in file order: what writing the same header again needs (strings kept as their bytes)."""
    V = _gguf().GGUFValueType
    out = []
    for key, f in header.fields.items():
        if key.startswith("GGUF."):  # the reader's pseudo-fields: version and counts
            continue
        types = [V(t) for t in f.types]
        if types[0] == V.STRING:
            out.append(Field(key, bytes(f.parts[-1]), V.STRING))
        elif types[0] == V.ARRAY:  # arrays of arrays were refused when read (ckpt.io.gguf.prescan)
            # parts: key length, key, ARRAY, element type, count, values: an empty array's type is not in `types`
            sub = V(int(f.parts[3][0]))
            values = ([bytes(f.parts[i]) for i in f.data] if sub == V.STRING
                      else [f.parts[i].tolist()[0] for i in f.data])
            out.append(Field(key, values, V.ARRAY, sub))
        else:
            out.append(Field(key, f.parts[-1].tolist()[0], types[0]))
    return out


def _alignment(fields: list[Field]) -> int:
    return next((int(f.value) for f in fields if f.key == "general.alignment"), ALIGNMENT)


def layout(entries: list[Entry], fields: list[Field], alignment: int | None = None):
    """(header bytes, name -> (absolute start, end), file size). Tensors keep the given order; data is
    aligned to `general.alignment` when the fields set it, else 32."""
    alignment = alignment or _alignment(fields)
    head = bytearray(b"GGUF" + struct.pack("<IQQ", VERSION, len(entries), len(fields)))
    for f in fields:
        head += _pack_value(f.key, _gguf().GGUFValueType.STRING) + struct.pack("<I", int(f.vtype))
        head += _pack_value(f.value, f.vtype, f.sub_type)
    rel, pos = {}, 0
    for e in entries:
        head += _pack_value(e.name, _gguf().GGUFValueType.STRING)
        head += struct.pack("<I", len(e.shape)) + b"".join(struct.pack("<Q", d) for d in reversed(e.shape))
        head += struct.pack("<IQ", ggml_type(e), pos)
        rel[e.name] = (pos, pos + e.nbytes)
        pos = _pad(pos + e.nbytes, alignment)
    start = _pad(len(head), alignment)
    head += bytes(start - len(head))
    regions = {k: (start + a, start + b) for k, (a, b) in rel.items()}
    return bytes(head), regions, start + pos


def file_size(entries: list[Entry], fields: list[Field]) -> int:
    return layout(entries, fields)[2]


class GGUFFileWriter(RegionWriter):
    def __init__(self, path, entries: list[Entry], fields: list[Field], direct: bool = False):
        head, regions, size = layout(entries, fields)
        self._open(path, entries, regions, direct=direct)
        self._start([(0, head)], size)  # sparse: alignment padding reads as zeros, as GGUFWriter writes it
