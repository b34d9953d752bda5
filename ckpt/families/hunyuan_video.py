"""HunyuanVideo 1.x (T2V, I2V, SkyReels I2V): Tencent's layout (`double_blocks.N.img_attn_qkv`, as in the
release, Comfy-Org's repackaged single files, musubi-tuner and diffusion-pipe LoRAs) <-> diffusers
HunyuanVideoTransformer3DModel.

The blocks are Flux.1's with Tencent's names: double blocks fuse `img_attn_qkv` (diffusers `to_q/k/v`, row
thirds) and `txt_attn_qkv` (`add_*_proj`); single blocks fuse `linear1` = q, k, v and the MLP input
(rows [0,H), [H,2H), [2H,3H), [3H,end); H = the columns of `linear1`); the text token refiner fuses
`self_attn_qkv` (`to_q/k/v`, biases too). `final_layer.adaLN_modulation.1` is `norm_out.linear` with
shift and scale halves swapped; the refiner's `adaLN_modulation.1` is `norm_out.linear` unchanged.
MLPs are `mlp.fc1/fc2` (diffusers `ff.net.0.proj/net.2`), modulations `*_mod.linear` and
`modulation.linear` (`norm1(_context).linear`, `norm.linear`). Reference: diffusers
`convert_hunyuan_video_transformer_to_diffusers` (forward only; it hard-codes H = 3072, the pairs take
H from the shapes).

ComfyUI spelling: ComfyUI keeps the model under Flux-style names internally (`img_attn.qkv`,
`img_mod.lin`, `img_mlp.0`, `img_attn.norm.query_norm`, `modulation.lin`, `time_in.in_layer`, the refiner's
`self_attn.qkv`): its loader renames Tencent keys to those (`HunyuanVideo.process_unet_state_dict` in
comfy/supported_models.py) and its ModelSave/CheckpointSave write them back as they are
(`process_unet_state_dict_for_saving` only puts `model.model.` before them). Such a file is the original
layout spelled a second way (`COMFY`, a rename of whole modules; q/k norm weights `.weight`, before
ComfyUI's RMSNorm change `.scale`): `pairs` name each original tensor the way the file does, so convert
and merge-lora read it; `--layout original` writes Tencent's spelling. ComfyUI recognises the model by
`txt_in.individual_token_refiner` (the same in both spellings; model_detection.py), and so does the
original signature: Flux.1 has no token refiner.

LoRAs: musubi-tuner (`lora_unet_double_blocks_0_img_attn_qkv`), diffusion-pipe (`transformer.` or
`diffusion_model.` + Tencent names) and ComfyUI name the Tencent modules; diffusers/PEFT, OneTrainer and
SimpleTuner the diffusers ones. LoRAs saved by ComfyUI in its Flux-style names are extra aliases
(`lora_aliases`) on a Tencent-spelled base, Tencent names on a ComfyUI-spelled one; kohya spellings coincide
where the names only differ by `.` vs `_` (`img_attn_qkv`).
"""

from __future__ import annotations

import math
from dataclasses import replace

from ckpt.families.flux_blocks import ADD_QKV, QKV, final_adaln, fused_qkv, single_linear1
from ckpt.families.spec import (DIFFUSERS, ORIGINAL, Alias, ConventionError, Family, GGUFStorage, Pair, Shapes,
                                Signature, at, block_indices, blocks_count, dim, has, module_of, present, renames)

TOP = (
    ("img_in.proj", "x_embedder.proj"),
    ("time_in.mlp.0", "time_text_embed.timestep_embedder.linear_1"),
    ("time_in.mlp.2", "time_text_embed.timestep_embedder.linear_2"),
    ("guidance_in.mlp.0", "time_text_embed.guidance_embedder.linear_1"),
    ("guidance_in.mlp.2", "time_text_embed.guidance_embedder.linear_2"),
    ("vector_in.in_layer", "time_text_embed.text_embedder.linear_1"),
    ("vector_in.out_layer", "time_text_embed.text_embedder.linear_2"),
    ("txt_in.input_embedder", "context_embedder.proj_in"),
    ("txt_in.t_embedder.mlp.0", "context_embedder.time_text_embed.timestep_embedder.linear_1"),
    ("txt_in.t_embedder.mlp.2", "context_embedder.time_text_embed.timestep_embedder.linear_2"),
    ("txt_in.c_embedder.linear_1", "context_embedder.time_text_embed.text_embedder.linear_1"),
    ("txt_in.c_embedder.linear_2", "context_embedder.time_text_embed.text_embedder.linear_2"),
    ("final_layer.linear", "proj_out"),
)
REFINER = (
    ("norm1", "norm1"),
    ("self_attn_proj", "attn.to_out.0"),
    ("norm2", "norm2"),
    ("mlp.fc1", "ff.net.0.proj"),
    ("mlp.fc2", "ff.net.2"),
    ("adaLN_modulation.1", "norm_out.linear"),
)
DOUBLE = (
    ("img_mod.linear", "norm1.linear"),
    ("txt_mod.linear", "norm1_context.linear"),
    ("img_attn_proj", "attn.to_out.0"),
    ("txt_attn_proj", "attn.to_add_out"),
    ("img_mlp.fc1", "ff.net.0.proj"),
    ("img_mlp.fc2", "ff.net.2"),
    ("txt_mlp.fc1", "ff_context.net.0.proj"),
    ("txt_mlp.fc2", "ff_context.net.2"),
)
DOUBLE_NORMS = (
    ("img_attn_q_norm", "attn.norm_q"),
    ("img_attn_k_norm", "attn.norm_k"),
    ("txt_attn_q_norm", "attn.norm_added_q"),
    ("txt_attn_k_norm", "attn.norm_added_k"),
)
SINGLE = (("linear2", "proj_out"), ("modulation.linear", "norm.linear"))
SINGLE_NORMS = (("q_norm", "attn.norm_q"), ("k_norm", "attn.norm_k"))
REFINER_HEAD = "txt_in.individual_token_refiner.blocks"
DIFFUSERS_REFINER = "context_embedder.token_refiner.refiner_blocks"

# ComfyUI's internal (Flux-style) names of Tencent modules, applied in order to a module name: comfy
# `HunyuanVideo.process_unet_state_dict` (comfy/supported_models.py), which renames keys the same way.
COMFY = (
    ("_mod.linear", "_mod.lin"),
    ("_attn_qkv", "_attn.qkv"),
    ("_attn_proj", "_attn.proj"),
    ("mlp.fc1", "mlp.0"),
    ("mlp.fc2", "mlp.2"),
    ("modulation.linear", "modulation.lin"),
    ("time_in.mlp.0", "time_in.in_layer"),
    ("time_in.mlp.2", "time_in.out_layer"),
    ("guidance_in.mlp.0", "guidance_in.in_layer"),
    ("guidance_in.mlp.2", "guidance_in.out_layer"),
    ("t_embedder.mlp.0", "t_embedder.in_layer"),
    ("t_embedder.mlp.2", "t_embedder.out_layer"),
    ("c_embedder.linear_1", "c_embedder.in_layer"),
    ("c_embedder.linear_2", "c_embedder.out_layer"),
    ("_attn_q_norm", "_attn.norm.query_norm"),
    ("_attn_k_norm", "_attn.norm.key_norm"),
    (".q_norm", ".norm.query_norm"),
    (".k_norm", ".norm.key_norm"),
)
# ComfyUI's RMSNorm parameter: `weight` now, `scale` in files saved before its RMSNorm change (its loader
# still renames `.scale` to `.weight`).
COMFY_NORM_SUFFIXES = ("weight", "scale")

# Names Flux.1 does not have (its BFL signature also finds `double_blocks.N.img_attn...`).
TENCENT_ONLY = at(r"((img|txt)_mod_.linear|(img|txt)_mlp_.fc[12]|modulation_.linear|(img|txt)_attn_[qk]_norm"
                  r"|individual_token_refiner)")
ORIGINAL_NAMES = at(r"(double_blocks_.\d+_.(img|txt)_|single_blocks_.\d+_.(linear[12]|modulation|[qk]_norm|norm)"
                    r"|txt_in_.(individual_token_refiner|input_embedder|[tc]_embedder))")
DIFFUSERS_NAMES = at(r"((single_)?transformer_blocks_.\d+_.|context_embedder_.token_refiner)")
# HunyuanVideo 1.5 names (separate q/k/v, its extra embedders); the other module answers for those.
# Names only ComfyUI's spelling has (the label says which spelling a file uses); dots, not `_.`: with `_`
# some would be Tencent's (`self_attn_qkv`).
COMFY_NAMES = at(r"((img|txt)_(mod\.lin|attn\.qkv|mlp\.[02])(\.|$)|modulation\.lin(\.|$)|self_attn\.qkv"
                 r"|norm\.(query|key)_norm|(time|guidance)_in\.in_layer)")
V15 = at(r"((img|txt)_attn_[qkv](\.|$)|byt5_in|vision_in|cond_type_embed|context_embedder_2|image_embedder"
         r"|time_embed_.timestep_embedder)")


def refiner_pairs(h: int, refiners: list[int]) -> list[Pair]:
    """The text token refiner's blocks (1.x and 1.5 alike): renames and the thirds of `self_attn_qkv`."""
    out = []
    for i in refiners:
        b, d = f"{REFINER_HEAD}.{i}", f"{DIFFUSERS_REFINER}.{i}"
        out += renames(REFINER, b + ".", d + ".")
        out += fused_qkv(b, d, h, (("self_attn_qkv", QKV),))
    return out


def pairs_for(h: int, mlp: int, doubles: list[int], singles: list[int], refiners: list[int]) -> list[Pair]:
    """Tencent <-> diffusers tensors for width h and single-block MLP width mlp (HunyuanVideo's blocks
    share both)."""
    out = renames(TOP) + final_adaln() + refiner_pairs(h, refiners)
    for i in doubles:
        b, d = f"double_blocks.{i}", f"transformer_blocks.{i}"
        out += renames(DOUBLE, b + ".", d + ".")
        out += renames(DOUBLE_NORMS, b + ".", d + ".", ends=("weight",))
        out += fused_qkv(b, d, h, (("img_attn_qkv", QKV), ("txt_attn_qkv", ADD_QKV)))
    for j in singles:
        b, d = f"single_blocks.{j}", f"single_transformer_blocks.{j}"
        out += renames(SINGLE, b + ".", d + ".")
        out += renames(SINGLE_NORMS, b + ".", d + ".", ends=("weight",))
        out += single_linear1(b, d, h, mlp)
    return out


def widths(shapes: Shapes, layout: str) -> tuple[int, int]:
    """(H, single-block MLP width) from the shapes: H is the columns of a block's input projection."""
    h = mlp = 0
    if layout == ORIGINAL:
        for k in has(shapes, r"^(double_blocks\.\d+\.img_attn[._]qkv|single_blocks\.\d+\.linear1)\.weight$"):
            h = shapes[k][1]
            if ".linear1." in k:
                mlp = shapes[k][0] - 3 * h
    else:
        for k in has(shapes, r"^(single_)?transformer_blocks\.\d+\.(attn\.to_q|proj_mlp)\.weight$"):
            if k.endswith("proj_mlp.weight"):
                mlp = shapes[k][0]
            else:
                h = shapes[k][0]
    return h, mlp


def comfy_name(module: str) -> str:
    for tencent, comfy in COMFY:
        module = module.replace(tencent, comfy)
    return module


def spellings(key: str) -> list[str]:
    """The names one Tencent tensor has in files: Tencent's, then ComfyUI's (q/k norms: `.weight`, `.scale`)."""
    module, suffix = key.rsplit(".", 1)
    comfy = comfy_name(module)
    if comfy == module:
        return [key]
    if comfy.endswith("_norm") and suffix == "weight":
        return [key] + [f"{comfy}.{e}" for e in COMFY_NORM_SUFFIXES]
    return [key, f"{comfy}.{suffix}"]


def in_file(key: str, shapes: Shapes) -> str:
    """The spelling of Tencent tensor `key` that `shapes` holds (Tencent's when none does)."""
    return next((s for s in spellings(key) if s in shapes), key)


def _all_pairs(shapes: Shapes, layout: str) -> list[Pair]:
    """Every pair of the model, original side in Tencent's spelling."""
    if layout == ORIGINAL:
        blocks = (block_indices(shapes, "double_blocks"), block_indices(shapes, "single_blocks"),
                  block_indices(shapes, REFINER_HEAD))
    else:
        blocks = (block_indices(shapes, "transformer_blocks"), block_indices(shapes, "single_transformer_blocks"),
                  block_indices(shapes, DIFFUSERS_REFINER))
    return pairs_for(*widths(shapes, layout), *blocks)


def pairs(shapes: Shapes, layout: str) -> list[Pair]:
    """The pairs of the model; on an original-layout file each original tensor is named as the file spells
    it (Tencent's or ComfyUI's names, tensor by tensor, as ComfyUI's loader accepts either)."""
    found = _all_pairs(shapes, layout)
    if layout == ORIGINAL:
        found = [replace(p, original=in_file(p.original, shapes)) if p.original else p for p in found]
    return present(found, shapes, layout)


def lora_aliases(shapes: Shapes, layout: str) -> list[Alias]:
    """On an original-layout base: each module's name in the other spelling (ComfyUI's Flux-style names on
    a Tencent-spelled base, Tencent's on a ComfyUI-spelled one)."""
    if layout != ORIGINAL:
        return []
    out, seen = [], set()
    for p in _all_pairs(shapes, ORIGINAL):
        if p.original is None or not p.original.endswith(".weight") or p.original in seen:
            continue
        seen.add(p.original)
        key = in_file(p.original, shapes)
        if key not in shapes:
            continue
        for name in {module_of(p.original), comfy_name(module_of(p.original))} - {module_of(key)}:
            out.append(Alias(name, key))
    return out


# What the weights do not say (diffusers' HunyuanVideoTransformer3DModel configs of the releases). The
# I2V release's `image_condition_type` is "latent_concat" (33 input channels); the later "token_replace"
# I2V has T2V's 16 channels and no tensor of its own: such a file needs --config.
CONVENTIONS = {"qk_norm": "rms_norm", "rope_theta": 256.0, "rope_axes_dim": {128: [16, 56, 56]},
               "image_condition_type": {33: "latent_concat"}}


def patch_and_head(s: Shapes, conventions: dict, label: str):
    """(patch embedding shape [H, in, pt, ph, pw], H, head size, rope axes) of a diffusers-layout model,
    1.x and 1.5 alike; ConventionError where the head size or a non-square patch is not theirs."""
    pe = s["x_embedder.proj.weight"]
    width, head = pe[0], s["transformer_blocks.0.attn.norm_q.weight"][0]
    rope = conventions["rope_axes_dim"].get(head)
    if rope is None:
        raise ConventionError(f"{label}'s rope axes are known for an attention head size of 128, not {head}")
    if pe[3] != pe[4]:
        raise ConventionError(f"the patch is {pe[3]}x{pe[4]}; {label}'s patches are square")
    return pe, width, head, rope


def diffusers_config(s: Shapes) -> dict:
    pe, width, head, rope = patch_and_head(s, CONVENTIONS, "HunyuanVideo")
    return {
        "_class_name": "HunyuanVideoTransformer3DModel",
        "in_channels": pe[1],
        "out_channels": s["proj_out.weight"][0] // math.prod(pe[2:]),
        "num_attention_heads": width // head,
        "attention_head_dim": head,
        "num_layers": blocks_count(s, "transformer_blocks"),
        "num_single_layers": blocks_count(s, "single_transformer_blocks"),
        "num_refiner_layers": blocks_count(s, DIFFUSERS_REFINER),
        "mlp_ratio": s["transformer_blocks.0.ff.net.0.proj.weight"][0] / width,
        "patch_size": pe[3],
        "patch_size_t": pe[2],
        "qk_norm": CONVENTIONS["qk_norm"],
        "guidance_embeds": "time_text_embed.guidance_embedder.linear_1.weight" in s,
        "text_embed_dim": s["context_embedder.proj_in.weight"][1],
        "pooled_projection_dim": s["time_text_embed.text_embedder.linear_1.weight"][1],
        "rope_theta": CONVENTIONS["rope_theta"],
        "rope_axes_dim": rope,
        "image_condition_type": CONVENTIONS["image_condition_type"].get(pe[1]),
    }


def identify(keys, shapes, layout):
    in_ch = dim(shapes, keys, r"^(img_in|x_embedder)\.proj\.weight$", 1)
    variant = {33: "I2V ", 32: "SkyReels I2V ", 16: "T2V "}.get(in_ch, "")
    if layout != ORIGINAL:
        where = "(diffusers HunyuanVideoTransformer3DModel)"
    else:
        where = "(ComfyUI's Flux-style names)" if has(keys, COMFY_NAMES) else "(Tencent)"
    return "hunyuan_video", f"HunyuanVideo {variant}video transformer {where}"


FAMILY = Family(
    family_id="hunyuan_video",
    label="HunyuanVideo",
    layouts={
        ORIGINAL: Signature(ORIGINAL_NAMES, required=(TENCENT_ONLY,), forbidden=(V15,)),
        DIFFUSERS: Signature(DIFFUSERS_NAMES, required=(at(r"(context_embedder_.token_refiner|x_embedder_.proj)"),),
                             forbidden=(V15,)),
    },
    identify=identify,
    diffusers_class="HunyuanVideoTransformer3DModel",
    pairs=pairs,
    lora_aliases=lora_aliases,
    diffusers_config=diffusers_config,
    kohya_layout=ORIGINAL,
    lora_namings=("musubi-tuner/kohya (Tencent names)", "diffusion-pipe", "ComfyUI (also its Flux-style names)",
                  "diffusers/PEFT", "OneTrainer", "SimpleTuner LyCORIS"),
    high_precision={
        ORIGINAL: (r"^(img_in|time_in|guidance_in|vector_in|txt_in|final_layer)\.",),
        DIFFUSERS: (r"^(x_embedder|time_text_embed|context_embedder|norm_out|proj_out)\.",),
    },
    gguf=GGUFStorage("hyvid"),  # ComfyUI-GGUF's name; its 5-D patch embedding is F32 as for every family
    priority=1,  # over Flux.1, whose BFL signature also finds `double_blocks.N.img_attn_...`
    blocks=(r"^double_blocks\.(\d+)\.", r"^single_blocks\.(\d+)\."),
)
