"""Wan 2.1 / 2.2 video transformers (T2V, I2V, TI2V-5B, the two A14B experts, VACE): the original Wan
layout (`blocks.N.self_attn.q`, as in Wan's releases, ComfyUI single files and musubi-tuner LoRAs) <->
diffusers WanTransformer3DModel / WanVACETransformer3DModel.

No tensor is fused: the correspondence is renames only. `self_attn` is `attn1`, `cross_attn` is `attn2`
(`q/k/v/o` -> `to_q/to_k/to_v/to_out.0`, I2V `k_img/v_img/norm_k_img` -> `add_k_proj/add_v_proj/
norm_added_k`), `ffn.0/.2` -> `ffn.net.0.proj/.net.2`, `modulation` -> `scale_shift_table`, `head.head`
-> `proj_out`, and the block norms are renumbered: the original `norm3` (cross-attention norm, the one
with weights) is diffusers' `norm2`. Reference: diffusers `convert_wan_transformer_to_diffusers`
(forward only; the reverse is this table read backwards).

LoRAs: musubi-tuner/kohya `lora_unet_blocks_0_self_attn_q` and ComfyUI `diffusion_model.blocks.0...` name
the original modules, diffusers/PEFT `transformer.blocks.0.attn1.to_q` the diffusers ones; Wan-Fun's
`lora_unet__blocks_...` spelling is accepted by the key map. Nothing is fused, so every LoRA module maps
to one base tensor in either direction.
"""

from __future__ import annotations

import math

from ckpt.families.spec import (DIFFUSERS, ORIGINAL, ConventionError, Family, GGUFStorage, Pair, Shapes, Signature,
                                block_indices, blocks_count, dim, has, present, renames, start)

TOP = (
    ("patch_embedding", "patch_embedding"),
    ("text_embedding.0", "condition_embedder.text_embedder.linear_1"),
    ("text_embedding.2", "condition_embedder.text_embedder.linear_2"),
    ("time_embedding.0", "condition_embedder.time_embedder.linear_1"),
    ("time_embedding.2", "condition_embedder.time_embedder.linear_2"),
    ("time_projection.1", "condition_embedder.time_proj"),
    ("head.head", "proj_out"),
    # I2V (Wan 2.1): CLIP image embedding
    ("img_emb.proj.0", "condition_embedder.image_embedder.norm1"),
    ("img_emb.proj.1", "condition_embedder.image_embedder.ff.net.0.proj"),
    ("img_emb.proj.3", "condition_embedder.image_embedder.ff.net.2"),
    ("img_emb.proj.4", "condition_embedder.image_embedder.norm2"),
    # VACE
    ("vace_patch_embedding", "vace_patch_embedding"),
)
ATTN = (("q", "to_q"), ("k", "to_k"), ("v", "to_v"), ("o", "to_out.0"))
BLOCK = (
    *((f"self_attn.{o}", f"attn1.{d}") for o, d in ATTN),
    *((f"cross_attn.{o}", f"attn2.{d}") for o, d in ATTN),
    ("cross_attn.k_img", "attn2.add_k_proj"),
    ("cross_attn.v_img", "attn2.add_v_proj"),
    ("norm3", "norm2"),
    ("ffn.0", "ffn.net.0.proj"),
    ("ffn.2", "ffn.net.2"),
    ("before_proj", "proj_in"),  # VACE blocks
    ("after_proj", "proj_out"),
)
NORMS = (
    ("self_attn.norm_q", "attn1.norm_q"),
    ("self_attn.norm_k", "attn1.norm_k"),
    ("cross_attn.norm_q", "attn2.norm_q"),
    ("cross_attn.norm_k", "attn2.norm_k"),
    ("cross_attn.norm_k_img", "attn2.norm_added_k"),
)
HEADS = ("blocks", "vace_blocks")

ORIGINAL_NAMES = start(r"_?(vace_)?blocks_.\d+_.(self_attn|cross_attn|ffn_.[02]|norm3|modulation)")
DIFFUSERS_NAMES = start(r"_?(vace_)?blocks_.\d+_.(attn[12]_.(to_|norm_|add_)|ffn_.net_.|scale_shift_table)")


def pairs_for(blocks: dict[str, list[int]]) -> list[Pair]:
    out = renames(TOP)
    out += [Pair("head.modulation", "scale_shift_table")]
    for head, indices in blocks.items():
        for i in indices:
            b = f"{head}.{i}"
            out += renames(BLOCK, b + ".", b + ".")
            out += renames(NORMS, b + ".", b + ".", ends=("weight",))
            out.append(Pair(f"{b}.modulation", f"{b}.scale_shift_table"))
    return out


def pairs(shapes: Shapes, layout: str) -> list[Pair]:
    return present(pairs_for({h: block_indices(shapes, h) for h in HEADS}), shapes, layout)


def identify(keys, shapes, layout):
    in_ch = dim(shapes, keys, r"^patch_embedding\.weight$", 1)
    if has(keys, start(r"_?vace_")):
        variant = "VACE"
    elif has(keys, start(r"_?img_emb_.|condition_embedder_.image_embedder")) or has(keys, r"(k_img|add_k_proj)"):
        variant = "I2V"
    else:
        variant = {36: "I2V", 48: "TI2V-5B", 16: "T2V"}.get(in_ch, "")
    cls = "WanVACETransformer3DModel" if variant == "VACE" else "WanTransformer3DModel"
    where = "(original)" if layout == ORIGINAL else f"(diffusers {cls})"
    return "wan", f"Wan 2.x {variant + ' ' if variant else ''}video transformer {where}"


# What the weights do not say (diffusers' WanTransformer3DModel configs of the Wan 2.1/2.2 releases).
CONVENTIONS = {"attention_head_dim": 128, "eps": 1e-6, "rope_max_seq_len": 1024, "qk_norm": "rms_norm_across_heads"}


def diffusers_config(s: Shapes) -> dict:
    pe = s["patch_embedding.weight"]  # [dim, in, pt, ph, pw]
    width, head = pe[0], CONVENTIONS["attention_head_dim"]
    if width % head:
        raise ConventionError(f"Wan's attention head size is {head} in every release, but the width {width} is no "
                              f"multiple of it")
    patch = tuple(pe[2:])
    image = s.get("condition_embedder.image_embedder.norm1.weight")
    added = s.get("blocks.0.attn2.add_k_proj.weight")
    cfg = {
        "_class_name": "WanTransformer3DModel",
        "patch_size": list(patch),
        "num_attention_heads": width // head,
        "attention_head_dim": head,
        "in_channels": pe[1],
        "out_channels": s["proj_out.weight"][0] // math.prod(patch),
        "text_dim": s["condition_embedder.text_embedder.linear_1.weight"][1],
        "freq_dim": s["condition_embedder.time_embedder.linear_1.weight"][1],
        "ffn_dim": s["blocks.0.ffn.net.0.proj.weight"][0],
        "num_layers": blocks_count(s, "blocks"),
        "cross_attn_norm": "blocks.0.norm2.weight" in s,
        "qk_norm": CONVENTIONS["qk_norm"] if "blocks.0.attn1.norm_q.weight" in s else None,
        "eps": CONVENTIONS["eps"],
        "image_dim": image[0] if image else None,
        "added_kv_proj_dim": added[1] if added else None,
        "rope_max_seq_len": CONVENTIONS["rope_max_seq_len"],
        "pos_embed_seq_len": None,
    }
    vace = blocks_count(s, "vace_blocks")
    if vace:
        # VACE blocks sit at evenly spaced layers (1.3B: every 2nd of 30, 14B: every 5th of 40)
        cfg.update(_class_name="WanVACETransformer3DModel", vace_in_channels=s["vace_patch_embedding.weight"][1],
                   vace_layers=list(range(0, cfg["num_layers"], cfg["num_layers"] // vace))[:vace])
    return cfg


FAMILY = Family(
    family_id="wan",
    label="Wan 2.1/2.2",
    layouts={ORIGINAL: Signature(ORIGINAL_NAMES), DIFFUSERS: Signature(DIFFUSERS_NAMES)},
    identify=identify,
    diffusers_class="WanTransformer3DModel",
    config_classes=(r"WanVACETransformer3DModel",),
    pairs=pairs,
    diffusers_config=diffusers_config,
    kohya_layout=ORIGINAL,
    lora_namings=("musubi-tuner/kohya (original names)", "ComfyUI", "diffusers/PEFT", "OneTrainer",
                  "SimpleTuner LyCORIS", "Wan-Fun"),
    high_precision={
        ORIGINAL: (r"^(patch_embedding|vace_patch_embedding|text_embedding|time_embedding|time_projection|head"
                   r"|img_emb|cond_encoder|frame_packer|audio_injector|casual_audio_encoder|trainable_cond_mask)\.",
                   r"modulation$"),  # (S2V: cond_encoder ... trainable_cond_mask, as ComfyUI-GGUF keeps them)
        DIFFUSERS: (r"^(patch_embedding|vace_patch_embedding|condition_embedder|proj_out)\.", r"scale_shift_table$"),
    },
    gguf=GGUFStorage("wan", f32=(r"\.modulation", r"\.encoder\.padding_tokens", r"trainable_cond_mask",
                                 r"casual_audio_encoder\.(weights|encoder\.conv)")),
    blocks=(r"^blocks\.(\d+)\.",),
)
