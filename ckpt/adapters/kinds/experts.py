"""PEFT LoRAs on 3-D expert parameters (`LoraConfig(target_parameters=[...])`, PEFT's `lora.ParamWrapper`): gpt-oss
`mlp.experts.gate_up_proj` / `mlp.experts.down_proj`, stored [experts, in, out].

PEFT saves such a module under the name of the module that owns the parameter (`...mlp.experts.lora_A.weight`);
several parameters of one module nest their wrappers, each inner one a `base_layer` deeper, the first parameter
wrapped (in the module's registration order) innermost. Its factors are one LoRA of rank r * E over all experts:
lora_A [r * E, in] with rows expert-major (e * r + j), lora_B [out, r * E] with columns rank-major (j * E + e);
expert e's delta is (PEFT `ParamWrapper.get_delta_weight`, parameters stored [E, in, out] as gpt-oss's are):

    delta[e] = scaling * einsum("o r e, e r i -> e i o", B.reshape(out, r, E), A.reshape(E, r, in))[e]

The key map (`ckpt.adapters.keymap`) claims the module names for the banks with an `ExpertBank` transform on
the Placement: to the shape checks it presents the bank as the [out, in] a LoRA of these factors has, and it marks
the patch so that `experts_patches` gives it an `ExpertLoRA`, which adds each expert's delta to the whole bank
(`match_loras` calls it, so merge-lora and `ckpt merge`'s BASE+LORA share it; a path that does not is refused by
the unprepared transform instead of applying the factors as a plain LoRA).

Names are resolved without the LoRA's shapes, so the nesting is read as PEFT writes it when both banks are
targeted (or down_proj alone): `experts` is down_proj's, `experts.base_layer` gate_up_proj's. A LoRA on gate_up_proj
alone is saved as `experts` too: its factors do not fit down_proj, and fit gate_up_proj only, so it lands there
(`command._other_bank`).
"""

from __future__ import annotations

from dataclasses import replace

from ckpt.lazy import torch

from ckpt.adapters.kinds.base import Adapter, alpha_scale
from ckpt.adapters.keymap import ExpertBank


class ExpertLoRA(Adapter):
    """A ParamWrapper LoRA module (`lora`'s factors and scale) merged into an expert bank [E, in, out]."""

    kind = "lora"
    row_local = False

    def __init__(self, lora, bank: ExpertBank, shape):
        super().__init__(lora.module)
        self.lora, self.experts = lora, bank.experts
        self.e_in, self.e_out = shape[1], shape[2]
        if lora.rank % self.experts:
            raise lora.error(f"rank {lora.rank} is not a multiple of the {self.experts} experts of the bank it "
                             "targets (a PEFT target_parameters LoRA has rank r * experts)")
        self.r = lora.rank // self.experts
        self._rows, self._cols = self.experts, self.e_in * self.e_out
        # PEFT's scaling: lora_alpha / r (or / sqrt(r)) with r the rank per expert, not the factors' r * E
        self.scale = alpha_scale(lora.module.alpha(), self.r, lora.module.rslora)

    def release(self):
        self.lora.release()

    def is_zero(self):
        return self.lora.is_zero()

    def delta(self):
        dev = self.lora.device = self.device
        A = self.lora.part(self.lora.down_role).to(dev).reshape(self.experts, self.r, self.e_in)
        B = self.lora.part(self.lora.up_role).to(dev).reshape(self.e_out, self.r, self.experts)
        return torch.einsum("ore,eri->eio", B, A).reshape(self.experts, -1) * self.scale

    def apply(self, w, a, b, ratio):
        dev = self.lora.device = self.device
        A = self.lora.part(self.lora.down_role).to(dev).reshape(self.experts, self.r, self.e_in)
        B = self.lora.part(self.lora.up_role).to(dev).reshape(self.e_out, self.r, self.experts)
        d = torch.einsum("ore,eri->eio", B[..., a:b], A[a:b])  # experts [a, b)
        w.add_(d.reshape(b - a, -1), alpha=ratio * self.scale)


def experts_patches(patches, views):
    """The matched patches (per component: view key -> [Patch]) with every patch on an `ExpertBank` target given
    its `ExpertLoRA` (the adapter the matching made is the plain LoRA of the same factors)."""
    out = []
    for comp, view in zip(patches, views):
        fixed = {}
        for key, ps in comp.items():
            fixed[key] = [replace(p, adapter=ExpertLoRA(p.adapter, p.transform, tuple(view.tensors[key].shape)),
                                  transform=replace(p.transform, prepared=True))
                          if isinstance(p.transform, ExpertBank) and not p.transform.prepared else p for p in ps]
        out.append(fixed)
    return out
