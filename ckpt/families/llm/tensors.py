"""The tensors llama.cpp's converter makes of a Hugging Face model's on the way to GGUF, as lazy views: each reads its
rows band by band from the source tensors, so an architecture's transforms stream like every output.

Facts of the converter shared by the architectures (`ckpt.families.llm.archs`): q/k rows permuted for llama.cpp's
RoPE (`LlamaModel.permute`), a constant added (Gemma's norms + 1), per-expert matrices stacked into one tensor."""

from __future__ import annotations

import math

from ckpt.lazy import torch

from ckpt.errors import CkptError
from ckpt.io.tensors import Tensor


class HeadRowsPermuted(Tensor):
    """HF rows (2, hd/2) per head -> llama.cpp's (hd/2, 2) (`LlamaModel.permute`); the reader's
    `ckpt.quant.gguf_llm.HeadRowsUnpermuted` is its inverse. Bands hold whole heads."""

    def __init__(self, base: Tensor, head: int):
        self.base, self.head, self.name, self.home = base, head, base.name, base.home
        self.dtype, self.shape = base.dtype, tuple(base.shape)
        self.row_align = None if base.row_align is None else math.lcm(head, base.row_align)

    def read(self, start, stop, device, scratch=None):
        x = self.base.read(start, stop, device, scratch)
        rest = x.shape[1:]
        h = (stop - start) // self.head
        return x.reshape(h, 2, self.head // 2, *rest).transpose(1, 2).reshape(stop - start, *rest).contiguous()


class Shifted(Tensor):
    """`base + shift` as the reference computes it (Gemma's norms + 1): in float32 for a BF16 source (upcast
    first, as prepare_tensors does), else in the source's own dtype."""

    def __init__(self, base: Tensor, shift: float):
        self.base, self.shift, self.name, self.home = base, shift, base.name, base.home
        self.shape, self.row_align = tuple(base.shape), base.row_align
        self.dtype = base.dtype if base.dtype in (torch.float16, torch.float32) else torch.float32

    def read(self, start, stop, device, scratch=None):
        return self.base.read(start, stop, device, scratch).to(self.dtype) + self.shift


class Stacked(Tensor):
    """Matrices of one shape stacked on a new first dim (`torch.stack(parts)`): a layer's experts as the one
    [experts, rows, cols] tensor llama.cpp has. A band is whole experts, each read and copied in turn."""

    row_align = 1

    def __init__(self, name: str, parts: list[Tensor]):
        first = parts[0]
        for p in parts:
            if tuple(p.shape) != tuple(first.shape) or p.dtype != first.dtype:
                raise CkptError(f"{name}: experts {first.name} {list(first.shape)} and {p.name} {list(p.shape)} "
                                "cannot be stacked")
        self.name, self.parts, self.home, self.dtype = name, list(parts), first.home, first.dtype
        self.shape = (len(parts), *first.shape)

    @property
    def natural_dtype(self) -> torch.dtype:
        return self.parts[0].natural_dtype

    def read(self, start, stop, device, scratch=None):
        out = torch.empty((stop - start, *self.shape[1:]), dtype=self.dtype, device=device)
        for i in range(start, stop):
            p = self.parts[i]
            out[i - start].copy_(p.read(0, p.rows, device, scratch).reshape(self.shape[1:]))
        return out
