"""Reusable scratch buffers: allocating fresh pages costs about 1 GB/s in page faults here, so hot
paths read and cast into buffers that are kept and only grow (bounded by the band size)."""

from __future__ import annotations

import torch


class Buffers:
    def __init__(self):
        self._bufs: dict[str, torch.Tensor] = {}

    def get(self, role: str, nbytes: int) -> torch.Tensor:
        """A uint8 CPU tensor of at least `nbytes`, reused by the next call with the same role."""
        buf = self._bufs.get(role)
        if buf is None or buf.numel() < nbytes:
            buf = torch.empty(max(nbytes, 1), dtype=torch.uint8)
            self._bufs[role] = buf
        return buf

    def typed(self, role: str, dtype: torch.dtype, shape) -> torch.Tensor:
        n = 1
        for d in shape:
            n *= d
        return self.get(role, n * dtype.itemsize)[: n * dtype.itemsize].view(dtype).reshape(shape)
