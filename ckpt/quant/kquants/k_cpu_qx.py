"""Compiled CPU kernels (`ckpt.quant.kquants.jit`) for ggml's symmetric K-quants `Q3_K` and `Q6_K`, both paths:
without an importance `quantize_row_q3_K_ref` (`make_q3_quants`) and `quantize_row_q6_K_ref` (`make_qx_quants`,
weights x*x), with one `quantize_row_q3_K_impl` (`make_qx_quants` weighted by qw * sqrt(sigma2 + x*x) for the
sub-blocks, then again by the sub-blocks' weight sums for their 6-bit scales) and `quantize_row_q6_K_impl`
(`make_qx_quants` weighted by the importance itself), byte for byte what llama.cpp's `ggml-quants.c` writes
(MIT; the llama-cpp-python 0.3.36 vendoring).

Why a scalar kernel: see `k_cpu_qkx` (the torch encoders of kquants/qx.py stay for CUDA). Each function is the C
function statement for statement in float32 (C's evaluation order: `w*x*l` is `(w*x)*l`); where the C code
stores an int in an `int8_t` (Q3_K's sub-block scale before its clamp, Q6_K's scale bytes) it wraps as there.
"""

from __future__ import annotations

from ckpt.lazy import numpy as np

from ckpt.quant.kquants import Encoder
from ckpt.quant.kquants.jit import cpu_encoder, kernel, nearest_int, put_fp16
from ckpt.quant.kquants.k_cpu_qkx import importance_block

QK_K = 256


@kernel
def make_qx_quants(n, nmax, x, L, qw, use_qw):
    """make_qx_quants(n, nmax, x, L, rmse_type 1, use_qw ? qw : NULL) on views of n values: the scale, levels
    (0 .. 2 nmax - 1) into L."""
    mx = np.float32(0.0)
    amax = np.float32(0.0)
    for i in range(n):
        ax = abs(x[i])
        if ax > amax:
            amax = ax
            mx = x[i]
    if amax < np.float32(1e-15):  # GROUP_MAX_EPS: all zero
        for i in range(n):
            L[i] = 0
        return np.float32(0.0)
    iscale = np.float32(-nmax) / mx
    sumlx = np.float32(0.0)
    suml2 = np.float32(0.0)
    for i in range(n):
        xi = x[i]
        l = max(-nmax, min(nmax - 1, nearest_int(iscale * xi)))
        L[i] = nmax + l
        w = qw[i] if use_qw else xi * xi
        sumlx += w * xi * np.float32(l)
        suml2 += w * np.float32(l) * np.float32(l)
    scale = sumlx / suml2 if suml2 != np.float32(0.0) else np.float32(0.0)
    best = scale * sumlx
    for is_ in range(-9, 10):
        if is_ == 0:
            continue
        iscale = -(np.float32(nmax) + np.float32(0.1) * np.float32(is_)) / mx
        sumlx = np.float32(0.0)
        suml2 = np.float32(0.0)
        for i in range(n):
            xi = x[i]
            l = max(-nmax, min(nmax - 1, nearest_int(iscale * xi)))
            w = qw[i] if use_qw else xi * xi
            sumlx += w * xi * np.float32(l)
            suml2 += w * np.float32(l) * np.float32(l)
        if suml2 > np.float32(0.0) and sumlx * sumlx > best * suml2:
            for i in range(n):
                L[i] = nmax + max(-nmax, min(nmax - 1, nearest_int(iscale * x[i])))
            scale = sumlx / suml2
            best = scale * sumlx
    return scale


@kernel
def make_q3_quants(n, nmax, x, L):
    """make_q3_quants(n, nmax, x, L, do_rmse = true) on views of n values: the scale, levels (0 .. 2 nmax - 1)
    into L."""
    mx = np.float32(0.0)
    amax = np.float32(0.0)
    for i in range(n):
        ax = abs(x[i])
        if ax > amax:
            amax = ax
            mx = x[i]
    if amax < np.float32(1e-15):  # GROUP_MAX_EPS: all zero
        for i in range(n):
            L[i] = 0
        return np.float32(0.0)
    iscale = np.float32(-nmax) / mx
    sumlx = np.float32(0.0)
    suml2 = np.float32(0.0)
    for i in range(n):
        xi = x[i]
        l = max(-nmax, min(nmax - 1, nearest_int(iscale * xi)))
        L[i] = l
        w = xi * xi
        sumlx += w * xi * np.float32(l)
        suml2 += w * np.float32(l) * np.float32(l)
    for _itry in range(5):
        n_changed = 0
        for i in range(n):
            xi = x[i]
            w = xi * xi
            li = np.float32(L[i])
            slx = sumlx - w * xi * li
            if slx > np.float32(0.0):
                sl2 = suml2 - w * li * li
                new_l = max(-nmax, min(nmax - 1, nearest_int(xi * sl2 / slx)))
                if new_l != np.int64(L[i]):
                    slx += w * xi * np.float32(new_l)
                    sl2 += w * np.float32(new_l) * np.float32(new_l)
                    if sl2 > np.float32(0.0) and slx * slx * suml2 > sumlx * sumlx * sl2:
                        L[i] = new_l
                        sumlx = slx
                        suml2 = sl2
                        n_changed += 1
        if n_changed == 0:
            break
    for i in range(n):
        L[i] += nmax
    return sumlx / suml2 if suml2 > np.float32(0.0) else np.float32(0.0)


@kernel
def q3_k_block(x, qw, out, L, scales, w, sw, Ls):
    """One block_q3_K {uint8 hmask[32]; uint8 qs[64]; uint8 scales[12]; fp16 d} of x[0:256] into out[0:110]:
    quantize_row_q3_K_ref (qw empty) or quantize_row_q3_K_impl (qw the block's importance)."""
    for j in range(12):
        out[96 + j] = 0
    if qw.shape[0] == 0:
        max_scale = np.float32(0.0)
        amax = np.float32(0.0)
        for j in range(16):
            s = make_q3_quants(16, 4, x[16 * j:16 * j + 16], L[16 * j:16 * j + 16])
            scales[j] = s
            if abs(s) > amax:
                amax = abs(s)
                max_scale = s
        if max_scale != np.float32(0.0):
            iscale = np.float32(-32.0) / max_scale
            for j in range(16):
                l = ((nearest_int(iscale * scales[j]) + 128) & 0xFF) - 128  # int8_t l
                Ls[j] = max(-32, min(31, l)) + 32
            d_block = np.float32(1.0) / iscale
        else:
            for j in range(16):
                Ls[j] = 0  # the memset scale bytes read back as 0
            d_block = np.float32(0.0)
    else:
        sumx2 = np.float32(0.0)
        for j in range(QK_K):
            sumx2 += x[j] * x[j]
        sigma2 = np.float32(2.0) * sumx2 / np.float32(QK_K)
        for j in range(16):
            for l in range(16):
                xi = x[16 * j + l]
                w[l] = qw[16 * j + l] * np.sqrt(sigma2 + xi * xi)
            sumw = np.float32(0.0)
            for l in range(16):
                sumw += w[l]
            sw[j] = sumw
            scales[j] = make_qx_quants(16, 4, x[16 * j:16 * j + 16], L[16 * j:16 * j + 16], w, True)
        d_block = make_qx_quants(16, 32, scales, Ls, sw, True)
    for j in range(16):
        l = np.int64(Ls[j])
        if j < 8:
            out[96 + j] = l & 0xF
        else:
            out[96 + j - 8] = np.int64(out[96 + j - 8]) | ((l & 0xF) << 4)
        out[96 + 8 + j % 4] = (np.int64(out[96 + 8 + j % 4]) | ((l >> 4) << (2 * (j // 4)))) & 0xFF
    d = put_fp16(out, 108, d_block)
    for j in range(16):
        sc = np.int64(out[96 + j]) & 0xF if j < 8 else np.int64(out[96 + j - 8]) >> 4
        sc = (sc | (((np.int64(out[96 + 8 + j % 4]) >> (2 * (j // 4))) & 3) << 4)) - 32
        dd = d * np.float32(sc)
        if dd == np.float32(0.0):
            continue
        for ii in range(16):
            L[16 * j + ii] = max(-4, min(3, nearest_int(x[16 * j + ii] / dd))) + 4
    for j in range(32):
        out[j] = 0
    for j in range(QK_K):
        if L[j] > 3:
            out[j % 32] = np.int64(out[j % 32]) | (1 << (j // 32))
            L[j] -= 4
    for j in range(0, QK_K, 128):
        for l in range(32):
            out[32 + j // 4 + l] = (np.int64(L[j + l]) | (np.int64(L[j + l + 32]) << 2)
                                        | (np.int64(L[j + l + 64]) << 4) | (np.int64(L[j + l + 96]) << 6)) & 0xFF


@kernel
def q6_k_block(x, qw, out, L, scales):
    """One block_q6_K {uint8 ql[128]; uint8 qh[64]; int8 scales[16]; fp16 d} of x[0:256] into out[0:210]:
    quantize_row_q6_K_ref (qw empty) or quantize_row_q6_K_impl (qw the block's importance)."""
    max_scale = np.float32(0.0)
    max_abs_scale = np.float32(0.0)
    use_qw = qw.shape[0] != 0
    for ib in range(16):
        s = make_qx_quants(16, 32, x[16 * ib:16 * ib + 16], L[16 * ib:16 * ib + 16], qw[16 * ib:16 * ib + 16], use_qw)
        scales[ib] = s
        if abs(s) > max_abs_scale:
            max_abs_scale = abs(s)
            max_scale = s
    if max_abs_scale < np.float32(1e-15):  # GROUP_MAX_EPS: an all-zero block
        for j in range(210):
            out[j] = 0
        return
    iscale = np.float32(-128.0) / max_scale
    d = put_fp16(out, 208, np.float32(1.0) / iscale)
    for ib in range(16):
        out[192 + ib] = min(127, nearest_int(iscale * scales[ib])) & 0xFF
    for j in range(16):
        dd = d * np.float32(((np.int64(out[192 + j]) + 128) & 0xFF) - 128)
        if dd == np.float32(0.0):
            continue
        for ii in range(16):
            L[16 * j + ii] = max(-32, min(31, nearest_int(x[16 * j + ii] / dd))) + 32
    for j in range(0, QK_K, 128):
        for l in range(32):
            q1 = np.int64(L[j + l])
            q2 = np.int64(L[j + l + 32])
            q3 = np.int64(L[j + l + 64])
            q4 = np.int64(L[j + l + 96])
            out[j // 2 + l] = (q1 & 0xF) | ((q3 & 0xF) << 4)
            out[j // 2 + l + 32] = (q2 & 0xF) | ((q4 & 0xF) << 4)
            out[128 + j // 4 + l] = (q1 >> 4) | ((q2 >> 4) << 2) | ((q3 >> 4) << 4) | ((q4 >> 4) << 6)


@kernel
def quantize_q3_k(x, qw, out):
    """Entry: fp32 rows x [r, n] -> block_q3_K rows out [r, n / 256 * 110]; qw [0 | 1 | r, n]."""
    L = np.zeros(QK_K, np.int8)
    Ls = np.zeros(16, np.int8)
    scales = np.zeros(16, np.float32)
    w = np.zeros(16, np.float32)
    sw = np.zeros(16, np.float32)
    for row in range(x.shape[0]):
        for i in range(x.shape[1] // QK_K):
            q3_k_block(x[row, QK_K * i:QK_K * i + QK_K], importance_block(qw, row, i),
                       out[row, 110 * i:110 * i + 110], L, scales, w, sw, Ls)


@kernel
def quantize_q6_k(x, qw, out):
    """Entry: fp32 rows x [r, n] -> block_q6_K rows out [r, n / 256 * 210]; qw [0 | 1 | r, n]."""
    L = np.zeros(QK_K, np.int8)
    scales = np.zeros(16, np.float32)
    for row in range(x.shape[0]):
        for i in range(x.shape[1] // QK_K):
            q6_k_block(x[row, QK_K * i:QK_K * i + QK_K], importance_block(qw, row, i),
                       out[row, 210 * i:210 * i + 210], L, scales)


ENCODERS = {
    "Q3_K": Encoder(cpu_encoder(__name__, "quantize_q3_k", QK_K, 110), static=True, weighted=True, devices=("cpu",),
                    rank=10),
    "Q6_K": Encoder(cpu_encoder(__name__, "quantize_q6_k", QK_K, 210), static=True, weighted=True, devices=("cpu",),
                    rank=10),
}
