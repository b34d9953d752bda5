"""LTX-Video 0.9.x (2B and 13B, 0.9.0 to 0.9.8 and distilled): Lightricks' layout (`patchify_proj`,
`adaln_single`, `attn1.q_norm`, as in the releases, ComfyUI single files and LTX-Video-Trainer / musubi
LoRAs) <-> diffusers LTXVideoTransformer3DModel.

Renames only, and few: `patchify_proj` is `proj_in`, `adaln_single` is `time_embed`, the attention
`q_norm/k_norm` are `norm_q/norm_k`; every other name (`transformer_blocks.N.attn1.to_q`, `ff.net.0.proj`,
`scale_shift_table`, `caption_projection`, `proj_out`) is the same in both layouts. Reference: diffusers
`convert_ltx_transformer_checkpoint_to_diffusers`. Release files bundle the VAE (`vae.*`) beside
`model.diffusion_model.`: merge-lora reads both, `convert --layout` wants the transformer alone.

LoRAs: LTX-Video-Trainer and ComfyUI (`diffusion_model.transformer_blocks.0.attn1.to_q`), kohya/musubi
(`lora_unet_transformer_blocks_0_attn1_to_q`), diffusers/PEFT (`transformer.`), OneTrainer and SimpleTuner
name modules whose names both layouts share; the few renamed ones (`patchify_proj`, `adaln_single.linear`)
land on either layout through the pairs.
"""

from __future__ import annotations

from ckpt.families.spec import (DIFFUSERS, ORIGINAL, ConventionError, Family, GGUFStorage, Pair, Shapes, Signature,
                                at, block_indices, blocks_count, present, renames, start)

TOP = (
    ("patchify_proj", "proj_in"),
    ("adaln_single.emb.timestep_embedder.linear_1", "time_embed.emb.timestep_embedder.linear_1"),
    ("adaln_single.emb.timestep_embedder.linear_2", "time_embed.emb.timestep_embedder.linear_2"),
    ("adaln_single.linear", "time_embed.linear"),
    ("caption_projection.linear_1", "caption_projection.linear_1"),
    ("caption_projection.linear_2", "caption_projection.linear_2"),
    ("proj_out", "proj_out"),
)
ATTN = ("to_q", "to_k", "to_v", "to_out.0")
BLOCK = tuple((f"{a}.{p}", f"{a}.{p}") for a in ("attn1", "attn2") for p in ATTN) + (
    ("ff.net.0.proj", "ff.net.0.proj"), ("ff.net.2", "ff.net.2"))
NORMS = tuple((f"{a}.{o}", f"{a}.{d}") for a in ("attn1", "attn2") for o, d in (("q_norm", "norm_q"),
                                                                                ("k_norm", "norm_k")))

BLOCK_NAMES = r"transformer_blocks_.\d+_.(attn[12]_.(to_|norm_|[qk]_norm)|ff_.net|scale_shift_table)"
ORIGINAL_NAMES = start(rf"({BLOCK_NAMES}|patchify_proj|adaln_single|caption_projection)")
# top-level names end at a separator: Kandinsky 5's `time_embeddings` is not `time_embed`
DIFFUSERS_NAMES = start(rf"({BLOCK_NAMES}|(proj_in|time_embed|caption_projection)_.)")
# what the MMDiT families (SD3/SD3.5 dual attention, Flux, HunyuanVideo) have in their diffusers blocks
MMDIT = start(r"(transformer_blocks_.\d+_.(attn_.|ff_context|norm1_context)|context_embedder|pos_embed|x_embedder)")
# LTX-2's audio stream and audio-video cross attention (its own module answers for those)
LTX2 = at(r"(audio_|video_to_audio|av_ca_|av_cross_attn|a2v|v2a|embeddings_connector)")


def pairs_for(blocks: list[int]) -> list[Pair]:
    out = renames(TOP) + [Pair("scale_shift_table", "scale_shift_table")]
    for i in blocks:
        b = f"transformer_blocks.{i}."
        out += renames(BLOCK, b, b) + renames(NORMS, b, b, ends=("weight",))
        out.append(Pair(b + "scale_shift_table", b + "scale_shift_table"))
    return out


def pairs(shapes: Shapes, layout: str) -> list[Pair]:
    return present(pairs_for(block_indices(shapes, "transformer_blocks")), shapes, layout)


# What the weights do not say (diffusers' LTXVideoTransformer3DModel configs of the 0.9.x releases).
CONVENTIONS = {"patch_size": 1, "patch_size_t": 1, "attention_head_dim": 64, "activation_fn": "gelu-approximate",
               "qk_norm": "rms_norm_across_heads", "norm_elementwise_affine": False, "norm_eps": 1e-6}


def diffusers_config(s: Shapes) -> dict:
    width, head = s["proj_in.weight"][0], CONVENTIONS["attention_head_dim"]
    if width % head:
        raise ConventionError(f"LTX-Video's attention head size is {head} in every release, but the width {width} "
                              "is no multiple of it")
    return {
        "_class_name": "LTXVideoTransformer3DModel",
        "in_channels": s["proj_in.weight"][1],
        "out_channels": s["proj_out.weight"][0],
        "patch_size": CONVENTIONS["patch_size"],
        "patch_size_t": CONVENTIONS["patch_size_t"],
        "num_attention_heads": width // head,
        "attention_head_dim": head,
        "cross_attention_dim": s["transformer_blocks.0.attn2.to_k.weight"][1],
        "num_layers": blocks_count(s, "transformer_blocks"),
        "activation_fn": CONVENTIONS["activation_fn"],
        "qk_norm": CONVENTIONS["qk_norm"],
        "norm_elementwise_affine": CONVENTIONS["norm_elementwise_affine"],
        "norm_eps": CONVENTIONS["norm_eps"],
        "caption_channels": s["caption_projection.linear_1.weight"][1],
        "attention_bias": "transformer_blocks.0.attn1.to_q.bias" in s,
        "attention_out_bias": "transformer_blocks.0.attn1.to_out.0.bias" in s,
    }


def identify(keys, shapes, layout):
    where = "(Lightricks)" if layout == ORIGINAL else "(diffusers LTXVideoTransformer3DModel)"
    return "ltx_video", f"LTX-Video 0.9 video transformer {where}"


FAMILY = Family(
    family_id="ltx_video",
    label="LTX-Video 0.9",
    layouts={
        ORIGINAL: Signature(ORIGINAL_NAMES, required=(at(r"(patchify_proj|adaln_single|attn[12]_.[qk]_norm)"),),
                            forbidden=(LTX2, MMDIT)),
        DIFFUSERS: Signature(DIFFUSERS_NAMES, required=(at(r"((proj_in|time_embed)_.|attn1_.norm_[qk])"),),
                             forbidden=(LTX2, MMDIT)),
    },
    identify=identify,
    diffusers_class="LTXVideoTransformer3DModel",
    pairs=pairs,
    diffusers_config=diffusers_config,
    kohya_layout=ORIGINAL,
    lora_namings=("LTX-Video-Trainer/ComfyUI", "musubi/kohya", "diffusers/PEFT", "OneTrainer", "SimpleTuner LyCORIS"),
    high_precision={
        ORIGINAL: (r"^(patchify_proj|adaln_single|caption_projection|proj_out)\.", r"scale_shift_table$"),
        DIFFUSERS: (r"^(proj_in|time_embed|caption_projection|proj_out)\.", r"scale_shift_table$"),
    },
    gguf=GGUFStorage("ltxv", f32=(r"scale_shift_table",)),  # ComfyUI-GGUF: ComfyUI reads the tables as F32
    blocks=(r"^transformer_blocks\.(\d+)\.",),
)
