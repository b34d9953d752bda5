"""The kernel copies of a file's untouched tensors, started before its computed tensors and run beside them.

A file that mixes stored tensors copied unread (`OutTensor.copy_ranges`) with computed ones used to write
them in one stream, in file order: the copies waited for each merge or cast between them (and, where the
plan is made without torch, for `import torch`, 1.1-1.35 s on the 2-core VM), although they need neither.
Here each copied tensor's block-aligned interior is copied by one thread of its own from the moment the file
is opened (the GIL released in every read and write call), while the calling thread imports torch and the
write stages produce the computed tensors; the stages' stream writes only the partial blocks at each copied
tensor's two ends (from the input, as before) and steps over the interior (`skip`). A file written with
O_DIRECT gets the interiors with O_DIRECT too (read into an aligned buffer), any other through the kernel's
copy (`ckpt.io.byte_copy.Copier`).

Why only whole blocks: a direct write covers whole blocks (`ckpt.io.direct`), and two writers that share a
block overwrite each other's bytes in it (or, one buffered and one direct, may leave the page cache holding
the older block, written back later over the newer). Split at block boundaries, the two writers never touch
the same block, whatever order they run in. Small tensors (interior under `MIN_BYTES`) stay in the stream:
each step over an interior flushes the direct writer's buffer early.

The thread checks for a stop between calls of `ckpt.io.byte_copy.CHUNK` bytes; an error it meets (a full
disk, an input cut short) is raised on the calling thread by `check()` / `finish()`, and `abort()` (an
interrupt, a failure elsewhere) stops and joins it before the output is removed.
"""

from __future__ import annotations

import errno
import os
import threading

from ckpt.io.byte_copy import BLOCK, CHUNK, Copier
from ckpt.io.fds import start_writeback
from ckpt.io.tensors import sub_ranges

ENABLED = True  # False: every copy goes through the stages' stream, in file order (tests compare: same bytes)
MIN_BYTES = 4 << 20  # an interior smaller than this stays in the stream


def interiors(copies: dict, regions: dict[str, tuple[int, int]]) -> dict[str, tuple[int, int]]:
    """Tensor name -> (first, last) byte of its region's block-aligned interior, relative to the region's start,
    for each copied tensor whose interior is at least `MIN_BYTES`."""
    out = {}
    for name in copies:
        start, end = regions[name]
        a, b = -(-start // BLOCK) * BLOCK, end // BLOCK * BLOCK
        if b - a >= MIN_BYTES:
            out[name] = (a - start, b - start)
    return out


class EarlyCopies:
    """Copies the interiors (`interiors`) of `copies` (name -> stored ranges) into writer `w`'s file on a thread
    started here; `progress` (a tqdm bar or None) is moved as they are written."""

    def __init__(self, w, copies: dict, progress=None):
        self.w, self.progress = w, progress
        self.parts = interiors(copies, w.regions) if ENABLED else {}
        self.jobs = sorted((w.regions[n][0] + a, sub_ranges(copies[n], a, b)) for n, (a, b) in self.parts.items())
        for _, ranges in self.jobs:  # opened here: the input handles are not shared across threads while opening
            for r in ranges:
                r.fd()
        self.error: BaseException | None = None
        self.stop = False
        self.moved = 0  # bytes written so far
        self.thread = None
        if self.jobs:
            self.thread = threading.Thread(target=self._run, name="ckpt-early-copies", daemon=True)
            self.thread.start()

    def _run(self) -> None:
        try:
            if self.w.sink is not None and self._run_direct():
                return
            self._run_kernel()
        except BaseException as e:  # raised on the calling thread by check() / finish()
            self.error = e

    def _run_kernel(self) -> None:
        """Through the page cache with the kernel's copy (`ckpt.io.byte_copy.Copier`): a file written buffered."""
        copier = Copier(self.w.fd)  # its own: a Copier remembers its way and keeps a buffer
        written = 0
        for pos, ranges in self.jobs:
            for r in ranges:
                for a in range(0, r.length, CHUNK):
                    if self.stop:
                        return
                    n = min(CHUNK, r.length - a)
                    copier.copy(r.fd(), r.start + a, n, pos, r.path)
                    pos, written = pos + n, written + n
                    if written >= CHUNK:  # writeback started as we go, as the stream's writes do
                        written = 0
                        start_writeback(self.w.fd)
                    self._moved(n)

    def _run_direct(self) -> bool:
        """Read into a page-aligned buffer, written with O_DIRECT as the rest of the file is (`ckpt.io.direct`).
        Through the page cache instead, writeback throttled them: a 1 GB attention-only merge-lora took 5.9 s
        against 3.6 s in one stream (median of 5, loaded 2-core VM); direct, 3.1 s against 3.1 s. False where
        the file takes no direct write here."""
        import mmap

        from ckpt.io.direct import BUFFER, open_direct
        from ckpt.io.header import read_into

        fd = open_direct(self.w.path)
        if fd is None:
            return False
        buf = mmap.mmap(-1, BUFFER)
        try:
            mv = memoryview(buf)
            for pos, ranges in self.jobs:
                fill = 0
                for r in ranges:
                    a = 0
                    while a < r.length:
                        if self.stop:
                            return True
                        n = min(BUFFER - fill, r.length - a)
                        read_into(r.fd(), mv[fill: fill + n], r.start + a, r.path)
                        fill, a = fill + n, a + n
                        if fill == BUFFER:
                            pos = self._direct_write(fd, mv, pos)
                            fill = 0
                if fill:  # an interior is whole blocks: so is its last piece
                    pos = self._direct_write(fd, mv[:fill], pos)
            return True
        except OSError as e:
            if e.errno == errno.EINVAL and not self.moved:  # refused on the first write: the kernel's copy instead
                return False
            raise
        finally:
            os.close(fd)
            mv = None
            try:
                buf.close()
            except BufferError:  # a failed read's traceback still holds a view of it: freed with it
                pass

    def _direct_write(self, fd: int, mv: memoryview, pos: int) -> int:
        done = 0
        while done < len(mv):  # a short direct write ends on a block boundary
            n = os.pwrite(fd, mv[done:], pos + done)
            if n <= 0:
                raise OSError(errno.EIO, "direct write made no progress")
            done += n
        self._moved(done)
        return pos + done

    def _moved(self, n: int) -> None:
        self.moved += n
        if self.progress is not None:
            self.progress.update(n)

    def check(self) -> None:
        """Raise what the thread met, if anything yet."""
        if self.error is not None:
            raise self.error

    def finish(self) -> None:
        """Wait for every copy; raise what the thread met."""
        if self.thread is not None:
            self.thread.join()
        self.check()

    def abort(self) -> None:
        """Stop after the call in flight and wait for it; never raises."""
        self.stop = True
        if self.thread is not None:
            self.thread.join()
