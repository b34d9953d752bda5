"""A tiny diffusers Ideogram4Transformer2DModel (tests/test_families_ideogram4.py, tests/test_merge_blocks.py):
one head of 256 (the head size whose MRoPE split the release fixes, so its config.json can be derived), two
blocks."""

from __future__ import annotations


def tiny_ideogram4():
    from diffusers import Ideogram4Transformer2DModel

    return Ideogram4Transformer2DModel(in_channels=8, num_layers=2, attention_head_dim=256, num_attention_heads=1,
                                       intermediate_size=64, adaln_dim=16, llm_features_dim=32)
