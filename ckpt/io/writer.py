"""Header-first safetensors writer: plan from (name, dtype, shape) alone, then stream bytes in.

The header is final before any data exists, so each tensor's region is known and tensors may be
produced in any order (written with pwrite at their offsets). Layout follows safetensors' own writer:
tensors sorted by dtype (descending item size), then name, so every tensor starts aligned to its item
size; the header is padded with spaces so the data region starts on an 8-byte boundary. The one exception is
a file with copied tensors on a filesystem that shares extents: its header may carry more spaces and its data
the copies' input order (the header's keys keep theirs), so that the filesystem can share their blocks
(`block_layout`).
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from typing import NamedTuple

from ckpt.lazy import torch

from ckpt.dtypes import itemsize, nbytes, st_name
from ckpt.io.byte_copy import BLOCK, best_shift
from ckpt.io.fds import WRITE_BEHIND, close_fd, pwrite_all, start_writeback
from ckpt.io.ggml_types import encoded_nbytes
from ckpt.report import plural


@dataclass(frozen=True)
class Entry:
    name: str
    dtype: torch.dtype | str  # or its safetensors name ("BF16"): a plan of byte copies never imports torch
    shape: tuple[int, ...]
    gguf_type: int | None = None  # GGUF only: the GGML block type the uint8 data holds (e.g. Q8_0)

    @property
    def nbytes(self) -> int:
        if self.gguf_type is not None:
            return encoded_nbytes(self.gguf_type, self.shape)
        return nbytes(self.dtype, self.shape)


# safetensors' own writer orders tensors by dtype (this order, observed with safetensors 0.8: item sizes
# descending, so every tensor is aligned to its item size), then by name. Following it exactly makes
# ckpt's bytes identical to `safetensors.torch.save` of the same tensors (tests/test_io_write.py).
_ST_ORDER = ["U64", "I64", "F64", "C64", "F32", "U32", "I32", "BF16", "F16", "U16", "I16", "F8_E5M2FNUZ",
             "F8_E4M3FNUZ", "F8_E8M0", "F8_E4M3", "F8_E5M2", "I8", "U8", "BOOL"]
_RANK = {name: i for i, name in enumerate(_ST_ORDER)}


def _order(e: Entry):
    return (-itemsize(e.dtype), _RANK.get(st_name(e.dtype), len(_RANK)), e.name)


def layout(entries: list[Entry], metadata: dict[str, str] | None, pad: int = 0,
           first: list[str] | tuple[str, ...] = ()) -> tuple[bytes, dict[str, tuple[int, int]]]:
    """Header bytes (length prefix included) and name -> (absolute start, end). `pad`: spaces added after the
    header's own padding (a multiple of 8), which the format allows: on a filesystem that shares extents they
    align copied tensors with their input's blocks (`ckpt.io.byte_copy.block_padding`). `first`: tensors whose
    data goes first, in this order, the rest after them in safetensors' order (on such a filesystem, the copied
    tensors in their input's order, `source_order`, so that they keep its block alignment). Readers sort the
    entries by their data_offsets (safetensors' Rust crate, `ckpt.io.header`), so the header keeps its keys in
    safetensors' order either way and only the offsets differ."""
    ordered = sorted(entries, key=_order)
    placed = ordered
    if first:
        rank = {name: i for i, name in enumerate(first)}
        placed = sorted(ordered, key=lambda e: rank.get(e.name, len(rank)))  # stable: the rest keep _order
    pos, rel = 0, {}
    for e in placed:
        rel[e.name] = (pos, pos + e.nbytes)
        pos += e.nbytes
    header: dict = {}
    if metadata:
        header["__metadata__"] = dict(metadata)
    for e in ordered:
        header[e.name] = {"dtype": st_name(e.dtype), "shape": list(e.shape), "data_offsets": list(rel[e.name])}
    js = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    js += b" " * (-(8 + len(js)) % 8 + pad)
    start = 8 + len(js)
    return struct.pack("<Q", len(js)) + js, {k: (start + a, start + b) for k, (a, b) in rel.items()}


def source_order(entries: list[Entry], copies: dict[str, list]) -> list[str]:
    """Every tensor's name in an order that keeps the copied tensors (`copies`: name -> stored ranges) where
    their input has them, up to a whole number of blocks: a filesystem shares a copied block only where it
    starts at the same offset within a block in both files (`ckpt.io.byte_copy`), and safetensors' own order
    (by name) scatters them. Within each item size (largest first, as safetensors lays them out, so every
    tensor stays aligned to its item size: all sizes are multiples of the item sizes that follow), copies go
    in the order of their input file (first met) and offset: a rename, the pieces of a split fused tensor or
    of a reordered one then stay contiguous. Where the input holds bytes no copy takes (a tensor this output
    computes or drops), a computed tensor of a size that matches them modulo the block fills the gap (a merged
    weight in its base's place); the other computed tensors follow, in safetensors' order."""
    files: dict = {}
    where: dict[str, tuple[int, int]] = {}
    for name, ranges in copies.items():
        if ranges:
            path = ranges[0].path
            where[name] = (files.setdefault(path, len(files)), min(r.start for r in ranges if r.path == path))
    out: list[str] = []
    pos, shift = 0, None
    ordered = sorted(entries, key=_order)
    for size in sorted({itemsize(e.dtype) for e in entries}, reverse=True):
        group = [e for e in ordered if itemsize(e.dtype) == size]
        fills: dict[int, list[Entry]] = {}  # computed tensors by their size modulo the block
        for e in group:
            if e.name not in where:
                fills.setdefault(e.nbytes % BLOCK, []).append(e)
        filled: set[str] = set()
        for e in sorted((e for e in group if e.name in where), key=lambda e: where[e.name]):
            start = where[e.name][1]
            gap = 0 if shift is None else (start - pos - shift) % BLOCK
            if gap and fills.get(gap):
                fill = fills[gap].pop(0)
                out.append(fill.name)
                filled.add(fill.name)
                pos += fill.nbytes
            shift = (start - pos) % BLOCK
            out.append(e.name)
            pos += e.nbytes
        for e in group:
            if e.name not in where and e.name not in filled:
                out.append(e.name)
                pos += e.nbytes
    return out


class BlockLayout(NamedTuple):
    """How a safetensors file on a filesystem that shares extents is laid out so that its copied tensors keep
    their input's block alignment (`block_layout`): `pad` spaces after the header
    (`ckpt.io.byte_copy.block_padding`) and, `by_source`, the data in the copies' input order (`source_order`)
    instead of safetensors' own. `BlockLayout()` is safetensors' own layout. A tuple of an int and a bool: the
    driver of a share (`ckpt.io.shares`) hands it to the workers, which derive the same order from the same plan."""

    pad: int = 0
    by_source: bool = False

    def first(self, entries: list[Entry], copies: dict[str, list]) -> list[str]:
        """`layout`'s `first` for this layout; `copies`: every copied tensor of the file (name -> stored ranges,
        `OutFile.byte_copies`)."""
        return source_order(entries, copies) if self.by_source else []


def block_layout(entries: list[Entry], metadata, copies: dict[str, list],
                 shareable: dict[str, list]) -> BlockLayout | None:
    """The layout that keeps the most copied bytes where a filesystem can share their blocks: safetensors' own
    order (every other filesystem's bytes, the header's spaces aside) or the copies in their input's order
    (`source_order`: a layout conversion's renamed and split tensors in the order they are stored, so one
    padding aligns them all where safetensors' order, by name, leaves a part at other offsets within their
    blocks), each with its best padding (`ckpt.io.byte_copy.block_padding`). The input order is taken only where
    it aligns more bytes. None where no copied range of a block or more can be aligned either way. `copies`:
    every copied tensor of the file (they set the order); `shareable`: those copied from the output's
    filesystem (only their blocks can be shared)."""
    best = None
    for by_source in (False, True):
        first = source_order(entries, copies) if by_source else ()
        shift, aligned = best_shift(shareable, layout(entries, metadata, 0, first)[1])
        if best is None or aligned > best[0]:
            best = (aligned, BlockLayout(shift, by_source))
    return best[1] if best[0] else None


def file_size(entries: list[Entry], metadata) -> int:
    head, regions = layout(entries, metadata)
    return len(head) + sum(e.nbytes for e in entries)


class RegionWriter:
    """What both file writers share: each tensor has a region planned up front; bands are appended to it
    in order with pwrite (so tensors may come in any order) and every region must end up full."""

    fd = -1
    copier = None
    sink = None  # a DirectSink (ckpt.io.direct) where the file is written with O_DIRECT
    size = 0

    def _open(self, path, entries: list[Entry], regions: dict[str, tuple[int, int]], fd: int | None = None,
              direct: bool = False) -> None:
        """`fd`: the file, already created (ckpt.io.publish creates output files exclusively); the writer
        owns it from here on and closes it on close() or abort(), also when this raises. Else `path`
        is created (or truncated). `direct`: write its bytes with O_DIRECT where the filesystem allows
        (`ckpt.io.direct`): only for a file written in order, header first (safetensors, GGUF)."""
        self.fd = -1 if fd is None else fd
        names = [e.name for e in entries]
        if len(set(names)) != len(names):
            self.abort()
            raise ValueError("duplicate tensor names in plan")
        self.path, self.regions = path, regions
        self.written = {n: 0 for n in names}
        self.unflushed = 0  # bytes written since writeback was last started
        if fd is None:
            self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
        if direct:
            from ckpt.io.direct import DirectSink, open_direct

            fd_direct = open_direct(path)
            if fd_direct is not None:
                self.sink = DirectSink(self.fd, fd_direct)

    def _put(self, pos: int, b) -> None:
        """`b` at file offset `pos`: through the O_DIRECT sink, else pwrite (writeback started as we go)."""
        if self.sink is not None:
            self.sink.put(pos, b)
            return
        pwrite_all(self.fd, memoryview(b), pos)
        self._behind(len(b))

    def _behind(self, n: int) -> None:
        """`n` more bytes went through the page cache: start their writeback every `WRITE_BEHIND` bytes."""
        self.unflushed += n
        if self.unflushed >= WRITE_BEHIND:
            self.unflushed = 0
            start_writeback(self.fd)

    def _append_at(self, name: str, n: int) -> int:
        """The file offset where the next `n` bytes of tensor `name` go; more than its region holds is refused."""
        start, end = self.regions[name]
        pos = start + self.written[name]
        if pos + n > end:
            raise RuntimeError(f"{name}: producer wrote more bytes than planned")
        return pos

    def write(self, name: str, data) -> None:
        """Append `data` (a CPU tensor or a numpy array, contiguous) to tensor `name`'s region."""
        if hasattr(data, "numel"):
            b = data.reshape(-1).view(torch.uint8).numpy() if data.numel() else b""
        else:  # a band cast without torch (`ckpt.cast.Caster.host_cast`)
            b = data.reshape(-1).view("uint8")
        self._put(self._append_at(name, len(b)), b)
        self._wrote(name, b)
        self.written[name] += len(b)

    def copy(self, name: str, ranges) -> None:
        """Append the stored byte `ranges` (`ckpt.io.tensors.ByteRange`) to tensor `name`'s region: copied by
        the kernel (`ckpt.io.byte_copy`; the bytes never enter Python), or, in a file written with O_DIRECT,
        read straight into its buffer."""
        total = sum(r.length for r in ranges)
        pos = self._append_at(name, total)
        if self.sink is None and self.copier is None:
            from ckpt.io.byte_copy import Copier

            self.copier = Copier(self.fd)
        for r in ranges:
            if self.sink is not None:  # a file written with O_DIRECT: the bytes are read into its buffer, in order
                self.sink.put_from(pos, r.fd(), r.start, r.length, r.path)
            else:
                self.copier.copy(r.fd(), r.start, r.length, pos, r.path)
            pos += r.length
        self.written[name] += total
        if self.sink is None:
            self._behind(total)

    def skip(self, name: str, n: int) -> None:
        """Step over the next `n` bytes of tensor `name`'s region: another thread writes them, whole blocks
        (`ckpt.io.early_copies`); the O_DIRECT sink leaves those blocks alone."""
        pos = self._append_at(name, n)
        if self.sink is not None:
            self.sink.skip(pos, pos + n)
        self.written[name] += n

    def _wrote(self, name: str, b) -> None:
        """Hook: a band of `name` is on disk (the torch zip keeps its CRC32 running)."""

    def _start(self, pieces, size: int) -> None:
        """Write what is known before any data (header, records: `pieces` of (offset, bytes)) and size the
        file up front (sparse): a reader of a half-written file sees zeros, never a short file."""
        try:
            self.size = size
            for offset, data in pieces:
                self._put(offset, data)
            os.ftruncate(self.fd, size)
        except BaseException:
            self.abort()
            raise

    def _check_full(self) -> None:
        short = [n for n, w in self.written.items() if w != self.regions[n][1] - self.regions[n][0]]
        if short:
            raise RuntimeError(f"{plural(len(short), 'tensor')} not fully written, e.g. {short[0]!r}")

    def close(self) -> None:
        """Every region full, then fsync and close."""
        try:
            self._check_full()
            if self.sink is not None:
                self.sink.close(self.size)
            os.fsync(self.fd)
        finally:
            self.abort()

    def abort(self) -> None:
        if self.sink is not None:
            self.sink.release()
            self.sink = None
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class SafetensorsWriter(RegionWriter):
    def __init__(self, path, entries: list[Entry], metadata: dict[str, str] | None, fd: int | None = None,
                 pad: int = 0, direct: bool = False, first: list[str] | tuple[str, ...] = ()):
        try:
            head, regions = layout(entries, metadata, pad, first)
        except BaseException:
            close_fd(fd)
            raise
        self._open(path, entries, regions, fd, direct)
        self._start([(0, head)], len(head) + sum(e.nbytes for e in entries))
