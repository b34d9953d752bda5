"""LoRA / LoCon: kohya `lora_down/lora_up` (+ Tucker `lora_mid`), old diffusers `.lora.down/.lora.up`,
`to_q_lora`, `lora_linear_layer`, PEFT `lora_A/lora_B` (`lora_B.bias`), PEFT embeddings and
`fan_in_fan_out` layers (stored transposed).

dW = up.flatten(1) @ down.flatten(1) reshaped to W; Tucker:
einsum("m n k l, i m, n j -> i j k l", mid, up2d, down2d). Scale alpha / rank (rank = down.shape[0]),
alpha / sqrt(rank) with PEFT's use_rslora, 1 without alpha. Layers PEFT stores transposed (embeddings,
GPT-2 Conv1D with fan_in_fan_out) get dW^T = A^T @ B^T, still one row band at a time.
"""

from __future__ import annotations

import math

from ckpt.lazy import torch

from ckpt.adapters.kinds.base import LowRankFamily, alpha_scale


class LoRA(LowRankFamily):
    bias_role = "up_bias"
    kind = "lora"

    def __init__(self, module):
        p = module.parts
        if "emb_A" in p or "emb_B" in p:
            self.down_role, self.up_role, self.transposed = "emb_A", "emb_B", True
        else:
            self.down_role, self.up_role, self.transposed = "down", "up", module.fan_in_fan_out
        self.module = module
        for role in (self.down_role, self.up_role):
            if role not in p:
                raise self._missing(module, role)
        down, up = p[self.down_role].shape, p[self.up_role].shape
        if len(down) < 2 or len(up) < 2:
            raise self.error(f"LoRA factors must be at least 2-D (down {list(down)}, up {list(up)})")
        self.rank = down[0]
        up_rank = up[1] if self.up_role == "up" else up[-1]
        in_flat = math.prod(down[1:])
        if "mid" in p:
            mid = p["mid"].shape
            if len(mid) < 2 or mid[0] != up_rank or mid[1] != self.rank or len(down) > 2 and math.prod(down[2:]) != 1:
                raise self.error(f"lora_mid {list(mid)} does not fit down {list(down)} / up {list(up)}")
            in_flat = down[1] * math.prod(mid[2:])
        elif up_rank != self.rank or math.prod(up[2:]) != 1:
            raise self.error(f"up {list(up)} and down {list(down)} have different ranks")
        out = up[0]
        if self.transposed and (len(down) != 2 or len(up) != 2):
            raise self.error("transposed (fan_in_fan_out / embedding) LoRA factors must be 2-D")
        self._rows, self._cols = (in_flat, out) if self.transposed else (out, in_flat)
        self.scale = module.scale if module.scale is not None else alpha_scale(module.alpha(), self.rank, module.rslora)
        super().__init__(module)

    @property
    def zero_if_any(self) -> tuple[str, ...]:
        return (self.up_role, self.down_role, "mid")  # up first: an untrained lora_B is the usual zero

    @staticmethod
    def _missing(module, role):
        from ckpt.errors import CkptError

        return CkptError(f"{module.source}: module {module.name!r}: has no {role} weight "
                         f"(keys: {', '.join(module.keys)})")

    def _down2d(self) -> torch.Tensor:
        if "down_eff" not in self._cache:
            down = self.part(self.down_role).reshape(self.rank, -1)
            if self.has("mid"):
                mid = self.part("mid")
                down = torch.einsum("mn...,nj->mj...", mid, down).reshape(mid.shape[0], -1)
            self._cache["down_eff"] = down
        return self._cache["down_eff"]

    def factors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(up [rows, r], down [r, cols]) in fp32 with dW = up @ down (scale not included), in the
        row view `add_delta` uses (a Tucker `lora_mid` folded into down; transposed layers as
        A^T, B^T). Lets resize and merge decompose the product without forming it."""
        if self.transposed:
            A = self.part(self.down_role).reshape(self.rank, -1)
            B = self.part(self.up_role).reshape(-1, self.rank)
            return A.t(), B.t()
        up = self.part(self.up_role)
        return up.reshape(up.shape[0], -1), self._down2d()

    def add_delta(self, w, a, b, factor):
        if self.transposed:  # stored W^T: rows of dW^T are columns of A
            A = self.part(self.down_role).reshape(self.rank, -1)
            B = self.part(self.up_role).reshape(-1, self.rank)
            w.addmm_(A[:, a:b].t(), B.t(), alpha=factor)
        else:
            up = self.part(self.up_role).reshape(self.part(self.up_role).shape[0], -1)
            if self.module.delta_in_weight_dtype and self.weight_dtype is not None:
                from ckpt.adapters.mlx_lm import fused_delta

                w.add_(fused_delta(up[a:b] * factor, self._down2d()).to(self.weight_dtype))
            else:
                w.addmm_(up[a:b], self._down2d(), alpha=factor)

    def apply_bias(self, bias, a, b, ratio):
        bias.add_(self.part("up_bias")[a:b], alpha=ratio * self.scale)
