"""FP8 storage layouts decoded to plain values (float32, exact products), see FORMATS.md "FP8".

Plain fp8 tensors need no decoder: they are read as they are and cast exactly by the caster.
Scaled layouts become `ScaledTensor`s: W = w.float() * scale, computed in fp32 and rounded once by the
caller's cast.
"""

from __future__ import annotations

import torch

from ckpt.dtypes import FP8
from ckpt.io.tensors import Tensor
from ckpt.quant.view import DecodeContext, Decoded


class ScaledTensor(Tensor):
    """W = w.float() * s with s broadcast per tensor (numel 1) or per row ([out, 1] ...)."""

    def __init__(self, weight: Tensor, scale: Tensor, natural=torch.bfloat16):
        self.weight, self.scale = weight, scale
        self.name, self.shape, self.home = weight.name, weight.shape, weight.home
        self.dtype = torch.float32
        self._natural = natural
        self.row_align = weight.row_align

    @property
    def natural_dtype(self):
        return self._natural

    @property
    def source_bytes(self):
        return self.weight.source_bytes

    def read(self, start, stop, device, out=None):
        w = self.weight.read(start, stop, device, out).float()
        s = self.scale.read_all(device).float()
        if s.numel() == 1:
            return w.mul_(s.reshape(()))
        return w.mul_(s.reshape(s.shape[0], *([1] * (w.dim() - 1)))[start:stop])


def comfy_legacy(ctx: DecodeContext) -> Decoded | None:
    """ComfyUI legacy scaled fp8: marker `<prefix>scaled_fp8`, per layer `X.scale_weight` (fp32 scalar),
    optional `X.scale_input`."""
    markers = [k for k in ctx.remaining if k == "scaled_fp8" or k.endswith(".scaled_fp8")]
    if not markers:
        return None
    tensors, consumed = {}, {m: "ComfyUI scaled-fp8 marker" for m in markers}
    for key in list(ctx.remaining):
        if key.endswith(".scale_weight"):
            wkey = key[: -len(".scale_weight")] + ".weight"
            w = ctx.remaining.get(wkey)
            if w is not None and w.dtype in FP8:
                tensors[wkey] = ScaledTensor(w, ctx.remaining[key])
                consumed[key] = f"scale of {wkey}"
        elif key.endswith(".scale_input"):
            consumed[key] = "activation scale (inference only)"
    return Decoded("comfy-scaled-fp8", tensors, consumed)


DECODERS = [comfy_legacy]
