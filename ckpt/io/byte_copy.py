"""Stored bytes copied into an output file by the kernel: the write path of tensors that change no byte.

A renamed tensor, a row slice of a fused one, pieces stacked back into one, a tensor a merge leaves alone,
a GGUF tensor kept in its type: each output byte is a byte of an input file (`Tensor.byte_ranges`,
`OutTensor.copy_ranges`). Reading those into Python and writing them back costs two copies through user
space, page faults on the buffers and a core; `os.copy_file_range` moves them inside the kernel, and on a
filesystem that shares extents (btrfs, XFS with reflink, bcachefs, ZFS with block cloning) it shares the
blocks instead of copying them where the source and output offsets are aligned alike.

Where the kernel or filesystem cannot (`EXDEV` across filesystems on older kernels, `ENOSYS`,
`EOPNOTSUPP`, `EINVAL` from a filesystem without it), `os.sendfile` (also in-kernel) is next, then
`pread`/`pwrite` through one reused buffer: the bytes are the same whichever way they travel, and the
choice is remembered per output file (`Copier`). A source that ends early is the input error reading
would raise; a full disk is the write error any write raises (`ckpt.io.output` turns both into one line).
"""

from __future__ import annotations

import errno
import os

CHUNK = 64 << 20  # bytes per call: progress and interrupts are seen between calls (also ckpt.io.writer.WRITE_BEHIND)
FALLBACK_BUFFER = 8 << 20  # the pread/pwrite fallback's one buffer

# errors that say "not this way here", never "this write failed": the next way is tried
_UNSUPPORTED = {errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EINVAL}

WAYS = ("copy_file_range", "sendfile", "pread")


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
        """`length` bytes of `src_fd` at `src_pos` to the output at `out_pos` (`path` names the input in errors)."""
        while length > 0:
            step = min(length, CHUNK)
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
        from ckpt.io.writer import pwrite_all

        pwrite_all(self.out_fd, mv[:got], out_pos)
        return got
