"""HiDream-I1 (Full, Dev, Fast) and HiDream-E1 image transformers: one naming.

HiDream's released single files (and ComfyUI's) already use the diffusers HiDreamImageTransformer2DModel
names (`double_stream_blocks.N.block.attn1.to_q`, the mixture-of-experts feed-forward
`ff_i.shared_experts.w1` / `ff_i.experts.K.w1` / router `ff_i.gate.weight`, `caption_projection.N.linear`),
optionally under ComfyUI's `model.diffusion_model.` prefix: diffusers' own converter
(`convert_hidream_transformer_to_diffusers`) only strips that prefix. So there is one layout, "diffusers",
and nothing to convert between layouts (a lone file is a diffusers state dict).

LoRAs: diffusers/PEFT (`transformer.`), ComfyUI/ai-toolkit (`diffusion_model.`), kohya-style
`lora_unet_double_stream_blocks_0_block_attn1_to_q`, OneTrainer and LyCORIS all spell the same names.
"""

from __future__ import annotations

import re

from ckpt.families.spec import DIFFUSERS, Family, GGUFStorage, Signature, start

NAMES = start(r"(double|single)_stream_blocks_.\d+_.block_.")
EXPERT = re.compile(r"ff_i[._]experts[._](\d+)[._]")


def identify(keys, shapes, layout):
    n = len({m.group(1) for k in keys if (m := EXPERT.search(k))})
    return "hidream", "HiDream-I1/E1 transformer (diffusers names" + (f", {n} routed experts)" if n else ")")


FAMILY = Family(
    family_id="hidream",
    label="HiDream",
    layouts={DIFFUSERS: Signature(NAMES)},
    identify=identify,
    diffusers_class="HiDreamImageTransformer2DModel",
    kohya_layout=DIFFUSERS,
    lora_namings=("diffusers/PEFT", "ComfyUI/ai-toolkit", "kohya-style", "OneTrainer", "SimpleTuner LyCORIS"),
    # ComfyUI-GGUF keeps the experts' router (`ff_i.gate.weight`, a bare parameter) in F32; the patch,
    # timestep, pooled-text and caption embedders and the final layer are the input/output layers.
    high_precision={
        DIFFUSERS: (r"\.ff_i\.gate\.weight$", r"^(x_embedder|t_embedder|p_embedder|caption_projection|final_layer)\."),
    },
    gguf=GGUFStorage("hidream", f32=(r"\.ff_i\.gate\.weight$", r"img_emb\.emb_pos")),
)
