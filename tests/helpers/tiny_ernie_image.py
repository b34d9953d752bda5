"""A tiny diffusers ErnieImageTransformer2DModel (tests/test_families_ernie_image.py, tests/test_merge_blocks.py):
two layers, patch 2, a text projection."""

from __future__ import annotations


def tiny_ernie_image(head: int = 16, hidden: int = 32):
    """Head 128 (the releases' rope axes 32+48+48) for --layout."""
    from diffusers import ErnieImageTransformer2DModel

    return ErnieImageTransformer2DModel(
        hidden_size=hidden, num_attention_heads=hidden // head, num_layers=2, ffn_hidden_size=48, in_channels=4,
        out_channels=4, patch_size=2, text_in_dim=12, rope_axes_dim=(32, 48, 48) if head == 128 else (4, 6, 6))
