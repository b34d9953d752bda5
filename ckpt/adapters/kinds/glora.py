"""LyCORIS GLoRA: dW = scale * (W @ A + B) with A = a1 @ a2 acting on the input dim and B = b1 @ b2,
i.e. W' = W + ratio * scale * (W a1 a2 + b1 b2); scale alpha / rank (no alpha: 1).

Current LyCORIS shapes: a1 [in, r], a2 [r, in], b1 [out, r], b2 [r, in(*k*k)] (conv: trailing 1x1 or
kernel dims). Older files store the pairs the other way round (a1 [r, in], a2 [in, r], b1 [r, in],
b2 [out, r]); the shapes tell which. W here is the weight as merged so far (earlier LoRAs included).
"""

from __future__ import annotations

import math

from ckpt.lazy import torch

from ckpt.adapters.kinds.base import Adapter, alpha_scale


class GLoRA(Adapter):
    kind = "glora"

    def __init__(self, module):
        super().__init__(module)
        p = module.parts
        missing = [r for r in ("a1", "a2", "b1", "b2") if r not in p]
        if missing:
            raise self.error(f"GLoRA module lacks {missing[0]}.weight")
        a1, a2, b1, b2 = (p[r].shape for r in ("a1", "a2", "b1", "b2"))
        if a1[1] == a2[0] == b1[1] == b2[0]:
            self.roles = ("a1", "a2", "b1", "b2")
        elif a1[0] == a2[1] == b1[0] == b2[1]:
            self.roles = ("a2", "a1", "b2", "b1")  # older layout: the pairs swapped
            a1, a2, b1, b2 = a2, a1, b2, b1
        else:
            raise self.error(f"GLoRA shapes a1 {list(a1)} a2 {list(a2)} b1 {list(b1)} b2 {list(b2)} do not chain")
        self.rank, self.n_in = a1[1], a1[0]
        if a2[1] != self.n_in or math.prod(b1[2:]) != 1:
            raise self.error("GLoRA a2 does not map back to the input width")
        self._rows, self._cols = b1[0], math.prod(b2[1:])
        self.scale = alpha_scale(module.alpha(), self.rank)

    def apply(self, w, a, b, ratio):
        ra1, ra2, rb1, rb2 = (self.part(r) for r in self.roles)
        A1 = ra1.reshape(self.n_in, self.rank)
        A2 = ra2.reshape(self.rank, self.n_in)
        w3 = w.view(w.shape[0], self.n_in, -1)
        wa = torch.einsum("oik,ij->ojk", w3, A1)
        delta = torch.einsum("ojk,ji->oik", wa, A2).reshape(w.shape[0], -1)
        delta.addmm_(rb1.reshape(self._rows, -1)[a:b], rb2.reshape(self.rank, -1))
        w.add_(delta, alpha=ratio * self.scale)
