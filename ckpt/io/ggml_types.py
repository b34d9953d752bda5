"""GGML's tensor types as gguf-py numbers them: which are plain arrays of one dtype, their names, and the bytes a
block-quantized tensor takes. Apart from the GGUF reader (`ckpt.io.gguf`) because every writer (the
safetensors/GGUF region planner in `ckpt.io.writer`, the GGUF writer, the decoders) needs these sizes without
reading a GGUF."""

from __future__ import annotations

import math

from ckpt.lazy import torch

from ckpt.dtypes import ST_TO_TORCH


def gguf_package():
    """The `gguf` package (gguf-py), imported on first use: it is only needed when a GGUF is read or written."""
    import gguf

    return gguf


def plain_names() -> dict[int, str]:
    """GGML types that are plain arrays of one dtype, by its safetensors name (reading headers needs no torch)."""
    T = gguf_package().GGMLQuantizationType
    return {T.F32: "F32", T.F16: "F16", T.BF16: "BF16", T.F64: "F64", T.I8: "I8", T.I16: "I16", T.I32: "I32",
            T.I64: "I64"}


def plain_types() -> dict[int, torch.dtype]:
    """GGML types that are plain arrays of one torch dtype."""
    return {k: ST_TO_TORCH[v] for k, v in plain_names().items()}


def type_name(ggml_type: int) -> str:
    T = gguf_package().GGMLQuantizationType
    try:
        return T(ggml_type).name
    except ValueError:
        return f"type {ggml_type}"


def block_size(ggml_type: int) -> tuple[int, int]:
    """(elements per block, bytes per block); plain types are blocks of one element."""
    return gguf_package().GGML_QUANT_SIZES[ggml_type]


def encoded_nbytes(ggml_type: int, shape) -> int:
    blk, size = block_size(ggml_type)
    return math.prod(shape) // blk * size
