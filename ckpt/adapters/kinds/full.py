"""LyCORIS full fine-tune deltas: `diff` (the whole dW) and `diff_b` (bias delta), scale 1."""

from __future__ import annotations

import math

from ckpt.adapters.kinds.base import Adapter


class Full(Adapter):
    zero_if_any = ("diff",)  # the delta itself
    bias_role = "diff_b"
    kind = "full"

    def __init__(self, module):
        super().__init__(module)
        p = module.parts
        if "diff" not in p and "diff_b" not in p:
            raise self.error("full module has neither diff nor diff_b")
        s = p["diff"].shape if "diff" in p else None
        self.has_weight = "diff" in p
        self._rows = s[0] if s else None
        self._cols = math.prod(s[1:]) if s else None

    def apply(self, w, a, b, ratio):
        w.add_(self.part("diff").reshape(self._rows, -1)[a:b], alpha=ratio)

    def delta(self):
        if not self.has_weight:
            raise self.error("holds only a bias delta (diff_b)")
        return self.part("diff").reshape(self._rows, -1).clone()

    def apply_bias(self, bias, a, b, ratio):
        bias.add_(self.part("diff_b")[a:b], alpha=ratio)
