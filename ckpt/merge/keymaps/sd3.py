"""SD3/SD3.5: SAI MMDiT layout (`joint_blocks.N.x_block.attn.qkv`) <-> diffusers SD3Transformer2DModel.

diffusers/PEFT and OneTrainer SD3 LoRAs name diffusers modules; kohya SD3 LoRAs name the SAI ones. The
image-stream `to_q/k/v` are row thirds of `x_block.attn.qkv` (context: `add_*_proj` of
`context_block.attn.qkv`, SD3.5 dual attention: `attn2.*` of `x_block.attn2.qkv`). `norm_out.linear`,
and the last block's `norm1_context.linear` (a 2-chunk continuous norm, recognised by its 2H rows), are
the SAI modulation with shift and scale halves swapped.
"""

from __future__ import annotations

from ckpt.merge.keymaps import Alias, Pair, Shapes, block_indices, pair_aliases, thirds

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


def is_sai(base: Shapes) -> bool:
    return any(k.startswith("joint_blocks.") for k in base)


def is_diffusers(base: Shapes) -> bool:
    return "pos_embed.proj.weight" in base and any(".attn.add_q_proj." in k for k in base)


def pairs(blocks: dict[int, tuple[int, bool]]) -> list[Pair]:
    """SAI <-> diffusers tensors for blocks {i: (H, context modulation is the 2-chunk final kind)}."""
    out: list[Pair] = []
    for end in ("weight", "bias"):
        for sai, dif in BASIC:
            out.append(Pair(f"{sai}.{end}", f"{dif}.{end}"))
        out.append(Pair(f"final_layer.adaLN_modulation.1.{end}", f"norm_out.linear.{end}", transform="swap_halves"))
    out.append(Pair("pos_embed", "pos_embed.pos_embed"))
    for i, (h, final_context) in blocks.items():
        b, d = f"joint_blocks.{i}", f"transformer_blocks.{i}"
        for end in ("weight", "bias"):
            for sai, attn, names in FUSED:
                for rows, name in zip(thirds(0, h), names):
                    out.append(Pair(f"{b}.{sai}.{end}", f"{d}.{attn}.{name}.{end}", rows))
            for sai, dif in BLOCK:
                out.append(Pair(f"{b}.{sai}.{end}", f"{d}.{dif}.{end}"))
            out.append(Pair(
                f"{b}.context_block.adaLN_modulation.1.{end}",
                f"{d}.norm1_context.linear.{end}",
                transform="swap_halves" if final_context else None,
            ))
    return out


def aliases(base: Shapes) -> list[Alias] | None:
    if is_sai(base):
        blocks = {}
        for i in block_indices(base, "joint_blocks"):
            qkv = base.get(f"joint_blocks.{i}.x_block.attn.qkv.weight")
            if qkv:
                h = qkv[0] // 3
                ctx = base.get(f"joint_blocks.{i}.context_block.adaLN_modulation.1.weight")
                blocks[i] = (h, bool(ctx) and ctx[0] == 2 * h)
        return pair_aliases(pairs(blocks), base, native_base=True)
    if is_diffusers(base):
        blocks = {}
        for i in block_indices(base, "transformer_blocks"):
            q = base.get(f"transformer_blocks.{i}.attn.to_q.weight")
            if q:
                ctx = base.get(f"transformer_blocks.{i}.norm1_context.linear.weight")
                blocks[i] = (q[0], bool(ctx) and ctx[0] == 2 * q[0])
        return pair_aliases(pairs(blocks), base, native_base=False)
    return None
