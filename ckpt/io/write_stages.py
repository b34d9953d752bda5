"""The write stages: bands of every output tensor flow read -> compute -> write, concurrently.

Three stages, each on its own long-lived thread for the whole output file (never a thread per band):

- read (the calling thread): `Tensor.read` of band i+2 into one slot's buffers: pread, decoding,
  merging. Every read stays on this one thread, in the order of today's serial loop, because reads
  keep state: adapter factor caches and their `release()` after a tensor's last band (MergedTensor),
  the previous band's mapped pages given back (PickleTensor's `_MappedBands`), lazily computed scales
  that read a whole tensor (encoders' `Lazy`, `AmaxScale`). A cast that is not `OutTensor.stateless`
  runs here too, for the same reason.
- compute: the stateless cast of band i+1 (`ckpt.cast.Caster`: one rounding, overflow and NaN
  accounting fused with it), then, on CUDA, the copy to pinned host memory.
- write: band i, pwrite at its planned offset (in order, so the torch zip's running CRC holds), then the
  progress bar.

A tensor whose output bytes are stored byte ranges of an input (`OutTensor.copy_ranges`) goes through the
same queues as copy jobs (`copy()`): no slot, no data, nothing to compute; the writer copies the ranges with
the kernel (`ckpt.io.byte_copy`) in order with the bands around them; a large one's block-aligned interior
is copied by a thread of its own from the start (`ckpt.io.early_copies`), and the writer steps over it
(`skip()`). (A file of copies alone never starts the stages: `ckpt.io.output` copies it on the calling
thread, without torch.)

At most `depth` bands are in flight: a slot (its scratch buffers) returns to the reader only after its
band is written. Memory is therefore `depth` x the buffers of one band, whatever the model size. The
stages pass the GIL back and forth only between torch kernels and syscalls, which release it.

On CUDA the reader works on its own stream (host->device copies from pinned memory, decode, merge), the
cast on a second and the device->host copy into pinned memory on a third, so copies overlap compute and
file I/O; the writer waits on one event per band, the only synchronisation the stages make.
Counts the cast found on the device (overflow, NaN) travel back with the band (`Slot.defer`).
"""

from __future__ import annotations

import contextlib
import queue
import threading

from ckpt.lazy import torch

from ckpt.devices import exact_fp32
from ckpt.io.buffers import Buffers

DEPTH = 3  # bands in flight: one being read, one cast, one written (tests vary it)


def stage_threads(cores: int) -> int:
    """torch intra-op threads while the stages run: half of the cores left after the writer and the
    reader's own I/O, at least one. The reading and the compute stage each run torch ops (decode, merge;
    cast) at the same time, and two OpenMP teams that together ask for more threads than there are
    cores stall each other at every op's barrier (measured on 2 cores: 2 threads each made a convert 2x
    slower in wall time and 3x in CPU time; 1 thread each was the fastest). Where one stage holds the work and the
    other only moves bytes, `WriteStages(busy_stage=)` gives that stage every core: "read" for a model merge,
    whose compute stage only casts (a 1 GB TIES merge: 27 s with 1 thread, 20 s with 2, on 2 cores), "compute"
    for K-quant GGUF, whose reader only reads the source."""
    return max(1, (cores - 2) // 2)

_STOP = object()


class Slot(Buffers):
    """One band's scratch buffers, plus the values its cast left on the device to report later."""

    def __init__(self):
        super().__init__()
        self.deferred: list = []  # (callback, device tensor): callback(host copy) once the band is done

    def defer(self, fn, value: torch.Tensor) -> None:
        if value.device.type == "cpu":
            fn(value)
        else:
            self.deferred.append((fn, value))


class _Band:
    __slots__ = ("slot", "name", "dtype", "cast", "data", "nbytes", "ready", "done", "host", "ranges", "skip")

    def __init__(self, slot, name, dtype, cast, data):
        self.slot, self.name, self.dtype, self.cast, self.data = slot, name, dtype, cast, data
        self.nbytes = 0
        self.ready = self.done = None  # CUDA events: read finished / device->host copy finished
        self.host: list = []  # (callback, pinned host tensor) of deferred values
        self.ranges = None  # a byte copy (`WriteStages.copy`): stored ranges the writer copies, no data
        self.skip = 0  # bytes another thread writes (`WriteStages.skip`): the writer steps over them


class WriteStages:
    """`band()` hands the reader a free slot, `submit()` passes the band read into it on; `finish()`
    waits for every band to be written (and raises what a stage raised); `abort()` stops the stages."""

    def __init__(self, writer, device: torch.device | None, progress=None, depth: int | None = None,
                 busy_stage: str | None = None):
        """`device` None: the bands are numpy arrays cast without torch (`ckpt.cast.Caster.host_cast`), and the
        stages never import it."""
        self.writer, self.device, self.progress = writer, device, progress
        self.torch_free = device is None
        self.gpu = _CudaStreams(device) if device is not None and device.type == "cuda" else None
        self.threads_before = self.compute_threads = 0
        if not self.torch_free:
            self._share_cores(busy_stage)
        # Merges' matmuls run in the reading stage: full fp32 on CUDA, the caller's TF32 setting back after.
        self.exact = exact_fp32() if self.gpu else None
        if self.exact is not None:
            self.exact.__enter__()
        self.free: queue.SimpleQueue = queue.SimpleQueue()
        for _ in range(max(1, depth or DEPTH)):
            self.free.put(Slot())
        self.to_compute: queue.SimpleQueue = queue.SimpleQueue()
        self.to_write: queue.SimpleQueue = queue.SimpleQueue()
        self.error: BaseException | None = None
        self.stopping = False  # abort(): skip the work still queued
        self.threads = [threading.Thread(target=self._compute_loop, name="ckpt-compute", daemon=True),
                        threading.Thread(target=self._write_loop, name="ckpt-write", daemon=True)]
        for t in self.threads:
            t.start()
        if not self.torch_free:
            torch.set_num_threads(self.reader_threads)  # the reader: this thread
        self.open = True

    def _share_cores(self, busy_stage: str | None) -> None:
        # Each stage thread sets its own count as it starts: a thread takes whatever count another thread set
        # last when it first uses torch (torch 2.13's OpenMP build), so setting it here before starting the
        # compute thread left that thread with the reader's share (issue 25: K-quant and legacy GGUF encodes
        # ran on one core with busy_stage "compute").
        self.threads_before = cores = torch.get_num_threads()
        share = stage_threads(cores)
        self.compute_threads = cores if busy_stage == "compute" else share
        self.reader_threads = cores if busy_stage == "read" else share

    # ------------------------------------------------------------------------------------- reader side

    def band(self) -> Slot:
        """A free slot (blocks while `depth` bands are in flight); raises what a stage raised."""
        slot = self.free.get()
        if self.error is not None:
            self.free.put(slot)
            self._raise()
        slot.deferred.clear()
        return slot

    def reading(self):
        """Context for the reader's device work (its own CUDA stream)."""
        return self.gpu.reading() if self.gpu else contextlib.nullcontext()

    def submit(self, slot: Slot, name: str, dtype: torch.dtype, data: torch.Tensor, cast=None) -> None:
        """Band `data` of tensor `name` (planned `dtype`), read into `slot`; `cast(data, slot)` runs on the
        compute stage (None: `data` is already the output band)."""
        b = _Band(slot, name, dtype, cast, data)
        if self.gpu:
            b.ready = self.gpu.mark_read()
        self.to_compute.put(b)

    def copy(self, name: str, ranges) -> None:
        """Stored byte `ranges` of tensor `name` for the writer to copy with the kernel (`ckpt.io.byte_copy`),
        in order with the bands around them. A copy holds no buffer, so it takes no slot."""
        if self.error is not None:
            self._raise()
        b = _Band(None, name, None, None, None)
        b.ranges, b.nbytes = ranges, sum(r.length for r in ranges)
        self.to_compute.put(b)

    def skip(self, name: str, n: int) -> None:
        """The next `n` bytes of tensor `name` are written by another thread (`ckpt.io.early_copies`): the writer
        steps over them in order with the bands around them (`RegionWriter.skip`). No slot, no data."""
        if self.error is not None:
            self._raise()
        b = _Band(None, name, None, None, None)
        b.ranges, b.skip = (), n
        self.to_compute.put(b)

    def finish(self) -> None:
        """Wait until every submitted band is written; raise what a stage raised."""
        self._stop()
        self._raise()

    def abort(self) -> None:
        """Stop the stages (queued bands are dropped) and wait for them; never raises their errors."""
        self.stopping = True
        self._stop()

    # -------------------------------------------------------------------------------------- the stages

    def _stop(self) -> None:
        if self.open:
            self.open = False
            self.to_compute.put(_STOP)
        for t in self.threads:
            t.join()
        if self.threads_before:
            torch.set_num_threads(self.threads_before)
            self.threads_before = 0
        if self.exact is not None:
            exact, self.exact = self.exact, None
            exact.__exit__(None, None, None)
        if self.gpu is not None:  # once per file: nothing of ours is still copying when the buffers go
            try:
                self.gpu.synchronize()
            except Exception:  # a device error; finish() reports it, abort() is already unwinding one
                if self.stopping:
                    return
                raise

    def _raise(self) -> None:
        if self.error is not None:
            err = self.error
            raise err

    def _fail(self, e: BaseException) -> None:
        if self.error is None:
            self.error = e

    def _recycle(self, b: _Band) -> None:
        b.data = b.cast = b.ranges = None
        b.skip = 0
        b.host = []
        if b.slot is not None:
            self.free.put(b.slot)

    def _compute_loop(self) -> None:
        # torch sets a thread's count to the last one set anywhere when the thread first uses torch (its lazy
        # per-thread init); after that first use, this thread's own setting stays its own
        if not self.torch_free:
            torch.get_num_threads()
            torch.set_num_threads(self.compute_threads)
        while True:
            b = self.to_compute.get()
            if b is _STOP:
                self.to_write.put(_STOP)
                return
            if self.error is not None or self.stopping:
                self._recycle(b)
                continue
            if b.ranges is not None:  # a byte copy: nothing to compute
                self.to_write.put(b)
                continue
            try:
                if self.torch_free:  # a numpy band: its cast (a compiled kernel) releases the GIL
                    b.data = y = b.data if b.cast is None else b.cast(b.data, b.slot)
                    b.nbytes = y.nbytes
                    self.to_write.put(b)
                    continue
                with self.gpu.computing(b) if self.gpu else contextlib.nullcontext():
                    y = b.data if b.cast is None else b.cast(b.data, b.slot)
                    if y.dtype != b.dtype:
                        raise RuntimeError(f"{b.name}: produced {y.dtype}, planned {b.dtype}")
                    b.nbytes = y.numel() * y.element_size()
                    if y.device.type != "cpu":
                        y = self.gpu.to_host(b, y)
                    b.host += [(fn, v.cpu()) for fn, v in b.slot.deferred]  # left on a device: copied now
                    b.slot.deferred.clear()
                    b.data = y.contiguous()
                self.to_write.put(b)
            except BaseException as e:  # re-raised on the reader's thread by band() / finish()
                self._fail(e)
                self._recycle(b)

    def _write_loop(self) -> None:
        while True:
            b = self.to_write.get()
            if b is _STOP:
                return
            try:
                if self.error is None and not self.stopping:
                    if b.done is not None:
                        b.done.synchronize()  # the one wait per band on CUDA
                    if b.skip:
                        self.writer.skip(b.name, b.skip)
                    elif b.ranges is not None:
                        self.writer.copy(b.name, b.ranges)
                    else:
                        self.writer.write(b.name, b.data)
                    for fn, host in b.host:
                        fn(host)
                    if self.progress is not None:
                        self.progress.update(b.nbytes)
            except BaseException as e:
                self._fail(e)
            finally:
                self._recycle(b)


class _CudaStreams:
    """The three CUDA streams of the write stages and the hand-offs between them. Tensors made on one
    stream and used on another are `record_stream`-ed, so the caching allocator never reuses their memory
    early; host memory is pinned (torch's caching host allocator keeps a pinned block until the copies
    that used it are done, so it is reused without page faults and never while a copy reads it)."""

    def __init__(self, device: torch.device):
        self.device = device if device.index is not None else torch.device("cuda", torch.cuda.current_device())
        self.read = torch.cuda.Stream(self.device)
        self.compute = torch.cuda.Stream(self.device)
        self.d2h = torch.cuda.Stream(self.device)

    @contextlib.contextmanager
    def reading(self):
        with torch.cuda.device(self.device), torch.cuda.stream(self.read):
            yield

    def mark_read(self):
        ev = torch.cuda.Event()
        ev.record(self.read)
        return ev

    @contextlib.contextmanager
    def computing(self, b: _Band):
        with torch.cuda.device(self.device), torch.cuda.stream(self.compute):
            self.compute.wait_event(b.ready)
            if b.data.device.type == "cuda":
                b.data.record_stream(self.compute)
            yield

    def to_host(self, b: _Band, y: torch.Tensor) -> torch.Tensor:
        """Queue the device->host copy of `y` (and of the band's deferred values) on the copy stream,
        into the slot's own pinned buffer (reused band after band: no fresh pinned memory per band)."""
        self.d2h.wait_stream(self.compute)
        with torch.cuda.stream(self.d2h):
            y.record_stream(self.d2h)
            n = y.numel() * y.element_size()
            host = b.slot.pinned("d2h", n).view(y.dtype).view(y.shape) if n else torch.empty(y.shape, dtype=y.dtype)
            host.copy_(y, non_blocking=True)
            b.slot.fence("d2h", self.d2h)
            b.host = [(fn, _pinned_copy(v, self.d2h)) for fn, v in b.slot.deferred]
            b.slot.deferred.clear()
            b.done = torch.cuda.Event(blocking=True)  # the writer sleeps on it, not spins
            b.done.record(self.d2h)
        return host


    def synchronize(self) -> None:
        for stream in (self.read, self.compute, self.d2h):
            stream.synchronize()


def _pinned_copy(t: torch.Tensor, stream) -> torch.Tensor:
    """A few counts per band: torch's caching host allocator recycles these small pinned blocks."""
    t.record_stream(stream)
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    return host
