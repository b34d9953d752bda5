"""The recipe a flag-built `ckpt merge` runs: the same `Recipe` a YAML config gives, so both paths merge the
same way and `--print-config` prints the YAML that runs it.

`ckpt merge A B --alpha 0.3`: weighted_sum of A and B. `ckpt merge A B C --method add_difference --alpha 1.0`.
`ckpt merge --method ties --base B M1 M2 --param density=0.5 --weight 0.6,0.4`: `--weight` and `--density` take
one value (for every model) or one per model in order (for `linear`, whose base takes a weight too, one more for
the base last); `--param NAME=VALUE` sets any declared shared or per-model parameter for all models (VALUE a
number, true/false, or a comma list: a gradient).
"""

from __future__ import annotations

from ckpt.errors import CkptError
from ckpt.merge.recipe import recipe_from_dict
from ckpt.merge.shown import cut, shown

DEFAULT_TWO = "weighted_sum"


def _value(text: str, where: str):
    text = text.strip()
    if "," in text:
        return [_value(p, where) for p in text.split(",")]
    low = text.lower()
    if low in ("true", "false"):
        return low == "true"
    try:
        v = float(text)
    except ValueError:
        raise CkptError(f"{where}: {shown(text)} is not a number, true/false or a comma list of numbers") from None
    return int(v) if v.is_integer() and "." not in text and "e" not in low else v


def _per_model(text: str | None, name: str, n: int, with_base: bool):
    if text is None:
        return None
    values = [_value(p, f"--{name}") for p in text.split(",")]
    if len(values) == 1:
        return values[0]
    if len(values) not in (n, n + with_base):
        raise CkptError(f"--{name} {cut(text)}: give one value or one per model ({n}"
                        + (f", or {n + 1} with the base's last" if with_base else "") + f"), got {len(values)}")
    return values


def recipe_from_flags(models: list[str], *, method: str | None, base: str | None, alpha: float | None,
                      weight: str | None, density: str | None, params: list[str], dtype: str | None,
                      tokenizer_source: str | None):
    from ckpt.merge.methods import get_method

    if not models:
        raise CkptError("merge: give a config (YAML) or the models to merge")
    if method is None:
        if base is None and len(models) == 2:
            method = DEFAULT_TWO
        else:
            raise CkptError("merge: --method is needed for this merge (two models alone default to weighted_sum)")
    m = get_method(method)
    glob: dict = {}
    if alpha is not None:
        glob["alpha"] = alpha
    for p in params:
        if "=" not in p:
            raise CkptError(f"--param {cut(p)}: write NAME=VALUE")
        k, v = p.split("=", 1)
        glob[k.strip()] = _value(v, f"--param {cut(k.strip())}")
    per_model: dict[str, list] = {}
    with_base = base is not None and (m.param("weight") is not None and m.param("weight").scope == "input")
    for name, text in (("weight", weight), ("density", density)):
        v = _per_model(text, name, len(models), with_base and name == "weight")
        if isinstance(v, list):
            per_model[name] = v
        elif v is not None:
            glob[name] = v
    entries = []
    for i, spec in enumerate(models + ([base] if base is not None and per_model.get("weight") and
                                       len(per_model["weight"]) == len(models) + 1 else [])):
        ps = {k: vs[i] for k, vs in per_model.items() if i < len(vs)}
        entries.append({"model": spec, "parameters": ps} if ps else {"model": spec})
    data: dict = {"merge_method": method, "models": entries}
    if base is not None:
        data["base_model"] = base
    if glob:
        data["parameters"] = glob
    if dtype:
        data["dtype"] = dtype
    if tokenizer_source:
        data["tokenizer_source"] = tokenizer_source
    return recipe_from_dict(data, "merge")

