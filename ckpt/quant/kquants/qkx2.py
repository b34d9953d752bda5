"""ggml's `Q2_K`, `Q4_K` and `Q5_K` block encoders: the types whose sub-block scales and mins come from
`make_qkx2_quants` (an iterative least-squares search over candidate scales), byte for byte what llama.cpp's
`quantize_row_q2_K_ref`, `quantize_row_q4_K_ref` and `quantize_row_q5_K_ref` (`ggml/src/ggml-quants.c`) write.

Every sub-block of every row is handled at once: sub-blocks are laid out as a [elements, sub-blocks] tensor, and
each float32 sum the C code accumulates in a loop over the 16 or 32 elements of a sub-block is accumulated here in
the same order (a Python loop over the element index, one add per element across all sub-blocks), never with a
reduction whose order differs. Products, sums and divisions are float32 tensor ops one by one (no fused
multiply-add, no division turned into a multiplication by a reciprocal), so every rounding is the C code's.
"""

from __future__ import annotations

from ckpt.lazy import numpy as np, torch

from ckpt.quant.kquants.cfloat import SAFE_ROUND, div, fp16_bytes, nearest_int, rounded, seq_sum
from ckpt.quant.kquants.rows import encode_rows

QK_K = 256
# super-blocks handled per pass (bounds the temporaries: ~ 10 float32 copies of CHUNK * 256 values)
CHUNK = 1024


def _make_qkx2_quants(x: torch.Tensor, w: torch.Tensor, nmax: int, rmin: float, rdelta: float, nstep: int,
                      use_mad: bool):
    """make_qkx2_quants on every column of x [n, B] (weights w [n, B]): (L int32 [n, B], scale [B], the_min [B]).

    The search's codes are rounded with `rounded` (one op) where every |iscale * (x - min)| of the step is provably
    within nearest_int's exact range (bounded per column from max, min and the column's smallest x), and with the
    bit trick otherwise; the three weighted sums of a step accumulate in one buffer (one in-order sum of 3 rows)."""
    xmin = x.amin(0)
    mn = xmin
    mx = x.amax(0)
    zero = torch.zeros_like(mn)
    mn = torch.where(mn > 0, zero, mn)
    sum_w = seq_sum(w)
    sum_x = seq_sum(w * x)
    same = mx == mn  # the C code returns early: L = 0, scale 0, the_min = -min
    mn0 = mn
    n, B = x.shape
    sums = torch.empty((n, 3, B), dtype=x.dtype, device=x.device)
    diff = torch.empty_like(x)

    def err(scale, lf, m):
        torch.mul(lf, scale, out=diff)  # scale * l, then + min, then - x: the C expression's order
        diff.add_(m).sub_(x)
        if use_mad:
            diff.abs_()
        else:
            diff.mul_(diff)
        diff.mul_(w)
        return seq_sum(diff)

    def codes(iscale, m):
        v = iscale * (x - m)
        # |v| <= |iscale| * max(mx - m, m - xmin): within the exact range, one round; else the C bit trick
        bound = iscale.abs() * torch.maximum(mx - m, m - xmin)
        if bool((bound < SAFE_ROUND).all()):
            return rounded(v, 0, nmax)
        return nearest_int(v).clamp_(0, nmax).float()

    iscale = div(float(np.float32(nmax)), mx - mn)
    scale = div(1.0, iscale)
    L = codes(iscale, mn)
    best = err(scale, L, mn)
    for step in range(nstep + 1):
        # the C loop reads `min` as updated by the steps before (`max - min`, `x[i] - min`)
        c = np.float32(rmin) + np.float32(rdelta) * np.float32(step) + np.float32(nmax)
        iscale = div(float(c), mx - mn)
        lf = codes(iscale, mn)
        wl = torch.mul(w, lf, out=sums[:, 0])
        torch.mul(wl, lf, out=sums[:, 1])
        torch.mul(wl, x, out=sums[:, 2])
        sum_l, sum_l2, sum_xl = seq_sum(sums).unbind(0)
        D = sum_w * sum_l2 - sum_l * sum_l
        this_scale = div(sum_w * sum_xl - sum_x * sum_l, D)
        this_min = div(sum_l2 * sum_x - sum_l * sum_xl, D)
        pos = this_min > 0
        this_min = torch.where(pos, zero, this_min)
        this_scale = torch.where(pos, div(sum_xl, sum_l2), this_scale)
        cur = err(this_scale, lf, this_min)
        take = (D > 0) & (cur < best)
        L = torch.where(take, lf, L)
        best = torch.where(take, cur, best)
        scale = torch.where(take, this_scale, scale)
        mn = torch.where(take, this_min, mn)
    L = torch.where(same, torch.zeros_like(L), L).to(torch.int32)
    scale = torch.where(same, zero, scale)
    mn = torch.where(same, mn0, mn)
    return L, scale, -mn


def _max_pos(v: torch.Tensor) -> torch.Tensor:
    """`float m = 0; for each s: if (s > m) m = s;` over the last dim (+0 when nothing is positive)."""
    m = v.amax(-1)
    return torch.where(m > 0, m, torch.zeros_like(m))


def _fp16(v: torch.Tensor) -> torch.Tensor:
    return v.to(torch.float16)


def _scales_k4(ls: torch.Tensor, lm: torch.Tensor) -> torch.Tensor:
    """The 12 bytes of 6-bit scales and mins (ls, lm int32 [nb, 8], each <= 63), as the ref quantizers pack them."""
    lo_s, hi_s = ls[:, :4], ls[:, 4:]
    lo_m, hi_m = lm[:, :4], lm[:, 4:]
    b0 = lo_s | ((hi_s >> 4) << 6)
    b4 = lo_m | ((hi_m >> 4) << 6)
    b8 = (hi_s & 0xF) | ((hi_m & 0xF) << 4)
    return torch.cat([b0, b4, b8], 1)


def _encode_k4(xb: torch.Tensor, nmax: int, rmin: float, nstep: int) -> tuple:
    """Shared Q4_K / Q5_K part for super-blocks xb [nb, 256]: (d fp16 [nb], dmin fp16 [nb], 12 scale bytes [nb, 12],
    L int32 [nb, 256])."""
    nb = xb.shape[0]
    x = xb.reshape(nb * 8, 32).t().contiguous()  # [32, sub-blocks]
    sum_x2 = seq_sum(x * x)
    # sqrtf: torch's float32 sqrt is not correctly rounded on CPU (its vectorized path misses by an ulp); the
    # float64 root of a float32 value rounded to float32 is sqrtf's result (53 >= 2 * 24 + 2 bits)
    av_x = torch.sqrt(div(sum_x2, 32.0).double()).float()
    w = av_x + x.abs()
    L, scales, mins = _make_qkx2_quants(x, w, nmax, rmin, 0.1, nstep, False)
    scales = scales.reshape(nb, 8)
    mins = mins.reshape(nb, 8)
    max_scale = _max_pos(scales)
    max_min = _max_pos(mins)
    zero = torch.zeros_like(max_scale)
    inv_scale = torch.where(max_scale > 0, div(63.0, max_scale), zero)
    inv_min = torch.where(max_min > 0, div(63.0, max_min), zero)
    ls = (nearest_int(inv_scale[:, None] * scales) & 0xFF).clamp_(max=63)
    lm = (nearest_int(inv_min[:, None] * mins) & 0xFF).clamp_(max=63)
    d16 = _fp16(div(max_scale, 63.0))
    dmin16 = _fp16(div(max_min, 63.0))
    d = d16.float()[:, None] * ls.float()  # [nb, 8]
    dm = dmin16.float()[:, None] * lm.float()
    d = d.reshape(-1)
    dm = dm.reshape(-1)
    lq = nearest_int(div(x + dm, d.expand_as(x).contiguous())).clamp_(0, nmax)
    L = torch.where(d == 0, L, lq)  # `if (!d) continue;` keeps make_qkx2_quants' L
    L = L.t().reshape(nb, 256)
    return d16, dmin16, _scales_k4(ls, lm), L


def _q4_k_blocks(xb: torch.Tensor) -> torch.Tensor:
    nb = xb.shape[0]
    d16, dmin16, sc, L = _encode_k4(xb, 15, -1.0, 20)
    L = L.reshape(nb, 4, 2, 32)
    qs = (L[:, :, 0] | (L[:, :, 1] << 4)).reshape(nb, 128)
    return torch.cat([fp16_bytes(d16), fp16_bytes(dmin16), sc.to(torch.uint8), qs.to(torch.uint8)], 1)


def _q5_k_blocks(xb: torch.Tensor) -> torch.Tensor:
    nb = xb.shape[0]
    d16, dmin16, sc, L = _encode_k4(xb, 31, -0.5, 15)
    low = (L & 0xF).reshape(nb, 4, 2, 32)
    qs = (low[:, :, 0] | (low[:, :, 1] << 4)).reshape(nb, 128)
    hi = (L >> 4).reshape(nb, 8, 32)
    qh = torch.zeros((nb, 32), dtype=torch.int32, device=xb.device)
    for s in range(8):
        qh |= hi[:, s] << s
    return torch.cat([fp16_bytes(d16), fp16_bytes(dmin16), sc.to(torch.uint8), qh.to(torch.uint8),
                      qs.to(torch.uint8)], 1)


def _q2_k_blocks(xb: torch.Tensor) -> torch.Tensor:
    nb = xb.shape[0]
    x = xb.reshape(nb * 16, 16).t().contiguous()  # [16, sub-blocks]
    L, scales, mins = _make_qkx2_quants(x, x.abs(), 3, -0.5, 0.1, 15, True)
    scales = scales.reshape(nb, 16)
    mins = mins.reshape(nb, 16)
    max_scale = _max_pos(scales)
    max_min = _max_pos(mins)
    zero = torch.zeros_like(max_scale)
    has_s = max_scale > 0
    has_m = max_min > 0
    ls = nearest_int(torch.where(has_s, div(15.0, max_scale), zero)[:, None] * scales)
    ls = torch.where(has_s[:, None], ls, torch.zeros_like(ls))
    lm = nearest_int(torch.where(has_m, div(15.0, max_min), zero)[:, None] * mins)
    lm = torch.where(has_m[:, None], lm, torch.zeros_like(lm))
    sc = (ls & 0xFF) | ((lm << 4) & 0xFF)
    d16 = _fp16(torch.where(has_s, div(max_scale, 15.0), zero))
    dmin16 = _fp16(torch.where(has_m, div(max_min, 15.0), zero))
    d = (d16.float()[:, None] * (sc & 0xF).float()).reshape(-1)
    dm = (dmin16.float()[:, None] * (sc >> 4).float()).reshape(-1)
    lq = nearest_int(div(x + dm, d.expand_as(x).contiguous())).clamp_(0, 3)
    L = torch.where(d == 0, L, lq)
    L = L.t().reshape(nb, 2, 4, 32)
    qs = (L[:, :, 0] | (L[:, :, 1] << 2) | (L[:, :, 2] << 4) | (L[:, :, 3] << 6)).reshape(nb, 64)
    return torch.cat([sc.to(torch.uint8), qs.to(torch.uint8), fp16_bytes(d16), fp16_bytes(dmin16)], 1)


def quantize_q2_k(rows: torch.Tensor) -> torch.Tensor:
    return encode_rows(rows, QK_K, 84, CHUNK, _q2_k_blocks)


def quantize_q4_k(rows: torch.Tensor) -> torch.Tensor:
    return encode_rows(rows, QK_K, 144, CHUNK, _q4_k_blocks)


def quantize_q5_k(rows: torch.Tensor) -> torch.Tensor:
    return encode_rows(rows, QK_K, 176, CHUNK, _q5_k_blocks)

ENCODERS = {"Q2_K": quantize_q2_k, "Q4_K": quantize_q4_k, "Q5_K": quantize_q5_k}
