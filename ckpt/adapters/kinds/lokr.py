"""LyCORIS LoKr: dW = kron(W1, W2), W1 = lokr_w1 or w1_a @ w1_b, W2 = lokr_w2, w2_a @ w2_b, or Tucker
einsum("i j k l, i p, j r -> p r k l", lokr_t2, w2_a, w2_b).

The scale follows LyCORIS' forward pass and is applied once: alpha / rank with the rank of a
decomposed factor (w2_b.shape[0], else w1_b.shape[0]); when both factors are full matrices the scale
is 1 whatever alpha says. (LyCORIS' own merge path multiplies the scale in twice.)

Row i of kron(W1, W2) is W1[i // n2] (x) W2[i % n2], so a row band needs only the W1 rows it touches.
"""

from __future__ import annotations

import math

from ckpt.lazy import torch

from ckpt.adapters.kinds.base import LowRankFamily, alpha_scale


class LoKr(LowRankFamily):
    zero_if_any = ("w1", "w1a", "w1b", "w2", "w2a", "w2b", "t2")  # the delta is a product of these
    kind = "lokr"

    def __init__(self, module):
        self.module = module
        p = module.parts
        (r1, c1), rank1 = self._shape1(p)
        (r2, c2), rank2 = self._shape2(p)
        self._n2 = r2
        self._rows, self._cols = r1 * r2, c1 * c2
        rank = rank2 if rank2 is not None else rank1
        self.scale = 1.0 if rank is None else alpha_scale(module.alpha(), rank)
        super().__init__(module)

    def _shape1(self, p):
        if "w1" in p:
            s = p["w1"].shape
            if len(s) != 2:
                raise self.error(f"lokr_w1 must be 2-D, got {list(s)}")
            return (s[0], s[1]), None
        if "w1a" in p and "w1b" in p:
            a, b = p["w1a"].shape, p["w1b"].shape
            if len(a) != 2 or len(b) != 2 or a[1] != b[0]:
                raise self.error(f"lokr_w1_a {list(a)} and lokr_w1_b {list(b)} do not multiply")
            return (a[0], b[1]), b[0]
        raise self.error("LoKr module lacks lokr_w1 (or lokr_w1_a/lokr_w1_b)")

    def _shape2(self, p):
        if "w2" in p:
            s = p["w2"].shape
            return (s[0], math.prod(s[1:])), None
        if "w2a" in p and "w2b" in p:
            a, b = p["w2a"].shape, p["w2b"].shape
            if "t2" in p:
                t = p["t2"].shape
                if len(t) < 2 or t[0] != a[0] or t[1] != b[0]:
                    raise self.error(f"lokr_t2 {list(t)} does not fit lokr_w2_a {list(a)} / lokr_w2_b {list(b)}")
                return (a[1], b[1] * math.prod(t[2:])), b[0]
            if len(a) != 2 or a[1] != b[0]:
                raise self.error(f"lokr_w2_a {list(a)} and lokr_w2_b {list(b)} do not multiply")
            return (a[0], math.prod(b[1:])), b[0]
        raise self.error("LoKr module lacks lokr_w2 (or lokr_w2_a/lokr_w2_b)")

    def _w1(self):
        if "W1" not in self._cache:
            self._cache["W1"] = self.part("w1") if self.has("w1") else self.part("w1a") @ self.part("w1b")
        return self._cache["W1"]

    def _w2(self):
        if "W2" not in self._cache:
            if self.has("w2"):
                w2 = self.part("w2")
            elif self.has("t2"):
                w2 = torch.einsum("ij...,ip,jr->pr...", self.part("t2"), self.part("w2a"), self.part("w2b"))
            else:
                w2 = self.part("w2a") @ self.part("w2b").reshape(self.part("w2b").shape[0], -1)
            self._cache["W2"] = w2.reshape(self._n2, -1)
        return self._cache["W2"]

    def add_delta(self, w, a, b, factor):
        n2 = self._n2
        lo, hi = a // n2, (b - 1) // n2 + 1
        k = torch.kron(self._w1()[lo:hi], self._w2())
        w.add_(k[a - lo * n2: b - lo * n2], alpha=factor)
