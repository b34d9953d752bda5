"""The tensors llama.cpp's converter makes of a Hugging Face model's on the way to GGUF, as lazy views: each reads its
rows band by band from the source tensors, so an architecture's transforms stream like every output.

Facts of the converter shared by the architectures (`ckpt.families.llm.archs`): q/k rows permuted for llama.cpp's
RoPE (`LlamaModel.permute`), a constant added (Gemma's norms + 1), per-expert matrices stacked into one tensor."""

from __future__ import annotations

import math

from ckpt.lazy import torch

from ckpt.errors import CkptError
from ckpt.io.tensors import Tensor, read_rows


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

    def natural_source(self):
        return self.parts[0]

    def read(self, start, stop, device, scratch=None):
        out = torch.empty((stop - start, *self.shape[1:]), dtype=self.dtype, device=device)
        for i in range(start, stop):
            p = self.parts[i]
            out[i - start].copy_(p.read(0, p.rows, device, scratch).reshape(self.shape[1:]))
        return out


class RowsGathered(Tensor):
    """Runs of another tensor's rows, [(start, stop), ...], one after the other: a fused projection split and
    regrouped as llama.cpp has it (Qwen3-Next's per-head q/k/v/z rows as q, k, v and z; Qwen3.5's value heads
    from grouped to tiled order). A band reads only the runs it covers, each copied out of the base's band."""

    def __init__(self, base: Tensor, runs, name: str | None = None):
        self.base, self.runs = base, [(int(a), int(b)) for a, b in runs]
        if not base.shape or any(not 0 <= a <= b <= base.rows for a, b in self.runs):
            raise CkptError(f"{base.name}: rows {self.runs[:2]}... outside {list(base.shape)}")
        self.name, self.home = name or base.name, base.home
        self.shape = (sum(b - a for a, b in self.runs), *base.shape[1:])
        self.row_align = None if base.row_align is None else 1

    dtype = property(lambda self: self.base.dtype)  # asked of the base when needed: planning needs no torch
    dtype_name = property(lambda self: self.base.dtype_name)

    def natural_source(self):
        return self.base

    def read(self, start, stop, device, scratch=None):
        out = torch.empty((stop - start, *self.shape[1:]), dtype=self.dtype, device=device)
        at = 0
        for a, b in self.runs:
            lo, hi = max(start, at), min(stop, at + b - a)
            if lo < hi:
                out[lo - start: hi - start].copy_(read_rows(self.base, a + lo - at, a + hi - at, device, scratch))
            at += b - a
            if at >= stop:
                break
        return out


class ColumnsGathered(Tensor):
    """Another tensor's columns in the order `index` gives (`x[:, index]`), row band by row band: the input
    side of a projection whose inputs llama.cpp reorders (Qwen3.5's out_proj over tiled value heads)."""

    def __init__(self, base: Tensor, index, name: str | None = None):
        if len(base.shape) < 2 or sorted(index) != list(range(base.shape[1])):
            raise CkptError(f"{base.name}: {len(index)} columns cannot reorder {list(base.shape)}")
        self.base, self.index = base, list(index)
        self.name, self.home, self.shape, self.row_align = name or base.name, base.home, tuple(base.shape), \
            base.row_align

    dtype = property(lambda self: self.base.dtype)
    dtype_name = property(lambda self: self.base.dtype_name)

    def natural_source(self):
        return self.base

    def read(self, start, stop, device, scratch=None):
        x = self.base.read(start, stop, device, scratch)
        return x.index_select(1, torch.tensor(self.index, dtype=torch.long, device=x.device))


class Packed(Tensor):
    """A tensor the reference writes as bytes the checkpoint already holds in a GGML block type, moved, not
    requantized (gpt-oss's MXFP4 expert banks, repacked from their blocks and scales): `base` is its values (what
    a llama-quantize mix that gives it another type quantizes), `packed` its bytes in `ggml_type` (uint8
    [..., rows, bytes per row], the GGUF's stored rows). The planner (`ckpt.targets.planners.gguf_llm_out`)
    writes `packed` as it is for every `convert_hf_to_gguf.py` outtype."""

    def __init__(self, base: Tensor, packed: Tensor, ggml_type: str, name: str | None = None):
        self.base, self.packed, self.ggml_type = base, packed, ggml_type
        self.name, self.home, self.shape, self.row_align = name or base.name, base.home, tuple(base.shape), \
            base.row_align

    dtype = property(lambda self: self.base.dtype)
    dtype_name = property(lambda self: self.base.dtype_name)

    def natural_source(self):
        return self.base

    @property
    def source_bytes(self) -> int:
        return self.packed.source_bytes

    def read(self, start, stop, device, scratch=None):
        return self.base.read(start, stop, device, scratch)


class Picked(Tensor):
    """`base[:, ..., index, ...]`: one index of a dimension past the first, that dimension dropped (Qwen2-VL's
    Conv3D patch kernel [out, in, t, h, w] as llama.cpp's two Conv2D kernels, one per temporal slice). Rows are
    the base's, read band by band."""

    def __init__(self, base: Tensor, dim: int, index: int, name: str | None = None):
        if not 0 < dim < len(base.shape) or not 0 <= index < base.shape[dim]:
            raise CkptError(f"{base.name}: no index {index} of dimension {dim} in {list(base.shape)}")
        self.base, self.dim, self.index = base, dim, index
        self.name, self.home, self.row_align = name or base.name, base.home, base.row_align
        self.dtype = base.dtype
        self.shape = tuple(s for i, s in enumerate(base.shape) if i != dim)

    def natural_source(self):
        return self.base

    def read(self, start, stop, device, scratch=None):
        return self.base.read(start, stop, device, scratch).select(self.dim, self.index).contiguous()


class Unstacked(Tensor):
    """Matrix `index` of a stacked [n, rows, cols] tensor: one expert of llama.cpp's `ffn_*_exps`, read back as the
    per-expert HF tensor `Stacked` was made of (GLM-4.5's `mlp.experts.X.*_proj`, MiniMax-M2's
    `block_sparse_moe.experts.X.w1..3`). Read whole (one expert's matrix per read: a stored GGUF tensor is read in
    whole experts); its stored bytes are a byte range of the stacked tensor's where those are plain."""

    row_align = None

    def __init__(self, base: Tensor, index: int, name: str):
        if len(base.shape) != 3 or not 0 <= index < base.shape[0]:
            raise CkptError(f"{base.name}: no matrix {index} in {list(base.shape)}")
        self.base, self.index, self.name, self.home = base, index, name, base.home
        self.shape = tuple(base.shape[1:])

    dtype = property(lambda self: self.base.dtype)  # asked of the base when needed: planning needs no torch
    dtype_name = property(lambda self: self.base.dtype_name)

    def natural_source(self):
        return self.base

    def byte_ranges(self):
        from ckpt.io.tensors import sub_ranges

        ranges = self.base.byte_ranges()
        if ranges is None:
            return None
        size = sum(r.length for r in ranges) // self.base.rows
        return sub_ranges(ranges, self.index * size, (self.index + 1) * size)

    def read(self, start, stop, device, scratch=None):
        return read_rows(self.base, self.index, self.index + 1, device, scratch)[0, start:stop]
