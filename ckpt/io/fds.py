"""Writing through a raw file descriptor: the loops and hints every writer (safetensors, GGUF, torch zip, the
O_DIRECT sink, the kernel byte copier) shares. Its own module so that those writers import it and not each
other (`ckpt.io.writer` hands bands to `ckpt.io.direct` and `ckpt.io.byte_copy`, which only need these)."""

from __future__ import annotations

import os


def pwrite_all(fd: int, mv: memoryview, pos: int) -> None:
    """pwrite may write less than asked (signals, quotas): loop until all of `mv` is at `pos`."""
    while len(mv):
        n = os.pwrite(fd, mv, pos)
        mv, pos = mv[n:], pos + n


WRITE_BEHIND = 64 << 20  # bytes written between two requests to start writing them back to disk

_sync_file_range = None  # libc's sync_file_range once looked up; False where there is none


def start_writeback(fd: int) -> None:
    """Ask the kernel to start writing `fd`'s dirty pages to disk now, without waiting for it (Linux
    `sync_file_range(SYNC_FILE_RANGE_WRITE)`; nothing elsewhere). Left alone, writeback starts only when
    a tenth of RAM is dirty, so the closing fsync would wait for most of the file at once; started as we
    go, the disk writes while later bands are computed. A hint only: errors surface in the fsync."""
    global _sync_file_range
    if _sync_file_range is None:
        _sync_file_range = False
        try:
            import ctypes

            f = ctypes.CDLL(None, use_errno=True).sync_file_range
            f.argtypes, f.restype = (ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint), ctypes.c_int
            _sync_file_range = f
        except (OSError, AttributeError):
            pass
    if _sync_file_range:
        _sync_file_range(fd, 0, 0, 2)  # SYNC_FILE_RANGE_WRITE, the whole file


def close_fd(fd: int | None) -> None:
    """Close a descriptor handed to a writer that failed before taking it."""
    if fd is not None:
        try:
            os.close(fd)
        except OSError:
            pass
