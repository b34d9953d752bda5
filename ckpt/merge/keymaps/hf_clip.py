"""Hugging Face CLIP text encoders saved without the `text_model.` wrapper.

transformers 5's CLIPTextModel holds its layers directly (`encoder.layers.N.self_attn.q_proj`), while
every LoRA trainer names them through the wrapper of older releases and of CLIPTextModelWithProjection
(`text_model.encoder.layers.N...`, kohya `lora_te1_text_model_encoder_layers_N_...`).
"""

from __future__ import annotations

from ckpt.merge.keymaps import Alias, Shapes, module_of
from ckpt.merge.targets import Target


def is_unwrapped(base: Shapes) -> bool:
    return any(k.startswith("encoder.layers.") for k in base) and any(
        k.startswith("embeddings.token_embedding") for k in base
    )


def aliases(base: Shapes) -> list[Alias] | None:
    if not is_unwrapped(base):
        return None
    return [
        Alias("text_model." + module_of(k), (Target(k),))
        for k in base
        if k.startswith(("encoder.", "embeddings.", "final_layer_norm.")) and not k.endswith(".bias")
    ]
