"""Ideogram 4 (Ideogram AI): the reference layout (ComfyUI's `comfy/ldm/ideogram4/model.py`, the names ComfyUI
single files and ai-toolkit LoRAs use) <-> diffusers Ideogram4Transformer2DModel.

A NextDiT/Lumina 2 style single-stream transformer. The two layouts share every name but the attention of
each block: the reference fused `layers.N.attention.qkv` ([q; k; v], equal thirds: no grouped kv heads) is
diffusers' `attention.to_q/to_k/to_v`, and `attention.o` is `attention.to_out.0`. The rest is one naming in
both (`attention.norm_q/norm_k`, `feed_forward.w1/w2/w3`, `attention_norm1/2`, `ffn_norm1/2`, the block's
lower-case `adaln_modulation`, `input_proj`, `llm_cond_norm`, `llm_cond_proj`, `t_embedding.mlp_in/mlp_out`,
`adaln_proj`, `embed_image_indicator`, `final_layer.linear/adaln_modulation`).

Reference: diffusers 0.42.1 has no single-file converter for Ideogram 4. The table is ComfyUI's model class
read against diffusers' (the same module tree but the attention) and diffusers' LoRA converter
`_convert_non_diffusers_ideogram4_lora_to_diffusers`, which splits a LoRA on `attention.qkv` into thirds for
`to_q/to_k/to_v` and renames `attention.o` to `to_out.0`; the tests check the table against the model class
both ways and against that converter.

Recognition: Lumina 2 and Z-Image also have `layers.N.attention.qkv`; Ideogram 4's own names are
`attention.o` (theirs: `attention.out`), the lower-case `adaln_modulation` (theirs: `adaLN_modulation`) and
its embedders (`llm_cond_proj`, `adaln_proj`, `t_embedding`, `embed_image_indicator`). A LoRA on
`attention.qkv` alone names none of them and reads as Lumina 2 / Z-Image (merge-lora goes by the base).

LoRAs: ai-toolkit (ostris) and ComfyUI write the reference names under `diffusion_model.` (`lora_A/B` or
kohya `lora_down/up` + `alpha`); diffusers/PEFT the diffusers names. Either lands on either layout: a `qkv`
LoRA on the three diffusers pieces, a `to_q/k/v` LoRA on thirds of `attention.qkv`.
"""

from __future__ import annotations

from ckpt.families.spec import (DIFFUSERS, ORIGINAL, ConventionError, Family, Pair, Shapes, Signature,
                                block_indices, blocks_count, present, renames, start, thirds)

SAME_TOP = ("input_proj", "llm_cond_proj", "t_embedding.mlp_in", "t_embedding.mlp_out", "adaln_proj",
            "final_layer.linear", "final_layer.adaln_modulation")
SAME_TOP_PARAMS = ("llm_cond_norm.weight", "embed_image_indicator.weight")
SAME_BLOCK = ("adaln_modulation",)
SAME_BLOCK_PARAMS = ("attention.norm_q.weight", "attention.norm_k.weight", "feed_forward.w1.weight",
                     "feed_forward.w2.weight", "feed_forward.w3.weight", "attention_norm1.weight",
                     "attention_norm2.weight", "ffn_norm1.weight", "ffn_norm2.weight")

_SHARED = (r"layers_.\d+_.(attention_.norm_[qk]|feed_forward_.w[123]|(attention|ffn)_norm[12]|adaln_modulation)"
           r"|input_proj|llm_cond_(norm|proj)|t_embedding_.mlp_(in|out)|adaln_proj|embed_image_indicator"
           r"|final_layer_.(linear|adaln_modulation)")
ORIGINAL_NAMES = start(rf"(layers_.\d+_.attention_.(qkv|o)(\.|$)|{_SHARED})")
DIFFUSERS_NAMES = start(rf"(layers_.\d+_.attention_.(to_[qkv]|to_out)|{_SHARED})")
# Ideogram 4, not Lumina 2 / Z-Image (`attention.out`, `adaLN_modulation`, `x_embedder`, `cap_embedder`)
ORIGINAL_ONLY = start(r"(layers_.\d+_.(attention_.o(\.|$)|adaln_modulation)|llm_cond_proj|adaln_proj"
                      r"|embed_image_indicator)")
DIFFUSERS_ONLY = start(r"(layers_.\d+_.adaln_modulation|llm_cond_proj|adaln_proj|embed_image_indicator)")
ORIGINAL_ATTN = start(r"layers_.\d+_.attention_.(qkv|o)(\.|$)")
DIFFUSERS_ATTN = start(r"layers_.\d+_.attention_.(to_[qkv]|to_out)")


def pairs_for(widths: dict[int, int]) -> list[Pair]:
    """Reference <-> diffusers tensors for blocks {index: hidden size}."""
    out = renames([(m, m) for m in SAME_TOP]) + [Pair(p, p) for p in SAME_TOP_PARAMS]
    for i, h in widths.items():
        b = f"layers.{i}."
        out += [Pair(f"{b}attention.qkv.weight", f"{b}attention.{n}.weight", rows)
                for rows, n in zip(thirds(0, h), ("to_q", "to_k", "to_v"))]
        out.append(Pair(f"{b}attention.o.weight", f"{b}attention.to_out.0.weight"))
        out += renames([(m, m) for m in SAME_BLOCK], b, b)
        out += [Pair(b + p, b + p) for p in SAME_BLOCK_PARAMS]
    return out


def widths(shapes: Shapes, layout: str) -> dict[int, int]:
    out = {}
    for i in block_indices(shapes, "layers"):
        if layout == ORIGINAL:
            qkv = shapes.get(f"layers.{i}.attention.qkv.weight")
            out[i] = qkv[0] // 3 if qkv else 0
        else:
            q = shapes.get(f"layers.{i}.attention.to_q.weight")
            out[i] = q[0] if q else 0
    return out


def pairs(shapes: Shapes, layout: str) -> list[Pair]:
    return present(pairs_for(widths(shapes, layout)), shapes, layout)


# What the weights do not say (diffusers' Ideogram4Transformer2DModel defaults, which ComfyUI's class repeats):
# the MRoPE split of the head's frequencies (t, h, w: they add up to half the head size), rope theta, norm eps.
CONVENTIONS = {"mrope_section": {256: [24, 20, 20]}, "rope_theta": 5_000_000, "norm_eps": 1e-05}


def diffusers_config(s: Shapes) -> dict:
    head = s["layers.0.attention.norm_q.weight"][0]
    section = CONVENTIONS["mrope_section"].get(head)
    if section is None:
        raise ConventionError(f"Ideogram 4's MRoPE split is known for an attention head size of 256, not {head}")
    width = s["input_proj.weight"][0]
    return {
        "_class_name": "Ideogram4Transformer2DModel",
        "in_channels": s["input_proj.weight"][1],
        "num_layers": blocks_count(s, "layers"),
        "attention_head_dim": head,
        "num_attention_heads": width // head,
        "intermediate_size": s["layers.0.feed_forward.w1.weight"][0],
        "adaln_dim": s["adaln_proj.weight"][0],
        "llm_features_dim": s["llm_cond_proj.weight"][1],
        "rope_theta": CONVENTIONS["rope_theta"],
        "mrope_section": section,
        "norm_eps": CONVENTIONS["norm_eps"],
    }


def identify(keys, shapes, layout):
    where = "(original)" if layout == ORIGINAL else "(diffusers Ideogram4Transformer2DModel)"
    return "ideogram4", f"Ideogram 4 transformer {where}"


# The rule of the closest family ComfyUI-GGUF knows, Lumina 2 / Z-Image (the NextDiT Ideogram 4 is built on):
# the input and output layers and the conditioning embedders stay unquantized. Same names in both layouts.
HIGH_PRECISION = (r"^(input_proj|llm_cond_norm|llm_cond_proj|t_embedding|adaln_proj|embed_image_indicator"
                  r"|final_layer)\.",)

FAMILY = Family(
    family_id="ideogram4",
    label="Ideogram 4",
    layouts={
        ORIGINAL: Signature(ORIGINAL_NAMES, required=(ORIGINAL_ONLY,), forbidden=(DIFFUSERS_ATTN,)),
        DIFFUSERS: Signature(DIFFUSERS_NAMES, required=(DIFFUSERS_ONLY,), forbidden=(ORIGINAL_ATTN,)),
    },
    identify=identify,
    diffusers_class="Ideogram4Transformer2DModel",
    pairs=pairs,
    diffusers_config=diffusers_config,
    kohya_layout=ORIGINAL,
    lora_namings=("ai-toolkit/ComfyUI (`diffusion_model.`, reference names, kohya or PEFT factors)",
                  "diffusers/PEFT", "OneTrainer", "SimpleTuner LyCORIS"),
    high_precision={ORIGINAL: HIGH_PRECISION, DIFFUSERS: HIGH_PRECISION},
    blocks=(r"^layers\.(\d+)\.",),
)
