"""Qwen-Image 2.1 (the single-stream, block-causal successor of Qwen-Image): ComfyUI's layout (the
"original": `transformer_blocks.N.img_mlp.gate_up`, as ComfyUI's model class holds and saves it) <->
diffusers QwenImage21Transformer2DModel.

Every name but one is the same in both layouts (`transformer_blocks.N.attn.to_q/to_k/to_v/to_out.0`,
`attn.norm_q/norm_k`, `img_mlp.out`, the one shared `modulation.1` of all blocks, `txt_in.text_norm/
in_layer/out_layer`, `time_text_embed.timestep_embedder.linear_1/2`, `img_in`, `norm_out.linear`,
`proj_out`; no biases anywhere). The difference is the SwiGLU feed-forward: ComfyUI runs the gate and up
projections as one GEMM, `img_mlp.gate_up` = [gate; up], gate rows first, where diffusers keeps
`img_mlp.gate_layer` (the gate) and `img_mlp.proj` (the up projection) apart. Reference: diffusers
`convert_qwen_image21_transformer_checkpoint_to_diffusers` (it halves `gate_up`; the reverse is the table
read backwards), ComfyUI `comfy/ldm/qwen_image21/model.py` (`SwiGLUFeedForward`, fused when its detection
finds `gate_up`, the form a ComfyUI-saved file has) and `comfy/lora.py` (a LoRA on `gate_layer` lands on
rows [0, h) of `gate_up`, one on `proj` on rows [h, 2h)). The Qwen releases ship the diffusers layout.

Recognition: the 2.1-only modules (`img_mlp.gate_up/gate_layer/proj/out` directly under a block,
`txt_in.text_norm/in_layer/out_layer`); a file with `gate_up` is the original layout, one without it the
diffusers layout (the shared names alone, e.g. a LoRA on attention and `txt_in` only, read as diffusers:
the same tensors either way). Qwen-Image (1) has `img_mlp.net.0.proj`, `img_mod`, `add_q_proj` and a
plain `txt_in` Linear: nothing of it is read as 2.1, nor 2.1 as it (ckpt/families/qwen_image.py).

LoRAs: diffusers/PEFT (`transformer.` + diffusers names), ComfyUI (`diffusion_model.` + its names, the fused
`gate_up` included, or `gate_layer`/`proj` on its halves), kohya `lora_unet_` flattened either way,
SimpleTuner LyCORIS (`lycoris_`), DiffSynth (no prefix). A LoRA on `gate_layer`/`proj` merges into the
rows of `gate_up` and a `gate_up` LoRA into both diffusers halves.
"""

from __future__ import annotations

from ckpt.families.spec import (DIFFUSERS, ORIGINAL, ConventionError, Family, Pair, Shapes, Signature,
                                block_indices, blocks_count, present, renames, start)

TOP = ("time_text_embed.timestep_embedder.linear_1", "time_text_embed.timestep_embedder.linear_2",
       "txt_in.in_layer", "txt_in.out_layer", "img_in", "modulation.1", "norm_out.linear", "proj_out")
TOP_NORMS = ("txt_in.text_norm",)
BLOCK = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "img_mlp.out")
BLOCK_NORMS = ("attn.norm_q", "attn.norm_k")
FUSED, GATE, UP = "img_mlp.gate_up", "img_mlp.gate_layer", "img_mlp.proj"

_BLOCK = r"transformer_blocks_.\d+_."
_END = r"($|[._])"
_MLP = start(_BLOCK + r"img_mlp_.(gate_up|gate_layer|proj|out)" + _END)
# The 2.1-only modules: its feed-forward directly under a block, its text projection.
EVIDENCE = rf"({_MLP}|{start(r'txt_in_.(text_norm|in_layer|out_layer)' + _END)})"
NAMES = rf"({start(_BLOCK + r'attn_.(to_[qkv]|to_out|norm_[qk])' + _END)}|{EVIDENCE}|{start(r'modulation_.1' + _END)})"
# Qwen-Image (1) and the other MMDiT classes that name blocks `transformer_blocks`: none is 2.1.
OTHERS = start(_BLOCK + r"(attn_.(add_[qkv]_proj|to_add_out)|(img|txt)_mod_.|txt_mlp_.|img_mlp_.net_.|ff_.|norm1)")
HAS_FUSED = start(_BLOCK + r"img_mlp_.gate_up" + _END)


def identify(keys, shapes, layout):
    where = "(ComfyUI, fused gate_up)" if layout == ORIGINAL else "(diffusers QwenImage21Transformer2DModel)"
    return "qwen_image21", f"Qwen-Image 2.1 transformer {where}"


def pairs_for(widths: dict[int, int]) -> list[Pair]:
    """Original <-> diffusers tensors for blocks {index: SwiGLU hidden width (0: no feed-forward weights)}."""
    out = renames([(m, m) for m in TOP], ends=("weight",))
    out += renames([(m, m) for m in TOP_NORMS], ends=("weight",))
    for i, h in widths.items():
        b = f"transformer_blocks.{i}."
        out += renames([(m, m) for m in BLOCK + BLOCK_NORMS], b, b, ends=("weight",))
        if h:
            out += [Pair(f"{b}{FUSED}.weight", f"{b}{GATE}.weight", (0, h)),
                    Pair(f"{b}{FUSED}.weight", f"{b}{UP}.weight", (h, 2 * h))]
    return out


def widths(shapes: Shapes, layout: str) -> dict[int, int]:
    out = {}
    for i in block_indices(shapes, "transformer_blocks"):
        b = f"transformer_blocks.{i}."
        if layout == ORIGINAL:
            fused = shapes.get(f"{b}{FUSED}.weight")
            out[i] = fused[0] // 2 if fused else 0
        else:
            half = shapes.get(f"{b}{UP}.weight") or shapes.get(f"{b}{GATE}.weight")
            out[i] = half[0] if half else 0
    return out


def pairs(shapes: Shapes, layout: str) -> list[Pair]:
    return present(pairs_for(widths(shapes, layout)), shapes, layout)


# What the weights do not say (QwenImage21Transformer2DModel's defaults, the 2.1 release's config): 2.1
# consumes latents unpatched (patch 1), its rope axes for heads of 128, the norm eps, and `causal_condition`
# (text and condition tokens modulated from t = 0), which no weight holds.
CONVENTIONS = {"patch_size": 1, "axes_dims_rope": {128: [16, 56, 56]}, "eps": 1e-6, "causal_condition": True}


def diffusers_config(s: Shapes) -> dict:
    """QwenImage21Transformer2DModel's config.json from the shapes: the head size is the per-head q norm's
    width, the channels come from `img_in`/`proj_out` at the release's patch size 1, the MLP ratio from the
    up projection's rows."""
    head = s["transformer_blocks.0.attn.norm_q.weight"][0]
    rope = CONVENTIONS["axes_dims_rope"].get(head)
    if rope is None:
        raise ConventionError(f"Qwen-Image 2.1's rope axes are known for an attention head size of 128, not {head}")
    inner = s["img_in.weight"][0]
    hidden = s["transformer_blocks.0.img_mlp.proj.weight"][0]
    if inner % head or hidden % inner:
        raise ConventionError(f"the width {inner} and MLP width {hidden} are not whole heads of {head} and a whole "
                              "MLP ratio")
    return {
        "_class_name": "QwenImage21Transformer2DModel",
        "patch_size": CONVENTIONS["patch_size"],
        "in_channels": s["img_in.weight"][1],
        "out_channels": s["proj_out.weight"][0],
        "num_layers": blocks_count(s, "transformer_blocks"),
        "attention_head_dim": head,
        "num_attention_heads": inner // head,
        "context_in_dim": s["txt_in.text_norm.weight"][0],
        "mlp_ratio": hidden // inner,
        "axes_dims_rope": rope,
        "eps": CONVENTIONS["eps"],
        "causal_condition": CONVENTIONS["causal_condition"],
    }


# Qwen-Image's rule (ComfyUI-GGUF's for `qwen_image`: the input and output layers and the timestep embedder
# stay unquantized), with 2.1's text projection under `txt_in` and its one shared `modulation` projection,
# which feeds every block as Wan's `time_projection` does (kept by ComfyUI-GGUF's Wan rule). Same names in
# both layouts. ComfyUI-GGUF names no 2.1 architecture, so no `gguf`: `--to gguf-*` refuses it.
HIGH_PRECISION = (r"^(img_in|txt_in|time_text_embed|modulation|norm_out|proj_out)\.",)

FAMILY = Family(
    family_id="qwen_image21",
    label="Qwen-Image 2.1",
    layouts={
        ORIGINAL: Signature(NAMES, required=(HAS_FUSED,), forbidden=(OTHERS,)),
        DIFFUSERS: Signature(NAMES, required=(EVIDENCE,), forbidden=(OTHERS, HAS_FUSED)),
    },
    identify=identify,
    diffusers_class="QwenImage21Transformer2DModel",
    pairs=pairs,
    diffusers_config=diffusers_config,
    # as Qwen-Image's trainers and diffusers' Qwen LoRA converter: `lora_unet_` + the diffusers names
    kohya_layout=DIFFUSERS,
    lora_namings=("diffusers/PEFT", "ComfyUI (fused gate_up, or its gate_layer/proj halves)",
                  "kohya/musubi-tuner (diffusers names)", "DiffSynth", "SimpleTuner LyCORIS"),
    high_precision={DIFFUSERS: HIGH_PRECISION, ORIGINAL: HIGH_PRECISION},
    blocks=(r"^transformer_blocks\.(\d+)\.",),
)
