"""A merge recipe: what `ckpt merge` runs, read from a mergekit YAML config or built from flags.

The schema is mergekit's (`mergekit-yaml` / `mergekit-pytorch` 0.1.5): `merge_method`, `base_model`, `models:
[{model, parameters}]` (a plain string is a model without parameters, which the SD classics' `models: [A, B, C]`
uses), `parameters`, `dtype` (compute), `out_dtype`, `slices: [{sources: [{model, layer_range, parameters}],
base_model, parameters}]`, `tokenizer_source: base | MODEL`. Everything a config says is either used or refused
by name: an unknown key, a mergekit feature ckpt does not have (`modules`, `tokenizer`, `chat_template`,
`residual_weight`, `tokenizer_source: union`), a method or parameter the method does not declare. Parameter values
are checked against the method's declared types and ranges here, before any input is opened, for every value a
gradient or filter list can produce.

`to_yaml()` writes the recipe back (resolved: the method's defaults filled in, the seed where one is used, dtypes
by mergekit's names, so mergekit runs it too):
`--print-config`, the safetensors `__metadata__` and the model card all print it.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass, field
from pathlib import Path

from ckpt.errors import CkptError
from ckpt.merge.params import check_setting
from ckpt.merge.shown import shown

TOP_KEYS = ("merge_method", "base_model", "models", "slices", "parameters", "dtype", "out_dtype", "tokenizer_source")
LACKING = {  # mergekit keys ckpt does not implement: refused by name, never ignored
    "modules": "per-module configs (multimodal models)",
    "tokenizer": "tokenizer merging (vocabulary union and token embedding permutation)",
    "chat_template": "chat template selection",
}
DTYPES = {"float32": "fp32", "fp32": "fp32", "float": "fp32", "float16": "fp16", "fp16": "fp16", "half": "fp16",
          "bfloat16": "bf16", "bf16": "bf16", "float64": "fp64", "fp64": "fp64", "double": "fp64"}
OUT_DTYPES = ("fp32", "fp16", "bf16")
MERGEKIT_DTYPES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16", "fp64": "float64"}
MAX_MODEL_TEXT = 4096  # characters of a model's path or hub id (Linux's PATH_MAX)
MAX_LAYER = 10_000  # a slice's layer_range END (the deepest models have a few hundred layers)


@dataclass
class ModelRef:
    """One input as the config names it: `spec` (any source ckpt reads) and, for mergekit's `BASE+LORA`, the LoRA
    merged into it first."""

    text: str  # as written in the config: the model's identity (parameters, RNG keys, the base)
    spec: str
    lora: str | None = None


@dataclass
class InputModel:
    model: ModelRef
    parameters: dict = field(default_factory=dict)


@dataclass
class SliceSource:
    model: ModelRef
    layer_range: tuple[int, int]
    parameters: dict = field(default_factory=dict)


@dataclass
class Slice:
    sources: list[SliceSource]
    base_model: ModelRef | None = None
    parameters: dict = field(default_factory=dict)


@dataclass
class Recipe:
    method: str
    models: list[InputModel] = field(default_factory=list)
    base_model: ModelRef | None = None
    parameters: dict = field(default_factory=dict)
    slices: list[Slice] | None = None
    dtype: str | None = None  # compute dtype: inputs are rounded to it (ckpt computes in fp32 at least)
    out_dtype: str | None = None
    tokenizer_source: ModelRef | None = None  # None: the base's (or the first model's)
    seed: int | None = None  # randomized methods (DARE, DELLA): --seed
    source: str = "merge"  # the config file (or "merge" for flags): what errors found later name

    @property
    def refs(self) -> list[ModelRef]:
        """Every distinct input, in mergekit's order: the models (or slice sources) as listed, then the base
        when it is not among them."""
        seen: dict[str, ModelRef] = {}
        listed = [m.model for m in self.models] if self.slices is None else \
            [s.model for sl in self.slices for s in sl.sources]
        for r in listed + [r for r in (self.base_model,) if r is not None]:
            seen.setdefault(r.text, r)
        return list(seen.values())

    def groups(self):
        """(where, inputs, base) for every group of inputs one output tensor merges: the models with the base, or
        each slice's sources with its base (the slice's, else the global one), in mergekit's order."""
        glob = self.base_model.text if self.base_model is not None else None
        if self.slices is None:
            yield "", [r.text for r in self.refs], glob
            return
        for i, sl in enumerate(self.slices):
            order: list[str] = []
            for s in sl.sources:
                if s.model.text not in order:
                    order.append(s.model.text)
            base = sl.base_model.text if sl.base_model is not None else glob
            if base is not None and base not in order:
                order.append(base)
            yield f"slices[{i}]: ", order, base

    def to_dict(self, resolved: bool = True) -> dict:
        """The recipe as mergekit's YAML schema spells it (dtype names as mergekit reads them); `resolved`: with
        the method's defaults written into the global parameters."""
        d: dict = {"merge_method": self.method}
        if self.base_model is not None:
            d["base_model"] = self.base_model.text
        if self.slices is not None:
            d["slices"] = [_slice_dict(s) for s in self.slices]
        else:
            d["models"] = [({"model": m.model.text, "parameters": m.parameters} if m.parameters else
                            {"model": m.model.text}) for m in self.models]
        params = dict(self.parameters)
        if resolved:  # the method's defaults, said: what the merge ran with (a model's own settings still win)
            from ckpt.merge.methods import get_method

            for p in get_method(self.method).params:
                if not p.required and p.default is not None:
                    params.setdefault(p.name, p.default)
        if params:
            d["parameters"] = params
        for k in ("dtype", "out_dtype"):
            if getattr(self, k):
                d[k] = MERGEKIT_DTYPES[getattr(self, k)]
        if self.tokenizer_source is not None:
            d["tokenizer_source"] = self.tokenizer_source.text
        return d

    def to_yaml(self) -> str:
        import yaml

        class Dumper(yaml.SafeDumper):
            pass

        def lists(dumper, data):  # numeric gradients on one line, as mergekit prints them
            flow = all(isinstance(e, (int, float)) and not isinstance(e, bool) for e in data)
            return dumper.represent_sequence("tag:yaml.org,2002:seq", data, flow_style=flow)

        Dumper.add_representer(list, lists)
        text = yaml.dump(self.to_dict(), Dumper=Dumper, sort_keys=False, default_flow_style=False)
        if self.seed is not None:
            text += f"# ckpt merge --seed {self.seed}\n"
        return text


def _slice_dict(s: Slice) -> dict:
    d: dict = {"sources": [dict({"model": x.model.text, "layer_range": list(x.layer_range)},
                                **({"parameters": x.parameters} if x.parameters else {})) for x in s.sources]}
    if s.base_model is not None:
        d["base_model"] = s.base_model.text
    if s.parameters:
        d["parameters"] = s.parameters
    return d


def model_ref(value, where: str) -> ModelRef:
    """`model: PATH` or mergekit's `model: BASE+LORA` (split at the last `+`, unless the whole text is a path)."""
    if not isinstance(value, str) or not value.strip():
        raise CkptError(f"{where}: a model is a path or hub id (a string), not {shown(value)}")
    text = value.strip()
    if len(text) > MAX_MODEL_TEXT:
        raise CkptError(f"{where}: a model's path or hub id of {len(text):,} characters is longer than a path can "
                        f"be ({MAX_MODEL_TEXT:,})")
    if any(ord(c) < 32 or ord(c) == 127 for c in text):
        raise CkptError(f"{where}: {shown(text)}: a model's path or hub id holds no control characters")
    if _local(text, where) is None and "+" in text:
        spec, lora = text.rsplit("+", 1)
        if not spec or not lora:
            raise CkptError(f"{where}: {shown(text)}: write BASE+LORA with both parts")
        _local(spec, where)
        _local(lora, where)
        return ModelRef(text, spec, lora)
    return ModelRef(text, text)


def _local(text: str, where: str) -> os.stat_result | None:
    """The stat of `text` as a local path (links followed), None where nothing is there (a hub id). A local input
    is a folder or a regular file: a FIFO or a device (/dev/zero, or a link to it) would be read without end."""
    if text.startswith("~"):
        try:
            p = Path(text).expanduser()
        except RuntimeError:  # ~user where the user does not exist
            raise CkptError(f"{where}: {shown(text)}: {shown(text.split('/', 1)[0][1:])} is no user of this "
                            "machine") from None
    else:
        p = Path(text)
    try:
        st = os.stat(p)
    except (OSError, ValueError):
        return None  # missing (a hub id, or said when it is opened), or not a path: said when it is opened
    if not (stat.S_ISDIR(st.st_mode) or stat.S_ISREG(st.st_mode)):
        from ckpt.io.small_inputs import check_regular

        check_regular(p, f"{where}: {shown(text)}")
    return st


def _mapping(value, where: str, allowed: tuple[str, ...], lacking: dict | None = None) -> dict:
    if not isinstance(value, dict):
        raise CkptError(f"{where}: expected a mapping with keys {', '.join(allowed)}, got {type(value).__name__}")
    for k in value:
        if lacking and k in lacking:
            raise CkptError(f"{where}: {k!r} ({lacking[k]}) is a mergekit feature ckpt does not have; remove it")
        if k not in allowed:
            raise CkptError(f"{where}: unknown key {shown(k)} (ckpt reads {', '.join(allowed)})")
    return value


def _params(value, where: str, method) -> dict:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise CkptError(f"{where}: parameters are a mapping of name: value, got {type(value).__name__}")
    for name, setting in value.items():
        p = method.param(name)
        if p is None:
            takes = ", ".join(q.name for q in method.params) or "no parameters"
            raise CkptError(f"{where}: {method.name} has no parameter {shown(name)} (it takes {takes})")
        check_setting(setting, p, f"{where}.{name}")
    return dict(value)


def _dtype(value, key: str, allowed) -> str | None:
    if value is None:
        return None
    d = DTYPES.get(value.lower()) if isinstance(value, str) else None
    if d is None or d not in allowed:
        raise CkptError(f"{key}: {shown(value)}: choose one of {', '.join(sorted(k for k, v in DTYPES.items() if v in allowed))}")
    return d


def load_recipe(path: str) -> Recipe:
    """Read and check a mergekit YAML config (one-line errors naming the key): a regular file of a bounded size
    whose YAML expands to a bounded document (`ckpt.merge.config_yaml`)."""
    from ckpt.merge.config_yaml import load_config

    return recipe_from_dict(load_config(path), str(path))


def recipe_from_dict(data, where: str) -> Recipe:
    from ckpt.merge.methods import get_method

    _mapping(data, where, TOP_KEYS, LACKING)
    if "merge_method" not in data:
        raise CkptError(f"{where}: merge_method is missing")
    method = get_method(data["merge_method"])
    r = Recipe(method=method.name)
    if data.get("base_model") is not None:
        r.base_model = model_ref(data["base_model"], f"{where}: base_model")
    has_models, has_slices = data.get("models") is not None, data.get("slices") is not None
    if has_models == has_slices:
        raise CkptError(f"{where}: give exactly one of models: or slices:")
    if has_models:
        if not isinstance(data["models"], list) or not data["models"]:
            raise CkptError(f"{where}: models: is a list of {{model: PATH, parameters: {{...}}}}")
        for i, m in enumerate(data["models"]):
            at = f"{where}: models[{i}]"
            if isinstance(m, str):
                r.models.append(InputModel(model_ref(m, at)))
                continue
            _mapping(m, at, ("model", "parameters"))
            if "model" not in m:
                raise CkptError(f"{at}: model is missing")
            r.models.append(InputModel(model_ref(m["model"], at), _params(m.get("parameters"), f"{at}.parameters", method)))
    else:
        if not isinstance(data["slices"], list) or not data["slices"]:
            raise CkptError(f"{where}: slices: is a list of {{sources: [{{model, layer_range}}]}}")
        r.slices = []
        for i, s in enumerate(data["slices"]):
            at = f"{where}: slices[{i}]"
            _mapping(s, at, ("sources", "base_model", "parameters"),
                     {"residual_weight": "adding a residual of the base to a slice"})
            if not isinstance(s.get("sources"), list) or not s["sources"]:
                raise CkptError(f"{at}: sources: is a list of {{model, layer_range: [START, END]}}")
            srcs = []
            for j, x in enumerate(s["sources"]):
                sat = f"{at}.sources[{j}]"
                _mapping(x, sat, ("model", "layer_range", "parameters"))
                lr = x.get("layer_range")
                if (not isinstance(lr, list) or len(lr) != 2 or not all(isinstance(v, int) and not isinstance(v, bool)
                                                                       for v in lr) or not 0 <= lr[0] < lr[1] <= MAX_LAYER):
                    raise CkptError(f"{sat}: layer_range is [START, END] with 0 <= START < END <= {MAX_LAYER:,}, got "
                                    f"{shown(lr)}")
                if "model" not in x:
                    raise CkptError(f"{sat}: model is missing")
                srcs.append(SliceSource(model_ref(x["model"], sat), (lr[0], lr[1]),
                                        _params(x.get("parameters"), f"{sat}.parameters", method)))
            lengths = {b - a for a, b in (x.layer_range for x in srcs)}
            if len(lengths) != 1:
                raise CkptError(f"{at}: every source of a slice spans the same number of layers, got "
                                f"{', '.join(f'{a}:{b}' for a, b in (x.layer_range for x in srcs))}")
            sb = model_ref(s["base_model"], f"{at}.base_model") if s.get("base_model") is not None else None
            r.slices.append(Slice(srcs, sb, _params(s.get("parameters"), f"{at}.parameters", method)))
    r.parameters = _params(data.get("parameters"), f"{where}: parameters", method)
    r.dtype = _dtype(data.get("dtype"), "dtype", ("fp32", "fp16", "bf16", "fp64"))
    r.out_dtype = _dtype(data.get("out_dtype"), "out_dtype", OUT_DTYPES)
    ts = data.get("tokenizer_source")
    if ts is not None:
        if ts == "union":
            raise CkptError(f"{where}: tokenizer_source: union (a merged vocabulary with permuted embeddings) is a "
                            "mergekit feature ckpt does not have; use base or a model of the config")
        if ts != "base":
            r.tokenizer_source = model_ref(ts, f"{where}: tokenizer_source")
    method.check_recipe(r, where)
    _check_required(r, method, where)
    r.source = where
    return r


def _check_required(r: Recipe, method, where: str) -> None:
    """A required parameter that no setting of a model can give (not its own, not its slice's, not the global
    ones) is refused now; one that only some filters give is checked per tensor when the merge is planned."""
    from ckpt.merge.methods.base import NON_BASE, SHARED

    groups = ([[(m.model, m.parameters) for m in r.models]] if r.slices is None else
              [[(x.model, x.parameters) for x in sl.sources] for sl in r.slices])
    slice_params = [{}] if r.slices is None else [sl.parameters for sl in r.slices]
    bases = [r.base_model] * len(groups) if r.slices is None else [sl.base_model or r.base_model for sl in r.slices]
    for p in method.params:
        if not p.required:
            continue
        for group, sp, base in zip(groups, slice_params, bases):
            if p.name in r.parameters or p.name in sp:
                continue
            if p.scope == SHARED:
                raise CkptError(f"{where}: {method.name} needs parameter {p.name} (give it in parameters:)")
            refs = [(ref, ps) for ref, ps in group]
            if base is not None and all(ref.text != base.text for ref, _ in refs):
                refs.append((base, {}))
            for ref, ps in refs:
                if p.scope == NON_BASE and base is not None and ref.text == base.text:
                    continue
                if p.name not in ps:
                    raise CkptError(f"{where}: {method.name} needs parameter {p.name} for {ref.text} (give it in its "
                                    "parameters: or the global ones)")
