"""A tiny diffusers Kandinsky6Transformer3DModel (tests/test_families_kandinsky6.py, tests/test_merge_blocks.py):
two visual blocks, one video and one audio text block, heads of 128 (video) and 64 (audio): the Pro and Lite
sizes whose rope axes the config is derived for."""

from __future__ import annotations


def tiny_kandinsky6(token_types: int = 2, cross_gates: bool = True):
    from diffusers import Kandinsky6Transformer3DModel

    return Kandinsky6Transformer3DModel(
        in_visual_dim=4, out_visual_dim=4, in_text_dim=12, in_text_dim2=8, time_dim=32, patch_size=(1, 2, 2),
        model_dim=128, ff_dim=64, num_text_blocks=1, num_visual_blocks=2, axes_dims=(32, 48, 48), visual_cond=True,
        in_audio_dim=6, out_audio_dim=6, model_dim_a=64, time_dim_a=32, ff_dim_a=32, axes_dims_a=(16, 24, 24),
        audio_freqs_scaling=0.144, scale_factor=(1.0, 2.0, 2.0), text_token_padding=True, ca_rope=True,
        cross_gates=cross_gates, fix_modulation=True, visual_token_type_num_embeddings=token_types)
