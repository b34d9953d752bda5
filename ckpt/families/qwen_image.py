"""Qwen-Image (and Qwen-Image-Edit, -Edit-2509/2511, -Layered): one naming.

Qwen's releases and ComfyUI's single files use the diffusers QwenImageTransformer2DModel names
(`transformer_blocks.N.attn.to_q`, `attn.add_q_proj`, `img_mod.1`, `img_mlp.net.0.proj`, `txt_in`,
`norm_out.linear`), optionally under ComfyUI's `model.diffusion_model.` prefix; diffusers loads them with
no conversion at all. So there is one layout, "diffusers". (Qwen-Image 2.1 is another architecture,
QwenImage21Transformer2DModel, not this family.)

`convert --layout` moves the weights between ComfyUI's single file (the "original" container: one file,
bare or under `model.diffusion_model.`) and diffusers' model folder (config.json, sharded
`diffusion_pytorch_model*.safetensors`) without renaming a tensor; `diffusers_config` writes the config.json
from the shapes. The Edit-2511 release differs from Qwen-Image in `zero_cond_t` only, which no weight
holds: its folder needs `--config` (see CONVENTIONS).

LoRAs: diffusers/PEFT (`transformer.`), DiffSynth (no prefix, `.lora_A.default.weight`), ComfyUI/
ai-toolkit (`diffusion_model.`), musubi-tuner/kohya (`lora_unet_transformer_blocks_0_attn_add_q_proj`:
the names flattened; they cannot be split back by rule, `to_add_out`/`add_q_proj`/`img_mlp` keep their
underscores, so the key map spells every base key the kohya way instead of parsing), OneTrainer, LyCORIS.
"""

from __future__ import annotations

from ckpt.families.spec import (DIFFUSERS, ORIGINAL, ConventionError, Family, GGUFStorage, Shapes, Signature, at,
                                blocks_count, has, start)

NAMES = start(r"transformer_blocks_.\d+_.((img|txt)_mod_.1|(img|txt)_mlp_.net_.[02]|attn_.(add_[qkv]_proj|to_add_out))")
# Flux.1/Chroma/SD3/HunyuanVideo diffusers classes share `transformer_blocks.N.attn.add_q_proj`.
OTHERS = (at(r"single_transformer_blocks_."), at(r"transformer_blocks_.\d+_.(ff|ff_context|norm1|norm1_context)_."),
          at(r"pos_embed_."))


def identify(keys, shapes, layout):
    layered = has(keys, r"addition_t_embedding")
    return "qwen_image", ("Qwen-Image-Layered" if layered else "Qwen-Image") + " transformer (diffusers names)"


# What the weights do not say (the transformer/config.json of Qwen/Qwen-Image, -Edit, -Edit-2509, -2512,
# -Layered). `zero_cond_t` is True in Qwen-Image-Edit-2511 alone, and changes nothing in the weights: a
# derived config says False, so that release needs `--config Qwen/Qwen-Image-Edit-2511/transformer`.
# Layered's two flags go together with its `addition_t_embedding` (the one weight Layered adds).
CONVENTIONS = {"patch_size": 2, "axes_dims_rope": {128: [16, 56, 56]}, "guidance_embeds": False, "zero_cond_t": False}


def diffusers_config(s: Shapes) -> dict:
    """QwenImageTransformer2DModel's config.json from the shapes: the head size is the per-head q norm's
    width, the channels come from `img_in`/`proj_out` at the releases' patch size."""
    head = s["transformer_blocks.0.attn.norm_q.weight"][0]
    width = s["img_in.weight"][0]
    rope = CONVENTIONS["axes_dims_rope"].get(head)
    if rope is None:
        raise ConventionError(f"Qwen-Image's rope axes are known for an attention head size of 128, not {head}")
    patch = CONVENTIONS["patch_size"]
    out_rows = s["proj_out.weight"][0]
    if out_rows % (patch * patch):
        raise ConventionError(f"proj_out's {out_rows} rows are no multiple of the patch area {patch * patch}")
    layered = "time_text_embed.addition_t_embedding.weight" in s
    return {
        "_class_name": "QwenImageTransformer2DModel",
        "patch_size": patch,
        "in_channels": s["img_in.weight"][1],
        "out_channels": out_rows // (patch * patch),
        "num_layers": blocks_count(s, "transformer_blocks"),
        "attention_head_dim": head,
        "num_attention_heads": width // head,
        "joint_attention_dim": s["txt_in.weight"][1],
        "guidance_embeds": CONVENTIONS["guidance_embeds"],
        "axes_dims_rope": rope,
        "zero_cond_t": CONVENTIONS["zero_cond_t"],
        "use_additional_t_cond": layered,
        "use_layer3d_rope": layered,
    }


HIGH_PRECISION = (r"^(img_in|txt_in|txt_norm|time_text_embed|norm_out|proj_out)\.",)

FAMILY = Family(
    family_id="qwen_image",
    label="Qwen-Image",
    layouts={DIFFUSERS: Signature(NAMES, forbidden=OTHERS)},
    identify=identify,
    diffusers_class="QwenImageTransformer2DModel",
    diffusers_config=diffusers_config,
    kohya_layout=DIFFUSERS,
    lora_namings=("musubi-tuner/kohya (diffusers names)", "ComfyUI/ai-toolkit", "diffusers/PEFT", "DiffSynth",
                  "OneTrainer", "SimpleTuner LyCORIS"),
    # ComfyUI-GGUF's rule: the input and output layers and the timestep embedder stay unquantized. The
    # original files use the same names, so `convert --layout original --to <quant>` keeps the same layers.
    high_precision={DIFFUSERS: HIGH_PRECISION, ORIGINAL: HIGH_PRECISION},
    gguf=GGUFStorage("qwen_image"),
    blocks=(r"^transformer_blocks\.(\d+)\.",),
)
