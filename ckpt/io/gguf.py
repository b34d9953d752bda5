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
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from ckpt.lazy import torch

from ckpt.dtypes import ST_TO_TORCH
from ckpt.errors import file_error
from ckpt.io.header import TensorInfo
from ckpt.io.tensors import FileHandles, RawTensor

GGUF_MAGIC = b"GGUF"


def _gguf():
    import gguf  # imported on first use: the package is only needed when a GGUF is read or written

    return gguf


def plain_names() -> dict[int, str]:
    """GGML types that are plain arrays of one dtype, by its safetensors name (reading headers needs no torch)."""
    T = _gguf().GGMLQuantizationType
    return {T.F32: "F32", T.F16: "F16", T.BF16: "BF16", T.F64: "F64", T.I8: "I8", T.I16: "I16", T.I32: "I32",
            T.I64: "I64"}


def plain_types() -> dict[int, torch.dtype]:
    """GGML types that are plain arrays of one torch dtype."""
    return {k: ST_TO_TORCH[v] for k, v in plain_names().items()}


def type_name(ggml_type: int) -> str:
    T = _gguf().GGMLQuantizationType
    try:
        return T(ggml_type).name
    except ValueError:
        return f"type {ggml_type}"


def block_size(ggml_type: int) -> tuple[int, int]:
    """(elements per block, bytes per block); plain types are blocks of one element."""
    return _gguf().GGML_QUANT_SIZES[ggml_type]


def encoded_nbytes(ggml_type: int, shape) -> int:
    blk, size = block_size(ggml_type)
    return math.prod(shape) // blk * size


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
            if types and types[0] == _gguf().GGUFValueType.ARRAY and len(f.data) > 16:
                out[key] = f"[{len(f.data)} values]"
            else:
                out[key] = str(self.value(key))
        return out


def read_gguf_header(path: Path, handles: FileHandles, relpath: str) -> GGUFHeader:
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
    gguf = _gguf()
    try:
        reader = gguf.GGUFReader(path, "r")
    except OSError as e:
        raise file_error(path, f"cannot read: {e.strerror or e}") from None
    except (ValueError, IndexError, KeyError, OverflowError, TypeError, UnicodeDecodeError, MemoryError) as e:
        raise file_error(path, _reader_problem(e, size)) from None
    if reader.byte_order != "I":
        raise file_error(path, "big-endian GGUF files are not supported")
    version = int(reader.fields["GGUF.version"].parts[0][0])
    tensors: dict[str, GGUFStored] = {}
    plain = plain_names()
    for t in reader.tensors:
        ggml_type = int(t.tensor_type)
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        start, nbytes = int(t.data_offset), int(t.n_bytes)
        if start + nbytes > size:  # the reader's view is short then; say it plainly
            raise file_error(path, f"truncated: tensor {t.name!r} data ends at byte {start + nbytes} but the file "
                                   f"has {size} bytes")
        dtype = plain.get(ggml_type, "U8")
        read_shape = shape if ggml_type in plain else tuple(int(d) for d in t.data.shape)
        info = TensorInfo(t.name, dtype, read_shape, path, start, start + nbytes)
        tensors[t.name] = GGUFStored(info, handles, relpath, ggml_type, shape)
    fields = {k: f for k, f in reader.fields.items()}
    header = GGUFHeader(path, version, int(reader.alignment), int(reader.data_offset), tensors, fields)
    if header.value("split.count", 1) not in (0, 1):
        raise file_error(path, f"split GGUF ({header.value('split.count')} parts); merge the parts first "
                               "(llama.cpp: llama-gguf-split --merge FIRST-PART OUT.gguf)")
    return header


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
