"""LTX-2 (19B audio-video, dev and distilled; LTX-2.3 names too): Lightricks' layout (`patchify_proj`,
`adaln_single`, `av_ca_*_adaln_single`, `attn1.q_norm`, as in the release's `model.diffusion_model.`,
ComfyUI and LTX-2 trainer LoRAs) <-> diffusers LTX2VideoTransformer3DModel.

Renames only: `patchify_proj`/`audio_patchify_proj` are `proj_in`/`audio_proj_in`, `adaln_single`/
`audio_adaln_single` are `time_embed`/`audio_time_embed`, the four audio-video cross-attention modulations
`av_ca_{video_scale_shift,a2v_gate,audio_scale_shift,v2a_gate}_adaln_single` are
`av_cross_attn_{video_scale_shift,video_a2v_gate,audio_scale_shift,audio_v2a_gate}`, the blocks'
`scale_shift_table_a2v_ca_{video,audio}` are `{video,audio}_a2v_cross_attn_scale_shift_table`, and every
attention's `q_norm/k_norm` is `norm_q/norm_k`; all else (`attn1`, `audio_attn2`, `audio_to_video_attn`,
`ff`, `audio_ff`, ...) keeps its name. The text connectors (`video_embeddings_connector`,
`audio_embeddings_connector`) live in the original transformer but are a separate diffusers model
(LTX2TextConnectors): they have no counterpart here, and `convert --layout diffusers` drops them with a note.
Reference: diffusers `convert_ltx2_transformer_to_diffusers`; LTX-2.3's `prompt_adaln_single` /
`audio_prompt_adaln_single` (`prompt_adaln` / `audio_prompt_adaln`) are from diffusers' LTX-2 LoRA
converter (its single-file converter does not know them yet).

LoRAs: the LTX-2 trainer and ComfyUI (`diffusion_model.` + Lightricks names), kohya/musubi
(`lora_unet_`), diffusers/PEFT (`transformer.`), OneTrainer and SimpleTuner; most module names are the same
in both layouts.
"""

from __future__ import annotations

from ckpt.families.ltx_video import MMDIT
from ckpt.families.spec import (DIFFUSERS, ORIGINAL, ConventionError, Family, Pair, Shapes, Signature, at,
                                block_indices, blocks_count, has, present, renames, start)

ADALN = ("emb.timestep_embedder.linear_1", "emb.timestep_embedder.linear_2", "linear")
MODULATIONS = (
    ("adaln_single", "time_embed"),
    ("audio_adaln_single", "audio_time_embed"),
    ("av_ca_video_scale_shift_adaln_single", "av_cross_attn_video_scale_shift"),
    ("av_ca_a2v_gate_adaln_single", "av_cross_attn_video_a2v_gate"),
    ("av_ca_audio_scale_shift_adaln_single", "av_cross_attn_audio_scale_shift"),
    ("av_ca_v2a_gate_adaln_single", "av_cross_attn_audio_v2a_gate"),
    ("prompt_adaln_single", "prompt_adaln"),  # LTX-2.3
    ("audio_prompt_adaln_single", "audio_prompt_adaln"),
)
TOP = tuple((f"{o}.{p}", f"{d}.{p}") for o, d in MODULATIONS for p in ADALN) + (
    ("patchify_proj", "proj_in"),
    ("audio_patchify_proj", "audio_proj_in"),
    ("caption_projection.linear_1", "caption_projection.linear_1"),
    ("caption_projection.linear_2", "caption_projection.linear_2"),
    ("audio_caption_projection.linear_1", "audio_caption_projection.linear_1"),
    ("audio_caption_projection.linear_2", "audio_caption_projection.linear_2"),
    ("proj_out", "proj_out"),
    ("audio_proj_out", "audio_proj_out"),
)
TOP_TABLES = ("scale_shift_table", "audio_scale_shift_table", "keyframes_abs_pos_embedding")
ATTENTIONS = ("attn1", "attn2", "audio_attn1", "audio_attn2", "audio_to_video_attn", "video_to_audio_attn")
BLOCK = tuple((f"{a}.{p}", f"{a}.{p}") for a in ATTENTIONS
              for p in ("to_q", "to_k", "to_v", "to_out.0", "to_gate_logits")) + tuple(
    (f"{f}.{p}", f"{f}.{p}") for f in ("ff", "audio_ff") for p in ("net.0.proj", "net.2"))
NORMS = tuple((f"{a}.{o}", f"{a}.{d}") for a in ATTENTIONS for o, d in (("q_norm", "norm_q"), ("k_norm", "norm_k")))
BLOCK_TABLES = (
    ("scale_shift_table", "scale_shift_table"),
    ("audio_scale_shift_table", "audio_scale_shift_table"),
    ("scale_shift_table_a2v_ca_video", "video_a2v_cross_attn_scale_shift_table"),
    ("scale_shift_table_a2v_ca_audio", "audio_a2v_cross_attn_scale_shift_table"),
    ("prompt_scale_shift_table", "prompt_scale_shift_table"),  # LTX-2.3
    ("audio_prompt_scale_shift_table", "audio_prompt_scale_shift_table"),
)
CONNECTORS = r"^(video|audio)_embeddings_connector\."

ORIGINAL_NAMES = start(r"(transformer_blocks_.\d+_.|(audio_)?patchify_proj|(audio_)?adaln_single|av_ca_"
                       r"|(audio_)?caption_projection|(video|audio)_embeddings_connector)")
DIFFUSERS_NAMES = start(r"(transformer_blocks_.\d+_.|(audio_)?proj_in|(audio_)?time_embed|av_cross_attn"
                        r"|(audio_)?caption_projection)")
AUDIO_VIDEO = at(r"(audio_(attn[12]|ff|to_video_attn|patchify_proj|proj_in|adaln_single|time_embed|scale_shift_table)"
                 r"|video_to_audio_attn|av_ca_|av_cross_attn)")

DIFFUSERS_ONLY = at(r"(proj_in|time_embed|norm_[qk]|av_cross_attn|a2v_cross_attn|prompt_adaln_.(emb|linear))")


def pairs_for(blocks: list[int]) -> list[Pair]:
    out = renames(TOP) + [Pair(t, t) for t in TOP_TABLES]
    for i in blocks:
        b = f"transformer_blocks.{i}."
        out += renames(BLOCK, b, b) + renames(NORMS, b, b, ends=("weight",))
        out += [Pair(b + o, b + d) for o, d in BLOCK_TABLES]
    return out


def pairs(shapes: Shapes, layout: str) -> list[Pair]:
    out = present(pairs_for(block_indices(shapes, "transformer_blocks")), shapes, layout)
    if layout == ORIGINAL:  # the text connectors: a separate diffusers model
        out += [Pair(k, None) for k in has(shapes, CONNECTORS)]
    return out


# What the weights do not say (diffusers' LTX2VideoTransformer3DModel config of the LTX-2 release).
CONVENTIONS = {
    "attention_head_dim": 128, "audio_attention_head_dim": 64, "patch_size": 1, "patch_size_t": 1,
    "audio_patch_size": 1, "audio_patch_size_t": 1, "vae_scale_factors": [8, 32, 32], "pos_embed_max_pos": 20,
    "base_height": 2048, "base_width": 2048, "audio_scale_factor": 4, "audio_pos_embed_max_pos": 20,
    "audio_sampling_rate": 16000, "audio_hop_length": 160, "activation_fn": "gelu-approximate",
    "qk_norm": "rms_norm_across_heads", "norm_elementwise_affine": False, "norm_eps": 1e-6, "rope_theta": 10000.0,
    "rope_double_precision": True, "causal_offset": 1, "timestep_scale_multiplier": 1000,
    "cross_attn_timestep_scale_multiplier": 1000, "rope_type": "interleaved",
}


def diffusers_config(s: Shapes) -> dict:
    c = CONVENTIONS
    width, audio = s["proj_in.weight"][0], s["audio_proj_in.weight"][0]
    head, audio_head = c["attention_head_dim"], c["audio_attention_head_dim"]
    if width % head or audio % audio_head:
        raise ConventionError(f"LTX-2's attention heads are {head} (video) and {audio_head} (audio) wide, but the "
                              f"widths {width} and {audio} are not multiples of them")
    b = "transformer_blocks.0."
    if any(k.startswith(b + "prompt_scale_shift_table") or ".to_gate_logits." in k for k in s):
        raise ConventionError("an LTX-2.3 transformer (gated attention, prompt modulation): its config is not "
                              "one the conventions of LTX-2 give")
    cfg = {
        "_class_name": "LTX2VideoTransformer3DModel",
        "in_channels": s["proj_in.weight"][1],
        "out_channels": s["proj_out.weight"][0],
        "num_attention_heads": width // head,
        "attention_head_dim": head,
        "cross_attention_dim": s[b + "attn2.to_k.weight"][1],
        "audio_in_channels": s["audio_proj_in.weight"][1],
        "audio_out_channels": s["audio_proj_out.weight"][0],
        "audio_num_attention_heads": audio // audio_head,
        "audio_attention_head_dim": audio_head,
        "audio_cross_attention_dim": s[b + "audio_attn2.to_k.weight"][1],
        "num_layers": blocks_count(s, "transformer_blocks"),
        "caption_channels": s["caption_projection.linear_1.weight"][1],
        "attention_bias": b + "attn1.to_q.bias" in s,
        "attention_out_bias": b + "attn1.to_out.0.bias" in s,
        "ff_bias": b + "ff.net.0.proj.bias" in s,
        "audio_ff_bias": b + "audio_ff.net.0.proj.bias" in s,
        "use_keyframes_abs_pos_embedding": "keyframes_abs_pos_embedding" in s,
    }
    cfg.update({k: v for k, v in c.items() if k not in ("attention_head_dim", "audio_attention_head_dim")})
    return cfg


def identify(keys, shapes, layout):
    where = "(Lightricks)" if layout == ORIGINAL else "(diffusers LTX2VideoTransformer3DModel)"
    return "ltx2", f"LTX-2 audio-video transformer {where}"


FAMILY = Family(
    family_id="ltx2",
    label="LTX-2",
    layouts={
        # most module names are the same in both layouts: those count as the original's
        ORIGINAL: Signature(ORIGINAL_NAMES, required=(AUDIO_VIDEO,), forbidden=(DIFFUSERS_ONLY, MMDIT)),
        DIFFUSERS: Signature(DIFFUSERS_NAMES, required=(AUDIO_VIDEO, DIFFUSERS_ONLY), forbidden=(MMDIT,)),
    },
    identify=identify,
    diffusers_class="LTX2VideoTransformer3DModel",
    pairs=pairs,
    diffusers_config=diffusers_config,
    kohya_layout=ORIGINAL,
    lora_namings=("LTX-2 trainer/ComfyUI", "musubi/kohya", "diffusers/PEFT", "OneTrainer", "SimpleTuner LyCORIS"),
    high_precision={
        ORIGINAL: (r"^((audio_)?patchify_proj|\w*adaln_single|(audio_)?caption_projection|(audio_)?proj_out)\.",
                   r"scale_shift_table\w*$", r"embeddings_connector"),
        DIFFUSERS: (r"^((audio_)?proj_in|(audio_)?time_embed|av_cross_attn\w*|(audio_)?prompt_adaln"
                    r"|(audio_)?caption_projection|(audio_)?proj_out)\.", r"scale_shift_table$"),
    },
    blocks=(r"^transformer_blocks\.(\d+)\.",),
)
