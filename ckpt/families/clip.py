"""CLIP text encoders: OpenCLIP towers (SD2's ViT-H, SDXL's bigG `conditioner.embedders.1.model`), the
"original" layout, <-> Hugging Face CLIPTextModel names (`text_model.encoder.layers.N.self_attn.q_proj`),
the "diffusers" layout (what diffusers pipelines, SD1 single files and every LoRA trainer use).

OpenCLIP fuses q, k, v into `attn.in_proj_weight` (rows [0,W), [W,2W), [2W,3W), W = width) and stores
`text_projection` as [width, proj], the transpose of HF's `text_projection.weight`. Reference: diffusers
`convert_open_clip_checkpoint`. transformers 5's CLIPTextModel saves its layers without the
`text_model.` wrapper (`encoder.layers.N...`); trainers still name them with it, so that spelling is a
LoRA alias. Variants by width: CLIP-L 768, OpenCLIP-H 1024, OpenCLIP-bigG 1280, CLIP-B 512.
"""

from __future__ import annotations

from ckpt.families.spec import (DIFFUSERS, ORIGINAL, SEP, Alias, Family, Pair, Shapes, Signature, at, block_indices,
                                dim, module_of, present, thirds)

LAYER = (
    ("attn.out_proj", "self_attn.out_proj"),
    ("ln_1", "layer_norm1"),
    ("ln_2", "layer_norm2"),
    ("mlp.c_fc", "mlp.fc1"),
    ("mlp.c_proj", "mlp.fc2"),
)
TOP = (
    ("token_embedding.weight", "text_model.embeddings.token_embedding.weight"),
    ("positional_embedding", "text_model.embeddings.position_embedding.weight"),
    ("ln_final.weight", "text_model.final_layer_norm.weight"),
    ("ln_final.bias", "text_model.final_layer_norm.bias"),
)
WIDTHS = {768: "CLIP-L", 1024: "OpenCLIP-H", 1280: "OpenCLIP-bigG", 512: "CLIP-B"}
WIDTH_KEYS = rf"(self_attn{SEP}[qkv]_proj|self_attn{SEP}out_proj|mlp{SEP}fc1)(\.weight)?$"

HF = at(r"(text_model_.)?encoder_.layers_.\d+_.(self_attn|mlp_.fc[12]|layer_norm[12])")
OPENCLIP = at(r"transformer_.resblocks_.\d+_.")


def width(keys, shapes: Shapes) -> int | None:
    return (shapes.get("ln_final.weight", (None,))[0] or dim(shapes, keys, r"token_embedding\.weight$", 1)
            or dim(shapes, keys, WIDTH_KEYS, 1))


def kind(keys, shapes: Shapes) -> str:
    """kohya's text-encoder kinds: "clip_g" (bigG, 1280 wide) or "clip_l" (anything else)."""
    return "clip_g" if width(keys, shapes) == 1280 else "clip_l"


def identify(keys, shapes, layout):
    w = width(keys, shapes)
    name = WIDTHS.get(w, "CLIP") if w else "CLIP"
    return "clip", f"{name} text encoder ({'HF CLIPTextModel' if layout == DIFFUSERS else 'OpenCLIP'})"


def pairs(shapes: Shapes, layout: str) -> list[Pair]:
    wrap = "" if layout == DIFFUSERS and not any(k.startswith("text_model.") for k in shapes) else "text_model."
    out: list[Pair] = []
    if layout == ORIGINAL:
        n = block_indices(shapes, "transformer.resblocks")
        w = (shapes.get("transformer.resblocks.0.attn.in_proj_weight") or (0,))[0] // 3
    else:
        n = block_indices(shapes, f"{wrap}encoder.layers")
        w = (shapes.get(f"{wrap}encoder.layers.0.self_attn.q_proj.weight") or (0,))[0]
    for i in n:
        src, dst = f"transformer.resblocks.{i}", f"{wrap}encoder.layers.{i}"
        for e in ("weight", "bias"):
            for rows, name in zip(thirds(0, w), ("q_proj", "k_proj", "v_proj")):
                out.append(Pair(f"{src}.attn.in_proj_{e}", f"{dst}.self_attn.{name}.{e}", rows))
            out += [Pair(f"{src}.{o}.{e}", f"{dst}.{d}.{e}") for o, d in LAYER]
    out += [Pair(o, d.replace("text_model.", wrap, 1)) for o, d in TOP]
    out.append(Pair("text_projection", "text_projection.weight", transform="transpose"))
    return present(out, shapes, layout)


def lora_aliases(shapes: Shapes, layout: str) -> list[Alias]:
    """HF CLIP saved without the `text_model.` wrapper answers to the wrapped names trainers use."""
    if layout != DIFFUSERS or any(k.startswith("text_model.") for k in shapes):
        return []
    return [Alias("text_model." + module_of(k), k) for k in shapes
            if k.startswith(("encoder.", "embeddings.", "final_layer_norm.")) and not k.endswith(".bias")]


FAMILY = Family(
    family_id="clip",
    kind="text_encoder",
    label="CLIP text encoder",
    layouts={ORIGINAL: Signature(OPENCLIP), DIFFUSERS: Signature(HF)},
    identify=identify,
    diffusers_class="CLIPTextModel",
    config_classes=(r"CLIPTextModel(WithProjection)?",),
    pairs=pairs,
    lora_aliases=lora_aliases,
    kohya_layout=DIFFUSERS,
    lora_namings=("kohya lora_te1_/lora_te2_", "diffusers text_encoder(_2).", "PEFT"),
    high_precision={ORIGINAL: (r"(token_embedding|positional_embedding)",),
                    DIFFUSERS: (r"embeddings\.",)},
)
