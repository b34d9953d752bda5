"""A plain weight stored as compressed-tensors with scales computed from the weight itself: what llm-compressor 0.14's
data-free path (`model_free_ptq`, or `oneshot` with a preset `QuantizationModifier` and no dataset) writes for one
Linear, byte for byte (`convert --to ct-*`, `ckpt.targets.planners.ct_out`). The --keep-format encoders of
`ckpt.quant.int_pack_encode` and `ckpt.quant.fp4_encode` keep or recompute a base's grid; these make the grid,
then code and pack with the same functions, so there is one packer per layout.

Every step runs in the model's dtype D (the weight's natural dtype: bf16 for a bf16 model), as the library's
memoryless min-max observer and `calculate_qparams` / `_quantize` compute on the weight in the model:

- FP8_DYNAMIC (channel): s = D(amax(|row|) / D(448)), a zero scale replaced by D's eps; codes = e4m3(clamp(D(x / s),
  +-448)): the quotient is rounded to D first, then to e4m3 (two roundings, as there). `weight` fp8 [N, K],
  `weight_scale` D [N, 1].
- FP8_BLOCK (128 x 128 blocks, partial blocks at the edges: the library zero-pads, which changes no amax): the same
  per block; `weight_scale` D [ceil(N / 128), ceil(K / 128)]. Bands are whole blocks of rows.
- W4A16 / W8A16 (int, symmetric, group G along the inputs): s = D(amax(|group|) / D(7.5 | 127.5)), zero -> eps;
  codes = clamp(round(D(x / s)), -2^(b-1), 2^(b-1) - 1) (`int_pack_encode.requantize_in`), packed with the offset
  2^(b-1) by `int_pack_encode.pack_rows` (pack-quantized for both widths); `weight_scale` D [N, K / G],
  `weight_shape` int64 [N, K]. A width that G does not divide is refused by the planner, as the library raises.
- NVFP4A16: `fp4_encode.Nvfp4Encoding` (compressed-tensors flavour), its global scale from the amax the planner
  gives: llm-compressor shares one global scale across a layer's q/k/v and gate/up weights.

Row-local scales are computed again for the codes' band and the scales' band (a min/max pass: cheaper than
holding them). NaN/Inf inputs are counted (`nonfinite_quantized`), never silently kept.
"""

from __future__ import annotations

import math

from ckpt.lazy import torch

from ckpt.io.plan import OutTensor
from ckpt.io.tensors import ComputedTensor, Tensor
from ckpt.quant.encoding import Derived, ErrorMeter
from ckpt.quant.int_pack_encode import pack_rows, requantize_in
from ckpt.report import Report

FP8_MAX = 448.0
BLOCK = 128  # FP8_BLOCK's block_structure [128, 128]


def _eps(dtype) -> float:
    return torch.finfo(dtype).eps


def _scales(amax: torch.Tensor, half_range: float, dtype) -> torch.Tensor:
    """`calculate_qparams` for a symmetric scheme: amax / (range / 2), both in D; a zero scale -> D's eps."""
    s = amax / torch.tensor(half_range * 2, dtype=dtype).div(2)
    return torch.where(s == 0, torch.tensor(_eps(dtype), dtype=dtype), s)


def _amax(x: torch.Tensor, dim) -> torch.Tensor:
    """max(|min(x, 0)|, max(x, 0)) in x's dtype, as the observer's min/max then `calculate_qparams` give it."""
    lo, hi = x.amin(dim=dim), x.amax(dim=dim)
    lo, hi = torch.clamp(lo, max=0), torch.clamp(hi, min=0)
    return torch.maximum(lo.abs(), hi.abs())


def _fp8_codes(xd: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    return (xd / s).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def _count(report: Report, name: str, x: torch.Tensor) -> None:
    bad = int((~torch.isfinite(x)).sum()) if x.is_floating_point() else 0
    report.count("nonfinite_quantized", name, bad)


def fp8_channel(t: Tensor, prefix: str, report: Report) -> list[OutTensor]:
    dt, n = t.natural_dtype, t.shape[0]

    def scale(x):
        return _scales(_amax(x.to(dt), 1).unsqueeze(1), FP8_MAX, dt)

    def codes(x, a, b):
        _count(report, t.name, x)
        xd = x.to(dt)
        return _fp8_codes(xd, scale(xd))

    return [_rows(f"{prefix}.weight", t, torch.float8_e4m3fn, tuple(t.shape), codes),
            _rows(f"{prefix}.weight_scale", t, dt, (n, 1), lambda x, a, b: scale(x))]


def fp8_block(t: Tensor, prefix: str, report: Report) -> list[OutTensor]:
    dt = t.natural_dtype
    n, k = t.shape
    nb, kb = -(-n // BLOCK), -(-k // BLOCK)

    def padded(x):
        xd = x.to(dt)
        r, c = xd.shape
        pr, pc = -(-r // BLOCK) * BLOCK - r, kb * BLOCK - c
        return torch.nn.functional.pad(xd, (0, pc, 0, pr)) if pr or pc else xd

    def scale(xp):
        r = xp.shape[0] // BLOCK
        blocks = xp.reshape(r, BLOCK, kb, BLOCK).transpose(1, 2).reshape(r, kb, -1)
        return _scales(_amax(blocks, -1), FP8_MAX, dt)

    def codes(x, a, b):
        _count(report, t.name, x)
        xp = padded(x)
        s = scale(xp).repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)
        return _fp8_codes(xp, s)[: x.shape[0], :k]

    align = BLOCK if t.row_align is None else math.lcm(BLOCK, t.row_align)
    out = _rows(f"{prefix}.weight", t, torch.float8_e4m3fn, (n, k), codes)
    if out.source.row_align is not None:
        out.source.row_align = align  # whole blocks of rows per band
    sc = _rows(f"{prefix}.weight_scale", t, dt, (nb, kb), lambda x, a, b: scale(padded(x)),
               rows_of=lambda a, b: (a * BLOCK, min(n, b * BLOCK)))
    return [out, sc]


def int_group(t: Tensor, prefix: str, bits: int, group: int, report: Report) -> list[OutTensor]:
    dt = t.natural_dtype
    n, k = t.shape
    half = 1 << (bits - 1)

    def scale(xd):
        return _scales(_amax(xd.reshape(xd.shape[0], -1, group), -1), half - 0.5, dt)

    def codes(x, a, b):
        _count(report, t.name, x)
        xd = x.to(dt)
        s = scale(xd).to(torch.float32).repeat_interleave(group, dim=1)
        q, _ = requantize_in(x.to(torch.float32), s, None, -half, half - 1, dt)  # the library's own clamp: no warning
        return pack_rows(q + half, bits)

    shape_name = f"{prefix}.weight_shape"
    shape = ComputedTensor(shape_name, lambda: torch.tensor([n, k], dtype=torch.int64), torch.int64, (2,), home=t.home)
    return [_rows(f"{prefix}.weight_packed", t, torch.int32, (n, -(-k * bits // 32)), codes),
            _rows(f"{prefix}.weight_scale", t, dt, (n, k // group), lambda x, a, b: scale(x.to(dt))),
            OutTensor(shape_name, torch.int64, (2,), shape)]


def nvfp4(t: Tensor, prefix: str, report: Report, amax) -> list[OutTensor]:
    """`fp4_encode.Nvfp4Encoding` on stand-ins of the three keys it writes; `amax`: the shared amax callable."""
    from ckpt.quant.fp4_encode import CT, Nvfp4Encoding

    n, k = t.shape

    def slot(key, dtype, shape):
        return ComputedTensor(f"{prefix}.{key}", None, dtype, shape, home=t.home)

    enc = Nvfp4Encoding(CT, t, slot("weight_packed", torch.uint8, (n, k // 2)),
                        slot("weight_scale", torch.float8_e4m3fn, (n, k // 16)),
                        slot("weight_global_scale", torch.float32, (1,)), amax=amax)
    return enc.encode(t, report, ErrorMeter(t.name, enc.label))


def _rows(key: str, t: Tensor, dtype, shape, fn, rows_of=None) -> OutTensor:
    src = Derived(key, t, dtype, shape, fn, rows_of=rows_of, band_by_value=True)
    return OutTensor(key, dtype, tuple(shape), src)
