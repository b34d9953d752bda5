"""Whole tensors an adapter ships in place of the base's: PEFT `modules_to_save` (saved as
`base_model.model.X.weight`) and the `X.base_layer.weight` PEFT saves when it trains embeddings.
They replace the base value before later deltas apply; a ratio r != 1 interpolates W + r * (new - W)."""

from __future__ import annotations

import math

from ckpt.adapters.kinds.base import Adapter


class Replace(Adapter):
    bias_role = "bias"
    kind = "replace"

    def __init__(self, module):
        super().__init__(module)
        w = module.parts.get("weight")
        self.has_weight = w is not None
        self._rows = w.shape[0] if w is not None and w.shape else None
        self._cols = math.prod(w.shape[1:]) if w is not None and w.shape else None

    def _put(self, dst, new, ratio):
        if ratio == 1:
            dst.copy_(new)
        else:
            dst.lerp_(new, ratio)

    def apply(self, w, a, b, ratio):
        self._put(w, self.part("weight").reshape(self._rows, -1)[a:b], ratio)

    def apply_bias(self, bias, a, b, ratio):
        self._put(bias, self.part("bias")[a:b], ratio)
