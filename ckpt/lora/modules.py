"""Input LoRA modules as the `ckpt lora` commands see them: their stored keys by role, their factors
or delta, and the shapes their output factors take. Reading is `ckpt.adapters.loading`'s; the math per
adapter kind is `ckpt.adapters.kinds`'; this only adds what rewriting a LoRA (rather than merging it)
needs to know."""

from __future__ import annotations

import math

from ckpt.lazy import torch

from ckpt.errors import CkptError
from ckpt.lora.formats import OutModule, alpha_tensor
from ckpt.adapters.kinds import make_adapter
from ckpt.adapters.checks import settle_alphas
from ckpt.adapters.loading import load_lora


def open_lora(spec: str, alpha: float | None = None, report=None):
    """The LoRA file, with modules that carry no alpha given `alpha` (--alpha) or, with a warning in
    `report`, alpha = rank, as merge-lora does (`ckpt.adapters.checks.settle_alphas`)."""
    f = load_lora(spec)
    if f.litgpt is not None:
        f.close()
        raise CkptError(f"{spec}: a LitGPT LoRA; ckpt lora reads kohya, PEFT, diffusers and LyCORIS files "
                        "(merge it with ckpt merge-lora)")
    if report is not None:
        try:
            settle_alphas(f, alpha, report)
        except BaseException:
            f.close()
            raise
    return f


def keys_by_role(m) -> dict[str, str]:
    """role -> stored key of a module (`parts` and `keys` are filled in the same order)."""
    return dict(zip(m.parts.keys(), m.keys))


def stored(m) -> dict[str, object]:
    """stored key -> logical tensor of every part of a module (for passing it through unchanged)."""
    return dict(zip(m.keys, m.parts.values()))


def as_stored(m, layout, store, src=None):
    """A module written exactly as stored (`ckpt.lora.formats.OutModule` with its tensors as `extra`), its
    scale kept: an alpha only --alpha gave (none stored) goes where the output keeps alphas (a `.alpha`
    tensor; PEFT's config and diffusers' metadata take `peft_alpha`), or is folded into up where it keeps
    none (a PEFT-style file without metadata)."""
    extra = stored(m)
    rank = src.rank if src is not None else None
    alpha = m.alpha() if src is not None else None
    if src is not None and "alpha" not in m.parts and m.config_alpha is not None and src.kind == "lora":
        if layout.alphas == "tensor":
            key = f"{m.name}.alpha"
            extra[key] = alpha_tensor(key, alpha)
        elif layout.alphas == "none" and src.scale != 1.0:
            key = src.roles[src.adapter.up_role]
            extra[key] = store.put(key, (src.adapter.part(src.adapter.up_role) * src.scale).to(m.parts[
                src.adapter.up_role].dtype))
    return OutModule(m.name, extra=extra, peft_rank=rank, peft_alpha=alpha if alpha is not None else rank)


class Source:
    """One input module with its adapter, on the work device."""

    def __init__(self, module, device):
        self.module = module
        self.adapter = make_adapter(module)
        self.adapter.device = device
        self.kind = module.kind
        self.roles = keys_by_role(module)

    @property
    def plain_lora(self) -> bool:
        """A LoRA whose delta is up @ down (any rank, Tucker folded), with no DoRA."""
        return self.kind == "lora" and getattr(self.adapter, "dora", None) is None

    @property
    def lora_like(self) -> bool:
        """A LoRA, with or without DoRA: its low-rank part can be re-factored."""
        return self.kind == "lora"

    @property
    def transposed(self) -> bool:
        return bool(getattr(self.adapter, "transposed", False))

    @property
    def shape2d(self) -> tuple[int, int]:
        return self.adapter.rows, self.adapter.cols

    @property
    def scale(self) -> float:
        return float(getattr(self.adapter, "scale", 1.0))

    @property
    def rank(self) -> int | None:
        return getattr(self.adapter, "rank", None)

    def factors(self):
        return self.adapter.factors()

    def delta(self):
        return self.adapter.delta()

    def conv(self) -> bool:
        tail = self.weight_tail()
        return len(tail) > 1 and math.prod(tail[1:]) > 1

    def weight_tail(self) -> tuple[int, ...]:
        """shape[1:] of the weight this module changes, as far as its stored shapes tell: a LoRA's
        down [r, in, kh, kw] (or in + lora_mid's kernel), a LyCORIS `diff`; else the flat width."""
        p = self.module.parts
        if self.kind == "lora" and not self.transposed:
            down = tuple(p["down"].shape)
            if "mid" in p:
                return (down[1],) + tuple(p["mid"].shape[2:])
            return down[1:]
        if self.kind == "full" and "diff" in p:
            return tuple(p["diff"].shape[1:])
        return (self.adapter.cols,)

    def release(self):
        self.adapter.release()


def factor_shapes(rows: int, k: int, tail: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(up shape, down shape) of rank-k factors of a weight [rows, *tail]: conv factors as LoCon
    (up [out, k, 1, 1], down [k, in, kh, kw])."""
    return (rows, k) + (1,) * (len(tail) - 1), (k,) + tuple(tail)


def to_layout(up: torch.Tensor, down: torch.Tensor, tail, transposed: bool):
    """Factors in row view -> the stored tensors: (up, down) shaped for the weight, or for a layer
    stored transposed (PEFT embeddings, fan_in_fan_out) (A = up^T, B = down^T) as (B, A)."""
    if transposed:
        return down.mT.contiguous(), up.mT.contiguous()
    ushape, dshape = factor_shapes(up.shape[0], up.shape[1], tail)
    return up.reshape(ushape), down.reshape(dshape)
