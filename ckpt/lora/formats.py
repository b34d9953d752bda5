"""Writing a LoRA in one of the namings its loaders expect: the stored keys of each module's factors,
where alpha lives, and which files make up the output.

- kohya (sd-scripts, musubi-tuner, ComfyUI): one file, `NAME.lora_down.weight` [r, in(, kh, kw)],
  `NAME.lora_up.weight` [out, r(, 1, 1)], `NAME.alpha` (fp32 scalar), scale alpha / r.
- peft: an adapter folder as `PeftModel.save_pretrained` writes it: `adapter_model.safetensors` with
  `base_model.model.NAME.lora_A.weight` / `.lora_B.weight`, and `adapter_config.json` (r, lora_alpha,
  rank_pattern / alpha_pattern for modules that differ, target_modules named in full).
- diffusers: the one file named by -o, `PREFIX.NAME.lora_A.weight` / `.lora_B.weight` (PREFIX
  `transformer`, `unet`, `text_encoder`...), no `.alpha` keys: the LoraConfig goes into the
  `lora_adapter_metadata` metadata as diffusers' `save_lora_weights` writes it (JSON, keys prefixed
  per component, indent 2, sorted keys).

`resize` and `merge` keep their input's naming: a `Layout.like(lora_file)` reuses each module's own
stored keys, the input's place for alpha (alpha tensors, adapter_config.json, lora_adapter_metadata,
or none: scale 1) and its container (file or adapter folder).

Nothing here computes: modules arrive as logical tensors (factors spilled to the scratch store, or
the input's own tensors for modules passed through) and become a `Plan` for the ordinary writer.
"""

from __future__ import annotations

import json
import math
import re
from collections import Counter
from dataclasses import dataclass, field

from ckpt.lazy import torch

from ckpt.cast import Caster
from ckpt.dtypes import is_float
from ckpt.io.checkpoint_plan import provenance
from ckpt.io.plan import OutTensor, Plan, plan_files
from ckpt.io.tensors import ComputedTensor, Tensor
from ckpt.lora.embeddings import embedding_keys, is_embedding
from ckpt.report import Report

FORMATS = ("kohya", "peft", "diffusers")
PEFT_PREFIX = "base_model.model."
PEFT_STEM = "adapter_model"  # adapter_model.safetensors (ckpt.io.plan.plan_files names it)
PEFT_CONFIG = "adapter_config.json"
META_KEY = "lora_adapter_metadata"
# kohya metadata that no longer describes a changed LoRA: dropped (hashes) or rewritten (dims).
STALE_METADATA = ("sshs_model_hash", "sshs_legacy_hash", "modelspec.hash_sha256")
DIFFUSERS_PREFIXES = ("transformer", "unet", "text_encoder", "text_encoder_2", "text_encoder_3", "prior", "decoder")


@dataclass
class OutModule:
    """One module of the output. `up @ down * alpha_scale` is its delta.

    `alpha`: the value stored (or put in the config) for this module; None means the module has no
    alpha anywhere and its scale is 1. `keys` (role -> stored key) keeps an input's own spelling;
    `extra` holds stored tensors written unchanged beside the factors (a DoRA magnitude) or a whole
    module passed through (no factors: `up` and `down` None)."""

    name: str
    up: Tensor | None = None
    down: Tensor | None = None
    alpha: float | None = None
    keys: dict[str, str] = field(default_factory=dict)
    extra: dict[str, Tensor] = field(default_factory=dict)
    peft_rank: int | None = None  # rank of a passed-through PEFT module (for rank_pattern)
    peft_alpha: float | None = None

    @property
    def rank(self) -> int | None:
        if self.down is not None:
            return self.down.shape[0]
        return self.peft_rank


@dataclass
class Layout:
    """Where an output puts modules and alphas.

    `container`: "file" (one safetensors file) or "folder" (PEFT adapter folder).
    `alphas`: "tensor" (`NAME.alpha` keys), "config" (adapter_config.json), "metadata"
    (`lora_adapter_metadata`), or "none" (no alpha anywhere: every scale is 1).
    `suffixes`: (down, up) key suffixes for modules whose keys are not given.
    `groups`: the name prefixes that group a LoraConfig (diffusers' per-component metadata,
    `transformer.` -> `transformer.r`, ...); empty: one config for all modules (a PEFT folder, or
    diffusers' flat metadata), whose pattern keys are the names without any of `strip`."""

    container: str = "file"
    alphas: str = "tensor"
    suffixes: tuple[str, str] = ("lora_down.weight", "lora_up.weight")
    groups: tuple[str, ...] = ()
    strip: tuple[str, ...] = ()
    rslora: bool = False
    config: dict = field(default_factory=dict)  # the input's adapter_config.json, or its LoraConfig metadata
    metadata: dict[str, str] = field(default_factory=dict)  # the input's other safetensors metadata

    @property
    def stores_alpha(self) -> bool:
        return self.alphas != "none"

    @property
    def peft_keys(self) -> bool:
        """Factors under PEFT's keys (`lora_A` / `lora_B`, `lora_embedding_A` / `_B` for embeddings)."""
        return self.suffixes[0].startswith("lora_A")

    def embedding_keys(self, name: str) -> dict[str, str] | None:
        """The stored keys of module `name` where it is an embedding in PEFT's spelling
        (`ckpt.lora.embeddings`); None where its factors take the ordinary keys."""
        return embedding_keys(name) if self.peft_keys and is_embedding(name) else None

    def alpha_for(self, scale: float, rank: int) -> float | None:
        """The alpha that gives `scale` at `rank` here (None where no alpha can be stored: scale 1)."""
        if not self.stores_alpha:
            return None
        return scale * (math.sqrt(rank) if self.rslora else rank)

    def peft_key(self, name: str) -> tuple[str, str]:
        """(config group, pattern key) of a module name: `transformer.a.b` -> ("transformer.", "a.b")."""
        for g in self.groups:
            if name.startswith(g):
                return g, name[len(g):]
        for p in self.strip:
            if name.startswith(p):
                return "", name[len(p):]
        return "", name

    # -- the formats ------------------------------------------------------------------------------
    @classmethod
    def of(cls, fmt: str, prefixes: tuple[str, ...] = ()) -> Layout:
        if fmt == "kohya":
            return cls("file", "tensor")
        if fmt == "peft":
            return cls("folder", "config", ("lora_A.weight", "lora_B.weight"), strip=(PEFT_PREFIX,))
        if fmt == "diffusers":
            return cls("file", "metadata", ("lora_A.weight", "lora_B.weight"), tuple(p + "." for p in prefixes))
        raise ValueError(fmt)

    @classmethod
    def like(cls, lora) -> Layout:
        """The layout of an input LoRA (`ckpt.adapters.files.LoraFile`)."""
        from pathlib import Path

        from ckpt.io.small_inputs import CONFIG_LIMIT, load_json_object

        keys = list(lora.ckpt.components[0].tensors)
        peft_style = any(".lora_A." in k for k in keys)
        suffixes = ("lora_A.weight", "lora_B.weight") if peft_style else ("lora_down.weight", "lora_up.weight")
        meta = dict(lora.ckpt.components[0].files[0].metadata)
        spec = Path(lora.spec).expanduser()
        config = spec / PEFT_CONFIG
        if spec.is_dir() and config.is_file():
            cfg = load_json_object(config, limit=CONFIG_LIMIT)
            return cls("folder", "config", suffixes, (), (PEFT_PREFIX,), bool(cfg.get("use_rslora")), cfg, meta)
        raw = meta.pop(META_KEY, None)
        if raw:
            d = json.loads(raw)
            flat = any(k in d for k in ("r", "lora_alpha"))
            groups = () if flat else tuple(sorted({k.rpartition(".")[0] + "." for k in d if "." in k}))
            rslora = bool(d.get("use_rslora")) if flat else any(v for k, v in d.items() if k.endswith(".use_rslora"))
            strip = tuple(p + "." for p in DIFFUSERS_PREFIXES) + (PEFT_PREFIX,)
            return cls("file", "metadata", suffixes, groups, strip, rslora, d, meta)
        has_alpha = any(k.endswith(".alpha") for k in keys)
        return cls("file", "tensor" if has_alpha or not peft_style else "none", suffixes, (), (), False, {}, meta)


def alpha_tensor(name: str, alpha: float) -> Tensor:
    """The 0-d fp32 `.alpha` tensor named `name` holding `alpha` (the kohya / LyCORIS placement)."""
    return ComputedTensor(name, lambda a=alpha: torch.tensor(a, dtype=torch.float32), torch.float32, ())


def _config_fields(entries: list[tuple[str, int, float]], base: dict, model: set[str] | None = None) -> dict:
    """r / lora_alpha (the most common values) and the patterns of the modules that differ, the way
    diffusers' get_peft_kwargs and PEFT's own configs express per-module ranks: each pattern key selects
    its one module (`pattern_key`), the target modules are exactly the LoRA's (`target_modules`; `model`:
    every module name of the model where it is known)."""
    cfg = dict(base)
    ranks = Counter(r for _, r, _ in entries)
    alphas = Counter(a for _, _, a in entries)
    r = ranks.most_common(1)[0][0] if ranks else cfg.get("r", 8)
    a = alphas.most_common(1)[0][0] if alphas else cfg.get("lora_alpha", r)
    names = [k for k, _, _ in entries]
    by_length: dict[int, list[str]] = {}
    for k in names:
        by_length.setdefault(len(k), []).append(k)
    cfg["r"] = int(r)
    cfg["lora_alpha"] = _num(a)
    cfg["rank_pattern"] = {pattern_key(k, by_length): int(v) for k, v, _ in entries if v != r}
    cfg["alpha_pattern"] = {pattern_key(k, by_length): _num(x) for k, _, x in entries if x != a}
    cfg["target_modules"] = target_modules(names, model, regex=isinstance(base.get("target_modules"), str))
    return cfg


def pattern_key(name: str, by_length: dict[int, list[str]]) -> str:
    """The rank_pattern / alpha_pattern key that selects module `name` alone among the LoRA's modules
    (`by_length`: their names by length).

    PEFT reads each key K as the regex `(.*\\.)?(K)$` against a module's full name, the first key that
    matches winning (`peft.utils.other.get_pattern_key`): a bare `proj_out` also selects
    `single_transformer_blocks.0.proj_out`, which then gets the top-level module's rank and fails to load
    ("size mismatch"). A leading `^` anchors the key at the start of the name, as PEFT's documentation and
    diffusers' own rank patterns write them (`^transformer_blocks.0.attn.to_q`), so that the key matches
    the whole name or nothing. Its dots still match any character: where that would select another
    module of the LoRA (a name of the same length), or the name holds other regex characters, it is
    escaped."""
    plain = re.escape(name) == name.replace(".", "\\.")
    if plain and not any(o != name and re.fullmatch(name, o) for o in by_length.get(len(name), ())):
        return "^" + name
    return "^" + re.escape(name)


def target_modules(names: list[str], model: set[str] | None = None, regex: bool = False) -> list[str] | str:
    """`target_modules`: the modules' full names, as PEFT and diffusers write them. PEFT adds a LoRA to
    every module whose name is a listed one or ends with `.` + a listed one, so where the model is known
    (`model`: all its module names) and a listed name is also the tail of a module the LoRA leaves alone
    (`proj_out`, `single_transformer_blocks.0.proj_out`), PEFT would wrap that one too (an empty LoRA:
    `PeftModel.from_pretrained` warns of its missing keys, diffusers of the mismatch with the file). The
    list is then one regex, which PEFT matches against whole names (`re.fullmatch`), naming exactly these;
    so it is where the input's config had a regex (`regex`: resize and merge do not know the model, the
    input's writer may have)."""
    listed = sorted(names)
    chosen = set(listed)
    if not regex:
        for other in (model or set()) - chosen:
            parts = other.split(".")
            if any(".".join(parts[i:]) in chosen for i in range(1, len(parts))):
                regex = True
                break
    return "(?:" + "|".join(re.escape(n) for n in listed) + ")" if regex else listed


def _num(x: float):
    return int(x) if float(x).is_integer() else float(x)


def plan_lora(modules: list[OutModule], layout: Layout, dtype_of, operation: str,
              extra_metadata: dict[str, str] | None = None, report: Report | None = None,
              model_names=None) -> Plan:
    """The output plan: one safetensors file (kohya / diffusers / a kept single-file layout) or a PEFT
    adapter folder. `dtype_of(tensor)` is the dtype each factor is written in (the scratch store
    already holds them in it; input tensors passed through keep theirs). `operation` is recorded as
    `ckpt_operation` (`ckpt.lora.operations`). `model_names`: every module name the output naming has
    for the model, where the base is known (`target_modules` then names only the LoRA's modules).

    With `report`, every floating tensor goes through the `Caster` that convert and merge-lora write
    with, so NaN/Inf values a LoRA carries (factors and alphas passed through as stored) are counted
    the same way there as here (`nonfinite_input`), never copied without a word."""
    outs: list[OutTensor] = []
    peft_entries: dict[str, list[tuple[str, int, float]]] = {}
    seen: set[str] = set()
    casters: dict[torch.dtype, Caster] = {}

    def add(key: str, t: Tensor, dtype=None):
        if key in seen:
            raise ValueError(f"two output tensors named {key!r}")
        seen.add(key)
        dt = dtype or t.dtype
        if report is not None and is_float(t.dtype):
            c = casters.setdefault(dt, Caster(dt, report))
            outs.append(OutTensor(key, dt, tuple(t.shape), t, c.band(key), stateless=True))
        elif dt == t.dtype:
            outs.append(OutTensor(key, dt, tuple(t.shape), t))
        else:
            outs.append(OutTensor(key, dt, tuple(t.shape), t, lambda x, b, d=dt: x.to(d), stateless=True))

    for m in modules:
        if m.down is not None:
            down_key = m.keys.get("down") or f"{m.name}.{layout.suffixes[0]}"
            up_key = m.keys.get("up") or f"{m.name}.{layout.suffixes[1]}"
            add(down_key, m.down, dtype_of(m.down))
            add(up_key, m.up, dtype_of(m.up))
            if layout.alphas == "tensor" and m.alpha is not None:
                key = m.keys.get("alpha") or f"{m.name}.alpha"
                add(key, alpha_tensor(key, m.alpha))
        for key, t in m.extra.items():
            add(key, t)
        if layout.alphas in ("config", "metadata") and m.rank is not None:
            group, key = layout.peft_key(m.name)
            alpha = m.alpha if m.down is not None else m.peft_alpha
            if report is not None and alpha is not None and not math.isfinite(alpha):  # into the config, counted
                report.count("nonfinite_input", f"{m.name}.alpha", 1)
            peft_entries.setdefault(group, []).append((key, m.rank, alpha if alpha is not None else m.rank))

    meta = {k: v for k, v in layout.metadata.items() if k not in STALE_METADATA and k != META_KEY}
    meta.setdefault("format", "pt")
    meta.update(extra_metadata or {})
    meta.update(provenance(operation))
    generated: dict[str, dict] = {}
    model: dict[str, set[str]] | None = None
    if model_names is not None:
        model = {}
        for name in model_names:
            group, key = layout.peft_key(name)
            model.setdefault(group, set()).add(key)
    if layout.alphas == "metadata" and peft_entries:
        packed = {}
        for group, entries in sorted(peft_entries.items()):
            base = _group_config(layout.config, group)
            for k, v in _config_fields(entries, base, model and model.get(group)).items():
                packed[group + k] = v
        meta[META_KEY] = json.dumps(packed, indent=2, sort_keys=True)
    if layout.container == "folder":
        base = dict(layout.config) or {"peft_type": "LORA", "task_type": None, "bias": "none",
                                       "lora_dropout": 0.0, "fan_in_fan_out": False, "use_rslora": False,
                                       "use_dora": False, "inference_mode": True, "base_model_name_or_path": None}
        entries = [e for es in peft_entries.values() for e in es]
        names = set().union(*model.values()) if model else None
        generated[PEFT_CONFIG] = _config_fields(entries, base, names)
        plan = Plan(single_file=False, files=plan_files(outs, PEFT_STEM, metadata=meta)[0])
    else:
        plan = Plan(single_file=True, files=plan_files(outs, "", metadata=meta)[0])
    plan.generated = generated
    return plan


def _group_config(config: dict, group: str) -> dict:
    """The LoraConfig fields of one metadata group (flat metadata: the whole dict)."""
    if not group:
        return {k: v for k, v in config.items() if "." not in k}
    return {k[len(group):]: v for k, v in config.items() if k.startswith(group)}


def kohya_numbered(name: str) -> bool:
    return bool(re.match(r"^lora_(unet|te\d*)_", name))
