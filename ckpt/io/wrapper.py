"""`Wrapper`: a tensor made from one other tensor, `base` (renamed, re-banded, permuted rows, merged patches).

What the wrapped tensor says of its storage stays the base's: the dtype the model had (`natural_dtype`, the
default output dtype) and the bytes reading it costs (`source_bytes`, progress accounting). `read` passes
the base's rows through unless a subclass computes something from them.
"""

from __future__ import annotations

from ckpt.io.tensors import Tensor


class Wrapper(Tensor):
    base: Tensor

    @property
    def natural_dtype(self):
        return self.base.natural_dtype

    @property
    def source_bytes(self):
        return self.base.source_bytes

    def read(self, start, stop, device, scratch=None):
        return self.base.read(start, stop, device, scratch)
