"""Stored bytes copied into an output file by the kernel: the write path of tensors that change no byte.

A renamed tensor, a row slice of a fused one, pieces stacked back into one, a tensor a merge leaves alone,
a GGUF tensor kept in its type: each output byte is a byte of an input file (`Tensor.byte_ranges`,
`OutTensor.copy_ranges`). Reading those into Python and writing them back costs two copies through user
space, page faults on the buffers and a core; `os.copy_file_range` moves them inside the kernel, and on a
filesystem that shares extents (btrfs, XFS with reflink, bcachefs, ZFS with block cloning) it shares the
blocks instead of copying them where the source and output offsets are aligned alike.

Where the kernel or filesystem cannot (`EXDEV` across filesystems on older kernels, `ENOSYS`,
`EOPNOTSUPP`, `EINVAL` from a filesystem without it), `os.sendfile` (also in-kernel; to sockets only on macOS:
`ENOTSOCK`) is next, then
`pread`/`pwrite` through one reused buffer: the bytes are the same whichever way they travel, and the
choice is remembered per output file (`Copier`). A source that ends early is the input error reading
would raise; a full disk is the write error any write raises (`ckpt.io.output` turns both into one line).
"""

from __future__ import annotations

import errno
import os

from ckpt.io.fds import pwrite_all

CHUNK = 64 << 20  # bytes per call: progress and interrupts are seen between calls (also ckpt.io.fds.WRITE_BEHIND)
FALLBACK_BUFFER = 8 << 20  # the pread/pwrite fallback's one buffer

# errors that say "not this way here", never "this write failed": the next way is tried (ENOTSOCK: macOS's
# sendfile sends to sockets only)
_UNSUPPORTED = {errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EINVAL, errno.ENOTSOCK}

WAYS = ("copy_file_range", "sendfile", "pread")

BLOCK = 4096  # the filesystem block a shared extent starts on (btrfs, XFS, bcachefs, ZFS: 4 KiB by default)
# statfs f_type of the Linux filesystems whose copy_file_range shares extents (reflink / block cloning)
SHARING = {0x58465342: "xfs", 0x9123683E: "btrfs", 0xCA451A4E: "bcachefs", 0x2FC12FC1: "zfs"}


def shares_extents(path) -> bool:
    """Whether `path` (an existing file or folder) is on a filesystem that may share extents on copy; False
    wherever that cannot be told (not Linux, no libc statfs)."""
    try:
        import ctypes
        import sys

        if not sys.platform.startswith("linux"):
            return False
        libc = ctypes.CDLL(None, use_errno=True)
        buf = ctypes.create_string_buffer(256)  # struct statfs: f_type is its first field (a long)
        if libc.statfs(os.fsencode(str(path)), buf) != 0:
            return False
        return ctypes.c_long.from_buffer(buf).value & 0xFFFFFFFF in SHARING
    except (OSError, AttributeError, ValueError):
        return False


def block_padding(copies: dict[str, list], regions: dict[str, tuple[int, int]]) -> int:
    """Spaces to add to a safetensors header so that most copied bytes start at the same offset within a
    block in the output as in their input: only then can the filesystem share their blocks instead of
    copying them (a shared extent starts on a block boundary in both files). The data region has no gaps,
    so the header length is the one free choice once the tensors' order is set (`ckpt.io.writer.block_layout`
    chooses that order with this padding): the one shift (a multiple of 8, keeping the data 8-aligned) that
    aligns the most bytes of ranges a block or longer. `regions`: each tensor's (start, end) in the unpadded
    file."""
    return best_shift(copies, regions)[0]


def best_shift(copies: dict[str, list], regions: dict[str, tuple[int, int]]) -> tuple[int, int]:
    """(`block_padding`'s shift, the bytes it aligns)."""
    weight: dict[int, int] = {}
    for name, ranges in copies.items():
        pos = regions[name][0]
        for r in ranges:
            if r.length >= BLOCK:
                d = (r.start - pos) % BLOCK
                weight[d] = weight.get(d, 0) + r.length
            pos += r.length
    best = max((d for d in weight if d % 8 == 0), key=lambda d: (weight[d], -d), default=0)
    return best, weight.get(best, 0)


class Copier:
    """Copies byte ranges of input files into one output file at given offsets, the first way that works."""

    def __init__(self, out_fd: int, ways: tuple[str, ...] = WAYS):
        self.out_fd = out_fd
        self.ways = [w for w in ways if w != "copy_file_range" or hasattr(os, "copy_file_range")]
        self.ways = [w for w in self.ways if w != "sendfile" or hasattr(os, "sendfile")] or ["pread"]
        self.buf: bytearray | None = None

    @property
    def way(self) -> str:
        return self.ways[0]

    def copy(self, src_fd: int, src_pos: int, length: int, out_pos: int, path) -> None:
        """`length` bytes of `src_fd` at `src_pos` to the output at `out_pos` (`path` names the input in errors).
        A range that starts inside a block is copied up to the block's end first: a filesystem shares blocks
        only from block-aligned offsets, and copies the whole call otherwise."""
        while length > 0:
            step = min(length, CHUNK, BLOCK - src_pos % BLOCK if src_pos % BLOCK else CHUNK)
            try:
                n = self._step(src_fd, src_pos, step, out_pos)
            except OSError as e:
                if e.errno in _UNSUPPORTED and len(self.ways) > 1:
                    self.ways.pop(0)  # not this way here: the next one, from the same byte
                    continue
                raise
            if n == 0:
                from ckpt.errors import file_error

                raise file_error(path, "unexpected end of file while reading tensor data")
            src_pos, out_pos, length = src_pos + n, out_pos + n, length - n

    def _step(self, src_fd: int, src_pos: int, n: int, out_pos: int) -> int:
        way = self.ways[0]
        if way == "copy_file_range":
            return os.copy_file_range(src_fd, self.out_fd, n, src_pos, out_pos)
        if way == "sendfile":  # writes at the output's file position: only the writer's thread moves it
            os.lseek(self.out_fd, out_pos, os.SEEK_SET)
            return os.sendfile(self.out_fd, src_fd, src_pos, n)
        if self.buf is None:
            self.buf = bytearray(FALLBACK_BUFFER)
        mv = memoryview(self.buf)[: min(n, FALLBACK_BUFFER)]
        got = os.preadv(src_fd, [mv], src_pos)
        pwrite_all(self.out_fd, mv[:got], out_pos)
        return got
