"""The tensors a quantizing planner leaves unquantized (comfy_quant, compressed-tensors, MLX): one rule for all.

A non-floating tensor is written as it is; a floating one in the planner's dtype (default: the dtype it had
before any storage encoding, `natural_dtype`), rounded once by the Caster of that dtype. The planner keeps one
`casters` dict for the whole plan, so each output dtype has one Caster and its overflow/NaN counts add up in the
run's summary."""

from __future__ import annotations

from ckpt.cast import Caster
from ckpt.dtypes import is_float
from ckpt.io.plan import OutTensor
from ckpt.io.tensors import Tensor
from ckpt.report import Report


def kept(t: Tensor, casters: dict, report: Report, dtype=None, name: str | None = None) -> OutTensor:
    """`t` unquantized, under `name` (default: its own), in `dtype` where it is floating (see the module)."""
    name = name or t.name
    if not is_float(t.dtype):
        return OutTensor(name, t.dtype, tuple(t.shape), t)
    dst = dtype or t.natural_dtype
    c = casters.setdefault(dst, Caster(dst, report))
    return OutTensor(name, dst, tuple(t.shape), t, c.band(name), stateless=True)
