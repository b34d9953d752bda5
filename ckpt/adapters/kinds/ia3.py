"""LyCORIS (IA)^3: W' = W * (1 + ratio * w) with the vector `w` on the output axis (rows), or on the
input axis when the module's `on_input` flag is set (conv: broadcast over the kernel)."""

from __future__ import annotations

from ckpt.adapters.kinds.base import Adapter


class IA3(Adapter):
    kind = "ia3"

    def __init__(self, module):
        super().__init__(module)
        p = module.parts
        if "weight" not in p:
            raise self.error("(IA)^3 module has on_input but no weight")
        self.n = p["weight"].numel
        self.on_input = bool(p["on_input"].read_all(self.device).reshape(-1)[0].item()) if "on_input" in p else False

    @property
    def rows(self):
        return None if self.on_input else self.n

    @property
    def cols(self):
        return None

    def check(self, rows, cols):
        if self.on_input and cols % self.n:
            return f"(IA)^3 input vector of {self.n} does not divide the {cols} input columns"
        if not self.on_input and rows != self.n:
            return f"(IA)^3 output vector of {self.n} entries, the target has {rows} rows"
        return None

    def apply(self, w, a, b, ratio):
        v = self.part("weight").reshape(-1)
        if self.on_input:
            w.view(w.shape[0], self.n, -1).mul_((v * ratio + 1).view(1, -1, 1))
        else:
            w.mul_((v[a:b] * ratio + 1).unsqueeze(1))
