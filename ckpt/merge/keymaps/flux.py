"""Flux: BFL layout (`double_blocks`, `single_blocks`, fused `qkv` and `linear1`) <-> diffusers
FluxTransformer2DModel names.

diffusers/PEFT, OneTrainer and SimpleTuner LoRAs name the diffusers modules (`attn.to_q`, `proj_mlp`);
kohya and ComfyUI LoRAs name the BFL modules. In a BFL base, diffusers `to_q/to_k/to_v` are row thirds of
`img_attn.qkv` (`add_*_proj` of `txt_attn.qkv`); in single blocks `to_q/k/v` and `proj_mlp` are rows
[0,H), [H,2H), [2H,3H), [3H,3H+M) of `linear1`. `norm_out.linear` is `final_layer.adaLN_modulation.1`
with its two halves (shift, scale) swapped. Widths come from the base's shapes, block by block.
Flux.2 keeps the BFL layout; its diffusers names add shared modulations and whole-`linear1` projections.
"""

from __future__ import annotations

from ckpt.merge.keymaps import Alias, Pair, Shapes, block_indices, pair_aliases, thirds
from ckpt.merge.targets import Target

BASIC = (
    ("img_in", "x_embedder"),
    ("txt_in", "context_embedder"),
    ("time_in.in_layer", "time_text_embed.timestep_embedder.linear_1"),
    ("time_in.out_layer", "time_text_embed.timestep_embedder.linear_2"),
    ("vector_in.in_layer", "time_text_embed.text_embedder.linear_1"),
    ("vector_in.out_layer", "time_text_embed.text_embedder.linear_2"),
    ("guidance_in.in_layer", "time_text_embed.guidance_embedder.linear_1"),
    ("guidance_in.out_layer", "time_text_embed.guidance_embedder.linear_2"),
    ("final_layer.linear", "proj_out"),
)

DOUBLE = (
    ("img_attn.proj", "attn.to_out.0"),
    ("txt_attn.proj", "attn.to_add_out"),
    ("img_mod.lin", "norm1.linear"),
    ("txt_mod.lin", "norm1_context.linear"),
    ("img_mlp.0", "ff.net.0.proj"),
    ("img_mlp.2", "ff.net.2"),
    ("txt_mlp.0", "ff_context.net.0.proj"),
    ("txt_mlp.2", "ff_context.net.2"),
)
DOUBLE_NORMS = (
    ("img_attn.norm.query_norm", "attn.norm_q"),
    ("img_attn.norm.key_norm", "attn.norm_k"),
    ("txt_attn.norm.query_norm", "attn.norm_added_q"),
    ("txt_attn.norm.key_norm", "attn.norm_added_k"),
)
# Flux.2 diffusers names (Flux2Transformer2DModel): shared modulations, `time_guidance_embed`, gated
# feed-forwards `ff.linear_in/out` (also LyCORIS's names for Flux.1), whole single-block projections.
FLUX2_BASIC = (
    ("time_in.in_layer", "time_guidance_embed.timestep_embedder.linear_1"),
    ("time_in.out_layer", "time_guidance_embed.timestep_embedder.linear_2"),
    ("guidance_in.in_layer", "time_guidance_embed.guidance_embedder.linear_1"),
    ("guidance_in.out_layer", "time_guidance_embed.guidance_embedder.linear_2"),
    ("double_stream_modulation_img.lin", "double_stream_modulation_img.linear"),
    ("double_stream_modulation_txt.lin", "double_stream_modulation_txt.linear"),
    ("single_stream_modulation.lin", "single_stream_modulation.linear"),
)
FLUX2_SINGLE = (("linear1", "attn.to_qkv_mlp_proj"), ("linear2", "attn.to_out"))
FF_LINEAR = (
    ("img_mlp.0", "ff.linear_in"),
    ("img_mlp.2", "ff.linear_out"),
    ("txt_mlp.0", "ff_context.linear_in"),
    ("txt_mlp.2", "ff_context.linear_out"),
)
# XLabs LoRAs: `double_blocks.N.processor.{qkv,proj}_lora{1,2}` (1 = image stream, 2 = text stream).
XLABS = (
    ("img_attn.qkv", "processor.qkv_lora1"),
    ("txt_attn.qkv", "processor.qkv_lora2"),
    ("img_attn.proj", "processor.proj_lora1"),
    ("txt_attn.proj", "processor.proj_lora2"),
)


def is_bfl(base: Shapes) -> bool:
    return any(k.startswith(("double_blocks.", "single_blocks.")) for k in base)


def is_diffusers(base: Shapes) -> bool:
    return any(k.startswith("single_transformer_blocks.") for k in base) or (
        "x_embedder.weight" in base and any(".attn.add_q_proj." in k for k in base)
    )


def pairs(doubles: dict[int, int], singles: dict[int, tuple[int, int]]) -> list[Pair]:
    """BFL <-> diffusers tensors for double blocks {i: H} and single blocks {j: (H, M)}."""
    out: list[Pair] = []
    for bfl, dif in BASIC:
        for end in ("weight", "bias"):
            out.append(Pair(f"{bfl}.{end}", f"{dif}.{end}"))
    for end in ("weight", "bias"):
        out.append(Pair(f"final_layer.adaLN_modulation.1.{end}", f"norm_out.linear.{end}", transform="swap_halves"))
    for i, h in doubles.items():
        b, d = f"double_blocks.{i}", f"transformer_blocks.{i}"
        for end in ("weight", "bias"):
            for rows, name in zip(thirds(0, h), ("to_q", "to_k", "to_v")):
                out.append(Pair(f"{b}.img_attn.qkv.{end}", f"{d}.attn.{name}.{end}", rows))
            for rows, name in zip(thirds(0, h), ("add_q_proj", "add_k_proj", "add_v_proj")):
                out.append(Pair(f"{b}.txt_attn.qkv.{end}", f"{d}.attn.{name}.{end}", rows))
            for bfl, dif in DOUBLE:
                out.append(Pair(f"{b}.{bfl}.{end}", f"{d}.{dif}.{end}"))
        for bfl, dif in DOUBLE_NORMS:
            out.append(Pair(f"{b}.{bfl}.scale", f"{d}.{dif}.weight"))
    for j, (h, m) in singles.items():
        b, d = f"single_blocks.{j}", f"single_transformer_blocks.{j}"
        for end in ("weight", "bias"):
            for rows, name in zip(thirds(0, h), ("attn.to_q", "attn.to_k", "attn.to_v")):
                out.append(Pair(f"{b}.linear1.{end}", f"{d}.{name}.{end}", rows))
            out.append(Pair(f"{b}.linear1.{end}", f"{d}.proj_mlp.{end}", (3 * h, 3 * h + m)))
            out.append(Pair(f"{b}.linear2.{end}", f"{d}.proj_out.{end}"))
            out.append(Pair(f"{b}.modulation.lin.{end}", f"{d}.norm.linear.{end}"))
    return out


def flux2_pairs(doubles, singles) -> list[Pair]:
    """Names that need no widths: Flux.2's (and LyCORIS's on Flux.1), and single-block norms. Kept apart
    from `pairs` because a diffusers base has either `to_q/k/v` + `proj_mlp` (Flux.1) or one
    `to_qkv_mlp_proj` (Flux.2) for the same BFL `linear1`."""
    out = [Pair(f"{bfl}.{end}", f"{dif}.{end}") for bfl, dif in FLUX2_BASIC for end in ("weight", "bias")]
    for i in doubles:
        for bfl, dif in FF_LINEAR:
            out += [Pair(f"double_blocks.{i}.{bfl}.{end}", f"transformer_blocks.{i}.{dif}.{end}")
                    for end in ("weight", "bias")]
    for j in singles:
        b, d = f"single_blocks.{j}", f"single_transformer_blocks.{j}"
        out.append(Pair(f"{b}.norm.query_norm.scale", f"{d}.attn.norm_q.weight"))
        out.append(Pair(f"{b}.norm.key_norm.scale", f"{d}.attn.norm_k.weight"))
        for bfl, dif in FLUX2_SINGLE:
            out += [Pair(f"single_blocks.{j}.{bfl}.{end}", f"single_transformer_blocks.{j}.{dif}.{end}")
                    for end in ("weight", "bias")]
    return out


def _bfl_widths(base: Shapes):
    doubles, singles = {}, {}
    for i in block_indices(base, "double_blocks"):
        qkv = base.get(f"double_blocks.{i}.img_attn.qkv.weight") or base.get(f"double_blocks.{i}.txt_attn.qkv.weight")
        if qkv:
            doubles[i] = qkv[0] // 3
    for j in block_indices(base, "single_blocks"):
        lin1, lin2 = base.get(f"single_blocks.{j}.linear1.weight"), base.get(f"single_blocks.{j}.linear2.weight")
        if lin1 and lin2:
            h = lin2[0]
            singles[j] = (h, lin1[0] - 3 * h)
    return doubles, singles


def _diffusers_widths(base: Shapes):
    doubles, singles = {}, {}
    for i in block_indices(base, "transformer_blocks"):
        q = base.get(f"transformer_blocks.{i}.attn.to_q.weight")
        if q:
            doubles[i] = q[0]
    for j in block_indices(base, "single_transformer_blocks"):
        q = base.get(f"single_transformer_blocks.{j}.attn.to_q.weight")
        mlp = base.get(f"single_transformer_blocks.{j}.proj_mlp.weight")
        if q and mlp:
            singles[j] = (q[0], mlp[0])
    return doubles, singles


def aliases(base: Shapes) -> list[Alias] | None:
    if is_bfl(base):
        doubles, singles = _bfl_widths(base)
        out = pair_aliases(pairs(doubles, singles), base, native_base=True)
        out += pair_aliases(
            flux2_pairs(block_indices(base, "double_blocks"), block_indices(base, "single_blocks")), base, True)
        for i in block_indices(base, "double_blocks"):
            b = f"double_blocks.{i}"
            for bfl, xlabs in XLABS:
                if f"{b}.{bfl}.weight" in base:
                    out.append(Alias(f"{b}.{xlabs}", (Target(f"{b}.{bfl}.weight"),)))
        for j, (h, _m) in singles.items():
            # ComfyUI's name for a LoRA on the attention part of linear1 only.
            qkv = Target(f"single_blocks.{j}.linear1.weight", (0, 3 * h))
            out.append(Alias(f"single_blocks.{j}.linear1_qkv", (qkv,)))
        return out
    if is_diffusers(base):
        doubles, singles = _diffusers_widths(base)
        out = pair_aliases(pairs(doubles, singles), base, native_base=False)
        out += pair_aliases(
            flux2_pairs(block_indices(base, "transformer_blocks"), block_indices(base, "single_transformer_blocks")),
            base, False)
        return out
    return None
