"""A base tensor with adapters baked in, as a logical `Tensor` the ordinary writer streams.

The base value (already decoded by ckpt.quant when it was stored as FP8) is read, widened to fp32 on
the work device, and every patch applies in order (several LoRAs stack onto the same tensor, each with
its own ratio). The result is fp32; the convert `Caster` then rounds once to the output dtype.

When every patch is row-local (a row of the result depends only on the same row of the base: LoRA,
LoHa, LoKr, full, IA3, GLoRA, output-axis DoRA), the tensor is read in row bands like any other, so
memory stays at a few bands. Otherwise (input-axis DoRA, targets with a `Transform`) it is read whole.

Before the plan wraps it, a matched base tensor stands in its view as `Patched`: the patches travel on the
tensor, so nothing has to look them up by object identity.
"""

from __future__ import annotations

from dataclasses import dataclass

from ckpt.lazy import torch

from ckpt.families import Transform
from ckpt.io.tensors import Tensor
from ckpt.io.wrapper import Wrapper


@dataclass
class Patch:
    adapter: object  # ckpt.adapters.kinds.base.Adapter
    ratio: float
    rows: tuple[int, int] | None = None  # slice of a fused target owned by the module
    transform: Transform | None = None  # the target's (ckpt.adapters.placement); the patch is applied whole
    bias: bool = False  # the patch changes the bias beside the adapter's weight
    offset: int = 0  # row of the module's delta that lands on the slice's first row (Placement.part)

    @property
    def row_local(self) -> bool:
        return self.transform is None and (self.bias or self.adapter.row_local)


class MergedTensor(Wrapper):
    @property
    def dtype(self):
        """fp32: the sum is computed there (a property so that importing the module needs no torch)."""
        return torch.float32

    dtype_name = "F32"  # the same, for planning without torch

    def __init__(self, base: Tensor, patches: list[Patch], replaces: Tensor | None = None):
        self.base, self.patches = base, patches
        self.replaces = base if replaces is None else replaces  # the decoded tensor it stands for (keep-format)
        self.name, self.shape, self.home = base.name, tuple(base.shape), base.home
        local = all(p.row_local for p in patches) and bool(self.shape)
        self.row_align = base.row_align if local else None

    def read(self, start, stop, device, scratch=None):
        x = self.base.read(start, stop, device, scratch)
        if device.type == "cpu":
            w = scratch.typed("merged", torch.float32, x.shape) if scratch is not None else torch.empty(x.shape)
            w.copy_(x)  # never change the base's own storage (pickles, cached values)
        else:
            w = x.to(torch.float32, copy=True)
        for p in self.patches:
            r0, r1 = p.rows or (0, self.rows)
            lo, hi = max(start, r0), min(stop, r1)
            if lo >= hi:
                continue
            seg = w[lo - start: hi - start]
            p.adapter.device, p.adapter.weight_dtype = device, self.base.dtype
            a, b = lo - r0 + p.offset, hi - r0 + p.offset
            if p.transform is None:
                if p.bias:
                    p.adapter.apply_bias(seg, a, b, p.ratio)
                else:
                    p.adapter.apply(seg.view(hi - lo, -1), a, b, p.ratio)
            else:
                _apply_transformed(p, seg)
        if stop >= self.rows:
            for p in self.patches:
                p.adapter.release()
        return w


class Patched(Wrapper):
    """A base tensor with the patches matched to it, standing for the base in the view a plan is made from.

    A plan's `make` sees one tensor at a time: carrying the patches here gives it what it needs without a
    side table keyed by object identity (names alone repeat across a pipeline's components). To the planning
    it is the base (name, dtype, shape, natural dtype); `merged()` is what gets written."""

    def __init__(self, base: Tensor, patches: list[Patch]):
        self.base, self.patches = base, patches
        self.name, self.shape, self.home, self.row_align = base.name, tuple(base.shape), base.home, base.row_align

    dtype = property(lambda self: self.base.dtype)
    dtype_name = property(lambda self: self.base.dtype_name)

    def merged(self) -> MergedTensor:
        return MergedTensor(self.base, self.patches)


def _apply_transformed(p: Patch, seg: torch.Tensor) -> None:
    """The module's delta is in its own layout; the target stores it transformed (whole slice): the
    slice is brought into the module's layout, patched there, and put back by the inverse."""
    tr = p.transform
    if p.bias:
        mod = tr.on_bias(seg)
        _apply_plain(p, mod)
        if mod is not seg:
            seg.copy_(tr.inverse.on_bias(mod))
        return
    mod = tr.apply(seg).contiguous()
    _apply_plain(p, mod)
    seg.copy_(tr.inverse.apply(mod))


def _apply_plain(p: Patch, seg: torch.Tensor) -> None:
    a, b = p.offset, p.offset + seg.shape[0]
    if p.bias:
        p.adapter.apply_bias(seg, a, b, p.ratio)
    else:
        p.adapter.apply(seg.reshape(seg.shape[0], -1), a, b, p.ratio)
