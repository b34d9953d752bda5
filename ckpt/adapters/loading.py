"""Reading adapters: LoRA files (any kind) and PEFT adapter folders, grouped into modules.

A stored key is a module name plus a suffix naming its part (`x.lora_down.weight` -> module `x`, part
`down`). The suffix table below is the whole vocabulary; keys it does not cover are reported as
unmatched, never dropped silently. Alpha comes from, in order: the module's own `alpha` tensor, the
PEFT `adapter_config.json` (lora_alpha, alpha_pattern, use_rslora), or the diffusers safetensors
metadata `lora_adapter_metadata`; without any, the commands give it --alpha or assume alpha = rank (scale 1)
with a warning (`ckpt.adapters.checks.settle_alphas`).

Tensors are read through `ckpt.io` (validated headers, pread on demand): a LoRA is never loaded whole.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path


from ckpt.errors import CkptError, file_error
from ckpt.io.checkpoint import open_checkpoint
from ckpt.io.hub import check_lora
from ckpt.io.tensors import RowConcat, RowSlice, Tensor
from ckpt.adapters import litgpt, mlx_lm
from ckpt.adapters.files import LoraFile, LoraModule
from ckpt.adapters.xlabs import xlabs_part

PEFT_PREFIX = "base_model.model."

# suffix -> (kind or None for parts any kind may carry, part role)
SUFFIXES: dict[str, tuple[str | None, str]] = {
    "lora_down.weight": ("lora", "down"),
    "lora_up.weight": ("lora", "up"),
    "lora_mid.weight": ("lora", "mid"),
    "lora.down.weight": ("lora", "down"),  # old diffusers LoRACompatibleLinear
    "lora.up.weight": ("lora", "up"),
    "lora_linear_layer.down.weight": ("lora", "down"),  # old diffusers text encoder
    "lora_linear_layer.up.weight": ("lora", "up"),
    "lora_A.weight": ("lora", "down"),
    "lora_B.weight": ("lora", "up"),
    "lora_B.bias": ("lora", "up_bias"),
    "lora_A.default.weight": ("lora", "down"),
    "lora_B.default.weight": ("lora", "up"),
    "lora_B.default.bias": ("lora", "up_bias"),
    "lora_embedding_A": ("lora", "emb_A"),
    "lora_embedding_B": ("lora", "emb_B"),
    "lora_embedding_A.default": ("lora", "emb_A"),
    "lora_embedding_B.default": ("lora", "emb_B"),
    "lora_magnitude_vector": ("lora", "magnitude"),
    "lora_magnitude_vector.weight": ("lora", "magnitude"),
    "lora_magnitude_vector.default": ("lora", "magnitude"),
    "lora_magnitude_vector.default.weight": ("lora", "magnitude"),
    "hada_w1_a": ("loha", "w1a"),
    "hada_w1_b": ("loha", "w1b"),
    "hada_w2_a": ("loha", "w2a"),
    "hada_w2_b": ("loha", "w2b"),
    "hada_t1": ("loha", "t1"),
    "hada_t2": ("loha", "t2"),
    "lokr_w1": ("lokr", "w1"),
    "lokr_w1_a": ("lokr", "w1a"),
    "lokr_w1_b": ("lokr", "w1b"),
    "lokr_w2": ("lokr", "w2"),
    "lokr_w2_a": ("lokr", "w2a"),
    "lokr_w2_b": ("lokr", "w2b"),
    "lokr_t2": ("lokr", "t2"),
    "diff": ("full", "diff"),
    "diff_b": ("full", "diff_b"),
    "a1.weight": ("glora", "a1"),
    "a2.weight": ("glora", "a2"),
    "b1.weight": ("glora", "b1"),
    "b2.weight": ("glora", "b2"),
    "on_input": ("ia3", "on_input"),
    "alpha": (None, "alpha"),
    "dora_scale": (None, "dora_scale"),
}
# diffusers attention-processor LoRAs: `...attn1.processor.to_q_lora.down.weight` (module `attn1.to_q`).
PROCESSOR_KEY = re.compile(r"^(?P<head>.*?)(?:\.processor)?\.(?P<proj>to_q|to_k|to_v|to_out)_lora\.(?P<role>down|up)\.weight$")
_ORDERED = sorted(SUFFIXES, key=len, reverse=True)
PEFT_FIELDS = ("lora_alpha", "r", "use_rslora", "alpha_pattern", "rank_pattern", "fan_in_fan_out", "peft_type")


@dataclass
class PeftSettings:
    """The parts of a PEFT LoraConfig that change the merge (adapter_config.json or diffusers metadata)."""

    lora_alpha: float | None = None
    use_rslora: bool = False
    alpha_pattern: dict = field(default_factory=dict)
    fan_in_fan_out: bool = False

    @classmethod
    def from_dict(cls, d: dict) -> PeftSettings:
        alpha = d.get("lora_alpha")
        return cls(float(alpha) if alpha is not None else None, bool(d.get("use_rslora")),
                   dict(d.get("alpha_pattern") or {}), bool(d.get("fan_in_fan_out")))

    def alpha_for(self, key: str) -> float | None:
        """PEFT's own rule (peft.utils.other.get_pattern_key): the first pattern P with
        re.match(rf"(.*\\.)?({P})$", key) wins."""
        for pat, value in self.alpha_pattern.items():
            if re.match(rf"(.*\.)?({pat})$", key):
                return float(value)
        return self.lora_alpha


def load_lora(spec: str, base_hint: Path | None = None) -> LoraFile:
    """`base_hint`: the base model's folder, where a LitGPT LoRA may find its model_config.yaml."""

    check_lora(spec)
    path = Path(spec).expanduser()
    if litgpt.is_lora(path):
        return litgpt.load(spec, base_hint)
    if mlx_lm.is_adapter(path):
        return mlx_lm.load(spec)
    settings_by_prefix: dict[str, PeftSettings] = {}
    peft_folder = False
    if path.is_dir():
        weights, settings = _peft_folder(path)
        if settings is not None:  # adapter_config.json
            settings_by_prefix[""] = settings
            peft_folder = True
    else:
        weights = path
    ckpt = open_checkpoint(str(weights))
    try:
        comp = ckpt.components[0]
        if not comp.tensors:
            raise file_error(weights, "holds no tensors, not a LoRA")
        if not settings_by_prefix:
            settings_by_prefix = _metadata_settings(weights, comp.files[0].metadata)
        modules, unknown = group_modules(comp.tensors, spec, settings_by_prefix, peft_folder)
        if not modules:
            raise file_error(weights, f"no LoRA/LyCORIS module found (keys such as {unknown[0]!r})")
        reorder_rows(modules, list(comp.tensors), spec)
        return LoraFile(spec, weights, modules, unknown, ckpt)
    except BaseException:
        ckpt.close()
        raise


def reorder_rows(modules: dict[str, LoraModule], keys: list[str], source: str) -> None:
    """Modules whose trainer stores the output rows in another order than the layout's, as the family of the
    LoRA's names says (`Family.lora_rows`: MiniMax-H3 DiffSynth-Studio LoRAs' per-head interleaved qkv): their
    up factor, its bias and a DoRA magnitude are reordered here, lazily (row slices), so merging, converting and
    resizing all read the layout's order, as diffusers' loader gives it."""
    from ckpt import families
    from ckpt.families.lora_namings import lora_target

    lora = {m.name: m for m in modules.values() if m.kind == "lora" and "up" in m.parts}
    rows = {name: m.parts["up"].rows for name, m in lora.items()}
    for fam in families.all_families():
        if fam.lora_rows is None:
            continue
        try:
            spans, why = fam.lora_rows(keys, rows), None
        except ValueError as e:
            spans, why = None, str(e)
        if spans == {}:
            continue
        match = lora_target(list(lora))[1]
        if match is None or match.family is not fam:
            continue
        if why is not None:
            raise CkptError(f"{source}: {why}; nothing was written")
        for name, order in spans.items():
            m = lora[name]
            for role in ("up", "up_bias", "magnitude"):
                t = m.parts.get(role)
                if t is not None and t.shape and t.rows == rows[name]:
                    m.parts[role] = RowConcat(t.name, [RowSlice(t, a, b) for a, b in order], t.home)


def _peft_folder(path: Path) -> tuple[Path, PeftSettings | None]:
    """The weights of an adapter folder and its adapter_config.json settings. A folder with one
    safetensors file and no config (diffusers `save_lora_adapter` / `save_lora_weights`) is that file,
    with settings from its metadata."""
    cfg_path = path / "adapter_config.json"
    if not cfg_path.is_file():
        files = sorted(path.glob("*.safetensors"))
        if len(files) == 1:
            return files[0], None
        raise file_error(path, "is a folder but not a PEFT adapter (no adapter_config.json); pass the LoRA file")
    try:
        cfg = json.loads(cfg_path.read_text())
        assert isinstance(cfg, dict)
    except (json.JSONDecodeError, UnicodeDecodeError, AssertionError):
        raise file_error(cfg_path, "not a valid JSON object") from None
    kind = cfg.get("peft_type", "LORA")
    if kind != "LORA":
        raise file_error(cfg_path, f"PEFT adapter type {kind!r} is not supported (LORA only)")
    for name in ("adapter_model.safetensors", "adapter_model.bin"):
        if (path / name).is_file():
            return path / name, PeftSettings.from_dict(cfg)
    raise file_error(path, "PEFT adapter folder without adapter_model.safetensors")


def _metadata_settings(weights: Path, metadata: dict[str, str]) -> dict[str, PeftSettings]:
    """diffusers writes the LoraConfig as JSON under `lora_adapter_metadata`: flat for one model
    (`{"r": 4, "lora_alpha": 8}`), or prefixed per pipeline component (`"transformer.lora_alpha"`)."""
    raw = metadata.get("lora_adapter_metadata")
    if not raw:
        return {}
    try:
        d = json.loads(raw)
        assert isinstance(d, dict)
    except (json.JSONDecodeError, AssertionError):
        raise file_error(weights, "metadata lora_adapter_metadata is not a JSON object") from None
    if any(k in d for k in PEFT_FIELDS):
        return {"": PeftSettings.from_dict(d)}
    grouped: dict[str, dict] = {}
    for k, v in d.items():
        prefix, _, fld = k.rpartition(".")
        if prefix and fld in PEFT_FIELDS + ("target_modules",):
            grouped.setdefault(prefix, {})[fld] = v
    return {p: PeftSettings.from_dict(g) for p, g in grouped.items()}


def _split(key: str) -> tuple[str, str | None, str] | None:
    """(module name, kind, role) of a stored key, or None."""
    x = xlabs_part(key)
    if x is not None:
        return x[0], "lora", x[1]
    m = PROCESSOR_KEY.match(key)
    if m is not None:
        proj = "to_out.0" if m["proj"] == "to_out" else m["proj"]
        return f"{m['head']}.{proj}", "lora", m["role"]
    for suffix in _ORDERED:
        if key.endswith("." + suffix):
            kind, role = SUFFIXES[suffix]
            return key[: -len(suffix) - 1], kind, role
    return None


def group_modules(tensors: dict[str, Tensor], source: str, settings_by_prefix: dict[str, PeftSettings],
                  peft_folder: bool) -> tuple[dict[str, LoraModule], list[str]]:
    modules: dict[str, LoraModule] = {}
    leftovers: list[str] = []

    def add(name, kind, role, key, slot=None):
        slot = slot or name
        m = modules.get(slot)
        if m is None:
            m = modules[slot] = LoraModule(name, source, None, {}, [], [name])
        if kind is not None:
            if m.kind not in (None, kind):
                raise CkptError(f"{source}: module {name!r} mixes {m.kind} and {kind} keys ({key!r})")
            m.kind = kind
        if role in m.parts:
            raise CkptError(f"{source}: module {name!r} has two {role} tensors ({key!r})")
        m.parts[role] = tensors[key]
        m.keys.append(key)

    for key in tensors:
        s = _split(key)
        if s is None:
            leftovers.append(key)
        else:
            add(*s, key)
    unknown = []
    for key in leftovers:
        head, _, last = key.rpartition(".")
        if last == "weight" and head in modules and "on_input" in modules[head].parts:
            add(head, "ia3", "weight", key)
        elif last in ("weight", "bias") and (peft_folder or key.startswith(PEFT_PREFIX)):
            # PEFT modules_to_save, or the base_layer copy PEFT saves with trained embeddings
            name = head[: -len(".base_layer")] if head.endswith(".base_layer") else head
            add(name, "replace", last, key, slot=name + " (replaced)")
        else:
            unknown.append(key)
    for name, m in list(modules.items()):
        if m.kind is None:  # only alpha / dora_scale: nothing to merge
            unknown += m.keys
            del modules[name]
            continue
        _settle(m, settings_by_prefix)
    return modules, unknown


def _settle(m: LoraModule, settings_by_prefix: dict[str, PeftSettings]) -> None:
    """PEFT settings for one module, and the spellings the key map should try."""
    name = m.name
    settings, key = settings_by_prefix.get(""), name
    for prefix, s in settings_by_prefix.items():
        if prefix and name.startswith(prefix + "."):
            settings, key = s, name[len(prefix) + 1:]
    if key.startswith(PEFT_PREFIX):
        key = key[len(PEFT_PREFIX):]
    if settings is not None:
        m.config_alpha = settings.alpha_for(key)
        m.rslora = settings.use_rslora
        m.fan_in_fan_out = settings.fan_in_fan_out
    if key != name:
        m.lookup_names.append(key)
