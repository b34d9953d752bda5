"""Header-first writer for PyTorch's zip checkpoint format (what `torch.save(state_dict, path)` writes).

`torch.save` needs every tensor in memory at once; this writer plans every byte offset from (name, dtype,
shape) alone, writes all that does not depend on data up front, and then takes each tensor in bands, so
memory is one band. The output is byte-identical to `torch.save` of the same plain dict of contiguous CPU
tensors (tests/test_io_torchzip.py), except the first 20 digits of `.data/serialization_id` (torch's are a
hash of its record names in `std::unordered_set` order; ours are a hash of the names in write order).

Measured with torch 2.13 (and read in caffe2/serialize/inline_container.cc and miniz 3.0.2's writer):
- records, in order: data.pkl, .format_version "1", .storage_alignment "64", byteorder, data/0..N-1 (one
  storage per tensor), version "3\\n", .data/serialization_id; all stored, no timestamps or attributes;
- local header: flags 0x0808 (0x0800, and no data descriptor, for an empty record), CRC and sizes zero;
  extras: a zip64 field (uncompressed size and a zero compressed size if the size is >= 0xFFFFFFFF, the
  header offset if that is) then "FB", a length, and 'Z's so the data starts on a 64-byte boundary;
- data descriptor PK\\x07\\x08 with CRC and sizes, 8-byte sizes when the record has a zip64 field;
- central directory: 0xFFFFFFFF in 32-bit fields that overflow, with a zip64 field holding them; then
  always a zip64 end record (made by 0x031E, needed 0x2D), its locator, and the end record;
- serialization_id: 20 digits, then 20 digits of c10::hash_combine over the descriptors' CRCs in order;
- data.pkl: protocol 2; a dtype with a legacy `*Storage` class pickles as `_rebuild_tensor_v2` with
  ('storage', torch.<X>Storage, key, 'cpu', numel); others (fp8, uint16/32/64) as `_rebuild_tensor_v3`
  with ('storage', torch.UntypedStorage, key, 'cpu', nbytes) and the dtype as a last argument.
"""

from __future__ import annotations

import hashlib
import io
import os
import pickle
import struct
import sys
import zlib
from collections import OrderedDict
from dataclasses import dataclass

from ckpt.lazy import torch

from ckpt.dtypes import as_torch
from ckpt.io.fds import close_fd, pwrite_all
from ckpt.io.writer import Entry, RegionWriter

ALIGN = 64
ZIP64_LIMIT = 0xFFFFFFFF  # miniz: a size or offset >= this gets zip64 fields (tests lower it to exercise them)
_ID = ".data/serialization_id"
_M64 = (1 << 64) - 1


class _Storage:
    """Stands in for a storage: torch pickles storages by persistent id only."""

    def __init__(self, pid: tuple):
        self.pid = pid


class _Tensor:
    """Reduces exactly as `torch.Tensor.__reduce_ex__` does for a contiguous CPU tensor at offset 0.
    Fresh tuples per tensor, as torch makes, so the pickle memo is reused exactly where torch's is."""

    def __init__(self, key: str, e: Entry):
        self.key, self.e = key, e

    def __reduce_ex__(self, proto):
        e, size, stride, n = self.e, tuple([int(d) for d in self.e.shape]), [], 1
        for d in reversed(size):  # torch's contiguous strides: a 0 dim counts as 1
            stride.insert(0, n)
            n *= max(d, 1)
        dtype = as_torch(e.dtype)
        legacy = torch.storage._dtype_to_storage_type_map().get(dtype)
        if legacy is not None:
            numel = e.nbytes // dtype.itemsize
            st = _Storage(("storage", getattr(torch, legacy), self.key, "cpu", numel))
            return torch._utils._rebuild_tensor_v2, (st, 0, size, tuple(stride), False, OrderedDict())
        st = _Storage(("storage", torch.UntypedStorage, self.key, "cpu", e.nbytes))
        return torch._utils._rebuild_tensor_v3, (st, 0, size, tuple(stride), False, OrderedDict(), dtype)


class _Pickler(pickle.Pickler):
    def persistent_id(self, obj):
        return obj.pid if type(obj) is _Storage else None


def _pickle(entries: list[Entry]) -> bytes:
    buf = io.BytesIO()
    _Pickler(buf, protocol=2).dump({e.name: _Tensor(str(i), e) for i, e in enumerate(entries)})
    return buf.getvalue()


def _u32(v: int) -> int:
    return 0xFFFFFFFF if v >= ZIP64_LIMIT else v


def _zip64(size: int, comp: int, offset: int) -> bytes:
    """The zip64 extra field (id 1): only the values that overflow, in the spec's order."""
    vals = ([size, comp] if size >= ZIP64_LIMIT else []) + ([offset] if offset >= ZIP64_LIMIT else [])
    return struct.pack(f"<HH{len(vals)}Q", 1, 8 * len(vals), *vals) if vals else b""


@dataclass(frozen=True)
class ZipRecord:
    name: bytes  # full name in the zip ("archive/data/0")
    offset: int  # of the local header
    head: bytes  # local header, name and extras
    size: int
    data: bytes | None  # known up front, or None (tensor data, serialization id)

    @property
    def start(self) -> int:
        return self.offset + len(self.head)

    @property
    def z64(self) -> bool:
        return self.size >= ZIP64_LIMIT or self.offset >= ZIP64_LIMIT

    def descriptor(self, crc: int) -> bytes:
        if not self.size:
            return b""
        return struct.pack("<IIQQ" if self.z64 else "<IIII", 0x08074B50, crc, self.size, self.size)

    def central(self, crc: int) -> bytes:
        extra = _zip64(self.size, self.size, self.offset)
        return struct.pack("<IHHHHHHIIIHHHHHII", 0x02014B50, 0, 0, 0x0808 if self.size else 0x0800, 0, 0, 0,
                           crc, _u32(self.size), _u32(self.size), len(self.name), len(extra), 0, 0, 0, 0,
                           _u32(self.offset)) + self.name + extra


@dataclass(frozen=True)
class ZipLayout:
    records: list[ZipRecord]
    regions: dict[str, tuple[int, int]]  # tensor name -> (absolute start, end) of its bytes
    central: int  # offset of the central directory
    size: int  # of the whole file


def _record(name: str, offset: int, size: int, data: bytes | None) -> ZipRecord:
    name_b = name.encode()
    z = _zip64(size, 0, offset)  # miniz writes the local header before the data: compressed size 0
    pad = -(offset + 30 + len(name_b) + len(z) + 4) % ALIGN
    extra = z + b"FB" + struct.pack("<H", pad) + b"Z" * pad
    head = struct.pack("<IHHHHHIIIHH", 0x04034B50, 0, 0x0808 if size else 0x0800, 0, 0, 0, 0, 0, 0,
                       len(name_b), len(extra)) + name_b + extra
    return ZipRecord(name_b, offset, head, size, data)


def layout(entries: list[Entry], archive_name: str) -> ZipLayout:
    """Every record's place and header, from (name, dtype, shape) alone."""
    if not archive_name:
        raise ValueError("empty archive name")
    plan = [("data.pkl", _pickle(entries)), (".format_version", b"1"), (".storage_alignment", str(ALIGN).encode()),
            ("byteorder", sys.byteorder.encode())]
    plan += [(f"data/{i}", e.nbytes) for i, e in enumerate(entries)] + [("version", b"3\n"), (_ID, 40)]
    records, pos = [], 0
    for name, d in plan:
        size = d if isinstance(d, int) else len(d)
        r = _record(f"{archive_name}/{name}", pos, size, None if isinstance(d, int) else d)
        records.append(r)
        pos = r.start + size + len(r.descriptor(0))
    regions = {e.name: (r.start, r.start + r.size) for e, r in zip(entries, records[4:])}
    cd_size = sum(len(r.central(0)) for r in records)
    return ZipLayout(records, regions, pos, pos + cd_size + 56 + 20 + 22)


def file_size(entries: list[Entry], archive_name: str = "archive") -> int:
    return layout(entries, archive_name).size


class TorchZipWriter(RegionWriter):

    def __init__(self, path, entries: list[Entry], archive_name: str, fd: int | None = None):
        try:
            self.layout = lay = layout(entries, archive_name)
        except BaseException:
            close_fd(fd)
            raise
        self._open(path, entries, lay.regions, fd)
        names = [e.name for e in entries]
        self.records = dict(zip(names, lay.records[4:]))
        self.crc = {n: 0 for n in names}
        # The records whose data is known now (everything but the tensors), whole; the tensors' local headers.
        pieces = ((r.offset, r.head if r.data is None else r.head + r.data + r.descriptor(zlib.crc32(r.data)))
                  for r in lay.records)
        self._start(pieces, lay.size)

    def _wrote(self, name: str, b) -> None:
        self.crc[name] = zlib.crc32(b, self.crc[name])

    def close(self) -> None:
        """Write what depends on data: descriptors, serialization id, central directory; then fsync."""
        try:
            self._check_full()
            lay, crcs = self.layout, {}
            for r in lay.records[:-1]:
                crcs[r.name] = zlib.crc32(r.data) if r.data is not None else 0
            for n, r in self.records.items():
                crcs[r.name] = self.crc[n]
                pwrite_all(self.fd, memoryview(r.descriptor(self.crc[n])), r.start + r.size)
            # torch: 20 digits hashing the record names, 20 of c10::hash_combine over descriptor CRCs.
            names_hash = int.from_bytes(hashlib.blake2b(b"\0".join(crcs), digest_size=8).digest(), "little")
            combined = 0
            for r in lay.records[:-1]:
                if r.size:
                    combined ^= (crcs[r.name] + 0x9E3779B9 + ((combined << 6) & _M64) + (combined >> 2)) & _M64
            sid = lay.records[-1]
            data = b"%020d%020d" % (names_hash, combined)
            crcs[sid.name] = zlib.crc32(data)
            pwrite_all(self.fd, memoryview(data + sid.descriptor(crcs[sid.name])), sid.start)
            cd = b"".join(r.central(crcs[r.name]) for r in lay.records)
            n, end64 = len(lay.records), lay.central + len(cd)
            tail = struct.pack("<IQHHIIQQQQ", 0x06064B50, 44, 0x031E, 0x2D, 0, 0, n, n, len(cd), lay.central)
            tail += struct.pack("<IIQI", 0x07064B50, 0, end64, 1)
            tail += struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, min(n, 0xFFFF), min(n, 0xFFFF),
                                _u32(len(cd)), _u32(lay.central), 0)
            pwrite_all(self.fd, memoryview(cd + tail), lay.central)
            os.fsync(self.fd)
        finally:
            self.abort()
