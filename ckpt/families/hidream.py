"""HiDream-I1 (Full, Dev, Fast) and HiDream-E1 image transformers: one naming.

HiDream's released single files (and ComfyUI's) already use the diffusers HiDreamImageTransformer2DModel
names (`double_stream_blocks.N.block.attn1.to_q`, the mixture-of-experts feed-forward
`ff_i.shared_experts.w1` / `ff_i.experts.K.w1` / router `ff_i.gate.weight`, `caption_projection.N.linear`),
optionally under ComfyUI's `model.diffusion_model.` prefix: diffusers' own converter
(`convert_hidream_transformer_to_diffusers`) only strips that prefix. So there is one layout, "diffusers",
and nothing to rename between layouts (a lone file is a diffusers state dict). `convert --layout` only
changes the container: ComfyUI's single file <-> diffusers' model folder, whose config.json
`diffusers_config` derives from the shapes and the releases' CONVENTIONS.

LoRAs: diffusers/PEFT (`transformer.`), ComfyUI/ai-toolkit (`diffusion_model.`), kohya-style
`lora_unet_double_stream_blocks_0_block_attn1_to_q`, OneTrainer and LyCORIS all spell the same names.
"""

from __future__ import annotations

import re

from ckpt.families.spec import (DIFFUSERS, ORIGINAL, ConventionError, Family, GGUFStorage, Shapes, Signature,
                                blocks_count, start)

NAMES = start(r"(double|single)_stream_blocks_.\d+_.block_.")
EXPERT = re.compile(r"ff_i[._]experts[._](\d+)[._]")


def identify(keys, shapes, layout):
    n = len({m.group(1) for k in keys if (m := EXPERT.search(k))})
    return "hidream", "HiDream-I1/E1 transformer (diffusers names" + (f", {n} routed experts)" if n else ")")


# What the weights do not say (transformer/config.json of the HiDream-I1 Full/Dev/Fast releases): the q/k
# norms span all heads, so the head size is the releases' 128; the patch size, rope axes, top-k of the
# router and the largest latent are theirs too. Block i reads Llama 3.1 8B's hidden state min(i, 31): the
# releases' `llama_layers` (0..31, then 31 for the remaining 16 of their 48 blocks).
CONVENTIONS = {"attention_head_dim": 128, "patch_size": 2, "axes_dims_rope": [64, 32, 32], "num_activated_experts": 2,
               "max_resolution": [128, 128], "llama_last_layer": 31}


def diffusers_config(s: Shapes) -> dict:
    """HiDreamImageTransformer2DModel's config.json from the shapes and CONVENTIONS."""
    width, head = s["x_embedder.proj.weight"][0], CONVENTIONS["attention_head_dim"]
    if width % head:
        raise ConventionError(f"HiDream's attention head size is {head} in every release, but the width {width} is "
                              "no multiple of it")
    area = CONVENTIONS["patch_size"] ** 2
    in_cols, out_rows = s["x_embedder.proj.weight"][1], s["final_layer.linear.weight"][0]
    if in_cols % area or out_rows % area:
        raise ConventionError(f"the patch embedding ({in_cols} columns) and final layer ({out_rows} rows) do not fit "
                              f"the releases' patch size {CONVENTIONS['patch_size']}")
    double, single = blocks_count(s, "double_stream_blocks"), blocks_count(s, "single_stream_blocks")
    routed = next((shape[0] for k, shape in s.items() if k.endswith(".ff_i.gate.weight")), 0)  # router: a row each
    last = CONVENTIONS["llama_last_layer"]
    return {
        "_class_name": "HiDreamImageTransformer2DModel",
        "patch_size": CONVENTIONS["patch_size"],
        "in_channels": in_cols // area,
        "out_channels": out_rows // area,
        "num_layers": double,
        "num_single_layers": single,
        "attention_head_dim": head,
        "num_attention_heads": width // head,
        # one caption projection per block (Llama's states), then one more for the T5 tokens
        "caption_channels": [s[f"caption_projection.{double + single}.linear.weight"][1],
                             s["caption_projection.0.linear.weight"][1]],
        "text_emb_dim": s["p_embedder.pooled_embedder.linear_1.weight"][1],
        "num_routed_experts": routed,
        # top-k of the router: the releases' 2, or every expert where there are fewer
        "num_activated_experts": min(CONVENTIONS["num_activated_experts"], routed) if routed else
        CONVENTIONS["num_activated_experts"],
        "axes_dims_rope": CONVENTIONS["axes_dims_rope"],
        "max_resolution": CONVENTIONS["max_resolution"],
        "llama_layers": [min(i, last) for i in range(double + single)],
    }


HIGH_PRECISION = (r"\.ff_i\.gate\.weight$", r"^(x_embedder|t_embedder|p_embedder|caption_projection|final_layer)\.")

FAMILY = Family(
    family_id="hidream",
    label="HiDream",
    layouts={DIFFUSERS: Signature(NAMES)},
    identify=identify,
    diffusers_class="HiDreamImageTransformer2DModel",
    diffusers_config=diffusers_config,
    kohya_layout=DIFFUSERS,
    lora_namings=("diffusers/PEFT", "ComfyUI/ai-toolkit", "kohya-style", "OneTrainer", "SimpleTuner LyCORIS"),
    # ComfyUI-GGUF keeps the experts' router (`ff_i.gate.weight`, a bare parameter) in F32; the patch,
    # timestep, pooled-text and caption embedders and the final layer are the input/output layers. The
    # original files use the same names, so `convert --layout original --to <quant>` keeps the same layers.
    high_precision={DIFFUSERS: HIGH_PRECISION, ORIGINAL: HIGH_PRECISION},
    gguf=GGUFStorage("hidream", f32=(r"\.ff_i\.gate\.weight$", r"img_emb\.emb_pos")),
    blocks=(r"^double_stream_blocks\.(\d+)\.", r"^single_stream_blocks\.(\d+)\."),
)
