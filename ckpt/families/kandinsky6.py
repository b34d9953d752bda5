"""Kandinsky 6 (Pro, Lite; T2VA and I2VA; the PiFlow-distilled releases): the joint video+audio DiT. The
original layout is the Kandinsky team's native one, which ComfyUI's model class holds and saves
(`visual_blocks.N.videoT.self_attention.to_query`); diffusers Kandinsky6Transformer3DModel renames modules
only: no tensor is fused, split or transformed.

The renames (ComfyUI `comfy/ldm/kandinsky6/detection.py` applies them to load a diffusers file):
`visual_blocks.N.` <-> `visual_transformer_blocks.N.`, within them `videoT`/`audioT` <-> `video_dec_block`/
`audio_dec_block`; `audio_outLayer.` <-> `audio_out_layer.`; the time embeddings' `in_layer`/`out_layer` <->
`timestep_embedder.linear_1/linear_2`; the feed-forwards' `in_layer`/`out_layer` <-> `net.0.proj`/`net.2`;
the text blocks' `self_attention` <-> `attn`. Everything else keeps its name (`va_cross_attention`,
`av_cross_attention`, the `*_modulation.out_layer`s, the embeddings). Diffusers has no single-file
converter for it; the table covers the model class exactly, both ways, and is ComfyUI's rename.

Recognition: `videoT`/`audioT` and `audio_outLayer` (original), `video_dec_block`/`audio_dec_block` and
`audio_out_layer` (diffusers), and the text blocks per stream (`video_text_transformer_blocks`). Kandinsky 5
(`visual_transformer_blocks.N.self_attention`, `text_transformer_blocks`) and the Kandinsky 6 video
super-resolution DiT (Kandinsky6SRTransformer3DModel) have none of these: they are not this family.

What the weights cannot tell: the rope axes and scalings, `ca_rope`, `fix_modulation`, `text_token_padding`
(no weight holds them; every release sets them, see CONVENTIONS); `cross_gates` is read from the cross-modal
modulation's rows. The distilled releases' output heads hold n_grid grids (`out_layer.out_layer` rows =
n_grid x patch volume x 16): diffusers' `out_visual_dim`/`out_audio_dim` carry them.

LoRAs: ComfyUI (`diffusion_model.` or no prefix, native names; `lora_unet_` flattened), diffusers/PEFT
(`transformer.` + diffusers names; the pipeline has no LoRA loader of its own, PEFT's `load_lora_adapter`
reads them). Nothing is fused, so every LoRA module maps to one base tensor in either direction.
"""

from __future__ import annotations

import math

from ckpt.families.spec import (DIFFUSERS, ORIGINAL, ConventionError, Family, Pair, Shapes, Signature,
                                block_indices, blocks_count, present, renames, start)

STREAMS = ("video", "audio")
ATTN = ("to_query", "to_key", "to_value", "out_layer")
ATTN_NORMS = ("query_norm", "key_norm")
FF = (("feed_forward.in_layer", "feed_forward.net.0.proj"), ("feed_forward.out_layer", "feed_forward.net.2"))
HALVES = (("videoT", "video_dec_block"), ("audioT", "audio_dec_block"))
CROSS = ("va_cross_attention", "av_cross_attention")

_END = r"($|[._])"
ORIGINAL_NAMES = start(r"(visual_blocks_.\d+_.(videoT|audioT|va_cross_attention|av_cross_attention|va_modulation"
                       r"|av_modulation)_.|(video|audio)_text_transformer_blocks_.\d+_.(self_attention|feed_forward_."
                       r"(in|out)_layer)|audio_outLayer_.|(video|audio)_time_embeddings_.(in|out)_layer" + _END + ")")
DIFFUSERS_NAMES = start(r"(visual_transformer_blocks_.\d+_.(video_dec_block|audio_dec_block|va_cross_attention"
                        r"|av_cross_attention|va_modulation|av_modulation)_.|(video|audio)_text_transformer_blocks_."
                        r"\d+_.(attn|feed_forward_.net)_.|audio_out_layer_.|(video|audio)_time_embeddings_."
                        r"timestep_embedder_.)")


def identify(keys, shapes, layout):
    where = "(original/ComfyUI)" if layout == ORIGINAL else "(diffusers Kandinsky6Transformer3DModel)"
    return "kandinsky6", f"Kandinsky 6 video+audio transformer {where}"


def _attention(o: str, d: str) -> list[Pair]:
    return (renames([(f"{o}.{m}", f"{d}.{m}") for m in ATTN], ends=("weight", "bias"))
            + renames([(f"{o}.{m}", f"{d}.{m}") for m in ATTN_NORMS], ends=("weight",)))


def pairs_for(text_blocks: dict[str, list[int]], visual_blocks: list[int]) -> list[Pair]:
    out = renames([(m, m) for m in ("visual_embeddings.in_layer", "out_layer.modulation.out_layer",
                                    "out_layer.out_layer", "audio_embeddings.in_layer", "audio_embeddings.norm")])
    out.append(Pair("visual_token_type_embeddings.weight", "visual_token_type_embeddings.weight"))
    out += renames([("audio_outLayer.modulation.out_layer", "audio_out_layer.modulation.out_layer"),
                    ("audio_outLayer.out_layer", "audio_out_layer.out_layer")])
    for s in STREAMS:
        out += renames([(f"{s}_time_embeddings.in_layer", f"{s}_time_embeddings.timestep_embedder.linear_1"),
                        (f"{s}_time_embeddings.out_layer", f"{s}_time_embeddings.timestep_embedder.linear_2")])
        out += renames([(f"{s}_{m}", f"{s}_{m}") for m in ("text_embeddings.in_layer", "text_embeddings.norm",
                                                           "pooled_text_embeddings.in_layer",
                                                           "pooled_text_embeddings.norm")])
        for i in text_blocks[s]:
            b = f"{s}_text_transformer_blocks.{i}."
            out += renames([(f"{b}text_modulation.out_layer", f"{b}text_modulation.out_layer")])
            out += _attention(f"{b}self_attention", f"{b}attn")
            out += renames([(f"{b}{o}", f"{b}{d}") for o, d in FF], ends=("weight",))
    for i in visual_blocks:
        bo, bd = f"visual_blocks.{i}.", f"visual_transformer_blocks.{i}."
        for o, d in HALVES:
            po, pd = f"{bo}{o}.", f"{bd}{d}."
            out += renames([(f"{po}visual_modulation.out_layer", f"{pd}visual_modulation.out_layer")])
            out += _attention(f"{po}self_attention", f"{pd}self_attention")
            out += _attention(f"{po}cross_attention", f"{pd}cross_attention")
            out += renames([(f"{po}{o2}", f"{pd}{d2}") for o2, d2 in FF], ends=("weight",))
        for c in CROSS:
            out += _attention(f"{bo}{c}", f"{bd}{c}")
        out += renames([(f"{bo}{m}.out_layer", f"{bd}{m}.out_layer") for m in ("va_modulation", "av_modulation")])
    return out


def pairs(shapes: Shapes, layout: str) -> list[Pair]:
    visual = "visual_blocks" if layout == ORIGINAL else "visual_transformer_blocks"
    text = {s: block_indices(shapes, f"{s}_text_transformer_blocks") for s in STREAMS}
    return present(pairs_for(text, block_indices(shapes, visual)), shapes, layout)


# What the weights do not say: the release contract (ComfyUI `comfy/ldm/kandinsky6/core_contract.py`
# DIT_CONFIG for Pro, `detection.py` _LITE_DIT_CONFIG for Lite; diffusers' docstring for the flags): the rope
# axes of a head size (they add up to it: Pro's heads of 128 (32, 48, 48), Lite's of 64 (16, 24, 24), the
# audio stream's alike), the video rope scaling, the audio rope frequency scaling, and three flags.
CONVENTIONS = {"axes_dims": {128: [32, 48, 48], 64: [16, 24, 24]}, "patch_size": [1, 2, 2],
               "scale_factor": [1.0, 2.0, 2.0], "audio_freqs_scaling": 0.144, "text_token_padding": True,
               "ca_rope": True, "fix_modulation": True}


def diffusers_config(s: Shapes) -> dict:
    """Kandinsky6Transformer3DModel's config.json from the shapes. The video input holds the noisy latent,
    the condition latent and a mask ((2C + 1) channels a patch, `visual_cond`); a distilled release's output
    heads hold n_grid grids, which diffusers' `out_visual_dim`/`out_audio_dim` count."""
    b = "visual_transformer_blocks.0."
    head = s[f"{b}video_dec_block.self_attention.query_norm.weight"][0]
    head_a = s[f"{b}audio_dec_block.self_attention.query_norm.weight"][0]
    axes, axes_a = CONVENTIONS["axes_dims"].get(head), CONVENTIONS["axes_dims"].get(head_a)
    if axes is None or axes_a is None:
        raise ConventionError(f"Kandinsky 6's rope axes are known for attention head sizes of 128 and 64, not "
                              f"{head} (video) and {head_a} (audio)")
    volume = math.prod(CONVENTIONS["patch_size"])
    width, cols = s["visual_embeddings.in_layer.weight"]
    out_rows = s["out_layer.out_layer.weight"][0]
    if cols % volume or (cols // volume - 1) % 2 or out_rows % volume:
        raise ConventionError(f"the video input ({cols} columns) and output ({out_rows} rows) are not (2C + 1) and "
                              f"C' channels of patches of {volume}")
    model_a = s["audio_embeddings.in_layer.weight"][0]
    cross = s[f"{b}va_modulation.out_layer.weight"][0]
    types = s.get("visual_token_type_embeddings.weight")
    return {
        "_class_name": "Kandinsky6Transformer3DModel",
        "in_visual_dim": (cols // volume - 1) // 2,
        "out_visual_dim": out_rows // volume,
        "in_text_dim": s["video_text_embeddings.in_layer.weight"][1],
        "in_text_dim2": s["video_pooled_text_embeddings.in_layer.weight"][1],
        "time_dim": s["video_time_embeddings.timestep_embedder.linear_2.weight"][0],
        "patch_size": CONVENTIONS["patch_size"],
        "model_dim": width,
        "ff_dim": s[f"{b}video_dec_block.feed_forward.net.0.proj.weight"][0],
        "num_text_blocks": blocks_count(s, "video_text_transformer_blocks"),
        "num_visual_blocks": blocks_count(s, "visual_transformer_blocks"),
        "axes_dims": axes,
        "visual_cond": True,
        "in_audio_dim": s["audio_embeddings.in_layer.weight"][1],
        "out_audio_dim": s["audio_out_layer.out_layer.weight"][0],
        "model_dim_a": model_a,
        "time_dim_a": s["audio_time_embeddings.timestep_embedder.linear_2.weight"][0],
        "ff_dim_a": s[f"{b}audio_dec_block.feed_forward.net.0.proj.weight"][0],
        "axes_dims_a": axes_a,
        "audio_freqs_scaling": CONVENTIONS["audio_freqs_scaling"],
        "scale_factor": CONVENTIONS["scale_factor"],
        "text_token_padding": CONVENTIONS["text_token_padding"],
        "ca_rope": CONVENTIONS["ca_rope"],
        "cross_gates": cross == 2 * width + model_a,
        "fix_modulation": CONVENTIONS["fix_modulation"],
        "visual_token_type_num_embeddings": types[0] if types else 0,
    }


# Kept in high precision: what diffusers keeps in fp32 under `from_pretrained(torch_dtype=...)`
# (`_keep_in_fp32_modules`: the time embeddings and every AdaLN `modulation` projection) and ComfyUI's K6
# evaluates in fp32 (`_time_embeddings_fp32`, `_modulation_fp32`), with the input and output layers every
# family keeps (ComfyUI-GGUF's rule for the video families: Wan's embeddings, head and modulation).
# ComfyUI-GGUF names no Kandinsky architecture, so no `gguf`: `--to gguf-*` refuses it.
_IO = (r"(visual_embeddings|visual_token_type_embeddings|audio_embeddings"
       r"|(video|audio)_(time|text|pooled_text)_embeddings)")
HIGH_PRECISION = {
    ORIGINAL: (rf"^({_IO}|out_layer|audio_outLayer)\.", r"modulation\.out_layer\.weight$"),
    DIFFUSERS: (rf"^({_IO}|out_layer|audio_out_layer)\.", r"modulation\.out_layer\.weight$"),
}

FAMILY = Family(
    family_id="kandinsky6",
    label="Kandinsky 6",
    layouts={ORIGINAL: Signature(ORIGINAL_NAMES), DIFFUSERS: Signature(DIFFUSERS_NAMES)},
    identify=identify,
    diffusers_class="Kandinsky6Transformer3DModel",
    pairs=pairs,
    diffusers_config=diffusers_config,
    kohya_layout=ORIGINAL,  # ComfyUI's `lora_unet_` names are its own (native) module paths
    lora_namings=("ComfyUI (original names)", "kohya (original names)", "diffusers/PEFT"),
    high_precision=HIGH_PRECISION,
    blocks=(r"^visual_blocks\.(\d+)\.",),
)
