"""Reading and validating a safetensors header without touching tensor data.

The rules are the safetensors reader's own (u64 length, JSON object, offsets tiling the data region
exactly, no trailing bytes), checked here so that each violation becomes one clear `CkptError` naming
the file, before any output exists.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from ckpt.dtypes import ST_TO_TORCH, ST_UNSUPPORTED, nbytes
from ckpt.errors import file_error

MAX_HEADER = 100_000_000  # safetensors' own cap


@dataclass(frozen=True)
class TensorInfo:
    """Where one stored tensor's bytes are: `path` from absolute byte `start` to `end`."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    path: Path
    start: int
    end: int

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


class _DuplicateKey(Exception):
    pass


def _unique_keys(pairs):
    """json object hook: a repeated key is an error (json.loads would silently keep the last one)."""
    obj = {}
    for k, v in pairs:
        if k in obj:
            raise _DuplicateKey(k)
        obj[k] = v
    return obj


def parse_header(path: Path, raw: bytes, file_size: int) -> Header:
    try:
        obj = json.loads(raw.decode("utf-8"), object_pairs_hook=_unique_keys)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise file_error(path, f"header is not valid JSON ({e})") from None
    except _DuplicateKey as e:
        raise file_error(path, f"header names {e.args[0]!r} twice") from None
    if not isinstance(obj, dict):
        raise file_error(path, "header is not a JSON object")
    data_start = 8 + len(raw)
    metadata = obj.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
    ):
        raise file_error(path, "__metadata__ must map strings to strings")
    infos = []
    for name, entry in obj.items():
        infos.append(_entry(path, name, entry, data_start))
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
        raise file_error(path, f"{file_size - pos} trailing bytes after the last tensor (invalid offsets)")
    return Header(path, {t.name: t for t in infos}, dict(metadata), data_start)


def _entry(path: Path, name: str, entry, data_start: int) -> TensorInfo:
    if not isinstance(entry, dict) or not {"dtype", "shape", "data_offsets"} <= entry.keys():
        raise file_error(path, f"tensor {name!r}: entry needs dtype, shape and data_offsets")
    st = entry["dtype"]
    if st in ST_UNSUPPORTED:
        raise file_error(path, f"tensor {name!r}: dtype {st} ({ST_UNSUPPORTED[st]}) is not supported")
    if st not in ST_TO_TORCH:
        hint = " (the safetensors name is F8_E4M3)" if st == "F8_E4M3FN" else ""
        raise file_error(path, f"tensor {name!r}: unknown dtype {st!r}{hint}")
    shape, offs = entry["shape"], entry["data_offsets"]
    if not (isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)):
        raise file_error(path, f"tensor {name!r}: invalid shape {shape!r}")
    if not (isinstance(offs, list) and len(offs) == 2 and all(type(o) is int for o in offs)):
        raise file_error(path, f"tensor {name!r}: invalid data_offsets {offs!r}")
    dtype = ST_TO_TORCH[st]
    want = nbytes(dtype, shape)
    if offs[0] < 0 or offs[1] - offs[0] != want:
        raise file_error(
            path, f"tensor {name!r}: data_offsets {offs} hold {offs[1] - offs[0]} bytes, "
            f"{st}{shape} needs {want} (invalid offsets)"
        )
    return TensorInfo(name, dtype, tuple(shape), path, data_start + offs[0], data_start + offs[1])


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
