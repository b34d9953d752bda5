"""Writing an output file sequentially with O_DIRECT: computed bytes go to the disk without the page cache.

Measured on the 2-core VM (ext4, 4.1 GB written from a 16 MiB buffer, `sync` before each run): buffered
`pwrite` + fsync took 4.3-8.4 s (the writer is throttled while the kernel writes dirty pages back, and every
page is allocated, filled and later reclaimed); the same bytes with O_DIRECT 3.0-3.4 s, faster than `cp` + sync
(3.9 s). The write stages' writer is the one thread that writes, in file order, so its writes can be gathered
into one aligned buffer and handed to the disk a buffer at a time.

`DirectSink` takes the file's bytes in order (`put(offset, bytes)`: header first, then each band; a gap
between tensors, as GGUF's alignment leaves, is zeros), copies them into one of two page-aligned buffers
and has a second thread write each full buffer with O_DIRECT while the other fills; `close()` writes the
last part padded to the block size and cuts the file back to its size. Where the filesystem refuses O_DIRECT (tmpfs, some FUSE and network filesystems: EINVAL
when opening or on the first write) the same bytes go through the ordinary descriptor instead, so the output
never depends on it. A write behind the buffer (never made by the writers today) is written buffered: the
kernel keeps direct and buffered writes of one file coherent.
"""

from __future__ import annotations

import errno
import mmap
import os

from ckpt.io.fds import pwrite_all

BUFFER = 16 << 20  # bytes per O_DIRECT write (4 MiB and 64 MiB measured the same; a multiple of ALIGN)
ALIGN = 4096  # offsets, lengths and buffer addresses of O_DIRECT I/O: the largest logical block size in use


def open_direct(path) -> int | None:
    """A second, O_DIRECT descriptor of the (created) output file `path`, or None where there is none."""
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return None
    try:
        return os.open(path, os.O_WRONLY | flag)
    except OSError:  # EINVAL: the filesystem does not do direct I/O
        return None


class DirectSink:
    """A file's bytes, in order, written a buffer at a time with O_DIRECT (`fd_direct`), else through `fd`."""

    def __init__(self, fd: int, fd_direct: int):
        self.fd, self.fd_direct = fd, fd_direct
        # two page-aligned buffers (as O_DIRECT wants its memory): one fills while the other is written by the
        # flushing thread, so copying bands in overlaps the disk writing (measured: the writer thread spent
        # about a quarter of its time copying bands into the one buffer, the disk idle meanwhile)
        self.bufs = [mmap.mmap(-1, BUFFER), mmap.mmap(-1, BUFFER)]
        self.pending: list = [None, None]  # the flush in flight from each buffer
        self.cur = 0
        self.mv = memoryview(self.bufs[0])
        self.flusher = None  # a one-thread executor, started on the first flush
        self.base = 0  # file offset of the buffer's first byte
        self.fill = 0  # bytes of the buffer that hold the file's bytes

    def put(self, pos: int, data) -> None:
        mv = memoryview(data).cast("B")
        if pos < self.base:  # behind what was written: rare, buffered (coherent with direct I/O once written)
            self._wait()
            pwrite_all(self.fd, mv, pos)
            return

        def copy(dst, at):
            dst[:] = mv[at: at + len(dst)]

        self._place(pos, len(mv), copy)

    def put_from(self, pos: int, fd: int, src_pos: int, length: int, path) -> None:
        """`length` bytes of the file `fd` at `src_pos` (an input; `path` names it in errors) to offset `pos`,
        read straight into the buffer: a stored tensor copied into a file written with O_DIRECT."""
        from ckpt.io.header import read_into

        if pos < self.base:  # behind what was written: read, then `put`'s way
            for a in range(0, length, BUFFER):
                chunk = bytearray(min(BUFFER, length - a))
                read_into(fd, memoryview(chunk), src_pos + a, path)
                self.put(pos + a, chunk)
            return
        self._place(pos, length, lambda dst, at: read_into(fd, dst, src_pos + at, path))

    def skip(self, pos: int, end: int) -> None:
        """Bytes [pos, end) (block-aligned) are written by another writer (`ckpt.io.early_copies`): the bytes
        before them are flushed (a gap up to them is zeros) and the buffer goes on at `end`, so no write of this
        sink touches their blocks."""
        if pos % ALIGN or end % ALIGN or pos < self.base + self.fill:
            raise ValueError(f"skip [{pos}, {end}) not block-aligned or behind the buffer")
        while pos - self.base >= BUFFER:  # a gap past the buffer: zeros up to its end, then the next buffer
            self.mv[self.fill:] = bytes(BUFFER - self.fill)
            self.fill = BUFFER
            self._flush()
        if pos > self.base + self.fill:
            self.mv[self.fill: pos - self.base] = bytes(pos - self.base - self.fill)
            self.fill = pos - self.base
        if self.fill:
            self._flush()
        self.base = end

    def _place(self, pos: int, length: int, fill) -> None:
        """Bytes [0, length) of a source for file offset `pos` (at or past the buffer's start) into the buffers:
        `fill(dst, at)` puts the source's bytes from `at` into the memoryview `dst`. A gap before them is
        zeros, as in the sparse file; each full buffer is flushed."""
        done = 0
        while done < length:
            at = pos + done - self.base
            if at >= BUFFER:  # a gap past the buffer: zeros up to its end, then the next buffer
                self.mv[self.fill:] = bytes(BUFFER - self.fill)
                self.fill = BUFFER
                self._flush()
                continue
            if at > self.fill:  # a gap inside the buffer
                self.mv[self.fill: at] = bytes(at - self.fill)
            n = min(length - done, BUFFER - at)
            fill(self.mv[at: at + n], done)
            self.fill = max(self.fill, at + n)
            done += n
            if self.fill == BUFFER:
                self._flush()

    def _flush(self) -> None:
        """Hand the buffer's `fill` bytes at `base` (padded with zeros to a whole block) to the flushing thread
        and go on in the other buffer once its own last write is done (its error, if any, raised here)."""
        n = -(-self.fill // ALIGN) * ALIGN
        if n > self.fill:
            self.mv[self.fill: n] = bytes(n - self.fill)
        if self.flusher is None:
            from concurrent.futures import ThreadPoolExecutor

            self.flusher = ThreadPoolExecutor(1, thread_name_prefix="ckpt-direct")
        self.pending[self.cur] = self.flusher.submit(self._write, self.mv[:n], self.base, self.fill)
        self.base += self.fill
        self.fill = 0
        self.cur ^= 1
        self.mv = memoryview(self.bufs[self.cur])
        self._wait(self.cur)

    def _wait(self, which: int | None = None) -> None:
        """Wait for the flush in flight from buffer `which` (None: both); raise its error."""
        for i in (0, 1) if which is None else (which,):
            f, self.pending[i] = self.pending[i], None
            if f is not None:
                f.result()

    def _write(self, mv: memoryview, pos: int, keep: int) -> None:
        if self.fd_direct >= 0:
            try:
                done = 0
                while done < len(mv):  # a short direct write ends on a block boundary
                    n = os.pwrite(self.fd_direct, mv[done:], pos + done)
                    if n <= 0:
                        raise OSError(errno.EIO, "direct write made no progress")
                    done += n
                return
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
                self._drop_direct()  # refused on write (some filesystems accept the open): buffered from here
        pwrite_all(self.fd, mv[:keep], pos)

    def close(self, size: int) -> None:
        """Write what is left; the file ends at `size` (the last block was padded past it)."""
        if self.fill:
            self._flush()
        self._wait()
        os.ftruncate(self.fd, size)
        self.release()

    def _drop_direct(self) -> None:
        if self.fd_direct >= 0:
            try:
                os.close(self.fd_direct)
            except OSError:
                pass
            self.fd_direct = -1

    def release(self) -> None:
        """Stop: wait for a write in flight (never leave a thread writing a buffer that is freed), free both."""
        if self.flusher is not None:
            for f in self.pending:
                if f is not None:
                    f.exception()  # waits; an error is the caller's to have raised (or not, when aborting)
            self.flusher.shutdown(wait=True)
            self.flusher = None
        self.pending = [None, None]
        self._drop_direct()
        bufs, self.bufs, self.mv = self.bufs, [], None
        for buf in bufs:
            try:
                buf.close()
            except BufferError:  # a failed write's traceback still holds a view of it: freed with it
                pass
