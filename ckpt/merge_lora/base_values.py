"""The values merge-lora merges into: a base's logical tensors as the people who trained the LoRA had them, and the
views the output is planned from, with every matched tensor merged in place.

A base decoded from an LLM quantization format (`ckpt.quant.formats`: `llm`) is merged from the value its library
computes (`AsComputed`: rounded once to the format's compute dtype where the decoder gives exact fp32 products,
compressed-tensors int packs): that value is the weight the QLoRA was trained against and the one PEFT merges into
(`merge_and_unload` on the library's dequantized model)."""

from __future__ import annotations

from dataclasses import replace

from ckpt.adapters.merged import MergedTensor
from ckpt.dtypes import is_float
from ckpt.io.wrapper import Wrapper
from ckpt.quant.formats import format_of


class AsComputed(Wrapper):
    """A decoded LLM-quantization weight as its library computes it (module docstring)."""

    def __init__(self, base):
        self.base, self.name, self.home = base, base.name, base.home
        self.shape, self.row_align, self.dtype = tuple(base.shape), base.row_align, base.natural_dtype

    def read(self, start, stop, device, scratch=None):
        return self.base.read(start, stop, device, scratch).to(self.dtype)


def as_computed(t):
    """`t`, or AsComputed(t) where it is an LLM-quantization weight whose decoder reads wider than its compute dtype."""
    fmt = format_of(t)
    if fmt is not None and fmt.llm and is_float(t.dtype) and is_float(t.natural_dtype) and t.natural_dtype != t.dtype:
        return AsComputed(t)
    return t


def merged_views(views, patches) -> list:
    """The views a merge-lora output is planned from: every tensor as its library computes it, the matched ones
    merged (`MergedTensor`, which `replaces` the decoded tensor: --keep-format re-encodes exactly those), each view
    made from its decoded `origin`."""
    out = []
    for v, ps in zip(views, patches):
        tensors = {k: MergedTensor(as_computed(t), ps[k], replaces=t) if k in ps else as_computed(t)
                   for k, t in v.tensors.items()}
        out.append(replace(v, tensors=tensors, origin=v))
    return out
