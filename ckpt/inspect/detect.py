"""What a set of tensor names (and their shapes) is: bundle parts, model family, LoRA family.

Detection works on names and header shapes only, never on values. Key names are matched with `[._]`
where a separator may be either, so the same rule recognises a base model's keys
(`input_blocks.4.1.transformer_blocks.0.attn2.to_k.weight`) and a kohya LoRA's flattened module names
(`lora_unet_input_blocks_4_1_transformer_blocks_0_attn2_to_k`).

Why prefixes matter: a trainer that expects bare keys matches nothing in a file whose keys all start
with `model.diffusion_model.` (ComfyUI / LDM all-in-one) and leaves its weights on the meta device
(kohya "Cannot copy out of meta tensor"). `split_parts` names each prefix so `inspect` can show it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

# Prefixes that mark a bundled component (LDM / ComfyUI all-in-one files), longest match wins.
BUNDLE_PREFIXES = [
    (re.compile(r"^model\.diffusion_model\."), "diffusion model, LDM/ComfyUI"),
    (re.compile(r"^diffusion_model\."), "diffusion model"),
    (re.compile(r"^model_ema\."), "EMA diffusion model, LDM"),
    (re.compile(r"^first_stage_model\."), "VAE, LDM"),
    (re.compile(r"^cond_stage_model\."), "text encoder, LDM"),
    (re.compile(r"^conditioner\.embedders\.\d+\."), "text encoder, SDXL LDM"),
    (re.compile(r"^text_encoders\.[^.]+\."), "text encoder, ComfyUI bundle"),
    (re.compile(r"^vae\."), "VAE, ComfyUI bundle"),
]
# Prefixes LoRA files put before module names (which model of a pipeline the module belongs to).
LORA_PREFIXES = [
    (re.compile(r"^lora_unet_"), "kohya UNet/transformer"),
    (re.compile(r"^lora_te\d?_"), "kohya text encoder"),
    (re.compile(r"^lora_transformer_"), "OneTrainer transformer"),
    (re.compile(r"^lycoris_"), "LyCORIS, SimpleTuner"),
    (re.compile(r"^base_model\.model\."), "PEFT"),
    (re.compile(r"^(unet|transformer|prior)\."), "diffusers"),
    (re.compile(r"^text_encoder(_\d)?\."), "diffusers text encoder"),
    (re.compile(r"^(diffusion_model|model\.diffusion_model)\."), "ComfyUI"),
]

# LoRA-family tensor-name suffixes: family -> regex on a key; group(1) is the module name.
LORA_KINDS: list[tuple[str, re.Pattern]] = [
    ("XLabs Flux LoRA", re.compile(r"^(.*\.processor\.\w*?_lora\d?)\.(down|up)\.weight$")),
    ("kohya LoRA/LoCon", re.compile(r"^(.*?)[._]lora_(down|up|mid)\.weight$")),
    ("PEFT/diffusers LoRA", re.compile(r"^(.*?)\.lora_(A|B)(\.[\w-]+)?\.(weight|bias)$")),
    ("LitGPT LoRA", re.compile(r"^(.*?)\.lora_(A|B)$")),  # lit_model.pth.lora
    ("LyCORIS LoHa", re.compile(r"^(.*?)\.hada_(w1_a|w1_b|w2_a|w2_b|t1|t2)$")),
    ("LyCORIS LoKr", re.compile(r"^(.*?)\.lokr_(w1|w1_a|w1_b|w2|w2_a|w2_b|t2)$")),
    ("DoRA", re.compile(r"^(.*?)\.(dora_scale|lora_magnitude_vector(\.[\w-]+)?)(\.weight)?$")),
    ("LyCORIS full diff", re.compile(r"^(.*?)\.(diff|diff_b)$")),
    ("(IA)^3", re.compile(r"^(.*?)\.(ia3_l(\.[\w-]+)?|on_input)$")),
    ("LyCORIS GLoRA", re.compile(r"^(.*?)\.(a1|a2|b1|b2)\.weight$")),
]
LORA_ALPHA = re.compile(r"^(.*?)\.alpha$")

SEP = r"[._]"


@dataclass
class Part:
    """Keys of one bundled component (or the whole file when nothing is bundled)."""

    prefix: str  # "" when the keys carry no known prefix
    role: str  # what the prefix means, "" when none
    keys: list[str] = field(default_factory=list)


def split_parts(names, lora: bool = False) -> list[Part]:
    """Group names by the known prefix they start with; parts come in table order (the diffusion model
    first), then by prefix, unprefixed keys last."""
    table = LORA_PREFIXES if lora else BUNDLE_PREFIXES
    parts: dict[str, Part] = {}
    rank: dict[str, tuple] = {"": (len(table), "")}
    for name in names:
        prefix, role = "", ""
        for i, (pat, what) in enumerate(table):
            m = pat.match(name)
            if m and len(m.group(0)) > len(prefix):
                prefix, role = m.group(0), what
                rank[prefix] = (i, prefix)
        parts.setdefault(prefix, Part(prefix, role)).keys.append(name)
    return sorted(parts.values(), key=lambda p: rank[p.prefix])


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
            if down:
                ranks.add(down[0])
            if down and up and len(down) >= 2:
                base_shapes[mod] = (up[0], down[1], *down[2:])
    if "kohya LoRA/LoCon" in kinds:  # LoCon when some factor is a conv with a kernel larger than 1x1
        locon = any(len(s) == 4 and tuple(s[2:]) != (1, 1) for s in base_shapes.values())
        kinds["kohya LoCon" if locon else "kohya LoRA"] = kinds.pop("kohya LoRA/LoCon")
    return kinds, base_shapes, ranks, alphas


def _has(keys, pattern: str) -> list[str]:
    rx = re.compile(pattern)
    return [k for k in keys if rx.search(k)]


def _dim(shapes: dict, keys, pattern: str, axis: int) -> int | None:
    """Size along `axis` of the first key matching `pattern` whose shape is known."""
    for k in _has(keys, pattern):
        s = shapes.get(k)
        if s is not None and len(s) > axis:
            return s[axis]
    return None


def _ldm_unet(keys, shapes) -> str:
    ctx = _dim(shapes, keys, rf"attn2{SEP}to_k(\.weight)?$", 1)
    if _has(keys, rf"(^|{SEP})label_emb{SEP}") or _has(keys, rf"(^|{SEP})add_embedding{SEP}"):
        return "SDXL refiner UNet" if ctx == 1280 else "SDXL UNet"
    if ctx == 2048:
        return "SDXL UNet"
    if ctx == 768:
        return "SD1 UNet"
    if ctx == 1024:
        return "SD2 UNet"
    return "SD1/SD2/SDXL UNet"


def _diffusers_unet_variant(keys, shapes) -> str:
    if _has(keys, rf"(^|{SEP})add_embedding{SEP}"):
        return _ldm_unet(keys, shapes)
    label = _ldm_unet(keys, shapes)
    if label == "SD1/SD2/SDXL UNet" and _has(keys, rf"down_blocks{SEP}[12]{SEP}attentions") \
            and not _has(keys, rf"down_blocks{SEP}0{SEP}attentions"):
        return "SDXL UNet"
    return label


def _flux_variant(keys) -> str:
    if _has(keys, rf"(^|{SEP})guidance_in{SEP}") or _has(keys, r"guidance_embedder"):
        return "Flux (dev: guidance embedding)"
    return "Flux"


def _vae(keys, shapes, diffusers: bool) -> str:
    z = _dim(shapes, keys, rf"(^|{SEP})encoder{SEP}conv_out\.weight$", 0)
    latents = f", {z // 2}-channel latents" if z else ""
    return f"VAE ({'diffusers AutoencoderKL' if diffusers else 'LDM'}{latents})"


CLIP_WIDTHS = {768: "CLIP-L", 1024: "OpenCLIP-H", 1280: "OpenCLIP-bigG", 512: "CLIP-B"}
CLIP_WIDTH_KEYS = rf"(self_attn{SEP}[qkv]_proj|self_attn{SEP}out_proj|mlp{SEP}fc1)(\.weight)?$"


def _clip(keys, shapes, hf: bool) -> str:
    w = _dim(shapes, keys, r"token_embedding\.weight$", 1) or _dim(shapes, keys, CLIP_WIDTH_KEYS, 1)
    name = CLIP_WIDTHS.get(w, "CLIP") if w else "CLIP"
    return f"{name} text encoder ({'HF CLIPTextModel' if hf else 'OpenCLIP'})"


def _at(body: str) -> str:
    """`body` starting at a name boundary; `_` in body stands for either separator."""
    return rf"(^|{SEP})" + body.replace("_.", SEP)


# (label function, patterns that must all match some key), tried in order; the rule whose first
# pattern matches the most keys wins (ties: the earlier rule).
RULES = [
    (lambda k, s: _flux_variant(k) + " transformer (BFL)",
     [_at(r"(double_blocks_.\d+_.((img|txt)_(attn|mlp|mod)|processor)|single_blocks_.\d+_.(linear[12]|modulation))")]),
    (lambda k, s: "SD3 MMDiT (BFL/SAI)", [_at(r"joint_blocks_.\d+_.(context_block|x_block)")]),
    (lambda k, s: _flux_variant(k) + " transformer (diffusers FluxTransformer2DModel)",
     [_at(r"single_transformer_blocks_.\d+_.")]),
    (lambda k, s: "SD3 transformer (diffusers SD3Transformer2DModel)",
     [_at(r"transformer_blocks_.\d+_.(attn_.add_q_proj|ff_context)"), _at(r"pos_embed_.")]),
    (lambda k, s: _ldm_unet(k, s) + " (LDM)", [_at(r"(input_blocks|output_blocks)_.\d+_.\d+_.")]),
    (lambda k, s: _vae(k, s, diffusers=True),
     [_at(r"(encoder_.down_blocks_.\d+_.resnets|decoder_.up_blocks_.\d+_.resnets)")]),
    (lambda k, s: _diffusers_unet_variant(k, s) + " (diffusers UNet2DConditionModel)",
     [_at(r"(down_blocks|up_blocks)_.\d+_.(resnets|attentions)_.")]),
    (lambda k, s: _vae(k, s, diffusers=False), [_at(r"(encoder_.down_.\d+_.block|decoder_.up_.\d+_.block)_.")]),
    (lambda k, s: _clip(k, s, hf=True),
     [_at(r"(text_model_.)?encoder_.layers_.\d+_.(self_attn|mlp_.fc[12]|layer_norm[12])")]),
    (lambda k, s: _clip(k, s, hf=False), [_at(r"transformer_.resblocks_.\d+_.")]),
    (lambda k, s: "T5 encoder", [_at(r"encoder_.block_.\d+_.layer_.\d+_.")]),
    (lambda k, s: "LitGPT GPT" + (" (older attn.attn names)" if _has(k, _at(r"attn_.attn")) else ""),
     [_at(r"h_.\d+_.(attn_.(qkv|attn)|mlp_.(fc|fc_1|fc_2|proj))")]),  # "transformer." may be stripped
    (lambda k, s: "HF causal LM (Llama-style decoder)",
     [_at(r"layers_.\d+_.(self_attn|mlp)_.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)")]),
]


def detect_family(keys, shapes: dict | None = None) -> str | None:
    """A model family label for `keys` (already stripped of bundle / LoRA prefixes), or None."""
    keys = list(keys)
    shapes = shapes or {}
    best, best_n = None, 0
    for label, patterns in RULES:
        hits = _has(keys, patterns[0])
        if not hits or not all(_has(keys, p) for p in patterns[1:]):
            continue
        if len(hits) > best_n:
            best, best_n = label(keys, shapes), len(hits)
    return best


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
