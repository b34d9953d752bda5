"""Parameter settings as mergekit evaluates them, per tensor.

A setting is a scalar; a gradient (a list of scalars: numeric lists are interpolated linearly at `t`, other lists
pick the value at `int(t * (len - 1))`); or a list of `{filter, value}` (the first whose filter is missing, `*` or a
substring of the tensor's name gives its value, itself a scalar or gradient). `t` is the tensor's layer (or block)
position in [0, 1]; tensors outside the layers have t = 0 (`ckpt.merge.blocks`).

Settings are looked up from the most specific place to the least: the model's own `parameters` (a slice source's),
the slice's, then the global ones; the first that gives a value wins, else the method's default, else the
parameter is missing (an error naming it). A filter matches the tensor's name in the output or, for a diffusion
model written in its diffusers layout, its original name, so block filters (`double_blocks.3.`) work on either.
"""

from __future__ import annotations

import math

from ckpt.errors import CkptError
from ckpt.merge.shown import shown


def _is_num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _is_scalar(v) -> bool:
    return isinstance(v, (int, float, bool, str))


def _is_condition(v) -> bool:
    return isinstance(v, dict)


def check_setting(setting, param, where: str) -> None:
    """Refuse a setting that cannot be evaluated or that can give a value `param` refuses (every scalar of a
    gradient and every filter value is checked; numeric interpolation stays within the endpoints' range)."""
    if _is_condition(setting):
        setting = [setting]
    if _is_scalar(setting):
        param.validate(setting, where)
        return
    if not isinstance(setting, list) or not setting:
        raise CkptError(f"{where}: a value, a list of values (a gradient) or a list of {{filter, value}}, not {shown(setting)}")
    if all(_is_scalar(e) for e in setting):
        for e in setting:
            param.validate(e, where)
        if not all(_is_num(e) for e in setting) and param.type in (int, float):
            raise CkptError(f"{where}: a gradient of numbers, got {shown(setting)}")
        return
    for i, cond in enumerate(setting):
        if not _is_condition(cond):
            raise CkptError(f"{where}[{i}]: a list mixes values and {{filter, value}} entries")
        extra = set(cond) - {"filter", "value"}
        if extra:
            raise CkptError(f"{where}[{i}]: unknown key {shown(sorted(extra, key=str)[0])} (a condition has filter and value)")
        if "value" not in cond:
            raise CkptError(f"{where}[{i}]: value is missing")
        f = cond.get("filter")
        if f is not None and not isinstance(f, str):
            raise CkptError(f"{where}[{i}].filter: a substring of tensor names, not {shown(f)}")
        if _is_condition(cond["value"]) or (isinstance(cond["value"], list) and any(_is_condition(v) for v in cond["value"])):
            raise CkptError(f"{where}[{i}].value: a value or a gradient")
        check_setting(cond["value"], param, f"{where}[{i}].value")


def evaluate(setting, names: tuple[str, ...], t: float, cast):
    """The value of `setting` for a tensor known by `names` (output name, original name) at position `t`;
    None when no filter matches. `cast` is the parameter's type."""
    if _is_condition(setting):
        setting = [setting]
    if _is_scalar(setting):
        return cast(setting)
    if all(_is_scalar(e) for e in setting):
        if not all(_is_num(e) for e in setting):
            return cast(setting[int(t * (len(setting) - 1))])
        scaled = t * (len(setting) - 1)
        i0 = int(scaled)
        i1 = min(len(setting) - 1, i0 + 1)
        frac = scaled - i0
        return cast((1 - frac) * setting[i0] + frac * setting[i1])
    for cond in setting:
        f = cond.get("filter")
        if f is None or f == "*" or any(n and f in n for n in names):
            return evaluate(cond["value"], names, t, cast)
    return None


def resolve(param, chain, names: tuple[str, ...], t: float, where: str):
    """The first value `chain` (settings dicts, most specific first) gives, else the default; a required
    parameter with none is an error naming the tensor."""
    for settings in chain:
        if settings and param.name in settings:
            v = evaluate(settings[param.name], names, t, param.cast)
            if v is not None:
                return v
    if param.required:
        raise CkptError(f"{where}: parameter {param.name} is missing for {names[0]} (no filter matches it; add a "
                        "condition without filter)")
    return param.cast(param.default) if param.default is not None else None


def finite(v) -> bool:
    return not isinstance(v, float) or math.isfinite(v)
