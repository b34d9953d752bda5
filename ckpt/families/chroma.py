"""Chroma (Chroma1-Base/HD, the Flux.1-schnell derivative by lodestones): original layout (BFL names, as in
the released `chroma*.safetensors`, ComfyUI single files and kohya/ai-toolkit LoRAs) <-> diffusers
ChromaTransformer2DModel.

Chroma is Flux.1 with every modulation pruned: no `img_mod`/`txt_mod`/`modulation`, no `time_in`,
`vector_in`, `guidance_in`, no `final_layer.adaLN_modulation`. The modulations come instead from one
`distilled_guidance_layer` (an MLP "approximator": `in_proj`, `layers.N.in_layer/out_layer`,
`norms.N.scale`, `out_proj`), which diffusers keeps under the same name (`in_layer/out_layer` ->
`linear_1/linear_2`, `norms.N.scale` -> `.weight`). Everything else is Flux.1's correspondence: thirds of
the fused `img_attn.qkv`/`txt_attn.qkv` are `to_q/k/v` and `add_*_proj`, single-block `linear1` rows are
`to_q/k/v` + `proj_mlp`, `linear2` is `proj_out`. Widths come from the shapes, block by block.
Reference: diffusers `convert_chroma_transformer_checkpoint_to_diffusers` (which hard-codes Chroma's
width 3072 to split `linear1`; there is no reverse converter).

Recognition: BFL names plus `distilled_guidance_layer` (a LoRA without it reads as Flux.1: both have the
same block names, and Flux.1 LoRA module names are a superset of Chroma's).

LoRAs: kohya/ai-toolkit and ComfyUI name the BFL modules (`lora_unet_double_blocks_0_img_attn_qkv`),
diffusers/PEFT/SimpleTuner the diffusers ones; a LoRA on the fused `qkv`/`linear1` lands on the diffusers
pieces and a LoRA on `to_q/k/v`/`proj_mlp` on rows of them, as for Flux.1.
"""

from __future__ import annotations

from ckpt.families.flux1 import BFL, DIFFUSERS_SINGLE, flux2_evidence
from ckpt.families.flux_blocks import bfl_double, bfl_double_widths, bfl_single, bfl_single_widths
from ckpt.families.spec import (DIFFUSERS, ORIGINAL, ConventionError, Family, GGUFStorage, Pair, Shapes, Signature,
                                at, block_indices, blocks_count, present, renames)

BASIC = (
    ("img_in", "x_embedder"),
    ("txt_in", "context_embedder"),
    ("final_layer.linear", "proj_out"),
    ("distilled_guidance_layer.in_proj", "distilled_guidance_layer.in_proj"),
    ("distilled_guidance_layer.out_proj", "distilled_guidance_layer.out_proj"),
)
DOUBLE = (
    ("img_attn.proj", "attn.to_out.0"),
    ("txt_attn.proj", "attn.to_add_out"),
    ("img_mlp.0", "ff.net.0.proj"),
    ("img_mlp.2", "ff.net.2"),
    ("txt_mlp.0", "ff_context.net.0.proj"),
    ("txt_mlp.2", "ff_context.net.2"),
)
SINGLE = (("linear2", "proj_out"),)
APPROXIMATOR = "distilled_guidance_layer"
CHROMA_NAMES = at(r"distilled_guidance_layer_.")


def _not_flux2(keys, shapes) -> bool:
    return not flux2_evidence(keys, shapes)


def identify(keys, shapes, layout):
    return "chroma", "Chroma transformer " + ("(original)" if layout == ORIGINAL
                                              else "(diffusers ChromaTransformer2DModel)")


def pairs_for(doubles: dict[int, int], singles: dict[int, tuple[int, int]], approximator: list[int]) -> list[Pair]:
    """Original <-> diffusers tensors for double blocks {i: H}, single blocks {j: (H, M)} and approximator
    layers [k]."""
    out = renames(BASIC)
    for k in approximator:
        b = f"{APPROXIMATOR}.layers.{k}"
        out += renames(((f"{b}.in_layer", f"{b}.linear_1"), (f"{b}.out_layer", f"{b}.linear_2")))
        out.append(Pair(f"{APPROXIMATOR}.norms.{k}.scale", f"{APPROXIMATOR}.norms.{k}.weight"))
    for i, h in doubles.items():
        out += bfl_double(i, h, DOUBLE)
    for j, (h, m) in singles.items():
        out += bfl_single(j, h, m, SINGLE)
    return out


def widths(shapes: Shapes, layout: str):
    """{double block: H}, {single block: (H, M)}, [approximator layer] from either layout's shapes."""
    layers = {*block_indices(shapes, f"{APPROXIMATOR}.layers"), *block_indices(shapes, f"{APPROXIMATOR}.norms")}
    return bfl_double_widths(shapes, layout), bfl_single_widths(shapes, layout), sorted(layers)


def pairs(shapes: Shapes, layout: str) -> list[Pair]:
    return present(pairs_for(*widths(shapes, layout)), shapes, layout)


# What the weights do not say (the ChromaTransformer2DModel config of lodestones/Chroma1-Base and -HD):
# the patch size (packed 2x2 latents enter as 64 channels through a Linear) and the rope axes.
CONVENTIONS = {"patch_size": 1, "axes_dims_rope": {128: [16, 56, 56]}}


def diffusers_config(s: Shapes) -> dict:
    head = s["transformer_blocks.0.attn.norm_q.weight"][0] if "transformer_blocks.0.attn.norm_q.weight" in s else \
        s["single_transformer_blocks.0.attn.norm_q.weight"][0]
    rope = CONVENTIONS["axes_dims_rope"].get(head)
    if rope is None:
        raise ConventionError(f"Chroma's rope axes are known for an attention head size of 128, not {head}")
    width, in_ch = s["x_embedder.weight"]
    patch = CONVENTIONS["patch_size"]
    out_ch = s["proj_out.weight"][0] // (patch * patch)
    approx = s[f"{APPROXIMATOR}.in_proj.weight"]
    return {
        "_class_name": "ChromaTransformer2DModel",
        "patch_size": patch,
        "in_channels": in_ch,
        "out_channels": None if out_ch == in_ch else out_ch,
        "num_layers": blocks_count(s, "transformer_blocks"),
        "num_single_layers": blocks_count(s, "single_transformer_blocks"),
        "attention_head_dim": head,
        "num_attention_heads": width // head,
        "joint_attention_dim": s["context_embedder.weight"][1],
        "axes_dims_rope": rope,
        "approximator_num_channels": approx[1],
        "approximator_hidden_dim": approx[0],
        "approximator_layers": blocks_count(s, f"{APPROXIMATOR}.layers"),
    }


FAMILY = Family(
    family_id="chroma",
    label="Chroma",
    layouts={
        ORIGINAL: Signature(BFL, required=(CHROMA_NAMES,), check=_not_flux2),
        DIFFUSERS: Signature(DIFFUSERS_SINGLE, required=(CHROMA_NAMES,), check=_not_flux2),
    },
    identify=identify,
    diffusers_class="ChromaTransformer2DModel",
    pairs=pairs,
    diffusers_config=diffusers_config,
    kohya_layout=ORIGINAL,
    lora_namings=("kohya/ai-toolkit (original names)", "ComfyUI", "diffusers/PEFT", "OneTrainer",
                  "SimpleTuner LyCORIS"),
    # ComfyUI-GGUF's Chroma rule (lcpp_chroma.patch): the approximator, the input/output layers in F32/F16.
    high_precision={
        ORIGINAL: (r"^(img_in|txt_in|final_layer|distilled_guidance_layer)\.",),
        DIFFUSERS: (r"^(x_embedder|context_embedder|proj_out|distilled_guidance_layer)\.",),
    },
    gguf=GGUFStorage("flux"),  # ComfyUI-GGUF stores Chroma as a Flux architecture
    blocks=(r"^double_blocks\.(\d+)\.", r"^single_blocks\.(\d+)\."),
)
