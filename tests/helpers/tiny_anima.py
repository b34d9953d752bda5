"""Tiny diffusers models of Anima's two parts (tests/test_families_anima.py, tests/test_merge_blocks.py): a
CosmosTransformer3DModel of two blocks (the DiT) and an AnimaTextConditioner of two layers (the LLM adapter whose
`llm_adapter.` tensors tell an Anima file from a Cosmos-Predict2 one), each from its own seed."""

from __future__ import annotations

import torch

TEXT = 24  # the adapter's output width = the DiT's cross-attention width


def tiny_cosmos():
    from diffusers import CosmosTransformer3DModel

    torch.manual_seed(0)
    return CosmosTransformer3DModel(
        in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=16, num_layers=2, mlp_ratio=2.0,
        text_embed_dim=TEXT, adaln_lora_dim=8, max_size=(128, 240, 240), patch_size=(1, 2, 2),
        rope_scale=(1.0, 4.0, 4.0), concat_padding_mask=True, extra_pos_embed_type=None)


def tiny_conditioner():
    from diffusers import AnimaTextConditioner

    torch.manual_seed(1)
    return AnimaTextConditioner(source_dim=20, target_dim=TEXT, model_dim=16, num_layers=2, num_attention_heads=2,
                                target_vocab_size=50)
