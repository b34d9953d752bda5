"""A tiny diffusers Krea2Transformer2DModel (tests/test_families_krea2.py, tests/test_merge_blocks.py): GQA
(2 heads, 1 kv head) of 16, two blocks, a text fusion of two layer-wise and one refiner block."""

from __future__ import annotations


def tiny_krea2():
    from diffusers import Krea2Transformer2DModel

    return Krea2Transformer2DModel(
        in_channels=16, num_layers=2, attention_head_dim=16, num_attention_heads=2, num_key_value_heads=1,
        intermediate_size=48, timestep_embed_dim=16, text_hidden_dim=24, num_text_layers=3,
        text_num_attention_heads=2, text_num_key_value_heads=2, text_intermediate_size=40,
        num_layerwise_text_blocks=2, num_refiner_text_blocks=1, axes_dims_rope=(4, 6, 6))
