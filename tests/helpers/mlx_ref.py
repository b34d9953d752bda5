"""MLX affine quantization restated in torch, for the main suite, which has no mlx (macOS/CPU wheels live in
.venv-serve): `quantize` is `mx.quantize`'s CPU kernel (mlx/backend/cpu/quantized.cpp: float32 group math, codes as
one little-endian bit stream per row), `dequantize` is `mx.dequantize` (two roundings in the scales' dtype).
tests/serve/test_mlx.py checks both against mlx itself bit for bit, over every bit width, group size and dtype, so
the main suite's MLX folders (`build`) and their oracle values stand on mlx's own numbers. Written independently of
ckpt.quant.mlx (a loop over bit positions, not its packer).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch


def _pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """codes [R, n] -> uint32 [R, n * bits / 32]: code j at bit j * bits of the row's stream."""
    R, n = codes.shape
    bit_stream = ((codes.to(torch.int64).unsqueeze(-1) >> torch.arange(bits)) & 1).reshape(R, -1, 32)
    words = (bit_stream << torch.arange(32)).sum(-1)  # int64 words
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32).view(torch.uint32)


def _unpack(words: torch.Tensor, bits: int) -> torch.Tensor:
    R = words.shape[0]
    w = words.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    bit_stream = ((w.unsqueeze(-1) >> torch.arange(32)) & 1).reshape(R, -1, bits)
    return (bit_stream << torch.arange(bits)).sum(-1)


def quantize(w: torch.Tensor, group: int, bits: int):
    n_bins = float((1 << bits) - 1)
    x = w.to(torch.float32).reshape(w.shape[0], -1, group)
    w_max, w_min = x.amax(-1, keepdim=True), x.amin(-1, keepdim=True)
    mask = w_min.abs() > w_max.abs()
    scale = torch.maximum((w_max - w_min) / n_bins, torch.tensor(1e-7))
    scale = torch.where(mask, scale, -scale)
    edge = torch.where(mask, w_min, w_max)
    q0 = torch.round(edge / scale)
    scale = torch.where(q0 != 0, edge / q0, scale)
    bias = torch.where(q0 != 0, edge, torch.zeros_like(edge))
    q = torch.round((x - bias) / scale).clamp(0, n_bins).reshape(w.shape[0], -1)
    return _pack(q, bits), scale.squeeze(-1).to(w.dtype), bias.squeeze(-1).to(w.dtype)


def dequantize(codes, scales, biases, group: int, bits: int) -> torch.Tensor:
    q = _unpack(codes, bits).to(scales.dtype)
    return q * scales.repeat_interleave(group, 1) + biases.repeat_interleave(group, 1)


def build(folder: Path, bits: int = 4, group: int = 32, dtype=torch.bfloat16, overrides: dict | None = None,
          kind: str = "llama", **cfg) -> dict[str, torch.Tensor]:
    """An MLX folder of a tiny `kind` as mlx_lm.convert -q writes it (every 2-D weight whose width is a multiple of
    its group quantized; `overrides`: {module path: {"bits", "group_size"}} per-layer entries, or False to keep a
    layer); returns {weight name: mx.dequantize's values} of the quantized weights."""
    from safetensors.torch import save_file

    from helpers.llm import tiny

    model = tiny(kind, **cfg).to(dtype)
    overrides = overrides or {}
    sd, oracle = {}, {}
    for name, t in model.state_dict().items():
        layer = name[: -len(".weight")]
        own = overrides.get(layer, {})
        g, b = (own or {}).get("group_size", group), (own or {}).get("bits", bits)
        if name.endswith(".weight") and t.dim() == 2 and own is not False and t.shape[1] % g == 0:
            q, s, z = quantize(t, g, b)
            sd[name], sd[f"{layer}.scales"], sd[f"{layer}.biases"] = q, s, z
            oracle[name] = dequantize(q, s, z, g, b)
        else:
            sd[name] = t.contiguous()
    folder.mkdir(parents=True, exist_ok=True)
    save_file(sd, folder / "model.safetensors", metadata={"format": "mlx"})
    config = model.config.to_dict()
    quant = {"group_size": group, "bits": bits, "mode": "affine",
             **{k: (v if v is False else {"group_size": v.get("group_size", group), "bits": v.get("bits", bits),
                                          "mode": "affine"}) for k, v in overrides.items()}}
    config.update(quantization=quant, quantization_config=quant)
    (folder / "config.json").write_text(json.dumps(config, indent=4))
    return oracle
