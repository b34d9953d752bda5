"""OpenCLIP text towers (SD2's ViT-H, SDXL's bigG `conditioner.embedders.1.model`) under the Hugging Face
CLIPTextModel names every trainer uses (`text_model.encoder.layers.N.self_attn.q_proj`).

OpenCLIP fuses q, k, v into `attn.in_proj_weight` (rows [0,W), [W,2W), [2W,3W), W = width) and stores
`text_projection` as [width, proj], the transpose of HF's `text_projection.weight`.
"""

from __future__ import annotations

from ckpt.merge.keymaps import Alias, Shapes, block_indices, thirds
from ckpt.merge.targets import Target

LAYER = (
    ("attn.out_proj.weight", "self_attn.out_proj"),
    ("ln_1.weight", "layer_norm1"),
    ("ln_2.weight", "layer_norm2"),
    ("mlp.c_fc.weight", "mlp.fc1"),
    ("mlp.c_proj.weight", "mlp.fc2"),
)
TOP = (
    ("token_embedding.weight", "text_model.embeddings.token_embedding"),
    ("positional_embedding", "text_model.embeddings.position_embedding"),
    ("ln_final.weight", "text_model.final_layer_norm"),
)


def is_openclip(base: Shapes) -> bool:
    return any(k.startswith("transformer.resblocks.") for k in base)


def width(base: Shapes) -> int | None:
    ln = base.get("ln_final.weight")
    return ln[0] if ln else None


def aliases(base: Shapes) -> list[Alias] | None:
    if not is_openclip(base):
        return None
    out: list[Alias] = []
    for i in block_indices(base, "transformer.resblocks"):
        src, dst = f"transformer.resblocks.{i}", f"text_model.encoder.layers.{i}"
        fused = base.get(f"{src}.attn.in_proj_weight")
        if fused:
            for rows, name in zip(thirds(0, fused[0] // 3), ("q_proj", "k_proj", "v_proj")):
                out.append(Alias(f"{dst}.self_attn.{name}", (Target(f"{src}.attn.in_proj_weight", rows),)))
        for key, name in LAYER:
            if f"{src}.{key}" in base:
                out.append(Alias(f"{dst}.{name}", (Target(f"{src}.{key}"),)))
    for key, name in TOP:
        if key in base:
            out.append(Alias(name, (Target(key),)))
    if "text_projection" in base:
        out.append(Alias("text_projection", (Target("text_projection", transform="transpose"),)))
    return out
