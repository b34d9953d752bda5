"""ERNIE-Image (Baidu): one naming.

Baidu's release, ComfyUI's model (`comfy/ldm/ernie/model.py`, `ErnieImageModel`) and its single files use the
diffusers ErnieImageTransformer2DModel names (`layers.N.self_attention.to_q`, `adaLN_sa_ln`, `adaLN_mlp_ln`,
`mlp.gate_proj/up_proj/linear_fc2`, `x_embedder.proj`, `text_proj`, `time_embedding.linear_1`, one shared
`adaLN_modulation.1`, `final_norm.linear`, `final_linear`), optionally under ComfyUI's `model.diffusion_model.`
prefix: diffusers' `convert_ernie_image_transformer_checkpoint_to_diffusers` only strips that prefix. So there
is one layout, "diffusers", as for Qwen-Image: `convert --layout` moves the weights between the single file
and the diffusers model folder without renaming a tensor, `diffusers_config` writes the config.json from
the shapes.

Recognition: `layers.N.` is also a language model's (`mlp.gate_proj/up_proj` are Llama's names) and
Z-Image/Lumina 2's (`layers.N.attention.`); ERNIE-Image's `self_attention.to_q` and `adaLN_*_ln` are its own.

LoRAs: diffusers/PEFT (`transformer.` / `base_model.model.`), ai-toolkit/ComfyUI (`diffusion_model.` + the same
names: diffusers' ErnieImageLoraLoaderMixin only swaps the prefix), kohya-flattened `lora_unet_layers_0_...`.
"""

from __future__ import annotations

from ckpt.families.spec import DIFFUSERS, ORIGINAL, ConventionError, Family, Shapes, Signature, blocks_count, start

NAMES = start(r"layers_.\d+_.(self_attention_.(to_q|to_k|to_v|to_out_.0|norm_q|norm_k)|adaLN_(sa|mlp)_ln"
              r"|mlp_.(gate_proj|up_proj|linear_fc2))")
# at least one name no Llama-style model has: a language model's `layers.N.mlp.gate_proj` alone is not it
OWN = start(r"(layers_.\d+_.(self_attention_.(to_|norm_)|adaLN_(sa|mlp)_ln|mlp_.linear_fc2)|final_linear"
            r"|adaLN_modulation)")

# What the weights do not say (ErnieImageTransformer2DModel's config of the release and diffusers' defaults):
# the rope axes (they add up to the head size) and theta, the norm epsilon.
CONVENTIONS = {"rope_axes_dim": {128: [32, 48, 48]}, "rope_theta": 256, "eps": 1e-06}


def diffusers_config(s: Shapes) -> dict:
    """ErnieImageTransformer2DModel's config.json: width, channels and patch from the patch embedder (a conv
    whose kernel is the patch), the head size from the per-head q norm, the text width from `text_proj`
    (absent: the text already has the model's width)."""
    norm = s.get("layers.0.self_attention.norm_q.weight")
    if norm is None:
        raise ConventionError("ERNIE-Image without q/k norms has no head size in its weights")
    head = norm[0]
    axes = CONVENTIONS["rope_axes_dim"].get(head)
    if axes is None:
        raise ConventionError(f"ERNIE-Image's rope axes are known for an attention head size of 128, not {head}")
    hidden, channels, patch = s["x_embedder.proj.weight"][:3]
    out_rows = s["final_linear.weight"][0]
    if out_rows % (patch * patch):
        raise ConventionError(f"final_linear's {out_rows} rows are no multiple of the patch area {patch * patch}")
    text = s.get("text_proj.weight")
    return {
        "_class_name": "ErnieImageTransformer2DModel",
        "hidden_size": hidden,
        "num_attention_heads": hidden // head,
        "num_layers": blocks_count(s, "layers"),
        "ffn_hidden_size": s["layers.0.mlp.gate_proj.weight"][0],
        "in_channels": channels,
        "out_channels": out_rows // (patch * patch),
        "patch_size": patch,
        "text_in_dim": text[1] if text else hidden,
        "rope_theta": CONVENTIONS["rope_theta"],
        "rope_axes_dim": axes,
        "eps": CONVENTIONS["eps"],
        "qk_layernorm": True,
    }


# The same rule as Qwen-Image's (the closest one-naming family; ComfyUI-GGUF names no ERNIE-Image architecture,
# so no `gguf`): the input and output layers, the timestep embedder and the one modulation shared by every
# block stay in high precision. The single files use the same names, so both layouts keep the same layers.
HIGH_PRECISION = (r"^(x_embedder|text_proj|time_embedding|adaLN_modulation|final_norm|final_linear)\.",)

FAMILY = Family(
    family_id="ernie_image",
    label="ERNIE-Image",
    layouts={DIFFUSERS: Signature(NAMES, required=(OWN,))},
    identify=lambda keys, shapes, layout: ("ernie_image", "ERNIE-Image transformer (diffusers names)"),
    diffusers_class="ErnieImageTransformer2DModel",
    diffusers_config=diffusers_config,
    kohya_layout=DIFFUSERS,
    lora_namings=("diffusers/PEFT", "ai-toolkit/ComfyUI (diffusion_model.)", "kohya (diffusers names)"),
    high_precision={DIFFUSERS: HIGH_PRECISION, ORIGINAL: HIGH_PRECISION},
    blocks=(r"^layers\.(\d+)\.",),
)
