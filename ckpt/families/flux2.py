"""Flux.2 (dev, klein): BFL layout <-> diffusers Flux2Transformer2DModel.

The BFL layout is Flux.1's, minus biases and per-block modulations: one shared
`double_stream_modulation_img/txt.lin` and `single_stream_modulation.lin`, gated MLPs
(`img_mlp.0` is 2 x mlp rows), and single blocks whose `linear1` (qkv + gated mlp) and `linear2` are
kept whole in diffusers (`attn.to_qkv_mlp_proj`, `attn.to_out`). Double-block `img_attn.qkv` is split
into `to_q/k/v` (`txt_attn.qkv` into `add_*_proj`), and `final_layer.adaLN_modulation.1` is
`norm_out.linear` with shift and scale swapped. Reference: diffusers
`convert_flux2_transformer_checkpoint_to_diffusers` (there is no reverse converter).

LoRAs: musubi-tuner/ai-toolkit name the BFL modules (`lora_unet_double_blocks_0_img_attn_qkv`),
diffusers/PEFT the diffusers ones; a LoRA on the fused `qkv` lands on the three diffusers pieces and a
LoRA on `to_q/k/v` on rows of `qkv`.
"""

from __future__ import annotations

from ckpt.families.flux1 import BFL, flux2_evidence
from ckpt.families.flux_blocks import BFL_SINGLE_NORMS, bfl_double, bfl_double_widths, final_adaln
from ckpt.families.spec import (DIFFUSERS, ORIGINAL, ConventionError, Family, GGUFStorage, Pair, Shapes, Signature, at,
                                block_indices, blocks_count, present, renames)

BASIC = (
    ("img_in", "x_embedder"),
    ("txt_in", "context_embedder"),
    ("time_in.in_layer", "time_guidance_embed.timestep_embedder.linear_1"),
    ("time_in.out_layer", "time_guidance_embed.timestep_embedder.linear_2"),
    ("guidance_in.in_layer", "time_guidance_embed.guidance_embedder.linear_1"),
    ("guidance_in.out_layer", "time_guidance_embed.guidance_embedder.linear_2"),
    ("double_stream_modulation_img.lin", "double_stream_modulation_img.linear"),
    ("double_stream_modulation_txt.lin", "double_stream_modulation_txt.linear"),
    ("single_stream_modulation.lin", "single_stream_modulation.linear"),
    ("final_layer.linear", "proj_out"),
)
DOUBLE = (
    ("img_attn.proj", "attn.to_out.0"),
    ("txt_attn.proj", "attn.to_add_out"),
    ("img_mlp.0", "ff.linear_in"),
    ("img_mlp.2", "ff.linear_out"),
    ("txt_mlp.0", "ff_context.linear_in"),
    ("txt_mlp.2", "ff_context.linear_out"),
)
SINGLE = (("linear1", "attn.to_qkv_mlp_proj"), ("linear2", "attn.to_out"))

DIFFUSERS_NAMES = at(r"(single_transformer_blocks_.\d+_.|transformer_blocks_.\d+_.ff(_context)?_.linear_(in|out))")


def identify(keys, shapes, layout):
    return "flux2", "Flux.2 transformer " + ("(BFL)" if layout == ORIGINAL else "(diffusers Flux2Transformer2DModel)")


def pairs_for(doubles: dict[int, int], singles: list[int]) -> list[Pair]:
    """BFL <-> diffusers tensors for double blocks {i: H} and single blocks [j]. Flux.2 has no biases."""
    out = renames(BASIC, ends=("weight",)) + final_adaln(ends=("weight",))
    for i, h in doubles.items():
        out += bfl_double(i, h, DOUBLE, ends=("weight",))
    for j in singles:
        b, d = f"single_blocks.{j}", f"single_transformer_blocks.{j}"
        out += renames(SINGLE, b + ".", d + ".", ends=("weight",))
        out += [Pair(f"{b}.{o}.scale", f"{d}.{n}.weight") for o, n in BFL_SINGLE_NORMS]
    return out


def widths(shapes: Shapes, layout: str):
    """{double block: H}, [single block] from either layout's shapes (single blocks are kept whole)."""
    singles = block_indices(shapes, "single_blocks" if layout == ORIGINAL else "single_transformer_blocks")
    return bfl_double_widths(shapes, layout), singles


def pairs(shapes: Shapes, layout: str) -> list[Pair]:
    return present(pairs_for(*widths(shapes, layout)), shapes, layout)


# What the weights do not say (diffusers' Flux2Transformer2DModel configs of the Flux.2 releases).
CONVENTIONS = {"patch_size": 1, "axes_dims_rope": {128: [32, 32, 32, 32]}, "rope_theta": 2000, "eps": 1e-6}


def diffusers_config(s: Shapes) -> dict:
    head = s["transformer_blocks.0.attn.norm_q.weight"][0] if "transformer_blocks.0.attn.norm_q.weight" in s else \
        s["single_transformer_blocks.0.attn.norm_q.weight"][0]
    width = s["x_embedder.weight"][0]
    rope = CONVENTIONS["axes_dims_rope"].get(head)
    if rope is None:
        raise ConventionError(f"Flux.2's rope axes are known for an attention head size of 128, not {head}")
    lin_in = s.get("transformer_blocks.0.ff.linear_in.weight")
    in_ch = s["x_embedder.weight"][1]
    out_ch = s["proj_out.weight"][0]
    return {
        "_class_name": "Flux2Transformer2DModel",
        "patch_size": CONVENTIONS["patch_size"],
        "in_channels": in_ch,
        "out_channels": None if out_ch == in_ch else out_ch,
        "num_layers": blocks_count(s, "transformer_blocks"),
        "num_single_layers": blocks_count(s, "single_transformer_blocks"),
        "attention_head_dim": head,
        "num_attention_heads": width // head,
        "joint_attention_dim": s["context_embedder.weight"][1],
        "timestep_guidance_channels": s["time_guidance_embed.timestep_embedder.linear_1.weight"][1],
        "mlp_ratio": lin_in[0] / 2 / width if lin_in else 3.0,
        "axes_dims_rope": rope,
        "rope_theta": CONVENTIONS["rope_theta"],
        "eps": CONVENTIONS["eps"],
        "guidance_embeds": "time_guidance_embed.guidance_embedder.linear_1.weight" in s,
    }


FAMILY = Family(
    family_id="flux2",
    label="Flux.2",
    layouts={
        ORIGINAL: Signature(BFL, check=flux2_evidence),
        DIFFUSERS: Signature(DIFFUSERS_NAMES, check=flux2_evidence),
    },
    identify=identify,
    diffusers_class="Flux2Transformer2DModel",
    pairs=pairs,
    diffusers_config=diffusers_config,
    kohya_layout=ORIGINAL,
    lora_namings=("musubi/ai-toolkit/kohya (BFL names)", "ComfyUI", "diffusers/PEFT", "OneTrainer",
                  "SimpleTuner LyCORIS"),
    high_precision={
        ORIGINAL: (r"^(img_in|txt_in|time_in|guidance_in|final_layer|(double|single)_stream_modulation\w*)\.",),
        DIFFUSERS: (r"^(x_embedder|context_embedder|time_guidance_embed|norm_out|proj_out"
                    r"|(double|single)_stream_modulation\w*)\.",),
    },
    gguf=GGUFStorage("flux"),  # ComfyUI-GGUF names Flux.2 "flux" too (its Flux.2 filter is the modulation rule)
    blocks=(r"^double_blocks\.(\d+)\.", r"^single_blocks\.(\d+)\."),
)
