"""Compiled CPU kernels (`ckpt.quant.kquants.jit`) for ggml's K-quants with a minimum, `Q2_K`, `Q4_K` and `Q5_K`,
both paths: without an importance `quantize_row_q*_K_ref` (sub-block scales from `make_qkx2_quants`), with one
`quantize_row_q*_K_impl` (`make_qkx3_quants` for the sub-blocks, `make_qp_quants` for the 4- or 6-bit scales of the
super-block), byte for byte what llama.cpp's `ggml-quants.c` writes (MIT; the llama-cpp-python 0.3.36 vendoring).

Why a scalar kernel: these searches (22 or 37 candidate scales per sub-block, each a pass of nearest_int and three
float32 sums) are the time of a K-quant export; the torch encoders (kquants/qkx2.py, kept for CUDA) vectorize
across sub-blocks and cap at a third of the C code's speed on the CPU. Here each function is the C function,
statement for statement, in float32 (`np.float32` literals, C's evaluation order, `w*l*l` as `(w*l)*l`), over
views of the block and sub-block (indices from 0: the compiler drops numpy's negative-index wraparound). Where the
C code stores an int in a `uint8_t` (the levels `L`, `Ls`, `Lm`, the packed scales) the value wraps as it does
there (`& 0xFF`) and later reads use the wrapped value: rows whose scales come out negative (importances with
zeros) take those paths.
"""

from __future__ import annotations

from ckpt.lazy import numpy as np

from ckpt.quant.kquants import Encoder
from ckpt.quant.kquants.jit import cpu_encoder, kernel, nearest_int, put_fp16

QK_K = 256


@kernel
def make_qkx_quants(n, nmax, x, w, L, Laux, rmin, rdelta, nstep, use_mad):
    """make_qkx2_quants / make_qkx3_quants (with weights; they differ only in `max == min` against `max <= min`,
    the same test since max >= min always holds and both are false on NaN) on x[0:n] with weights w[0:n], levels
    into L[0:n] (views: indices from 0 let the compiler drop numpy's negative-index wraparound): returns
    (scale, the_min)."""
    mn = x[0]
    mx = x[0]
    sum_w = w[0]
    sum_x = sum_w * x[0]
    for i in range(1, n):
        xi = x[i]
        if xi < mn:
            mn = xi
        if xi > mx:
            mx = xi
        wi = w[i]
        sum_w += wi
        sum_x += wi * xi
    if mn > np.float32(0.0):
        mn = np.float32(0.0)
    if mx <= mn:
        for i in range(n):
            L[i] = 0
        return np.float32(0.0), -mn
    iscale = np.float32(nmax) / (mx - mn)
    scale = np.float32(1.0) / iscale
    best_error = np.float32(0.0)
    for i in range(n):
        xi = x[i]
        l = nearest_int(iscale * (xi - mn))
        l = max(0, min(nmax, l))
        L[i] = l
        diff = scale * np.float32(l) + mn - xi
        diff = abs(diff) if use_mad else diff * diff
        best_error += w[i] * diff
    for step in range(nstep + 1):
        iscale = (rmin + rdelta * np.float32(step) + np.float32(nmax)) / (mx - mn)
        sum_l = np.float32(0.0)
        sum_l2 = np.float32(0.0)
        sum_xl = np.float32(0.0)
        for i in range(n):
            xi = x[i]
            l = nearest_int(iscale * (xi - mn))
            l = max(0, min(nmax, l))
            Laux[i] = l
            wl = w[i] * np.float32(l)
            sum_l += wl
            sum_l2 += wl * np.float32(l)
            sum_xl += wl * xi
        D = sum_w * sum_l2 - sum_l * sum_l
        if D > np.float32(0.0):
            this_scale = (sum_w * sum_xl - sum_x * sum_l) / D
            this_min = (sum_l2 * sum_x - sum_l * sum_xl) / D
            if this_min > np.float32(0.0):
                this_min = np.float32(0.0)
                this_scale = sum_xl / sum_l2
            cur_error = np.float32(0.0)
            for i in range(n):
                diff = this_scale * np.float32(Laux[i]) + this_min - x[i]
                diff = abs(diff) if use_mad else diff * diff
                cur_error += w[i] * diff
            if cur_error < best_error:
                for i in range(n):
                    L[i] = Laux[i]
                best_error = cur_error
                scale = this_scale
                mn = this_min
    return scale, -mn


@kernel
def make_qp_quants(n, nmax, x, L, qw):
    """make_qp_quants(n, nmax, x, L, quant_weights): the super-block scale of the sub-block scales x[0:n] (all >= 0
    but for odd rows), their levels into the uint8 L (wrapping as C's `uint8_t`; later reads use the wrapped
    value)."""
    mx = np.float32(0.0)
    for i in range(n):
        mx = mx if mx > x[i] else x[i]  # MAX(max, x[i])
    if mx < np.float32(1e-15):  # GROUP_MAX_EPS
        for i in range(n):
            L[i] = 0
        return np.float32(0.0)
    iscale = np.float32(nmax) / mx
    for i in range(n):
        L[i] = nearest_int(iscale * x[i]) & 0xFF
    scale = np.float32(1.0) / iscale
    best_mse = np.float32(0.0)
    for i in range(n):
        diff = x[i] - scale * np.float32(L[i])
        best_mse += qw[i] * diff * diff
    for is_ in range(-4, 5):
        if is_ == 0:
            continue
        iscale_is = (np.float32(0.1) * np.float32(is_) + np.float32(nmax)) / mx
        scale_is = np.float32(1.0) / iscale_is
        mse = np.float32(0.0)
        for i in range(n):
            l = min(nmax, nearest_int(iscale_is * x[i]))
            diff = x[i] - scale_is * np.float32(l)
            mse += qw[i] * diff * diff
        if mse < best_mse:
            best_mse = mse
            iscale = iscale_is
    sumlx = np.float32(0.0)
    suml2 = np.float32(0.0)
    for i in range(n):
        l = min(nmax, nearest_int(iscale * x[i]))
        L[i] = l & 0xFF
        wi = qw[i]
        sumlx += wi * x[i] * np.float32(l)
        suml2 += wi * np.float32(l) * np.float32(l)
    for _itry in range(5):
        n_changed = 0
        for i in range(n):
            wi = qw[i]
            li = np.float32(L[i])
            slx = sumlx - wi * x[i] * li
            sl2 = suml2 - wi * li * li
            if slx > np.float32(0.0) and sl2 > np.float32(0.0):
                new_l = min(nmax, nearest_int(x[i] * sl2 / slx))
                if new_l != np.int64(L[i]):
                    slx += wi * x[i] * np.float32(new_l)
                    sl2 += wi * np.float32(new_l) * np.float32(new_l)
                    if slx * slx * suml2 > sumlx * sumlx * sl2:
                        L[i] = new_l & 0xFF
                        sumlx = slx
                        suml2 = sl2
                        n_changed += 1
        if n_changed == 0:
            break
    return sumlx / suml2 if suml2 > np.float32(0.0) else np.float32(0.0)


@kernel
def q2_k_block(x, qw, out, L, Laux, w, scales, mins, sw, Ls, Lm):
    """One block_q2_K {uint8 scales[16]; uint8 qs[64]; fp16 d; fp16 dmin} of x[0:256] into out[0:84]:
    quantize_row_q2_K_ref (qw empty) or quantize_row_q2_K_impl (qw the block's importance)."""
    if qw.shape[0] == 0:
        max_scale = np.float32(0.0)
        max_min = np.float32(0.0)
        for j in range(16):
            xs = x[16 * j:16 * j + 16]
            for l in range(16):
                w[l] = abs(xs[l])
            s, m = make_qkx_quants(16, 3, xs, w, L[16 * j:16 * j + 16], Laux, np.float32(-0.5), np.float32(0.1), 15,
                                   True)
            scales[j] = s
            mins[j] = m
            if s > max_scale:
                max_scale = s
            if m > max_min:
                max_min = m
        if max_scale > np.float32(0.0):
            iscale = np.float32(15.0) / max_scale
            for j in range(16):
                out[j] = nearest_int(iscale * scales[j]) & 0xFF
            d = put_fp16(out, 80, max_scale / np.float32(15.0))
        else:
            for j in range(16):
                out[j] = 0
            d = put_fp16(out, 80, np.float32(0.0))
        if max_min > np.float32(0.0):
            iscale = np.float32(15.0) / max_min
            for j in range(16):
                out[j] = (np.int64(out[j]) | (nearest_int(iscale * mins[j]) << 4)) & 0xFF
            dmin = put_fp16(out, 82, max_min / np.float32(15.0))
        else:
            dmin = put_fp16(out, 82, np.float32(0.0))
    else:
        sumx2 = np.float32(0.0)
        for j in range(QK_K):
            sumx2 += x[j] * x[j]
        sigma2 = sumx2 / np.float32(QK_K)
        for j in range(16):
            xs = x[16 * j:16 * j + 16]
            for l in range(16):
                w[l] = qw[16 * j + l] * np.sqrt(sigma2 + xs[l] * xs[l])
            sumw = np.float32(0.0)
            for l in range(16):
                sumw += w[l]
            sw[j] = sumw
            s, m = make_qkx_quants(16, 3, xs, w, L[16 * j:16 * j + 16], Laux, np.float32(-0.9), np.float32(0.05), 36,
                                   False)
            scales[j] = s
            mins[j] = m
        dm = make_qp_quants(16, 15, scales, Ls, sw)
        mm = make_qp_quants(16, 15, mins, Lm, sw)
        d = put_fp16(out, 80, dm)
        dmin = put_fp16(out, 82, mm)
        for j in range(16):
            out[j] = (np.int64(Ls[j]) | (np.int64(Lm[j]) << 4)) & 0xFF
    for j in range(16):
        sc = np.int64(out[j])
        dd = d * np.float32(sc & 0xF)
        if dd == np.float32(0.0):
            continue
        dmj = dmin * np.float32(sc >> 4)
        for ii in range(16):
            L[16 * j + ii] = max(0, min(3, nearest_int((x[16 * j + ii] + dmj) / dd)))
    for j in range(0, QK_K, 128):
        for l in range(32):
            out[16 + j // 4 + l] = (np.int64(L[j + l]) | (np.int64(L[j + l + 32]) << 2)
                                    | (np.int64(L[j + l + 64]) << 4) | (np.int64(L[j + l + 96]) << 6)) & 0xFF


@kernel
def k4_scales(x, qw, out, L, Laux, w, scales, mins, sw, Ls, Lm, nmax, rmin, nstep, clamp_impl):
    """The part Q4_K and Q5_K share: the 8 sub-blocks' scales and mins of x[0:256], d, dmin and the 12 scale bytes
    into out[0:16], and the final levels (0..nmax) in L. `clamp_impl`: the _impl path's MIN(63, ls) (Q5_K's has
    it, Q4_K's does not: its wrapped levels go into the bytes as they are)."""
    if qw.shape[0] == 0:
        max_scale = np.float32(0.0)
        max_min = np.float32(0.0)
        for j in range(8):
            xs = x[32 * j:32 * j + 32]
            sum_x2 = np.float32(0.0)
            for l in range(32):
                sum_x2 += xs[l] * xs[l]
            av_x = np.sqrt(sum_x2 / np.float32(32.0))
            for l in range(32):
                w[l] = av_x + abs(xs[l])
            s, m = make_qkx_quants(32, nmax, xs, w, L[32 * j:32 * j + 32], Laux, rmin, np.float32(0.1), nstep, False)
            scales[j] = s
            mins[j] = m
            if s > max_scale:
                max_scale = s
            if m > max_min:
                max_min = m
        inv_scale = np.float32(63.0) / max_scale if max_scale > np.float32(0.0) else np.float32(0.0)
        inv_min = np.float32(63.0) / max_min if max_min > np.float32(0.0) else np.float32(0.0)
        for j in range(8):
            Ls[j] = min(63, nearest_int(inv_scale * scales[j]) & 0xFF)
            Lm[j] = min(63, nearest_int(inv_min * mins[j]) & 0xFF)
        d_block = max_scale / np.float32(63.0)
        m_block = max_min / np.float32(63.0)
    else:
        sum_x2 = np.float32(0.0)
        for l in range(QK_K):
            sum_x2 += x[l] * x[l]
        sigma2 = np.float32(2.0) * sum_x2 / np.float32(QK_K)
        for j in range(8):
            xs = x[32 * j:32 * j + 32]
            for l in range(32):
                w[l] = qw[32 * j + l] * np.sqrt(sigma2 + xs[l] * xs[l])
            sumw = np.float32(0.0)
            for l in range(32):
                sumw += w[l]
            sw[j] = sumw
            s, m = make_qkx_quants(32, nmax, xs, w, L[32 * j:32 * j + 32], Laux, np.float32(-0.9), np.float32(0.05),
                                   36, False)
            scales[j] = s
            mins[j] = m
        d_block = make_qp_quants(8, 63, scales, Ls, sw)
        m_block = make_qp_quants(8, 63, mins, Lm, sw)
        if clamp_impl:
            for j in range(8):
                Ls[j] = min(63, np.int64(Ls[j]))
                Lm[j] = min(63, np.int64(Lm[j]))
    q = out[4:16]
    for j in range(8):
        ls = np.int64(Ls[j])
        lm = np.int64(Lm[j])
        if j < 4:
            q[j] = ls
            q[j + 4] = lm
        else:
            q[j + 4] = ((ls & 0xF) | ((lm & 0xF) << 4)) & 0xFF
            q[j - 4] = (np.int64(q[j - 4]) | ((ls >> 4) << 6)) & 0xFF
            q[j] = (np.int64(q[j]) | ((lm >> 4) << 6)) & 0xFF
    d = put_fp16(out, 0, d_block)
    dmin = put_fp16(out, 2, m_block)
    for j in range(8):
        if j < 4:  # get_scale_min_k4
            sc = np.int64(q[j]) & 63
            m = np.int64(q[j + 4]) & 63
        else:
            sc = (np.int64(q[j + 4]) & 0xF) | ((np.int64(q[j - 4]) >> 6) << 4)
            m = (np.int64(q[j + 4]) >> 4) | ((np.int64(q[j]) >> 6) << 4)
        dd = d * np.float32(sc)
        if dd == np.float32(0.0):
            continue
        dm = dmin * np.float32(m)
        for ii in range(32):
            L[32 * j + ii] = max(0, min(nmax, nearest_int((x[32 * j + ii] + dm) / dd)))


@kernel
def scratch():
    """Per-call work arrays of the block kernels: L, Laux, w, scales, mins, sw, Ls, Lm."""
    return (np.zeros(QK_K, np.uint8), np.zeros(32, np.uint8), np.zeros(32, np.float32), np.zeros(16, np.float32),
            np.zeros(16, np.float32), np.zeros(16, np.float32), np.zeros(16, np.uint8), np.zeros(16, np.uint8))


@kernel
def importance_block(qw, row, i):
    """The importance of block i of row `row` (empty without one): qw is [0 | 1 | r, n]."""
    if qw.shape[0] == 0:
        return qw[0, 0:0]  # an empty 1-D view
    return qw[0 if qw.shape[0] == 1 else row, QK_K * i:QK_K * i + QK_K]


@kernel
def quantize_q2_k(x, qw, out):
    """Entry: fp32 rows x [r, n] -> block_q2_K rows out [r, n / 256 * 84]; qw [0 | 1 | r, n]."""
    L, Laux, w, scales, mins, sw, Ls, Lm = scratch()
    for row in range(x.shape[0]):
        for i in range(x.shape[1] // QK_K):
            q2_k_block(x[row, QK_K * i:QK_K * i + QK_K], importance_block(qw, row, i), out[row, 84 * i:84 * i + 84],
                       L, Laux, w, scales, mins, sw, Ls, Lm)


@kernel
def quantize_q4_k(x, qw, out):
    """Entry: fp32 rows x [r, n] -> block_q4_K rows {fp16 d, dmin; uint8 scales[12]; uint8 qs[128]}."""
    L, Laux, w, scales, mins, sw, Ls, Lm = scratch()
    for row in range(x.shape[0]):
        for i in range(x.shape[1] // QK_K):
            ob = out[row, 144 * i:144 * i + 144]
            k4_scales(x[row, QK_K * i:QK_K * i + QK_K], importance_block(qw, row, i), ob, L, Laux, w, scales, mins,
                      sw, Ls, Lm, 15, np.float32(-1.0), 20, False)
            for j in range(0, QK_K, 64):
                for l in range(32):
                    ob[16 + j // 2 + l] = (np.int64(L[j + l]) | (np.int64(L[j + l + 32]) << 4)) & 0xFF


@kernel
def quantize_q5_k(x, qw, out):
    """Entry: fp32 rows x [r, n] -> block_q5_K rows {fp16 d, dmin; uint8 scales[12]; uint8 qh[32]; uint8 qs[128]}."""
    L, Laux, w, scales, mins, sw, Ls, Lm = scratch()
    for row in range(x.shape[0]):
        for i in range(x.shape[1] // QK_K):
            ob = out[row, 176 * i:176 * i + 176]
            k4_scales(x[row, QK_K * i:QK_K * i + QK_K], importance_block(qw, row, i), ob, L, Laux, w, scales, mins,
                      sw, Ls, Lm, 31, np.float32(-0.5), 15, True)
            for j in range(32):
                ob[16 + j] = 0
            m1 = 1
            m2 = 2
            for nn in range(0, QK_K, 64):
                for j in range(32):
                    l1 = np.int64(L[nn + j])
                    if l1 > 15:
                        l1 -= 16
                        ob[16 + j] = np.int64(ob[16 + j]) | m1
                    l2 = np.int64(L[nn + j + 32])
                    if l2 > 15:
                        l2 -= 16
                        ob[16 + j] = np.int64(ob[16 + j]) | m2
                    ob[48 + nn // 2 + j] = (l1 | (l2 << 4)) & 0xFF
                m1 <<= 2
                m2 <<= 2


ENCODERS = {
    "Q2_K": Encoder(cpu_encoder(__name__, "quantize_q2_k", QK_K, 84), static=True, weighted=True, devices=("cpu",),
                    rank=10),
    "Q4_K": Encoder(cpu_encoder(__name__, "quantize_q4_k", QK_K, 144), static=True, weighted=True, devices=("cpu",),
                    rank=10),
    "Q5_K": Encoder(cpu_encoder(__name__, "quantize_q5_k", QK_K, 176), static=True, weighted=True, devices=("cpu",),
                    rank=10),
}
