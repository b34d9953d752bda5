"""Reading a GGUF file's header (metadata and tensor infos) through the `gguf` package, without its data.

`gguf.GGUFReader` (llama.cpp's own reader) parses the header from a memory map; only the header's pages
are touched. Tensor data is then read the way safetensors data is (`pread` into reused buffers, see
`ckpt.io.tensors.RawTensor`): reading a whole model through the map would grow RSS to the file's size.

Each stored GGUF tensor becomes a `GGUFStored` (a `RawTensor` with its GGML type): plain types
(F32, F16, BF16, F64, I8..I64) in their torch dtype, block-quantized types as the raw bytes, uint8 shaped
(*rows, bytes per row). Turning blocks into values, and GGUF names into model names, is the decoder's
work (`ckpt.quant.gguf`). Shapes are in torch order (GGUF stores dims innermost first).

Every way the reader rejects a file becomes one `CkptError` naming the file: not GGUF, a truncated
header, an unknown value or tensor type, tensor data past the end of the file, a big-endian file.

GGUFReader trusts every count and length in the header: an array count of 2^63 in the first key makes it
loop (and allocate) for ever, a huge string length or dimension count reads garbage, a product of dims
wraps around in uint64. So the header is walked once first (`prescan`), with `struct` over a memory map,
checking each count and length against the bytes left in the file, each value and tensor type against the
ones GGUF defines, n_dims against `MAX_DIMS` and each tensor's data against the file's end, before the
reader is let at it: what the reader then does is bounded by the file's size (and `MAX_ARRAY_VALUES`).
"""

from __future__ import annotations

import math
import mmap
import struct
from dataclasses import dataclass, field
from pathlib import Path


from ckpt.errors import file_error
from ckpt.io.ggml_types import gguf_package, plain_names, type_name
from ckpt.io.gguf_parts import KEY_COUNT, KEY_NO, KEY_TENSORS, PART_RE, SPLIT_KEYS, part_name
from ckpt.io.header import TensorInfo
from ckpt.io.tensors import FileHandles, RawTensor

GGUF_MAGIC = b"GGUF"
# ggml has 4 (GGML_MAX_DIMS); ComfyUI-GGUF's patched ggml writes 5-D patch embeddings (fix_5d_tensors.py).
# Above 8 a header is garbage, not a model (and torch reshapes have their own limit).
MAX_DIMS = 8
# Values in all metadata arrays: GGUFReader keeps one numpy view per value (~150 bytes each, 2 per string);
# real files hold a tokenizer of under 1.5M values (tokens, scores, types, merges of a 262k vocabulary).
MAX_ARRAY_VALUES = 1 << 23


class GGUFStored(RawTensor):
    """One stored GGUF tensor: `shape` is its stored shape in torch order (reversed GGUF dims);
    `dtype`/`self.shape` as read (uint8 bytes per row for block-quantized types)."""

    def __init__(self, info: TensorInfo, handles: FileHandles, home: str, ggml_type: int, stored_shape):
        super().__init__(info, handles, home)
        self.ggml_type = int(ggml_type)
        self.stored_shape = tuple(stored_shape)

    @property
    def quantized(self) -> bool:
        return self.ggml_type not in plain_names()

    @property
    def type_name(self) -> str:
        return type_name(self.ggml_type)

    @property
    def logical_numel(self) -> int:
        """Values stored (for block types `numel` counts bytes)."""
        return math.prod(self.stored_shape)


@dataclass
class GGUFHeader:
    path: Path
    version: int
    alignment: int
    data_start: int
    tensors: dict[str, GGUFStored]
    fields: dict = field(repr=False, default_factory=dict)  # key -> gguf ReaderField (parsed on demand)
    _values: dict = field(repr=False, default_factory=dict)
    # a split set (ckpt.io.gguf_split): every part, in order (`path` is the first); `fields` are the first
    # part's without the split.* keys, `tensors` those of all parts, each read from its own part
    parts: list[Path] = field(default_factory=list)

    def value(self, key: str, default=None):
        """A metadata value as Python data (str, int, float, bool, or a list of them), or `default`."""
        if key not in self._values:
            f = self.fields.get(key)
            if f is None:
                return default
            try:
                self._values[key] = f.contents()
            except (ValueError, IndexError, UnicodeDecodeError) as e:
                raise file_error(self.path, f"metadata {key!r} cannot be read ({e})") from None
        return self._values[key]

    def field_type(self, key: str) -> list:
        """The GGUF value types of a field ([ARRAY, INT32] for an array of int32)."""
        f = self.fields.get(key)
        return list(f.types) if f is not None else []

    @property
    def architecture(self) -> str | None:
        arch = self.value("general.architecture")
        return arch if isinstance(arch, str) else None

    def scalars(self) -> dict[str, str]:
        """Scalar and short metadata, as strings (for reports): long arrays (tokenizers) are summarized."""
        out = {}
        for key, f in self.fields.items():
            if key.startswith("GGUF."):
                continue
            types = list(f.types)
            if types and types[0] == gguf_package().GGUFValueType.ARRAY and len(f.data) > 16:
                out[key] = f"[{len(f.data)} values]"
            else:
                out[key] = str(self.value(key))
        return out


def read_gguf_header(path: Path, handles: FileHandles, relpath: str, whole_set: bool = True) -> GGUFHeader:
    """The header of the GGUF at `path`; a part of a split set (llama.cpp's gguf-split layout, `split.count` > 1)
    gives the whole set's header, its tensors read from every part (`ckpt.io.gguf_split`), unless `whole_set`
    is False (that part alone)."""
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise file_error(path, f"cannot read: {e.strerror or e}") from None
    if size == 0:
        raise file_error(path, "empty file, not a GGUF file")
    if magic != GGUF_MAGIC:
        raise file_error(path, "not a GGUF file (no GGUF magic)")
    gguf = gguf_package()
    prescan(path, size)
    try:
        reader = gguf.GGUFReader(path, "r")
    except OSError as e:
        raise file_error(path, f"cannot read: {e.strerror or e}") from None
    except (ValueError, IndexError, KeyError, OverflowError, TypeError, UnicodeDecodeError, MemoryError) as e:
        raise file_error(path, _reader_problem(e, size)) from None
    version = int(reader.fields["GGUF.version"].parts[0][0])
    tensors: dict[str, GGUFStored] = {}
    plain = plain_names()
    for t in reader.tensors:
        ggml_type = int(t.tensor_type)
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        start, nbytes = int(t.data_offset), int(t.n_bytes)  # within the file: prescan checked it
        dtype = plain.get(ggml_type, "U8")
        read_shape = shape if ggml_type in plain else tuple(int(d) for d in t.data.shape)
        info = TensorInfo(t.name, dtype, read_shape, path, start, start + nbytes)
        tensors[t.name] = GGUFStored(info, handles, relpath, ggml_type, shape)
    fields = {k: f for k, f in reader.fields.items()}
    header = GGUFHeader(path, version, int(reader.alignment), int(reader.data_offset), tensors, fields)
    if not whole_set:
        return header
    return open_split_set(header, handles)


# ------------------------------------------------------------------------------ a split set, read as one


def _count(header, key: str, what: str) -> int | None:
    v = header.value(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise file_error(header.path, f"metadata {key!r} is {v!r}, not {what}")
    return v


def split_count(header) -> int:
    """The header's `split.count` (1 when absent)."""
    n = _count(header, KEY_COUNT, "a count of parts")
    return 1 if n is None else n


def open_split_set(header, handles):
    """`header` as read from one file; a part of a split set (`split.count` > 1) becomes the whole set's."""
    count = split_count(header)
    if count <= 1:
        return header
    path = Path(header.path)
    no = _count(header, KEY_NO, "a part number")
    if no is None:
        raise file_error(path, f"split GGUF ({KEY_COUNT} {count}) without {KEY_NO}: not a part llama.cpp can load")
    if no >= count:
        raise file_error(path, f"split GGUF part {KEY_NO} {no}, but {KEY_COUNT} is {count} (parts are numbered "
                               f"0..{count - 1})")
    m = PART_RE.fullmatch(path.name)
    if m is None or int(m["count"]) != count:
        raise file_error(path, f"split GGUF part {no + 1} of {count}, but its name is not "
                               f"PREFIX-{no + 1:05d}-of-{count:05d}.gguf (llama.cpp finds the parts by their names); "
                               "rename it")
    if int(m["no"]) != no + 1:
        raise file_error(path, f"{KEY_NO} is {no}, but its name says part {m['no']} of {count} "
                               f"({KEY_NO} {int(m['no']) - 1})")
    names = [part_name(m["prefix"], i, count) for i in range(count)]
    paths = [path.with_name(n) for n in names]
    missing = [n for p, n in zip(paths, names) if p != path and not p.is_file()]
    if missing:
        raise file_error(path, f"part {missing[0]} of this split GGUF ({count} parts) is missing"
                               + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    first_name = names[0]
    headers = [header if p == path else read_gguf_header(p, handles, first_name, whole_set=False) for p in paths]
    first = headers[0]
    total = _count(first, KEY_TENSORS, "a count of tensors")
    arch = first.value("general.architecture")
    tensors, where = {}, {}
    for i, (h, p) in enumerate(zip(headers, paths)):
        other = split_count(h)
        if other != count:
            raise file_error(p, f"part of another split set: {KEY_COUNT} is {other}, {first_name} says {count}")
        if _count(h, KEY_NO, "a part number") != i:
            raise file_error(p, f"{KEY_NO} is {h.value(KEY_NO)!r}, but its name says part {i + 1:05d} of {count} "
                                f"({KEY_NO} {i})")
        n = _count(h, KEY_TENSORS, "a count of tensors")
        if n != total:
            raise file_error(p, f"part of another split set: {KEY_TENSORS} is {n}, {first_name} says {total}")
        a = h.value("general.architecture")
        if i and a is not None and a != arch:
            raise file_error(p, f"part of another model: general.architecture is {a!r}, {first_name} says {arch!r}")
        for name, t in h.tensors.items():
            if name in tensors:
                raise file_error(p, f"tensor {name!r} is also in {where[name]}: a split GGUF holds each tensor once")
            t.home = first_name  # the set is one weight file, named by its first part; `t.info.path` is its part
            tensors[name], where[name] = t, p.name
    if total is None:
        raise file_error(paths[0], f"split GGUF without {KEY_TENSORS}")
    if len(tensors) != total:
        raise file_error(paths[0], f"split GGUF of {count} parts holds {len(tensors)} tensors, but "
                                   f"{KEY_TENSORS} says {total} (a part is truncated or of another model)")
    fields = {k: f for k, f in first.fields.items() if k not in SPLIT_KEYS}
    return GGUFHeader(first.path, first.version, first.alignment, first.data_start, tensors, fields, parts=paths)


def split_note(header) -> str | None:
    """The note a reader of a split set gets."""
    if not header.parts:
        return None
    return (f"{header.parts[0].name} .. {header.parts[-1].name}: split GGUF of {len(header.parts)} parts, "
            "read as one model")


# GGUFValueType of each scalar (UINT8 .. FLOAT64, BOOL) -> its little-endian struct format: what the prescan
# steps over and `ckpt.io.gguf_writer` packs
SCALAR_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_SCALAR_SIZES = {t: struct.calcsize(f) for t, f in SCALAR_FORMATS.items()}
_STRING, _ARRAY, _UINT32 = 8, 9, 4


class _Scan:
    """A cursor over the header bytes that refuses, in one line, any read past the end of the file."""

    def __init__(self, buf, path: Path, size: int):
        self.buf, self.path, self.size, self.pos = buf, path, size, 0

    def fail(self, problem: str):
        return file_error(self.path, problem)

    def need(self, n: int, what: str) -> int:
        if n > self.size - self.pos:
            raise self.fail(f"truncated or corrupt: {what} at byte {self.pos} runs past the end of the file "
                            f"({self.size} bytes)")
        at, self.pos = self.pos, self.pos + n
        return at

    def u32(self, what: str) -> int:
        return struct.unpack_from("<I", self.buf, self.need(4, what))[0]

    def u64(self, what: str) -> int:
        return struct.unpack_from("<Q", self.buf, self.need(8, what))[0]

    def count(self, what: str, min_bytes: int) -> int:
        """A count of items of at least `min_bytes` each: no more than the rest of the file can hold."""
        at = self.pos
        n = self.u64(what)
        if n * min_bytes > self.size - self.pos:
            raise self.fail(f"truncated or corrupt: {what} at byte {at} is {n}, more than the "
                            f"{self.size - self.pos} bytes left in the file can hold")
        return n

    def skip_string(self, what: str) -> int:
        """Past one string; returns where its bytes start (its length is `self.pos` minus that)."""
        at = self.pos
        n = self.u64(f"{what} length")
        if n > self.size - self.pos:
            raise self.fail(f"truncated or corrupt: {what} at byte {at} is {n} bytes long, more than the "
                            f"{self.size - self.pos} bytes left in the file")
        return self.need(n, what)

    def string(self, what: str) -> bytes:
        start = self.skip_string(what)
        return bytes(self.buf[start:self.pos])

    def new_name(self, what: str, seen: set[str]) -> str:
        """`name`, refused when the header already had it (a duplicate key or tensor name); adds it to `seen`."""
        name = self.name(what)
        if name in seen:
            raise self.fail(f"invalid GGUF header (duplicate {what} {name!r})")
        seen.add(name)
        return name

    def name(self, what: str) -> str:
        at = self.pos
        raw = self.string(what)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise self.fail(f"invalid GGUF header: {what} at byte {at} is not UTF-8 ({raw[:40]!r})") from None


def prescan(path: Path, size: int) -> None:
    """Walk the header as gguf.md lays it out, refusing in one line anything GGUFReader would take on trust
    (module docstring): every count and length within the bytes left, value and tensor types GGUF knows,
    no duplicate names, at most `MAX_DIMS` dims, rows of whole blocks, an alignment that is a power of two,
    every tensor's data inside the file. Strings are not kept; only the header's pages are touched."""
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            _prescan(_Scan(buf, path, size))
    except OSError as e:
        raise file_error(path, f"cannot read: {e.strerror or e}") from None


def _prescan(s: _Scan) -> None:
    s.need(4, "magic")
    version = s.u32("version")
    if version & 0xFFFF == 0:
        raise s.fail("big-endian GGUF files are not supported")
    if version not in (2, 3):
        raise s.fail(f"unsupported GGUF version {version} (gguf reads versions 2 and 3)")
    n_tensors = s.count("tensor count", 8 + 4 + 4 + 8)  # name length, n_dims, type, offset
    n_kv = s.count("key-value count", 8 + 4 + 1)  # key length, value type, the smallest value
    keys: set[str] = set()
    alignment, array_values = 32, 0
    for _ in range(n_kv):
        key = s.new_name("metadata key", keys)
        vtype = s.u32(f"value type of {key!r}")
        if vtype == _ARRAY:
            sub = s.u32(f"array type of {key!r}")
            if sub == _ARRAY:
                raise s.fail(f"metadata {key!r} is an array of arrays, which llama.cpp does not read either")
            if sub != _STRING and sub not in _SCALAR_SIZES:
                raise s.fail(f"unknown metadata value type {sub} (array of {key!r})")
            n = s.count(f"array count of {key!r}", _SCALAR_SIZES.get(sub, 8))
            array_values += n
            if array_values > MAX_ARRAY_VALUES:
                raise s.fail(f"metadata arrays hold more than {MAX_ARRAY_VALUES} values in all ({key!r} has {n}); "
                             "ckpt reads at most that many (gguf's reader keeps an object per value)")
            if sub == _STRING:
                for _ in range(n):  # a tokenizer's 150k strings: no copies
                    s.skip_string(f"a string of {key!r}")
            else:
                s.need(n * _SCALAR_SIZES[sub], f"values of {key!r}")
        elif vtype == _STRING:
            s.skip_string(f"value of {key!r}")
        elif vtype in _SCALAR_SIZES:
            at = s.need(_SCALAR_SIZES[vtype], f"value of {key!r}")
            if key == "general.alignment":
                if vtype != _UINT32:
                    raise s.fail("invalid GGUF header: 'general.alignment' is not a UINT32")
                alignment = struct.unpack_from("<I", s.buf, at)[0]
                if alignment == 0 or alignment & (alignment - 1):
                    raise s.fail(f"invalid GGUF header: 'general.alignment' is {alignment}, not a power of two")
        else:
            raise s.fail(f"unknown metadata value type {vtype} (key {key!r})")
    sizes = gguf_package().GGML_QUANT_SIZES
    names: set[str] = set()
    spans = []
    for _ in range(n_tensors):
        name = s.new_name("tensor name", names)
        n_dims = s.u32(f"n_dims of tensor {name!r}")
        if n_dims > MAX_DIMS:
            raise s.fail(f"tensor {name!r} has {n_dims} dims; ckpt reads GGUF tensors of at most {MAX_DIMS} "
                         "(ggml has 4, ComfyUI-GGUF 5)")
        dims = [s.u64(f"dims of tensor {name!r}") for _ in range(n_dims)]
        ggml_type = s.u32(f"type of tensor {name!r}")
        offset = s.u64(f"data offset of tensor {name!r}")
        if ggml_type not in sizes:
            raise s.fail(f"unknown tensor type (tensor {name!r} has type {ggml_type}); this gguf package "
                         f"({_version()}) does not know it")
        if any(d >= 1 << 63 for d in dims):
            raise s.fail(f"tensor {name!r} has a dimension of {max(dims)}, past ggml's int64 limit")
        blk, nbytes = sizes[ggml_type]
        row = dims[0] if dims else 1
        if row % blk:
            raise s.fail(f"tensor {name!r} has rows of {row} values, not a whole number of "
                         f"{type_name(ggml_type)} blocks of {blk}")
        spans.append((name, offset, math.prod(dims) // blk * nbytes))
    data_start = -(-s.pos // alignment) * alignment
    for name, offset, nbytes in spans:
        end = data_start + offset + nbytes
        if end > s.size:
            raise s.fail(f"truncated or corrupt: tensor {name!r} data runs past the end of the file (ends at byte "
                         f"{end}, the file has {s.size} bytes)")


def _reader_problem(e: Exception, size: int) -> str:
    """The reader's exception, said as what is wrong with the file."""
    msg = str(e)
    if "GGMLQuantizationType" in msg:
        return f"unknown tensor type ({msg}); this gguf package ({_version()}) does not know it"
    if "GGUFValueType" in msg:
        return f"unknown metadata value type ({msg})"
    if "cannot reshape" in msg or isinstance(e, IndexError):
        return f"truncated or corrupt: the header or a tensor's data runs past the end of the file ({size} bytes)"
    if "version" in msg:
        return f"unsupported GGUF version ({msg})"
    if isinstance(e, KeyError) or "Duplicate" in msg or "duplicated" in msg:
        return f"invalid GGUF header (duplicate name: {msg})"
    return f"invalid GGUF file ({msg})"


def _version() -> str:
    from importlib import metadata

    try:
        return "gguf " + metadata.version("gguf")
    except metadata.PackageNotFoundError:
        return "gguf"
