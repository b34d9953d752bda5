"""`Wrapper`: a tensor made from one other tensor, `base` (renamed, re-banded, permuted rows, merged patches,
or decoded from the stored codes a quantized format keeps there).

What the wrapped tensor says of its storage stays the base's: the bytes reading it costs (`source_bytes`,
progress accounting), and the dtype the model had (`natural_dtype`, the default output dtype) unless
`natural` says otherwise: a decoder's base is codes (fp8, int8, packed 4-bit) whose own dtype is the
encoding's, so it names the model's dtype itself. One place for both properties, so no decoder or
adapter spells them again. `read` passes the base's rows through unless a subclass computes something
from them.
"""

from __future__ import annotations

from ckpt.io.tensors import Tensor


class Wrapper(Tensor):
    base: Tensor
    natural = None  # a torch dtype: the model's, where the base's is a storage encoding's; None: the base's

    @property
    def natural_dtype(self):
        return self.base.natural_dtype if self.natural is None else self.natural

    @property
    def natural_dtype_name(self):
        if self.natural is None and type(self).natural_dtype is Wrapper.natural_dtype:
            return self.base.natural_dtype_name  # the base's, asked without torch where it can answer so
        return super().natural_dtype_name

    @property
    def source_bytes(self):
        return self.base.source_bytes

    def read(self, start, stop, device, scratch=None):
        return self.base.read(start, stop, device, scratch)


class Renamed(Wrapper):
    """Another tensor under a new name, values and storage unchanged: what most layout pairs are
    (`convert --layout`) and what a GGUF LLM's plain tensors are under their HF names. Its dtype is asked of
    the base when needed, so planning over stored tensors needs no torch."""

    def __init__(self, base: Tensor, name: str):
        self.base, self.name, self.home = base, name, base.home
        self.shape, self.row_align = tuple(base.shape), base.row_align

    dtype = property(lambda self: self.base.dtype)
    dtype_name = property(lambda self: self.base.dtype_name)

    def byte_ranges(self):
        return self.base.byte_ranges()
