"""`Q6_K` and `Q3_K`: ggml's symmetric K-quants (`x = d * scale * q`, 16 sub-blocks of 16 per 256-block), byte for
byte what `quantize_row_q6_K_ref` and `quantize_row_q3_K_ref` in llama.cpp's `ggml-quants.c` write (MIT; the
llama-cpp-python 0.3.36 vendoring), with their helpers `make_qx_quants` (rmse_type 1, no weights) and
`make_q3_quants` (do_rmse).

Byte identity needs the C code's float32 arithmetic, operation for operation: every product is one elementwise
float32 op in the C order (`w*x*l` is `(w*x)*l`), every sum the C code accumulates over the 16 elements of a
sub-block is accumulated here in the same order (a Python loop over the element index, vectorized across all
sub-blocks, never `tensor.sum`), and every search with strict `>` (the first maximum wins) is a loop too.
Divisions are always tensor by tensor (torch turns `tensor / scalar` and `scalar / tensor` into a multiplication by
a reciprocal, which rounds differently). `nearest_int` is emulated with its own bit trick (add 1.5 * 2**23, read the
mantissa), so it agrees with C even outside the range its assert allows.

Layout inside: a chunk of blocks is held as [16 (element), sub-blocks] so that the per-element slices the
sequential loops touch are contiguous.
"""

from __future__ import annotations

import struct

from ckpt.lazy import numpy as np, torch

from ckpt.quant.kquants.cfloat import div, fp16_bytes, nearest_int, rounded, seq_sum
from ckpt.quant.kquants.rows import encode_rows

QK_K = 256
_CHUNK = 1024  # blocks per chunk (256K values, 1 MiB per temporary): the temporaries stay in cache (measured: 3x
# faster than chunks of 16K blocks)
_EPS = struct.unpack("<f", struct.pack("<f", 1e-15))[0]  # GROUP_MAX_EPS (1e-15f), as a float32


def _first_absmax(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(amax, max): the first value of largest |.| along dim 0, as the C loops `if (ax > amax) {...}` from 0."""
    amax = torch.zeros_like(x[0])
    mx = torch.zeros_like(x[0])
    for i in range(x.shape[0]):
        ax = x[i].abs()
        upd = ax > amax
        amax = torch.where(upd, ax, amax)
        mx = torch.where(upd, x[i], mx)
    return amax, mx


def _make_qx_quants_32(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """make_qx_quants(16, 32, x, L, rmse_type=1, qw=NULL) on x [16, S]: (scale [S], L int32 [16, S])."""
    nmax = 32
    amax, mx = _first_absmax(x)
    zero = amax < _EPS
    mx = torch.where(zero, torch.ones_like(mx), mx)  # keeps the masked lanes finite
    w = x * x
    wx = w * x
    sums = torch.empty((x.shape[0], 2, x.shape[1]), dtype=x.dtype, device=x.device)
    wl = torch.empty_like(x)

    def trial(c: float):
        # |iscale * x| <= c * |x| / amax <= c: within nearest_int's exact range, so one round (cfloat.rounded)
        iscale = div(-c, mx)
        lf = rounded(iscale * x, -nmax, nmax - 1)
        torch.mul(wx, lf, out=sums[:, 0])
        torch.mul(w, lf, out=wl)
        torch.mul(wl, lf, out=sums[:, 1])
        sumlx, suml2 = seq_sum(sums).unbind(0)
        return lf, sumlx, suml2

    lf, sumlx, suml2 = trial(float(nmax))
    L = lf
    scale = torch.where(suml2 != 0, sumlx / suml2, torch.zeros_like(sumlx))
    best = scale * sumlx
    for is_ in range(-9, 10):
        if is_ == 0:
            continue
        c = float(np.float32(nmax) + np.float32(0.1) * np.float32(is_))  # nmax + 0.1f*is, in float
        lf, sumlx, suml2 = trial(c)
        upd = (suml2 > 0) & (sumlx * sumlx > best * suml2)
        L = torch.where(upd, lf, L)
        scale = torch.where(upd, sumlx / suml2, scale)
        best = torch.where(upd, scale * sumlx, best)
    scale = torch.where(zero, torch.zeros_like(scale), scale)
    L = L.to(torch.int32) + nmax
    L = torch.where(zero, torch.zeros_like(L), L)
    return scale, L


def _make_q3_quants(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """make_q3_quants(16, 4, x, L, do_rmse=true) on x [16, S]: (scale [S], L int32 [16, S])."""
    nmax = 4
    amax, mx = _first_absmax(x)
    zero = amax < _EPS
    mx = torch.where(zero, torch.ones_like(mx), mx)
    iscale = div(-float(nmax), mx)
    L = nearest_int(iscale * x).clamp_(-nmax, nmax - 1)
    w = x * x
    wx = w * x
    lf = L.to(torch.float32)
    sumlx = seq_sum(wx * lf)
    suml2 = seq_sum((w * lf) * lf)
    active = ~zero
    for _itry in range(5):
        changed = torch.zeros_like(active)
        for i in range(16):
            Li = L[i]
            lif = Li.to(torch.float32)
            slx = sumlx - wx[i] * lif
            sl2 = suml2 - (w[i] * lif) * lif
            new_l = nearest_int((x[i] * sl2) / slx).clamp_(-nmax, nmax - 1)
            nf = new_l.to(torch.float32)
            slx2 = slx + wx[i] * nf
            sl22 = sl2 + (w[i] * nf) * nf
            ok = (active & (slx > 0) & (new_l != Li) & (sl22 > 0)
                  & ((slx2 * slx2) * suml2 > (sumlx * sumlx) * sl22))
            L[i] = torch.where(ok, new_l, Li)
            sumlx = torch.where(ok, slx2, sumlx)
            suml2 = torch.where(ok, sl22, suml2)
            changed |= ok
        active = active & changed
        if not bool(active.any()):
            break
    L = L + nmax
    scale = torch.where(suml2 > 0, sumlx / suml2, torch.zeros_like(sumlx))
    scale = torch.where(zero, torch.zeros_like(scale), scale)
    L = torch.where(zero, torch.zeros_like(L), L)
    return scale, L


def _sub_major(blocks: torch.Tensor) -> torch.Tensor:
    """[nb, 256] -> [16 (element), nb * 16 (sub-block)], contiguous."""
    nb = blocks.shape[0]
    return blocks.view(nb * 16, 16).t().contiguous()


def _block_major(L: torch.Tensor, nb: int) -> torch.Tensor:
    """[16, nb * 16] -> [nb, 256]."""
    return L.t().reshape(nb, QK_K)


def _first_absmax_cols(s: torch.Tensor) -> torch.Tensor:
    """The first of the 16 scales [nb, 16] of largest |.| per block."""
    return _first_absmax(s.t())[1]


def _q6_k_chunk(blocks: torch.Tensor) -> torch.Tensor:
    nb = blocks.shape[0]
    x = _sub_major(blocks)
    scales, L = _make_qx_quants_32(x)
    scales = scales.view(nb, 16)
    max_scale = _first_absmax_cols(scales)
    allzero = max_scale.abs() < _EPS
    max_scale = torch.where(allzero, torch.ones_like(max_scale), max_scale)
    iscale = div(-128.0, max_scale)
    d16 = div(1.0, iscale).to(torch.float16)
    q = nearest_int(iscale[:, None] * scales).clamp_(max=127)
    q = ((q + 128) & 0xFF) - 128  # int -> int8_t
    dd = (d16.to(torch.float32)[:, None] * q.to(torch.float32)).reshape(nb * 16)
    l = nearest_int(x / dd).clamp_(-32, 31) + 32
    L = torch.where(dd != 0, l, L)
    L = _block_major(L, nb).view(nb, 2, 4, 32)
    lo = L & 0xF
    hi = L >> 4
    ql = torch.cat([lo[:, :, 0] | (lo[:, :, 2] << 4), lo[:, :, 1] | (lo[:, :, 3] << 4)], dim=2).reshape(nb, 128)
    qh = (hi[:, :, 0] | (hi[:, :, 1] << 2) | (hi[:, :, 2] << 4) | (hi[:, :, 3] << 6)).reshape(nb, 64)
    out = torch.cat([ql.to(torch.uint8), qh.to(torch.uint8), (q & 0xFF).to(torch.uint8), fp16_bytes(d16)], dim=1)
    return torch.where(allzero[:, None], torch.zeros_like(out), out)


def _q3_k_chunk(blocks: torch.Tensor) -> torch.Tensor:
    nb = blocks.shape[0]
    x = _sub_major(blocks)
    scales, L = _make_q3_quants(x)
    scales = scales.view(nb, 16)
    max_scale = _first_absmax_cols(scales)
    has = max_scale != 0
    max_scale = torch.where(has, max_scale, torch.ones_like(max_scale))
    iscale = div(-32.0, max_scale)
    l = nearest_int(iscale[:, None] * scales)
    l = ((l + 128) & 0xFF) - 128  # int -> int8_t
    l = l.clamp_(-32, 31) + 32
    l = torch.where(has[:, None], l, torch.zeros_like(l))  # memset(scales, 0) when max_scale == 0
    d16 = torch.where(has, div(1.0, iscale), torch.zeros_like(iscale)).to(torch.float16)
    sb = torch.cat([(l[:, :8] & 0xF) | ((l[:, 8:] & 0xF) << 4),
                    (l[:, 0:4] >> 4) | ((l[:, 4:8] >> 4) << 2) | ((l[:, 8:12] >> 4) << 4) | ((l[:, 12:16] >> 4) << 6)],
                   dim=1)
    sc = l - 32  # what the C code reads back from the packed bytes
    dd = (d16.to(torch.float32)[:, None] * sc.to(torch.float32)).reshape(nb * 16)
    lq = nearest_int(x / dd).clamp_(-4, 3) + 4
    L = torch.where(dd != 0, lq, L)
    L = _block_major(L, nb)
    hbit = (L > 3).to(torch.int32)
    L = (L - 4 * hbit).view(nb, 2, 4, 32)
    hb = hbit.view(nb, 8, 32)
    hmask = torch.zeros_like(hb[:, 0])
    for b in range(8):
        hmask |= hb[:, b] << b
    qs = (L[:, :, 0] | (L[:, :, 1] << 2) | (L[:, :, 2] << 4) | (L[:, :, 3] << 6)).reshape(nb, 64)
    return torch.cat([hmask.to(torch.uint8), qs.to(torch.uint8), sb.to(torch.uint8), fp16_bytes(d16)], dim=1)


def encode_q6_k(rows: torch.Tensor) -> torch.Tensor:
    """fp32 [r, n] -> Q6_K blocks, uint8 [r, n / 256 * 210]."""
    return encode_rows(rows, QK_K, 210, _CHUNK, _q6_k_chunk)


def encode_q3_k(rows: torch.Tensor) -> torch.Tensor:
    """fp32 [r, n] -> Q3_K blocks, uint8 [r, n / 256 * 110]."""
    return encode_rows(rows, QK_K, 110, _CHUNK, _q3_k_chunk)


ENCODERS = {"Q3_K": encode_q3_k, "Q6_K": encode_q6_k}
