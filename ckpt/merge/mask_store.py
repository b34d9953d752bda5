"""Keep masks one pass over a tensor computed, packed 8 to a byte, for the next pass over the same elements.

Why: DELLA's keep mask needs each row's magnitude ranks (a sort of every row, `ckpt.merge.masks_cpu.della_keep`),
and both the L1 rescale pass (`ckpt.merge.methods.task_arithmetic._stats`) and the merge pass need the mask of
every band: ranking twice made DELLA the slowest of the task-arithmetic methods (issue 37). The first pass's masks,
one bit per element and model, are kept here and served to the second; a band the store does not cover is ranked
again, which gives the same bits (a mask is a function of the seed, model, tensor and element alone), so the store
only ever saves time.

Memory: every store reserves its packed size from one process-wide budget (`BUDGET`) when it is made; a tensor
whose masks do not fit gets no store (its merge pass ranks again, as before). Bands are served in any order and
any size (the merge reads bands of its own size, the stats pass those of `Job.passes`); the reservation goes back
when every model's mask has been read to the tensor's end (or on `release`, or when the tensor's state is dropped).
"""

from __future__ import annotations

import threading

from ckpt.lazy import numpy as np, torch

BUDGET = 256 << 20  # bytes of packed masks held at once by the whole process

_LOCK = threading.RLock()  # the stores' bands (re-entrant: a store's __del__ may run inside another's section)
_BUDGET_LOCK = threading.Lock()  # the reservations
_reserved = 0


def _take(nbytes: int) -> bool:
    global _reserved
    with _BUDGET_LOCK:
        if _reserved + nbytes > BUDGET:
            return False
        _reserved += nbytes
        return True


def _give(nbytes: int) -> None:
    global _reserved
    with _BUDGET_LOCK:
        _reserved -= nbytes


def reserved() -> int:
    """Bytes the live stores hold reserved now (for tests)."""
    return _reserved


class MaskStore:
    """Bool masks of one tensor's elements, per model index, as one bit array per model (a bit per element, set by
    `put` band by band, in any order); `get` rebuilds any run of elements that puts have covered.

    One array per model for the whole tensor, made when the model's first band comes (`_zeros`)."""

    def __init__(self, numel: int, nbytes: int):
        self.numel = numel
        self.nbytes = nbytes
        self.bits: dict[int, object] = {}  # model -> uint8 array of ceil(numel / 8) bytes, bit e = element e
        self.covered: dict[int, list] = {}  # model -> [(start, stop)] put so far
        # one lock for every store: a lock of its own per tensor is a small malloc that outlives the bands' buffers
        # around it and kept the heap from shrinking (peak RSS +250 MB on a 0.5 GB merge, as the heap arrays did)
        self.lock = _LOCK

    @classmethod
    def reserve(cls, numel: int, models: int) -> "MaskStore | None":
        """A store for `models` masks of a tensor of `numel` elements, or None when the budget cannot hold them."""
        nbytes = models * -(-numel // 8)
        return cls(numel, nbytes) if nbytes and _take(nbytes) else None

    def put(self, model: int, start: int, mask) -> None:
        """Keep `mask` (bool, CPU), the mask of the elements [start, start + mask.numel()) in flat order."""
        flat = mask.reshape(-1).numpy()
        n = flat.shape[0]
        with self.lock:
            if self.nbytes == 0:  # released
                return
            arr = self.bits.get(model)
            if arr is None:
                arr = self.bits[model] = _zeros(-(-self.numel // 8))
            head = min(n, -start % 8)  # bits up to the next byte boundary: OR-ed into a byte a band before may share
            if head:
                arr[start // 8] |= np.packbits(np.concatenate([np.zeros(start % 8, dtype=bool), flat[:head]]))[0]
            if n > head:
                a = (start + head) // 8
                packed = np.packbits(flat[head:])  # the last byte's tail is zeros: a later band ORs its head in
                np.bitwise_or(arr[a:a + packed.shape[0]], packed, out=arr[a:a + packed.shape[0]])
            self.covered.setdefault(model, []).append((start, start + n))

    def get(self, model: int, start: int, shape):
        """The mask of the elements [start, start + numel(shape)) shaped `shape`, or None where puts have not
        covered them. The reservation goes back once every model's mask has been read up to the tensor's end."""
        import math

        n = math.prod(shape)
        stop = start + n
        with self.lock:
            arr = self.bits.get(model)
            if arr is None or not _covers(self.covered[model], start, stop):
                return None
            bits = np.unpackbits(arr[start // 8:(stop + 7) // 8])[start % 8:start % 8 + n]
            if stop == self.numel:
                self.covered[model] = []
            done = not any(self.covered.values())
        if done:  # the last band of every model served: give the memory back now, not when the tensor is dropped
            self.release()
        return torch.from_numpy(bits).view(torch.bool).reshape(shape)

    def release(self) -> None:
        """Drop the masks and give the reservation back (idempotent)."""
        with self.lock:
            nbytes, self.nbytes = self.nbytes, 0
            self.bits.clear()
            self.covered.clear()
        if nbytes:
            _give(nbytes)

    def __del__(self):
        self.release()


def _zeros(nbytes: int):
    """A zeroed uint8 array in pages of its own (an anonymous mapping, unmapped when the array goes): it lives for
    the tensor's passes, and a long-lived block from the heap among the bands' short-lived buffers keeps the heap
    from shrinking (as a per-store lock did: see `__init__`)."""
    import mmap

    return np.frombuffer(mmap.mmap(-1, max(1, nbytes)), dtype=np.uint8)[:nbytes]


def _covers(ranges, start: int, stop: int) -> bool:
    """Whether the union of `ranges` holds [start, stop)."""
    pos = start
    for a, b in sorted(ranges):
        if a > pos:
            break
        pos = max(pos, b)
        if pos >= stop:
            return True
    return pos >= stop
