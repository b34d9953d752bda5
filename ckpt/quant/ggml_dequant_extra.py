"""Decoders of the GGML block types llama.cpp writes that the gguf package cannot decode: Q1_0 (gguf 0.19 knows
the type but has no dequantizer for it) and Q2_0 (it does not know the type; `ckpt.io.ggml_types` adds it). Each
is ggml's `dequantize_row_<type>` (ggml-quants.c of the llama.cpp the llama-cpp-python 0.3.36 sdist vendors, MIT)
in numpy, value for value: the fp16 block scale widened exactly, then one float32 product per value, as the C
computes it (tests/test_gguf_dequant_types.py compares them with the C on its own blocks)."""

from __future__ import annotations

from ckpt.lazy import numpy as np


def _scales(blocks):
    """The blocks' fp16 scales `d` (their first two bytes, little-endian) as float32 [blocks, 1]
    (GGML_FP16_TO_FP32 is exact)."""
    return blocks[:, :2].copy().view(np.float16).astype(np.float32)


def dequantize_q1_0(blocks):
    """block_q1_0 (an fp16 `d`, 128 sign bits, bit j of byte j/8 for value j): +d for a 1, -d for a 0."""
    blocks = blocks.reshape(-1, 18)
    d = _scales(blocks)
    bits = np.unpackbits(blocks[:, 2:], axis=1, bitorder="little").astype(bool)
    return np.where(bits, d, -d)


def dequantize_q2_0(blocks):
    """block_q2_0 (an fp16 `d`, 64 2-bit values, value j in bits 2*(j%4) of byte j/4): (q - 1) * d."""
    blocks = blocks.reshape(-1, 18)
    d = _scales(blocks)
    q = (blocks[:, 2:, None] >> np.array([0, 2, 4, 6], dtype=np.uint8)) & 3
    return (q.reshape(-1, 64).astype(np.float32) - np.float32(1)) * d


# GGML type name -> decoder of uint8 blocks (any shape whose size is whole blocks) to float32 [blocks, block]
DEQUANTIZE = {"Q1_0": dequantize_q1_0, "Q2_0": dequantize_q2_0}
