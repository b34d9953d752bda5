"""SD3/SD3.5: SAI MMDiT layout (`joint_blocks.N.x_block.attn.qkv`) <-> diffusers SD3Transformer2DModel.

The image-stream `to_q/k/v` are row thirds of `x_block.attn.qkv` (context: `add_*_proj` of
`context_block.attn.qkv`; SD3.5 dual attention: `attn2.*` of `x_block.attn2.qkv`). `norm_out.linear`,
and the last block's `norm1_context.linear` (a 2-chunk continuous norm, recognised by its 2H rows), are
the SAI modulation with shift and scale halves swapped. Reference: diffusers
`convert_sd3_transformer_checkpoint_to_diffusers`.

LoRAs: diffusers/PEFT and OneTrainer name the diffusers modules, kohya the SAI ones.
"""

from __future__ import annotations

import math

from ckpt.families.spec import (DIFFUSERS, ORIGINAL, Family, GGUFStorage, Pair, Shapes, Signature, at, block_indices,
                                blocks_count, present, renames, thirds)

BASIC = (
    ("x_embedder.proj", "pos_embed.proj"),
    ("t_embedder.mlp.0", "time_text_embed.timestep_embedder.linear_1"),
    ("t_embedder.mlp.2", "time_text_embed.timestep_embedder.linear_2"),
    ("y_embedder.mlp.0", "time_text_embed.text_embedder.linear_1"),
    ("y_embedder.mlp.2", "time_text_embed.text_embedder.linear_2"),
    ("context_embedder", "context_embedder"),
    ("final_layer.linear", "proj_out"),
)
BLOCK = (
    ("x_block.attn.proj", "attn.to_out.0"),
    ("context_block.attn.proj", "attn.to_add_out"),
    ("x_block.attn2.proj", "attn2.to_out.0"),
    ("x_block.adaLN_modulation.1", "norm1.linear"),
    ("x_block.mlp.fc1", "ff.net.0.proj"),
    ("x_block.mlp.fc2", "ff.net.2"),
    ("context_block.mlp.fc1", "ff_context.net.0.proj"),
    ("context_block.mlp.fc2", "ff_context.net.2"),
    ("x_block.attn.ln_q", "attn.norm_q"),
    ("x_block.attn.ln_k", "attn.norm_k"),
    ("context_block.attn.ln_q", "attn.norm_added_q"),
    ("context_block.attn.ln_k", "attn.norm_added_k"),
    ("x_block.attn2.ln_q", "attn2.norm_q"),
    ("x_block.attn2.ln_k", "attn2.norm_k"),
)
FUSED = (
    ("x_block.attn.qkv", "attn", ("to_q", "to_k", "to_v")),
    ("context_block.attn.qkv", "attn", ("add_q_proj", "add_k_proj", "add_v_proj")),
    ("x_block.attn2.qkv", "attn2", ("to_q", "to_k", "to_v")),
)


def pairs_for(blocks: dict[int, tuple[int, bool]]) -> list[Pair]:
    """SAI <-> diffusers tensors for blocks {i: (H, context modulation is the 2-chunk final kind)}."""
    out = renames(BASIC)
    out += [Pair(f"final_layer.adaLN_modulation.1.{e}", f"norm_out.linear.{e}", transform="swap_halves")
            for e in ("weight", "bias")]
    out.append(Pair("pos_embed", "pos_embed.pos_embed"))
    for i, (h, final_context) in blocks.items():
        b, d = f"joint_blocks.{i}", f"transformer_blocks.{i}"
        for e in ("weight", "bias"):
            for sai, attn, names in FUSED:
                for rows, name in zip(thirds(0, h), names):
                    out.append(Pair(f"{b}.{sai}.{e}", f"{d}.{attn}.{name}.{e}", rows))
            out.append(Pair(f"{b}.context_block.adaLN_modulation.1.{e}", f"{d}.norm1_context.linear.{e}",
                            transform="swap_halves" if final_context else None))
        out += renames(BLOCK, b + ".", d + ".")
    return out


def blocks(shapes: Shapes, layout: str) -> dict[int, tuple[int, bool]]:
    out = {}
    if layout == ORIGINAL:
        for i in block_indices(shapes, "joint_blocks"):
            qkv = shapes.get(f"joint_blocks.{i}.x_block.attn.qkv.weight")
            if qkv:
                h = qkv[0] // 3
                ctx = shapes.get(f"joint_blocks.{i}.context_block.adaLN_modulation.1.weight")
                out[i] = (h, bool(ctx) and ctx[0] == 2 * h)
    else:
        for i in block_indices(shapes, "transformer_blocks"):
            q = shapes.get(f"transformer_blocks.{i}.attn.to_q.weight")
            if q:
                ctx = shapes.get(f"transformer_blocks.{i}.norm1_context.linear.weight")
                out[i] = (q[0], bool(ctx) and ctx[0] == 2 * q[0])
    return out


def pairs(shapes: Shapes, layout: str) -> list[Pair]:
    return present(pairs_for(blocks(shapes, layout)), shapes, layout)


# What the weights do not say: SD3 without q/k norms has heads of 64 (SD3 Medium); the sample size is
# 128 latent pixels in every release.
CONVENTIONS = {"attention_head_dim": 64, "sample_size": 128}


def diffusers_config(s: Shapes) -> dict:
    proj = s["pos_embed.proj.weight"]  # [H, in, p, p]
    width, patch = proj[0], proj[2]
    norm = s.get("transformer_blocks.0.attn.norm_q.weight")
    head = norm[0] if norm else CONVENTIONS["attention_head_dim"]
    n = blocks_count(s, "transformer_blocks")
    return {
        "_class_name": "SD3Transformer2DModel",
        "sample_size": CONVENTIONS["sample_size"],
        "patch_size": patch,
        "in_channels": proj[1],
        "num_layers": n,
        "attention_head_dim": head,
        "num_attention_heads": width // head,
        "joint_attention_dim": s["context_embedder.weight"][1],
        "caption_projection_dim": s["context_embedder.weight"][0],
        "pooled_projection_dim": s["time_text_embed.text_embedder.linear_1.weight"][1],
        "out_channels": s["proj_out.weight"][0] // (patch * patch),
        "pos_embed_max_size": math.isqrt(s["pos_embed.pos_embed"][1]),
        "dual_attention_layers": [i for i in range(n) if f"transformer_blocks.{i}.attn2.to_q.weight" in s],
        "qk_norm": "rms_norm" if norm else None,
    }


FAMILY = Family(
    family_id="sd3",
    label="SD3/SD3.5",
    layouts={
        ORIGINAL: Signature(at(r"joint_blocks_.\d+_.(context_block|x_block)")),
        DIFFUSERS: Signature(at(r"transformer_blocks_.\d+_.(attn_.add_q_proj|ff_context)"), required=(at(r"pos_embed_."),)),
    },
    identify=lambda k, s, layout: ("sd3", "SD3 MMDiT (BFL/SAI)" if layout == ORIGINAL
                                   else "SD3 transformer (diffusers SD3Transformer2DModel)"),
    diffusers_class="SD3Transformer2DModel",
    pairs=pairs,
    diffusers_config=diffusers_config,
    kohya_layout=ORIGINAL,
    lora_namings=("kohya (SAI names)", "ComfyUI", "diffusers/PEFT", "OneTrainer", "SimpleTuner LyCORIS"),
    high_precision={
        ORIGINAL: (r"^(x_embedder|t_embedder|y_embedder|context_embedder|final_layer|pos_embed)",),
        DIFFUSERS: (r"^(pos_embed|time_text_embed|context_embedder|norm_out|proj_out)",),
    },
    gguf=GGUFStorage("sd3"),
    blocks=(r"^joint_blocks\.(\d+)\.",),
)
