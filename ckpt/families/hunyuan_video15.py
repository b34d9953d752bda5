"""HunyuanVideo 1.5 (480p/720p T2V and I2V, step-distilled, MeanFlow): Tencent's layout
(`double_blocks.N.img_attn_q`, as in the release, ComfyUI single files and musubi-tuner LoRAs) <->
diffusers HunyuanVideo15Transformer3DModel.

HunyuanVideo 1.x's double blocks with q, k and v kept apart (`img_attn_q/k/v` -> `attn.to_q/k/v`,
`txt_attn_q/k/v` -> `attn.add_*_proj`) and no single blocks; its text token refiner (fused
`self_attn_qkv`) and final layer (`final_layer.adaLN_modulation.1` = `norm_out.linear` with shift and
scale swapped) are 1.x's. New beside them: the ByT5 glyph mapper `byt5_in` (`context_embedder_2`), the
SigLIP projection `vision_in.proj` (`image_embedder`), `cond_type_embedding` (`cond_type_embed`),
`time_in` (`time_embed.timestep_embedder`) and, in MeanFlow checkpoints, `time_r_in`
(`time_embed.timestep_embedder_r`).

Reference: diffusers 0.42 has no single-file converter for 1.5 (`loaders/single_file_utils.py`); the
correspondence is diffusers' conversion script `scripts/convert_hunyuan_video1_5_to_diffusers.py` (not
shipped in the wheel) read against Tencent's and ComfyUI's model code (ComfyUI loads 1.5 through its
HunyuanVideo class and key renames). The tests check every module 1.5 shares with 1.x against 1.x's
diffusers-verified table, and the whole table against the diffusers model class (every tensor paired,
`from_pretrained` strict).

LoRAs: musubi-tuner (`lora_unet_double_blocks_0_img_attn_q`) and ComfyUI (`diffusion_model.`) name the
Tencent modules, diffusers/PEFT, OneTrainer and SimpleTuner the diffusers ones; every module maps to one
tensor (nothing fused but the refiner's qkv).
"""

from __future__ import annotations

import math

from ckpt.families.flux_blocks import ADD_QKV, QKV, final_adaln
from ckpt.families.hunyuan_video import (DIFFUSERS_REFINER, DOUBLE, DOUBLE_NORMS, REFINER_HEAD, TOP as V1_TOP,
                                         patch_and_head, refiner_pairs)
from ckpt.families.spec import (DIFFUSERS, ORIGINAL, Family, Pair, Shapes, Signature, at,
                                block_indices, blocks_count, dim, present, renames, start)

TOP = tuple(p for p in V1_TOP if p[0].startswith(("img_in", "txt_in", "final_layer"))) + (
    ("time_in.mlp.0", "time_embed.timestep_embedder.linear_1"),
    ("time_in.mlp.2", "time_embed.timestep_embedder.linear_2"),
    ("time_r_in.mlp.0", "time_embed.timestep_embedder_r.linear_1"),
    ("time_r_in.mlp.2", "time_embed.timestep_embedder_r.linear_2"),
    ("byt5_in.layernorm", "context_embedder_2.norm"),
    ("byt5_in.fc1", "context_embedder_2.linear_1"),
    ("byt5_in.fc2", "context_embedder_2.linear_2"),
    ("byt5_in.fc3", "context_embedder_2.linear_3"),
    ("vision_in.proj.0", "image_embedder.norm_in"),
    ("vision_in.proj.1", "image_embedder.linear_1"),
    ("vision_in.proj.3", "image_embedder.linear_2"),
    ("vision_in.proj.4", "image_embedder.norm_out"),
)
SPLIT = tuple((f"img_attn_{x}", f"attn.{n}") for x, n in zip("qkv", QKV)) + tuple(
    (f"txt_attn_{x}", f"attn.{n}") for x, n in zip("qkv", ADD_QKV))

ORIGINAL_NAMES = at(r"(double_blocks_.\d+_.(img|txt)_|txt_in_.(individual_token_refiner|input_embedder|[tc]_embedder)"
                    r"|byt5_in|vision_in|cond_type_embedding)")
DIFFUSERS_NAMES = start(r"(transformer_blocks_.\d+_.|context_embedder_.token_refiner|context_embedder_2|image_embedder"
                        r"|cond_type_embed_.)")
# separate q/k/v (kohya: `double_blocks_0_img_attn_q`), the 1.5-only embedders
ORIGINAL_ONLY = at(r"((img|txt)_attn_[qkv](\.|$)|byt5_in|vision_in|cond_type_embedding)")
DIFFUSERS_ONLY = start(r"(context_embedder_2|image_embedder|cond_type_embed_.|time_embed_.timestep_embedder)")


def pairs_for(h: int, doubles: list[int], refiners: list[int]) -> list[Pair]:
    out = renames(TOP)
    out.append(Pair("cond_type_embedding.weight", "cond_type_embed.weight"))
    out += final_adaln() + refiner_pairs(h, refiners)
    for i in doubles:
        b, d = f"double_blocks.{i}", f"transformer_blocks.{i}"
        out += renames(DOUBLE + SPLIT, b + ".", d + ".")
        out += renames(DOUBLE_NORMS, b + ".", d + ".", ends=("weight",))
    return out


def pairs(shapes: Shapes, layout: str) -> list[Pair]:
    if layout == ORIGINAL:
        h = dim(shapes, shapes, r"^txt_in\.individual_token_refiner\.blocks\.\d+\.self_attn_qkv\.weight$", 1)
        blocks = block_indices(shapes, "double_blocks"), block_indices(shapes, REFINER_HEAD)
    else:
        h = dim(shapes, shapes, r"^context_embedder\.token_refiner\.refiner_blocks\.\d+\.attn\.to_q\.weight$", 0)
        blocks = block_indices(shapes, "transformer_blocks"), block_indices(shapes, DIFFUSERS_REFINER)
    return present(pairs_for(h or 0, *blocks), shapes, layout)


# What the weights do not say (diffusers' HunyuanVideo15Transformer3DModel configs of the releases):
# `target_size` is the pipeline's default resolution (640: the 480p models; the 720p ones want 960 through
# --config), `task_type` is not read by the model (the class default is kept).
CONVENTIONS = {"qk_norm": "rms_norm", "rope_theta": 256.0, "rope_axes_dim": {128: [16, 56, 56]},
               "target_size": 640, "task_type": "i2v"}


def diffusers_config(s: Shapes) -> dict:
    pe, width, head, rope = patch_and_head(s, CONVENTIONS, "HunyuanVideo 1.5")
    return {
        "_class_name": "HunyuanVideo15Transformer3DModel",
        "in_channels": pe[1],
        "out_channels": s["proj_out.weight"][0] // math.prod(pe[2:]),
        "num_attention_heads": width // head,
        "attention_head_dim": head,
        "num_layers": blocks_count(s, "transformer_blocks"),
        "num_refiner_layers": blocks_count(s, DIFFUSERS_REFINER),
        "mlp_ratio": s["transformer_blocks.0.ff.net.0.proj.weight"][0] / width,
        "patch_size": pe[3],
        "patch_size_t": pe[2],
        "qk_norm": CONVENTIONS["qk_norm"],
        "text_embed_dim": s["context_embedder.proj_in.weight"][1],
        "text_embed_2_dim": s["context_embedder_2.norm.weight"][0],
        "image_embed_dim": s["image_embedder.norm_in.weight"][0],
        "rope_theta": CONVENTIONS["rope_theta"],
        "rope_axes_dim": rope,
        "target_size": CONVENTIONS["target_size"],
        "task_type": CONVENTIONS["task_type"],
        "use_meanflow": "time_embed.timestep_embedder_r.linear_1.weight" in s,
    }


def identify(keys, shapes, layout):
    where = "(Tencent)" if layout == ORIGINAL else "(diffusers HunyuanVideo15Transformer3DModel)"
    return "hunyuan_video15", f"HunyuanVideo 1.5 video transformer {where}"


FAMILY = Family(
    family_id="hunyuan_video15",
    label="HunyuanVideo 1.5",
    layouts={
        ORIGINAL: Signature(ORIGINAL_NAMES, required=(ORIGINAL_ONLY,), forbidden=(at(r"single_blocks_."),)),
        DIFFUSERS: Signature(DIFFUSERS_NAMES, required=(DIFFUSERS_ONLY,),
                             forbidden=(at(r"single_transformer_blocks_."),)),
    },
    identify=identify,
    diffusers_class="HunyuanVideo15Transformer3DModel",
    pairs=pairs,
    diffusers_config=diffusers_config,
    kohya_layout=ORIGINAL,
    lora_namings=("musubi-tuner/kohya (Tencent names)", "ComfyUI", "diffusers/PEFT", "OneTrainer",
                  "SimpleTuner LyCORIS"),
    high_precision={
        ORIGINAL: (r"^(img_in|time_in|time_r_in|txt_in|byt5_in|vision_in|cond_type_embedding|final_layer)\.",),
        DIFFUSERS: (r"^(x_embedder|time_embed|context_embedder|context_embedder_2|image_embedder|cond_type_embed"
                    r"|norm_out|proj_out)\.",),
    },
    priority=1,  # over Flux.1 and HunyuanVideo 1.x, whose signatures also find `double_blocks.N.img_...`
    blocks=(r"^double_blocks\.(\d+)\.",),
)
