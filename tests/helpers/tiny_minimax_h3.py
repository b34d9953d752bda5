"""A tiny diffusers MiniMaxH3Transformer3DModel (tests/test_families_minimax_h3.py, tests/test_merge_blocks.py):
two blocks, one token-refiner block, video and audio inputs."""

from __future__ import annotations


def tiny_minimax_h3(head: int = 16):
    """Head 128 (rope over 96 of its channels, as released) for --layout."""
    from diffusers import MiniMaxH3Transformer3DModel

    big = head == 128
    return MiniMaxH3Transformer3DModel(
        num_attention_heads=1 if big else 2, attention_head_dim=head, hidden_size=128 if big else 32, num_layers=2,
        num_refiner_layers=1, ffn_dim=48, in_channels=4, audio_in_channels=6, text_dim=12, freq_dim=8,
        time_embed_hidden_dim=24, time_embed_dim=20, rope_freq_dim=16 if big else 2)
