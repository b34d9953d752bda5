"""MiniMax-H3 (joint video + audio DiT): the reference layout (MiniMaxAI's `MiniMaxH3DiTModel` names, as in
Comfy-Org/MiniMax-H3 single files, the GGUFs made from them and ComfyUI's `comfy/ldm/minimax/model.py`)
<-> diffusers MiniMaxH3Transformer3DModel.

Renames: `blocks.N` -> `transformer_blocks.N`, `token_refiner.blocks.N` -> `token_refiner.refiner_blocks.N`,
`attn.out_proj` -> `attn.to_out.0`, `attn.q_norm/k_norm` -> `attn.norm_q/norm_k`, `mlp.fc2` -> `ff.net.2`,
`video_patch_proj`/`audio_patch_proj`/`condition_proj` -> `proj_in`/`audio_proj_in`/`context_embedder`,
`time_embedder.proj_in/proj_out` -> `time_embedder.linear_1/linear_2`, `final_layer.norm/adaln_proj.linear/
video_out/audio_out` -> `norm_out.norm/norm_out.linear/proj_out/audio_proj_out`. Not renames only:
- the fused `attn.qkv_proj` of every block and refiner block is diffusers' `to_q`/`to_k`/`to_v`, equal thirds;
- the gated `mlp.fc1` is `[gate; value]`, diffusers' SwiGLU `ff.net.0.proj` reads `[value; gate]`: halves swapped;
- `rope.inv_freq` (a buffer of the reference model) has no diffusers tensor: diffusers computes it from its
  config. `--layout diffusers` drops it with a note; `--layout original` from a diffusers folder writes it
  back, computed from config.json's `rope_freq_dim`/`rope_theta` as the reference computes it, float32 as the
  published files store it (`Family.computed`): ComfyUI's model reads it from the file.
Reference: diffusers `convert_minimax_h3_transformer_checkpoint_to_diffusers` (no reverse converter).

What the weights cannot tell: the row order of `qkv_proj`. Published single files (Comfy-Org/MiniMax-H3 and
the GGUFs derived from it) store the reference model's `[q; k; v]` stack; MiniMaxAI's own shards interleave
the rows per head (`[head0: q k v, head1: ...]`), with the same keys and shapes. This table is the stacked
order (diffusers' converter default `qkv_layout="stacked"`): a file merged by hand from the MiniMaxAI shards
would convert with q, k and v mixed, and is not supported. Pruned checkpoints (ComfyUI's `*_pruned_*`: a
tabulated `adaln_t_table` instead of `time_embedder`) are recognised and merge like any other, but have no
diffusers model: `--layout diffusers` refuses them, saying the file is pruned (diffusers' converter refuses them
too).

LoRAs: musubi-tuner (`lora_unet_blocks_0_attn_qkv_proj`, kohya flattened original names), ai-toolkit
(`diffusion_model.` + original names), the reference/ComfyUI naming (bare original names), diffusers/PEFT
(`transformer.transformer_blocks.0.attn.to_q`); the Turbo/distill LoRAs (lightx2v, larryvrh) are alpha-less
kohya/PEFT files (alpha = rank). A `qkv_proj` LoRA lands on thirds of the diffusers pieces, an `mlp.fc1` LoRA
with its up rows' halves swapped. DiffSynth-Studio LoRAs (bare names, `.lora_A.default.weight`: the `.default.`
infix is what tells them, as diffusers' loader tells them) are trained on the per-head interleaved `qkv_proj` of
MiniMaxAI's shards: `lora_rows` has the loader de-interleave their `qkv_proj` up rows per 128-wide head (every
release's head; diffusers assumes it too), so they merge as stacked LoRAs do; up rows that are no whole number
of such heads are refused.
"""

from __future__ import annotations

import math
import re

from ckpt.families.spec import (DIFFUSERS, ORIGINAL, Computed, ConventionError, Family, Pair, Shapes, Signature,
                                block_indices, blocks_count, has, present, renames, start, thirds)

REFINER_O, REFINER_D = "token_refiner.blocks", "token_refiner.refiner_blocks"
TOP = (("video_patch_proj", "proj_in"), ("audio_patch_proj", "audio_proj_in"), ("condition_proj", "context_embedder"),
       ("time_embedder.proj_in", "time_embedder.linear_1"), ("time_embedder.proj_out", "time_embedder.linear_2"),
       ("final_layer.adaln_proj.linear", "norm_out.linear"), ("final_layer.video_out", "proj_out"),
       ("final_layer.audio_out", "audio_proj_out"))
TOP_NORMS = (("final_layer.norm", "norm_out.norm"), ("token_refiner.final_norm", "token_refiner.final_norm"))
BLOCK = (("attn.out_proj", "attn.to_out.0"), ("mlp.fc2", "ff.net.2"))
BLOCK_NORMS = (("norm1", "norm1"), ("norm2", "norm2"), ("attn.q_norm", "attn.norm_q"), ("attn.k_norm", "attn.norm_k"))
ADALN = (("adaln_proj.linear", "adaln_proj.linear"),)  # main blocks only; the refiner has no modulation

ORIGINAL_NAMES = start(r"((token_refiner_.)?blocks_.\d+_.|(video|audio)_patch_proj|condition_proj|time_embedder_.proj_"
                       r"|final_layer_.(norm|adaln_proj|video_out|audio_out)|adaln_t_table|rope_.inv_freq)")
# what no other family's original names hold: the fused `qkv_proj`/`out_proj` of `blocks.N`, the modulation
# `adaln_proj`, the two patch projections and output heads (timm-style `blocks.N.attn.qkv` is not it)
ORIGINAL_ONLY = start(r"((token_refiner_.)?blocks_.\d+_.(attn_.(qkv_proj|out_proj)|adaln_proj_.linear)"
                      r"|(video|audio)_patch_proj|final_layer_.(video|audio)_out)")
DIFFUSERS_NAMES = start(r"(transformer_blocks_.\d+_.|token_refiner_.(refiner_blocks|final_norm)"
                        r"|(audio_)?proj_(in|out)_.|context_embedder_.|time_embedder_.linear_|norm_out_.)")
# LTX-2 (diffusers) has `audio_proj_in` and `transformer_blocks.N` too: the per-block `adaln_proj` and the
# refiner blocks are MiniMax-H3's own
DIFFUSERS_ONLY = start(r"(transformer_blocks_.\d+_.adaln_proj_.linear|token_refiner_.refiner_blocks_.)")


def identify(keys, shapes, layout):
    if layout == DIFFUSERS:
        return "minimax_h3", "MiniMax-H3 transformer (diffusers MiniMaxH3Transformer3DModel)"
    pruned = ", pruned: adaln_t_table" if has(keys, r"^adaln_t_table$") else ""
    return "minimax_h3", f"MiniMax-H3 transformer (original{pruned})"


def _block(o: str, d: str, h: int, adaln: bool) -> list[Pair]:
    out = []
    if h:
        out += [Pair(f"{o}.attn.qkv_proj.weight", f"{d}.attn.{n}.weight", rows)
                for rows, n in zip(thirds(0, h), ("to_q", "to_k", "to_v"))]
    out.append(Pair(f"{o}.mlp.fc1.weight", f"{d}.ff.net.0.proj.weight", transform="swap_halves"))
    out += renames(BLOCK, o + ".", d + ".", ends=("weight",))
    out += renames(BLOCK_NORMS, o + ".", d + ".", ends=("weight",))
    if adaln:
        out += renames(ADALN, o + ".", d + ".")
    return out


def pairs_for(blocks: dict[int, int], refiners: dict[int, int]) -> list[Pair]:
    """Original <-> diffusers tensors for {block index: q/k/v width} of the main and refiner blocks."""
    out = renames(TOP) + renames(TOP_NORMS, ends=("weight",))
    out.append(Pair("rope.inv_freq", None))
    for i, h in blocks.items():
        out += _block(f"blocks.{i}", f"transformer_blocks.{i}", h, True)
    for i, h in refiners.items():
        out += _block(f"{REFINER_O}.{i}", f"{REFINER_D}.{i}", h, False)
    return out


def _widths(shapes: Shapes, head: str, layout: str) -> dict[int, int]:
    out = {}
    for i in block_indices(shapes, head):
        if layout == ORIGINAL:
            qkv = shapes.get(f"{head}.{i}.attn.qkv_proj.weight")
            out[i] = qkv[0] // 3 if qkv else 0
        else:
            q = shapes.get(f"{head}.{i}.attn.to_q.weight")
            out[i] = q[0] if q else 0
    return out


def pairs(shapes: Shapes, layout: str) -> list[Pair]:
    heads = ("blocks", REFINER_O) if layout == ORIGINAL else ("transformer_blocks", REFINER_D)
    return present(pairs_for(*(_widths(shapes, h, layout) for h in heads)), shapes, layout)


# What the weights do not say (MiniMaxAI/MiniMax-H3 transformer/config.json, diffusers' defaults): the
# (t, h, w) patch, the rope frequencies per axis (the reference's `rope.inv_freq` has 16; diffusers computes
# it) and theta, the norm epsilons.
CONVENTIONS = {"patch_size": [1, 2, 2], "rope_freq_dim": 16, "rope_theta": 10000.0, "norm_eps": 1e-05,
               "qk_norm_eps": 1e-05, "final_norm_eps": 1e-05}


def diffusers_config(s: Shapes) -> dict:
    """MiniMaxH3Transformer3DModel's config.json: widths from the projections, the head size from the per-head
    q norm, the video latent channels from `proj_in` at the releases' (1, 2, 2) patch."""
    head = s["transformer_blocks.0.attn.norm_q.weight"][0]
    rope = CONVENTIONS["rope_freq_dim"]
    if 6 * rope > head:
        raise ConventionError(f"MiniMax-H3's rope rotates {6 * rope} channels of a head; this head has {head}")
    patch = CONVENTIONS["patch_size"]
    area = patch[0] * patch[1] * patch[2]
    hidden, cols = s["proj_in.weight"]
    if cols % area:
        raise ConventionError(f"proj_in's {cols} columns are no multiple of the patch volume {area}")
    return {
        "_class_name": "MiniMaxH3Transformer3DModel",
        "num_attention_heads": s["transformer_blocks.0.attn.to_q.weight"][0] // head,
        "attention_head_dim": head,
        "hidden_size": hidden,
        "num_layers": blocks_count(s, "transformer_blocks"),
        "num_refiner_layers": blocks_count(s, REFINER_D),
        "ffn_dim": s["transformer_blocks.0.ff.net.2.weight"][1],
        "in_channels": cols // area,
        "audio_in_channels": s["audio_proj_in.weight"][1],
        "patch_size": patch,
        "text_dim": s["context_embedder.weight"][1],
        "freq_dim": s["time_embedder.linear_1.weight"][1],
        "time_embed_hidden_dim": s["time_embedder.linear_1.weight"][0],
        "time_embed_dim": s["time_embedder.linear_2.weight"][0],
        "rope_freq_dim": rope,
        "rope_theta": CONVENTIONS["rope_theta"],
        "norm_eps": CONVENTIONS["norm_eps"],
        "qk_norm_eps": CONVENTIONS["qk_norm_eps"],
        "final_norm_eps": CONVENTIONS["final_norm_eps"],
    }


def rope_inv_freq(config: dict):
    """The reference's `rope.inv_freq` (diffusers' `MiniMaxH3RotaryPosEmbed` computes the same): `rope_freq_dim`
    frequencies theta ** (-2i / (2 * rope_freq_dim)), float32; the model class's defaults where config.json
    has no value. ValueError: values no model has (checked before anything is allocated)."""
    from ckpt.lazy import torch

    n = config.get("rope_freq_dim", CONVENTIONS["rope_freq_dim"])
    theta = config.get("rope_theta", CONVENTIONS["rope_theta"])
    head = config.get("attention_head_dim")
    if type(n) is not int or n < 1 or 6 * n > (head if type(head) is int else 6 * 4096):
        raise ValueError(f"rope_freq_dim {str(n)[:20]} is no positive count of frequencies that fits the "
                         f"attention_head_dim {str(head)[:20]}")
    if type(theta) not in (int, float) or not (math.isfinite(theta) and theta > 0):
        raise ValueError(f"rope_theta {str(theta)[:20]} is no positive number")
    return 1.0 / (theta ** (torch.arange(0, 2 * n, 2, dtype=torch.float32) / (2 * n)))


# DiffSynth-Studio LoRAs: peft's `.default.` infix over the original names (diffusers' loader tells them by it)
# and the per-head interleaved qkv of MiniMaxAI's shards, `[head0: q k v, head1: q k v, ...]`
DIFFSYNTH_KEYS = (".lora_A.default.weight", ".lora_B.default.weight")
QKV_MODULE = re.compile(r"^(diffusion_model\.|lora_unet_)?(token_refiner[._])?blocks[._]\d+[._]attn[._]qkv_proj$")
HEAD = 128  # every released MiniMax-H3's head width, by which diffusers de-interleaves too


def lora_rows(keys: list[str], rows: dict[str, int]) -> dict[str, list[tuple[int, int]]]:
    """A DiffSynth-Studio LoRA's `qkv_proj` up rows, per-head interleaved, as the stacked `[q; k; v]` of this
    table: for q, k, v in turn, that piece of every head."""
    if not any(k.endswith(DIFFSYNTH_KEYS) for k in keys):
        return {}
    out = {}
    for name, n in rows.items():
        if not QKV_MODULE.match(name):
            continue
        if n % (3 * HEAD) or not n:
            raise ValueError(f"module {name!r} has {n} up rows, no whole number of {HEAD}-wide heads of q, k and v: "
                             "not the per-head interleaved qkv_proj of a DiffSynth-Studio MiniMax-H3 LoRA "
                             "(its `.default.` keys), which cannot be reordered")
        heads = n // (3 * HEAD)
        out[name] = [(3 * HEAD * h + HEAD * j, 3 * HEAD * h + HEAD * (j + 1)) for j in range(3) for h in range(heads)]
    return out


FAMILY = Family(
    family_id="minimax_h3",
    label="MiniMax-H3",
    layouts={
        ORIGINAL: Signature(ORIGINAL_NAMES, required=(ORIGINAL_ONLY,)),
        DIFFUSERS: Signature(DIFFUSERS_NAMES, required=(DIFFUSERS_ONLY,)),
    },
    identify=identify,
    diffusers_class="MiniMaxH3Transformer3DModel",
    pairs=pairs,
    diffusers_config=diffusers_config,
    kohya_layout=ORIGINAL,
    lora_namings=("musubi-tuner/kohya (original names)", "ai-toolkit (diffusion_model.)", "ComfyUI/reference (bare)",
                  "diffusers/PEFT", "Turbo/distill LoRAs (lightx2v, larryvrh: alpha-less)"),
    # ComfyUI's model (comfy/ldm/minimax/model.py) holds the patch projections, the timestep MLP and the two
    # output heads in fp32, "the checkpoint's fp32 island" (diffusers' `_keep_in_fp32_modules` lists the same);
    # with them, as for the other video families, the text input projection, the final layer's modulation and
    # a pruned file's timestep table. ComfyUI-GGUF names no MiniMax-H3 architecture: no `gguf`.
    high_precision={
        ORIGINAL: (r"^(video_patch_proj|audio_patch_proj|condition_proj|time_embedder|final_layer)\.",
                   r"^adaln_t_table$"),
        DIFFUSERS: (r"^(proj_in|audio_proj_in|context_embedder|time_embedder|norm_out|proj_out|audio_proj_out)\.",),
    },
    blocks=(r"^blocks\.(\d+)\.",),
    computed=(Computed("rope.inv_freq", rope_inv_freq, "rope_freq_dim, rope_theta"),),
    lora_rows=lora_rows,
    unconvertible=((r"^adaln_t_table$", "a pruned MiniMax-H3 checkpoint (a tabulated adaln_t_table instead of "
                    "time_embedder), no diffusers MiniMaxH3Transformer3DModel can hold"),),
)
