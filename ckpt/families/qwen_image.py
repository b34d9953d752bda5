"""Qwen-Image (and Qwen-Image-Edit, -Edit-2509/2511, -Layered): one naming.

Qwen's releases and ComfyUI's single files use the diffusers QwenImageTransformer2DModel names
(`transformer_blocks.N.attn.to_q`, `attn.add_q_proj`, `img_mod.1`, `img_mlp.net.0.proj`, `txt_in`,
`norm_out.linear`), optionally under ComfyUI's `model.diffusion_model.` prefix; diffusers loads them with
no conversion at all. So there is one layout, "diffusers". (Qwen-Image 2.1 is another architecture,
QwenImage21Transformer2DModel, not this family.)

LoRAs: diffusers/PEFT (`transformer.`), DiffSynth (no prefix, `.lora_A.default.weight`), ComfyUI/
ai-toolkit (`diffusion_model.`), musubi-tuner/kohya (`lora_unet_transformer_blocks_0_attn_add_q_proj`:
the names flattened; they cannot be split back by rule, `to_add_out`/`add_q_proj`/`img_mlp` keep their
underscores, so the key map spells every base key the kohya way instead of parsing), OneTrainer, LyCORIS.
"""

from __future__ import annotations

from ckpt.families.spec import DIFFUSERS, Family, GGUFStorage, Signature, at, has, start

NAMES = start(r"transformer_blocks_.\d+_.((img|txt)_mod_.1|(img|txt)_mlp_.net_.[02]|attn_.(add_[qkv]_proj|to_add_out))")
# Flux.1/Chroma/SD3/HunyuanVideo diffusers classes share `transformer_blocks.N.attn.add_q_proj`.
OTHERS = (at(r"single_transformer_blocks_."), at(r"transformer_blocks_.\d+_.(ff|ff_context|norm1|norm1_context)_."),
          at(r"pos_embed_."))


def identify(keys, shapes, layout):
    layered = has(keys, r"addition_t_embedding")
    return "qwen_image", ("Qwen-Image-Layered" if layered else "Qwen-Image") + " transformer (diffusers names)"


FAMILY = Family(
    family_id="qwen_image",
    label="Qwen-Image",
    layouts={DIFFUSERS: Signature(NAMES, forbidden=OTHERS)},
    identify=identify,
    diffusers_class="QwenImageTransformer2DModel",
    kohya_layout=DIFFUSERS,
    lora_namings=("musubi-tuner/kohya (diffusers names)", "ComfyUI/ai-toolkit", "diffusers/PEFT", "DiffSynth",
                  "OneTrainer", "SimpleTuner LyCORIS"),
    # ComfyUI-GGUF's rule: the input and output layers and the timestep embedder stay unquantized.
    high_precision={
        DIFFUSERS: (r"^(img_in|txt_in|txt_norm|time_text_embed|norm_out|proj_out)\.",),
    },
    gguf=GGUFStorage("qwen_image"),
)
