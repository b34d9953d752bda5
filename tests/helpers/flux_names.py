"""Flux.1 (BFL layout) tensor names with small shapes and random bf16 values, for the GGUF writer tests
(linear2's input, 80, is not a multiple of 32)."""

from __future__ import annotations

import torch


def rnd(*shape, dtype=torch.bfloat16, seed=[0]):
    seed[0] += 1
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed[0])) * 0.5).to(dtype)


def tiny_flux(dtype=torch.bfloat16):
    """Flux (BFL layout) names with small shapes; linear2's input (80) is not a multiple of 32."""
    return {"img_in.weight": rnd(64, 48, dtype=dtype), "img_in.bias": rnd(64, dtype=dtype),
            "time_in.in_layer.weight": rnd(64, 256, dtype=dtype),
            "double_blocks.0.img_attn.qkv.weight": rnd(192, 64, dtype=dtype),
            "double_blocks.0.img_attn.qkv.bias": rnd(192, dtype=dtype),
            "double_blocks.0.img_attn.norm.query_norm.scale": rnd(16, dtype=dtype),
            "double_blocks.0.img_attn.proj.weight": rnd(64, 64, dtype=dtype),
            "double_blocks.0.img_mod.lin.weight": rnd(384, 64, dtype=dtype),
            "single_blocks.0.linear2.weight": rnd(64, 80, dtype=dtype),
            "single_blocks.0.modulation.lin.weight": rnd(32, 32, dtype=dtype),  # 1024 values: F32, then quantized
            "final_layer.linear.weight": rnd(64, 64, dtype=dtype)}
