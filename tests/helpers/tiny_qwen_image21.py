"""A tiny diffusers QwenImage21Transformer2DModel (tests/test_families_qwen_image2.py, tests/test_merge_blocks.py):
one head, SwiGLU ratio 3, two blocks by default."""

from __future__ import annotations


def tiny_qwen_image21(head: int = 128, layers: int = 2):
    """Heads of 128 by default: the size whose rope axes the config is derived for."""
    from diffusers import QwenImage21Transformer2DModel

    return QwenImage21Transformer2DModel(
        patch_size=1, in_channels=8, out_channels=8, num_layers=layers, attention_head_dim=head,
        num_attention_heads=1, context_in_dim=16, mlp_ratio=3,
        axes_dims_rope=(16, 56, 56) if head == 128 else (2, 3, 3))
