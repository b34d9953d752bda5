"""GGUF's legacy block types (`Q8_0`, `Q4_0`, `Q4_1`, `Q5_0`, `Q5_1`) as torch ops: byte for byte what the `gguf`
package's numpy quantizers (`gguf.quants.quantize`, `Q8_0.quantize_blocks` ...) write, on every core and on CUDA.

Every step is numpy's float32 step: true divisions (`cfloat.div`; numpy divides, torch's `tensor / scalar`
multiplies by a reciprocal), `np_roundf` (round half away from zero) spelled as gguf spells it, `abs().argmax()`
taking the first maximal element, the fp16 scale rounded to nearest even. numpy's float32 -> int8 / uint8 casts
are x86's: truncation to int32 (NaN, +-Inf and values out of int32 range give 0x80000000) then the low byte; that
is done explicitly here (a torch cast of NaN is undefined and differs on CUDA). A NaN scale is written as numpy on
x86 writes it: Q4_0/Q5_0 keep the block's first NaN (sign, quieted payload: take_along_axis keeps its bits); numpy's
max/min reductions (Q8_0, Q4_1, Q5_1) return its default NaN 0x7FC00000 for a NaN its vector loop sees, and
max - min of two equal infinities x86's 0xFFC00000. Left undefined, numpy's own result depending on its SIMD
build: a NaN that numpy's reduction leaves to its scalar tail (with AVX-512, a block's elements 17..31) and is not
the default NaN (numpy then keeps its sign and payload); Q4_1/Q5_1 blocks whose min (or max) is a zero present
with both signs (which zero numpy's SIMD min/max returns depends on the lanes and the vector width: the sign bit of
that zero fp16 min or scale may differ, the decoded values are the same); numpy builds whose casts differ from
x86's. ckpt's `encode` replaces NaN/Inf before it calls these encoders (as for the K-quants).
"""

from __future__ import annotations

import torch

from ckpt.quant.kquants.cfloat import div
from ckpt.quant.kquants.rows import encode_rows

QK = 32
CHUNK = 1 << 16  # blocks per vectorized step
QNAN = 0x7E00  # fp16 bits of numpy's default NaN 0x7FC00000
INDEFINITE = 0xFE00  # fp16 bits of x86's NaN of an invalid operation (inf - inf), 0xFFC00000


def _np_byte(v: torch.Tensor) -> torch.Tensor:
    """numpy's (x86) float32 -> int8/uint8 cast of integral-valued v, as int32 0..255: int32 truncation (invalid
    -> INT_MIN, whose low byte is 0), then the low byte."""
    ok = (v >= -2147483648.0) & (v < 2147483648.0)  # False for NaN
    return torch.where(ok, v, torch.zeros_like(v)).to(torch.int32) & 0xFF


def _first_nan_bits(b: torch.Tensor) -> torch.Tensor:
    """The float32 bits (int32 [c, 1]) of each block's first NaN (anything where there is none)."""
    ar = torch.arange(b.shape[1], device=b.device)
    idx = torch.where(torch.isnan(b), ar, b.shape[1]).amin(1, keepdim=True).clamp_(max=b.shape[1] - 1)
    return torch.gather(b, 1, idx).view(torch.int32)


def _nan_half(bits: torch.Tensor) -> torch.Tensor:
    """float32 NaN bits (int32) -> the fp16 bits numpy's `astype(np.float16)` gives it: sign, quiet, the payload's
    top 10 bits."""
    return ((bits >> 16) & 0x8000) | 0x7C00 | (((bits | 0x400000) & 0x7FFFFF) >> 13)


def _f16(d: torch.Tensor, nan_h) -> torch.Tensor:
    """[c, 1] float32 -> uint8 [c, 2]: numpy's `astype(np.float16)` bytes, with `nan_h` (fp16 bits, an int or an
    int32 [c, 1]) where d is NaN."""
    h = d.to(torch.float16).view(torch.int16).to(torch.int32) & 0xFFFF
    h = torch.where(torch.isnan(d), nan_h, h)
    return torch.cat([h & 0xFF, (h >> 8) & 0xFF], dim=1)


def _inv(d: torch.Tensor) -> torch.Tensor:
    """np.where(d == 0, 0, 1 / d)"""
    return torch.where(d == 0, torch.zeros_like(d), div(1.0, d))


def _signed_absmax(b: torch.Tensor) -> torch.Tensor:
    """take_along_axis(b, abs(b).argmax(-1)): the first element of largest magnitude (the first NaN if any). From
    the max and min where one has the larger magnitude; by position in the blocks where they tie (zeros of
    either sign, +x and -x) or hold a NaN."""
    mx = b.amax(1, keepdim=True)
    mn = b.amin(1, keepdim=True)
    out = torch.where(mx > -mn, mx, mn)
    tie = ~((mx > -mn) | (-mn > mx))  # also NaN
    if bool(tie.any()):
        i = tie.view(-1).nonzero().squeeze(1)
        out[i] = _first_absmax(b[i])
    return out


def _first_absmax(b: torch.Tensor) -> torch.Tensor:
    m = b.abs()
    mx = m.amax(1, keepdim=True)
    ar = torch.arange(b.shape[1], device=b.device)
    idx = torch.where((m == mx) | torch.isnan(m), ar, b.shape[1]).amin(1, keepdim=True)
    return torch.gather(b, 1, idx)


def _pack4(q: torch.Tensor) -> torch.Tensor:
    """q [c, 32] (int32 0..255) -> [c, 16]: byte j = (q[j] & 0xF) | (q[j + 16] << 4) as uint8."""
    return (q[:, :16] & 0x0F) | ((q[:, 16:] << 4) & 0xFF)


def _qh(q: torch.Tensor) -> torch.Tensor:
    """np.packbits(q >> 4, bitorder="little") for q in 0..31: [c, 4]."""
    bits = (q >> 4).reshape(-1, 4, 8)
    return (bits << torch.arange(8, device=q.device, dtype=torch.int32)).sum(2, dtype=torch.int32)


def _q8_0_blocks(b: torch.Tensor) -> torch.Tensor:
    d = div(b.abs().amax(1, keepdim=True), 127.0)
    v = b * _inv(d)
    # np_roundf (round half away from zero) as trunc(v) + trunc(2 * (v - trunc(v))): the same value for every v
    # (the fraction and its double are exact), NaN for NaN and +-Inf, as np_roundf gives
    t = v.trunc()
    r = t.add_(torch.trunc((v - t).mul_(2)))
    out = torch.empty((b.shape[0], 34), dtype=torch.uint8, device=b.device)
    out[:, :2] = _f16(d, QNAN)
    # |r| <= 127 (id = 1 / (amax / 127) rounded, or Inf, which makes every v NaN or +-Inf) or NaN, which numpy's
    # x86 cast makes 0 (INT_MIN's low byte)
    out[:, 2:] = torch.nan_to_num_(r, 0.0, 0.0, 0.0).to(torch.int8).view(torch.uint8)
    return out


def _x_0_blocks(b: torch.Tensor, nmax: float, half: float, top: int) -> torch.Tensor:
    d = div(_signed_absmax(b), nmax)
    q = _np_byte(torch.trunc(b * _inv(d) + half)).clamp_(max=top)
    nan_h = torch.full_like(d, 0, dtype=torch.int32)
    nan = torch.isnan(d)
    if bool(nan.any()):  # the block's first NaN, kept by take_along_axis and the division
        i = nan.view(-1).nonzero().squeeze(1)
        nan_h[i] = _nan_half(_first_nan_bits(b[i]))
    parts = [_f16(d, nan_h)]
    if top == 31:
        parts.append(_qh(q))
    parts.append(_pack4(q))
    return torch.cat(parts, dim=1).to(torch.uint8)


def _x_1_blocks(b: torch.Tensor, levels: float, top: int) -> torch.Tensor:
    mx = b.amax(1, keepdim=True)
    mn = b.amin(1, keepdim=True)
    d = div(mx - mn, levels)
    q = _np_byte(torch.trunc((b - mn) * _inv(d) + 0.5)).clamp_(max=top)
    # a NaN max/min is numpy's reduction's default NaN; max - min of two equal infinities is x86's "indefinite"
    has_nan = torch.isnan(mn)
    parts = [_f16(d, torch.where(has_nan, QNAN, INDEFINITE)), _f16(mn, QNAN)]
    if top == 31:
        parts.append(_qh(q))
    parts.append(_pack4(q))
    return torch.cat(parts, dim=1).to(torch.uint8)


def quantize_q8_0(rows: torch.Tensor) -> torch.Tensor:
    return encode_rows(rows, QK, 34, CHUNK, _q8_0_blocks)


def quantize_q4_0(rows: torch.Tensor) -> torch.Tensor:
    return encode_rows(rows, QK, 18, CHUNK, lambda b: _x_0_blocks(b, -8.0, 8.5, 15))


def quantize_q5_0(rows: torch.Tensor) -> torch.Tensor:
    return encode_rows(rows, QK, 22, CHUNK, lambda b: _x_0_blocks(b, -16.0, 16.5, 31))


def quantize_q4_1(rows: torch.Tensor) -> torch.Tensor:
    return encode_rows(rows, QK, 20, CHUNK, lambda b: _x_1_blocks(b, 15.0, 15))


def quantize_q5_1(rows: torch.Tensor) -> torch.Tensor:
    return encode_rows(rows, QK, 24, CHUNK, lambda b: _x_1_blocks(b, 31.0, 31))


ENCODERS = {
    "Q8_0": quantize_q8_0,
    "Q4_0": quantize_q4_0,
    "Q5_0": quantize_q5_0,
    "Q4_1": quantize_q4_1,
    "Q5_1": quantize_q5_1,
}
