"""What a set of tensor names (and their shapes) is: bundle parts, model family, LoRA family.

Detection works on names and header shapes only, never on values. Model families are the registry's
(`ckpt.families`): its signatures match `[._]` where a separator may be either, so the same rule
recognises a base model's keys (`input_blocks.4.1.transformer_blocks.0.attn2.to_k.weight`) and a kohya
LoRA's flattened module names (`lora_unet_input_blocks_4_1_transformer_blocks_0_attn2_to_k`).

Why prefixes matter: a trainer that expects bare keys matches nothing in a file whose keys all start
with `model.diffusion_model.` (ComfyUI / LDM all-in-one) and leaves its weights on the meta device
(kohya "Cannot copy out of meta tensor"). `split_parts` names each prefix so `inspect` can show it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from ckpt.families.prefixes import MODEL_PREFIXES, accepts, under  # the diffusion model's
from ckpt.families.lora_namings import LORA_PREFIXES  # prefixes LoRA files put before module names

# Prefixes that mark a bundled component (LDM / ComfyUI all-in-one files), longest match wins.
BUNDLE_PREFIXES = [
    *((re.compile("^" + re.escape(p)), role) for p, role in MODEL_PREFIXES.items()),  # ckpt.families.prefixes
    (re.compile(r"^model_ema\."), "EMA diffusion model, LDM"),
    (re.compile(r"^first_stage_model\."), "VAE, LDM"),
    (re.compile(r"^cond_stage_model\."), "text encoder, LDM"),
    (re.compile(r"^conditioner\.embedders\.\d+\."), "text encoder, SDXL LDM"),
    (re.compile(r"^text_encoders\.[^.]+\."), "text encoder, ComfyUI bundle"),
    (re.compile(r"^vae\."), "VAE, ComfyUI bundle"),
]
# LoRA-family tensor-name suffixes: family -> regex on a key; group(1) is the module name.
LORA_KINDS: list[tuple[str, re.Pattern]] = [
    ("XLabs Flux LoRA", re.compile(r"^(.*\.processor\.\w*?_lora\d?)\.(down|up)\.weight$")),
    ("kohya LoRA/LoCon", re.compile(r"^(.*?)[._]lora_(down|up|mid)\.weight$")),
    ("PEFT/diffusers LoRA", re.compile(r"^(.*?)\.lora_(A|B)(\.[\w-]+)?\.(weight|bias)$")),
    ("LitGPT LoRA", re.compile(r"^(.*?)\.lora_(A|B)$")),  # lit_model.pth.lora
    ("mlx-lm LoRA", re.compile(r"^(.*?)\.lora_(a|b)$")),  # adapters.safetensors: lora_a [in, r], lora_b [r, out]
    ("LyCORIS LoHa", re.compile(r"^(.*?)\.hada_(w1_a|w1_b|w2_a|w2_b|t1|t2)$")),
    ("LyCORIS LoKr", re.compile(r"^(.*?)\.lokr_(w1|w1_a|w1_b|w2|w2_a|w2_b|t2)$")),
    ("DoRA", re.compile(r"^(.*?)\.(dora_scale|lora_magnitude_vector(\.[\w-]+)?)(\.weight)?$")),
    ("LyCORIS full diff", re.compile(r"^(.*?)\.(diff|diff_b)$")),
    ("(IA)^3", re.compile(r"^(.*?)\.(ia3_l(\.[\w-]+)?|on_input)$")),
    ("LyCORIS GLoRA", re.compile(r"^(.*?)\.(a1|a2|b1|b2)\.weight$")),
]
LORA_ALPHA = re.compile(r"^(.*?)\.alpha$")



@dataclass
class BundlePart:
    """Keys of one bundled component (or the whole file when nothing is bundled)."""

    prefix: str  # "" when the keys carry no known prefix
    role: str  # what the prefix means, "" when none
    keys: list[str] = field(default_factory=list)


def split_parts(names, lora: bool = False, shapes: dict | None = None) -> list[BundlePart]:
    """Group names by the known prefix they start with; parts come in table order (the diffusion model
    first), then by prefix, unprefixed keys last. A guarded model prefix (`model.model.`) whose keys are no
    diffusion model (`shapes` help tell) is no prefix: those keys join the unprefixed ones."""
    table = LORA_PREFIXES if lora else BUNDLE_PREFIXES
    parts: dict[str, BundlePart] = {}
    rank: dict[str, tuple] = {"": (len(table), "")}
    for name in names:
        prefix, role = "", ""
        for i, (pat, what) in enumerate(table):
            m = pat.match(name)
            if m and len(m.group(0)) > len(prefix):
                prefix, role = m.group(0), what
                rank[prefix] = (i, prefix)
        parts.setdefault(prefix, BundlePart(prefix, role)).keys.append(name)
    for prefix in [p for p in parts if p and not lora and not accepts(p, *under(p, parts[p].keys, shapes))]:
        parts.setdefault("", BundlePart("", "")).keys.extend(parts.pop(prefix).keys)  # `model.model.` of an LLM wrapper
    return sorted(parts.values(), key=lambda p: rank[p.prefix])


def mostly_lora(kinds: dict[str, set[str]], alphas: int, n_keys: int) -> bool:
    """The rule that calls a checkpoint a LoRA (`lora_modules`' result over its `n_keys` keys): at least
    half of its keys are LoRA factors or alphas. inspect, merge-lora (a swapped BASE) and convert
    --layout (a LoRA passed as a model) all decide by it."""
    keys = sum(len(m) for m in kinds.values())
    return bool(kinds) and (keys * 2 + alphas) >= n_keys * 0.5


def looks_like_lora(names) -> bool:
    """`mostly_lora` of a list of key names."""
    names = list(names)
    kinds, _, _, alphas = lora_modules(names, {})
    return mostly_lora(kinds, alphas, len(names))


def lora_modules(names, shapes: dict) -> tuple[dict[str, set[str]], dict[str, tuple], set[int], int]:
    """LoRA-family keys -> (kind -> module names, module -> base weight shape where the factors say it,
    ranks seen, number of alpha keys). Keys that are not LoRA-family are ignored."""
    kinds: dict[str, set[str]] = {}
    base_shapes: dict[str, tuple] = {}
    ranks: set[int] = set()
    alphas = 0
    for name in names:
        if LORA_ALPHA.match(name):
            alphas += 1
            continue
        for kind, pat in LORA_KINDS:
            m = pat.match(name)
            if m:
                kinds.setdefault(kind, set()).add(m.group(1))
                break
    for kind, down_up in (("kohya LoRA/LoCon", (".lora_down.weight", ".lora_up.weight")),
                          ("PEFT/diffusers LoRA", (".lora_A.weight", ".lora_B.weight")),
                          ("LitGPT LoRA", (".lora_A", ".lora_B"))):
        for mod in kinds.get(kind, ()):
            down, up = shapes.get(mod + down_up[0]), shapes.get(mod + down_up[1])
            # LitGPT's fused attn.qkv stacks one rank-r pair per enabled projection: its rows are not a rank
            if down and not (kind == "LitGPT LoRA" and mod.endswith(".attn.qkv")):
                ranks.add(down[0])
            if down and up and len(down) >= 2:
                base_shapes[mod] = (up[0], down[1], *down[2:])
    for mod in kinds.get("mlx-lm LoRA", ()):  # transposed against PEFT's: the rank is lora_a's second axis
        a, b = shapes.get(mod + ".lora_a"), shapes.get(mod + ".lora_b")
        if a and len(a) == 2:
            ranks.add(a[1])
            if b and len(b) == 2:
                base_shapes[mod] = (b[1], a[0])
    for kind, factors in (("LyCORIS LoHa", (".hada_w1_b", ".hada_w2_b")),  # rank: rows of the b factors
                          ("LyCORIS LoKr", (".lokr_w1_b", ".lokr_w2_b"))):  # decomposed factors only
        for mod in kinds.get(kind, ()):
            for f in factors:
                s = shapes.get(mod + f)
                if s:
                    ranks.add(s[0])
                    break
    if "kohya LoRA/LoCon" in kinds:  # LoCon when some factor is a conv with a kernel larger than 1x1
        locon = any(len(s) == 4 and tuple(s[2:]) != (1, 1) for s in base_shapes.values())
        kinds["kohya LoCon" if locon else "kohya LoRA"] = kinds.pop("kohya LoRA/LoCon")
    return kinds, base_shapes, ranks, alphas


def family_from_config(config: dict | None) -> str | None:
    """The class a diffusers/transformers config.json names (`_class_name` or `architectures`)."""
    if not isinstance(config, dict):
        return None
    if isinstance(config.get("_class_name"), str):
        return config["_class_name"]
    arch = config.get("architectures")
    if isinstance(arch, list) and arch and isinstance(arch[0], str):
        return arch[0]
    return None
