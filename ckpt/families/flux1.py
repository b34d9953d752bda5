"""Flux.1 (dev, schnell, Kontext, Fill, Canny/Depth): BFL layout (`double_blocks`, `single_blocks`, fused
`qkv` and `linear1`) <-> diffusers FluxTransformer2DModel.

In the BFL layout diffusers' `to_q/to_k/to_v` are row thirds of `img_attn.qkv` (`add_*_proj` of
`txt_attn.qkv`); in single blocks `to_q/k/v` and `proj_mlp` are rows [0,H), [H,2H), [2H,3H), [3H,3H+M)
of `linear1`. `norm_out.linear` is `final_layer.adaLN_modulation.1` with its two halves (shift, scale)
swapped. Widths come from the shapes, block by block. Reference: diffusers
`convert_flux_transformer_checkpoint_to_diffusers`.

LoRAs: kohya/ai-toolkit name the BFL modules, diffusers/PEFT/OneTrainer/SimpleTuner the diffusers ones;
LyCORIS also uses Flux.2's `ff.linear_in/out` names on Flux.1, XLabs `processor.{qkv,proj}_lora{1,2}`,
ComfyUI `single_blocks.N.linear1_qkv` for the attention rows of `linear1`.
"""

from __future__ import annotations

from ckpt.families.flux_blocks import bfl_double, bfl_double_widths, bfl_single, bfl_single_widths, final_adaln
from ckpt.families.spec import (DIFFUSERS, ORIGINAL, Alias, ConventionError, Family, GGUFStorage, Pair, Shapes,
                                Signature, at, block_indices, blocks_count, dim, has, present, renames)

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
SINGLE = (("linear2", "proj_out"), ("modulation.lin", "norm.linear"))
# LyCORIS names the gated feed-forwards as Flux.2's diffusers class does.
FF_LINEAR = (
    ("img_mlp.0", "ff.linear_in"),
    ("img_mlp.2", "ff.linear_out"),
    ("txt_mlp.0", "ff_context.linear_in"),
    ("txt_mlp.2", "ff_context.linear_out"),
)
XLABS = (
    ("img_attn.qkv", "processor.qkv_lora1"),
    ("txt_attn.qkv", "processor.qkv_lora2"),
    ("img_attn.proj", "processor.proj_lora1"),
    ("txt_attn.proj", "processor.proj_lora2"),
)

BFL = at(r"(double_blocks_.\d+_.((img|txt)_(attn|mlp|mod)|processor)|single_blocks_.\d+_.(linear[12]|modulation))")
DIFFUSERS_SINGLE = at(r"single_transformer_blocks_.\d+_.")
# Names only Flux.2 has (shared modulations, whole-linear1 projection, time_guidance_embed).
FLUX2_NAMES = at(r"((double|single)_stream_modulation|to_qkv_mlp_proj|time_guidance_embed)")


def flux2_evidence(keys, shapes: Shapes) -> bool:
    """Flux.2 by names, or by shapes where its names are Flux.1's: gated MLPs make `img_mlp.0` 6H rows
    (Flux.1: 4H) and `linear1` 9H rows (Flux.1: 7H), H being the columns."""
    if has(keys, FLUX2_NAMES):
        return True
    for pattern, ratio in ((at(r"double_blocks_.\d+_.(img|txt)_mlp_.0(\.weight)?$"), 6),
                           (at(r"single_blocks_.\d+_.linear1(\.weight)?$"), 9)):
        rows, cols = dim(shapes, keys, pattern, 0), dim(shapes, keys, pattern, 1)
        if rows and cols and rows == ratio * cols:
            return True
    return False


def _not_flux2(keys, shapes) -> bool:
    return not flux2_evidence(keys, shapes)


def identify(keys, shapes, layout):
    guidance = has(keys, at(r"guidance_in_.")) or has(keys, r"guidance_embedder")
    label = "Flux (dev: guidance embedding)" if guidance else "Flux"
    width = dim(shapes, keys, at(r"(img_in|x_embedder)(\.weight)?$"), 1)
    if width in (384, 128):  # Fill: 64 latent + 320 mask/image channels; Canny/Depth: 64 + 64
        label = f"Flux ({'Fill' if width == 384 else 'Canny/Depth'}: {width} input channels)"
    where = "(BFL)" if layout == ORIGINAL else "(diffusers FluxTransformer2DModel)"
    return "flux1", f"{label} transformer {where}"


def pairs_for(doubles: dict[int, int], singles: dict[int, tuple[int, int]]) -> list[Pair]:
    """BFL <-> diffusers tensors for double blocks {i: H} and single blocks {j: (H, M)}."""
    out = renames(BASIC) + final_adaln()
    for i, h in doubles.items():
        out += bfl_double(i, h, DOUBLE)
    for j, (h, m) in singles.items():
        out += bfl_single(j, h, m, SINGLE)
    return out


def widths(shapes: Shapes, layout: str):
    """{double block: H}, {single block: (H, M)} from either layout's shapes."""
    return bfl_double_widths(shapes, layout), bfl_single_widths(shapes, layout)


def pairs(shapes: Shapes, layout: str) -> list[Pair]:
    return present(pairs_for(*widths(shapes, layout)), shapes, layout)


def lora_aliases(shapes: Shapes, layout: str) -> list[Alias]:
    """On a BFL base: LyCORIS's Flux.2-style diffusers names (`ff.linear_in`, whole-`linear1`
    `attn.to_qkv_mlp_proj`, `attn.to_out`), XLabs names, and ComfyUI's `linear1_qkv`."""
    if layout != ORIGINAL:
        return []
    out: list[Alias] = []
    for i in block_indices(shapes, "double_blocks"):
        b = f"double_blocks.{i}"
        for o, name in FF_LINEAR:
            if f"{b}.{o}.weight" in shapes:
                out.append(Alias(f"transformer_blocks.{i}.{name}", f"{b}.{o}.weight"))
        for o, xl in XLABS:
            if f"{b}.{o}.weight" in shapes:
                out.append(Alias(f"{b}.{xl}", f"{b}.{o}.weight"))
    for j in block_indices(shapes, "single_blocks"):
        b = f"single_blocks.{j}"
        for o, name in (("linear1", "attn.to_qkv_mlp_proj"), ("linear2", "attn.to_out")):
            if f"{b}.{o}.weight" in shapes:
                out.append(Alias(f"single_transformer_blocks.{j}.{name}", f"{b}.{o}.weight"))
    for j, (h, _m) in widths(shapes, ORIGINAL)[1].items():
        # ComfyUI's name for a LoRA on the attention rows of linear1 only
        out.append(Alias(f"single_blocks.{j}.linear1_qkv", f"single_blocks.{j}.linear1.weight", (0, 3 * h)))
    return out


# What the weights do not say (diffusers' FluxTransformer2DModel configs of the Flux.1 releases).
CONVENTIONS = {"patch_size": 1, "axes_dims_rope": {128: [16, 56, 56]}}


def diffusers_config(s: Shapes) -> dict:
    head = s["transformer_blocks.0.attn.norm_q.weight"][0]
    width = s["x_embedder.weight"][0]
    rope = CONVENTIONS["axes_dims_rope"].get(head)
    if rope is None:
        raise ConventionError(f"Flux.1's rope axes are known for an attention head size of 128, not {head}")
    in_ch, out_ch = s["x_embedder.weight"][1], s["proj_out.weight"][0]
    return {
        "_class_name": "FluxTransformer2DModel",
        "patch_size": CONVENTIONS["patch_size"],
        "in_channels": in_ch,
        "out_channels": None if out_ch == in_ch else out_ch,
        "num_layers": blocks_count(s, "transformer_blocks"),
        "num_single_layers": blocks_count(s, "single_transformer_blocks"),
        "attention_head_dim": head,
        "num_attention_heads": width // head,
        "joint_attention_dim": s["context_embedder.weight"][1],
        "pooled_projection_dim": s["time_text_embed.text_embedder.linear_1.weight"][1],
        "guidance_embeds": "time_text_embed.guidance_embedder.linear_1.weight" in s,
        "axes_dims_rope": rope,
    }


FAMILY = Family(
    family_id="flux1",
    label="Flux.1",
    layouts={
        ORIGINAL: Signature(BFL, check=_not_flux2),
        DIFFUSERS: Signature(DIFFUSERS_SINGLE, check=_not_flux2),
    },
    identify=identify,
    diffusers_class="FluxTransformer2DModel",
    pairs=pairs,
    lora_aliases=lora_aliases,
    diffusers_config=diffusers_config,
    kohya_layout=ORIGINAL,
    lora_namings=("kohya/ai-toolkit (BFL names)", "ComfyUI", "diffusers/PEFT", "OneTrainer", "SimpleTuner LyCORIS",
                  "XLabs"),
    high_precision={
        ORIGINAL: (r"^(img_in|txt_in|time_in|vector_in|guidance_in|final_layer)\.",),
        DIFFUSERS: (r"^(x_embedder|context_embedder|time_text_embed|norm_out|proj_out)\.",),
    },
    gguf=GGUFStorage("flux"),
    blocks=(r"^double_blocks\.(\d+)\.", r"^single_blocks\.(\d+)\."),
)
