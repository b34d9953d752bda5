"""LyCORIS LoHa: dW = (w1a @ w1b) * (w2a @ w2b) (Hadamard product), scale alpha / rank with
rank = w1b.shape[0]. Tucker (`hada_t1`/`hada_t2`, conv kernels): w = einsum("i j k l, i p, j r -> p r k l",
t, wa, wb) with wa [rank, out], wb [rank, in]."""

from __future__ import annotations

import math

from ckpt.lazy import torch

from ckpt.adapters.kinds.base import LowRankFamily, alpha_scale

ROLES = ("w1a", "w1b", "w2a", "w2b")


class LoHa(LowRankFamily):
    zero_if_any = ("w1a", "w1b", "w2a", "w2b", "t1", "t2")  # the delta is a product of these
    kind = "loha"

    def __init__(self, module):
        self.module = module
        p = module.parts
        missing = [r for r in ROLES if r not in p]
        if missing:
            raise self.error(f"LoHa module lacks hada_{missing[0][:2]}_{missing[0][2]}")
        shapes = [self._side_shape(i) for i in (1, 2)]
        if shapes[0] != shapes[1]:
            raise self.error(f"the two Hadamard factors have different shapes {shapes[0]} and {shapes[1]}")
        self._rows, self._cols = shapes[0]
        self.scale = alpha_scale(module.alpha(), p["w1b"].shape[0])
        super().__init__(module)

    def _side_shape(self, i):
        p = self.module.parts
        wa, wb = p[f"w{i}a"].shape, p[f"w{i}b"].shape
        if f"t{i}" in p:
            t = p[f"t{i}"].shape
            if len(t) < 2 or t[0] != wa[0] or t[1] != wb[0]:
                raise self.error(f"hada_t{i} {list(t)} does not fit hada_w{i}_a {list(wa)} / hada_w{i}_b {list(wb)}")
            return wa[1], wb[1] * math.prod(t[2:])
        if len(wa) != 2 or wa[1] != wb[0]:
            raise self.error(f"hada_w{i}_a {list(wa)} and hada_w{i}_b {list(wb)} do not multiply")
        return wa[0], math.prod(wb[1:])

    def _side(self, i, a, b):
        wa, wb = self.part(f"w{i}a"), self.part(f"w{i}b")
        if self.has(f"t{i}"):
            t = self.part(f"t{i}")
            return torch.einsum("ij...,ip,jr->pr...", t, wa[:, a:b], wb).reshape(b - a, -1)
        return wa[a:b] @ wb.reshape(wb.shape[0], -1)

    def add_delta(self, w, a, b, factor):
        w.add_(self._side(1, a, b).mul_(self._side(2, a, b)), alpha=factor)
