"""Reusable scratch buffers: allocating fresh pages costs about 1 GB/s in page faults here, so hot
paths read and cast into buffers that are kept and only grow (bounded by the band size).

On CUDA the buffers that copies go through are pinned (page-locked: the copy engines read and write
them directly, at full PCIe speed and asynchronously) and reused the same way, one per role: a run holds
a fixed set of them however many bands it moves. A pinned buffer is handed out again only after the
copy that last used it has finished (`fence` records where that copy was queued; `pinned` waits for it,
which in the write stages' steady state has long happened, so the wait costs nothing)."""

from __future__ import annotations

from ckpt.lazy import torch


class Buffers:
    def __init__(self):
        self._bufs: dict[str, torch.Tensor] = {}
        self._fences: dict[str, torch.cuda.Event] = {}
        self._children: dict[object, Buffers] = {}

    def child(self, key) -> "Buffers":
        """Buffers of their own for one operand of a tensor that reads several (a model merge reads one band of
        each input model into the same slot): the operands' role names never collide."""
        c = self._children.get(key)
        if c is None:
            c = self._children[key] = Buffers()
        return c

    def get(self, role: str, nbytes: int) -> torch.Tensor:
        """A uint8 CPU tensor of at least `nbytes`, reused by the next call with the same role."""
        buf = self._bufs.get(role)
        if buf is None or buf.numel() < nbytes:
            buf = torch.empty(max(nbytes, 1), dtype=torch.uint8)
            self._bufs[role] = buf
        return buf

    def host(self, role: str, nbytes: int):
        """A numpy uint8 array of exactly `nbytes`, reused (grown) by the next call with the same role: the
        buffers of a band read and cast without torch (`ckpt.cast.Caster.host_cast`)."""
        key = "host:" + role
        buf = self._bufs.get(key)
        if buf is None or buf.size < nbytes:
            from ckpt.lazy import numpy as np

            buf = self._bufs[key] = np.empty(max(nbytes, 1), dtype=np.uint8)
        return buf[:nbytes]

    def typed(self, role: str, dtype: torch.dtype, shape) -> torch.Tensor:
        n = 1
        for d in shape:
            n *= d
        return self.get(role, n * dtype.itemsize)[: n * dtype.itemsize].view(dtype).reshape(shape)

    def pinned(self, role: str, nbytes: int) -> torch.Tensor:
        """A pinned uint8 host tensor of exactly `nbytes` for an asynchronous copy to or from a GPU, reused
        by the next call with the same role once the copy `fence`d after this one has finished."""
        fence = self._fences.pop(role, None)
        if fence is not None:
            fence.synchronize()
        key = "pinned:" + role
        buf = self._bufs.get(key)
        if buf is None or buf.numel() < nbytes:
            self._bufs.pop(key, None)  # back to torch's pinned cache before a larger one is taken
            buf = torch.empty(max(nbytes, 1), dtype=torch.uint8, pin_memory=True)
            self._bufs[key] = buf
        return buf[:nbytes]

    def fence(self, role: str, stream=None) -> None:
        """Mark the copy just queued on `stream` (default: the current one) as the last user of the
        pinned buffer of `role`."""
        ev = torch.cuda.Event()
        ev.record(stream)
        self._fences[role] = ev
