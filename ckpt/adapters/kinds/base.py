"""The interface every adapter kind implements, and the DoRA post-step the LoRA kind shares.

An adapter is one LoRA *module* (all keys of one spelling such as `lora_unet_x` or
`base_model.model.layers.0.q_proj`) turned into a rule for changing the rows of its target slice.
Everything works on 2-D row views `[rows, prod(shape[1:])]` of the target slice in fp32, so that
`ckpt.adapters.merged.MergedTensor` can apply adapters band by band: `apply(w, a, b, ratio)` changes
`w` (rows [a, b) of the module's slice) in place. Adapters whose result for a row depends on other
rows (DoRA with input-axis norms) say `row_local = False` and then get the whole slice at once.

The LoRA scale (alpha / rank ...) is applied exactly once, inside `apply`; `ratio` is the user's
per-LoRA strength.
"""

from __future__ import annotations

import math

from ckpt.lazy import torch

from ckpt.errors import CkptError
from ckpt.io.output import bands
from ckpt.io.stored_scan import all_zero as stored_all_zero


class Adapter:
    kind: str = ""
    row_local: bool = True
    has_weight: bool = True  # False for modules that only carry a bias delta

    def __init__(self, module):
        self.module = module  # ckpt.adapters.loading.LoraModule
        self._cache: dict[str, torch.Tensor] = {}
        self._device = None  # the CPU until a merge sets one: matching plans without torch
        self.weight_dtype = None  # the base weight's dtype, set by the merge (`LoraModule.delta_in_weight_dtype`)

    @property
    def device(self):
        return torch.device("cpu") if self._device is None else self._device

    @device.setter
    def device(self, device) -> None:
        self._device = device

    # -- shape contract -------------------------------------------------------------------------
    _rows: int | None = None  # set by each kind's __init__ from its stored shapes
    _cols: int | None = None
    bias_role: str | None = None  # the stored part holding a bias delta (`diff_b`, PEFT `lora_B.bias`)

    @property
    def rows(self) -> int | None:
        """Rows of the module's delta (its output features in stored orientation)."""
        return self._rows

    @property
    def cols(self) -> int | None:
        """prod(shape[1:]) of the module's delta, or None when the kind adapts to any width."""
        return self._cols

    @property
    def bias_rows(self) -> int | None:
        """Rows of the bias delta, None when the module has none."""
        b = self.module.parts.get(self.bias_role) if self.bias_role else None
        return b.shape[0] if b is not None and b.shape else None

    def check(self, rows: int, cols: int) -> str | None:
        """Why this module cannot change a [rows, cols] slice (2-D row view), or None when it fits."""
        if not self.has_weight:
            return None
        if (self.rows is not None and self.rows != rows) or (self.cols is not None and self.cols != cols):
            return f"its delta is [{self.rows}, {self.cols}] (rows, flattened columns), the target slice is [{rows}, {cols}]"
        return None

    def keys(self) -> list[str]:
        return self.module.keys

    # -- math ------------------------------------------------------------------------------------
    def apply(self, w: torch.Tensor, a: int, b: int, ratio: float) -> None:
        raise NotImplementedError

    def apply_bias(self, bias: torch.Tensor, a: int, b: int, ratio: float) -> None:
        raise NotImplementedError

    def delta(self) -> torch.Tensor:
        """The module's whole delta (scale included) in its 2-D row view [rows, cols], fp32 on
        `self.device`, for commands that work on deltas without a base (`ckpt lora resize/merge`).
        Families whose change depends on the base weight have none: an error naming the module."""
        raise self.error(f"a {self.kind} module changes the base weight in a way that depends on it; "
                         "it has no delta of its own")

    def part(self, role: str) -> torch.Tensor:
        """A stored part of the module in fp32 on the work device, read once and kept until `release`."""
        t = self._cache.get(role)
        if t is None:
            t = self.module.parts[role].read_all(self.device).to(torch.float32)
            self._cache[role] = t
        return t

    def has(self, role: str) -> bool:
        return role in self.module.parts

    def release(self) -> None:
        self._cache.clear()

    # -- what the commands must say about a module ---------------------------------------------------
    zero_if_any: tuple[str, ...] = ()  # roles of which one all-zero tensor makes the weight delta zero

    def is_zero(self) -> bool:
        """The module changes nothing: rank 0, or an all-zero factor of the product its delta is (an
        untrained PEFT lora_B is zeros), and no bias delta. merge-lora says so instead of counting the
        tensors it "changed". Read from the stored tensors, not kept (a nonzero factor only as far as its first
        band: `_all_zero`); DoRA re-normalises even a zero delta."""
        if not self.zero_if_any or getattr(self, "dora", None) is not None:
            return False
        weight = not self.has_weight or any(_all_zero(self.module.parts[r]) for r in self.zero_if_any if self.has(r))
        return weight and (self.bias_role is None or not self.has(self.bias_role)
                           or _all_zero(self.module.parts[self.bias_role]))

    def nonfinite(self) -> dict[str, int]:
        """stored key -> NaN/Inf values of every floating part (alpha included) that holds any. Parts of up to
        32 bits are read through `part` (exact in fp32, kept until `release`), so the factors the command then
        computes with are not read a second time; wider ones as stored (fp32 could overflow a finite value)."""
        out = {}
        for key, (role, t) in zip(self.module.keys, self.module.parts.items()):
            if not t.dtype.is_floating_point or not t.numel:
                continue
            x = self.part(role) if t.dtype.itemsize <= 4 else t.read_all(torch.device("cpu"))
            n = int((~torch.isfinite(x)).sum())
            if n:
                out[key] = n
        cfg = self.module.config_alpha
        if "alpha" not in self.module.parts and cfg is not None and not math.isfinite(cfg):
            out["lora_alpha (adapter_config.json / lora_adapter_metadata)"] = 1
        return out

    def error(self, problem: str) -> CkptError:
        return CkptError(f"{self.module.source}: module {self.module.name!r}: {problem}")


def _all_zero(t) -> bool:
    """`t` holds no nonzero value (or none at all). Its first band (its smallest aligned one) is read alone,
    so a trained factor is told from a zero one without reading the rest; only a zero-led one is read whole.
    A stored F32/F16/BF16 factor is asked without torch (`ckpt.io.stored_scan`: planning imports no torch)."""
    stored = stored_all_zero(t)
    if stored is not None:
        return stored
    cpu = torch.device("cpu")
    first = next(bands(t, 1))
    spans = [first] + ([(first[1], t.rows)] if first[1] < t.rows else [])
    for a, b in spans:
        x = t.read(a, b, cpu)
        if bool((x.float() if x.element_size() == 1 else x).any()):  # fp8: no any()
            return False
    return True


def alpha_scale(alpha: float | None, rank: int, rslora: bool = False) -> float:
    """kohya/LyCORIS convention: no alpha (or alpha 0) means alpha = rank, i.e. scale 1. A rank-0 module's
    delta is zero whatever its scale: 1, rather than a division by zero."""
    if alpha is None or alpha == 0 or rank == 0:
        return 1.0
    return alpha / (math.sqrt(rank) if rslora else rank)


class LowRankFamily(Adapter):
    """LoRA, LoHa, LoKr: W += ratio * scale * dW, optionally followed by DoRA's re-normalisation.

    Subclasses implement `add_delta(w, a, b, factor)`: w += factor * dW[a:b] (dW in 2-D row view).
    """

    scale: float = 1.0
    dora = None  # ckpt.adapters.kinds.dora.Dora or None

    def __init__(self, module):
        super().__init__(module)
        from ckpt.adapters.kinds.dora import dora_for

        self.dora = dora_for(self)
        self.row_local = self.dora is None or self.dora.row_local

    def add_delta(self, w: torch.Tensor, a: int, b: int, factor: float) -> None:
        raise NotImplementedError

    def delta(self):
        if self.dora is not None:
            raise self.error("DoRA re-normalises the merged weight: its delta depends on the base weight")
        w = torch.zeros((self.rows, self.cols), dtype=torch.float32, device=self.device)
        self.add_delta(w, 0, self.rows, self.scale)
        return w

    def apply(self, w, a, b, ratio):
        if self.dora is None:
            self.add_delta(w, a, b, ratio * self.scale)
        else:
            self.dora.apply(w, a, b, ratio)
