"""The importance-matrix (`--imatrix`) encoders of the legacy types Q4_0, Q4_1, Q5_0 and Q5_1 as compiled CPU
kernels (`ckpt.quant.kquants.jit`), byte for byte what llama.cpp's `quantize_q4_0(..., quant_weights)` etc. write:
`quantize_row_q4_0_impl` / `_q4_1_impl` / `_q5_0_impl` / `_q5_1_impl` and the helpers they call,
`make_qx_quants` (rmse_type 1, with weights) and `make_qkx3_quants` (`ggml/src/ggml-quants.c` of llama.cpp
0c1e57098, as vendored by the llama-cpp-python 0.3.36 sdist; MIT).

Only the weighted path lives here: without an importance these types' ggml quantizer is the plain round-to-nearest
`quantize_row_q4_0_ref`, which the `gguf` package's numpy quantize already writes exactly (`ckpt.quant.gguf.encode`),
whereas with one ggml runs a different algorithm (a scale search weighted by qw[j] * sqrt(sigma2 + x[j]^2), sigma2
the row's mean square), which no vectorized form replays cheaply: hence a scalar kernel in the C loop order. Its
candidate passes run nearest_int as a branch-free rint where that is exact and fall back to ggml's exact bits
otherwise (`qx_pass`): at par with the C code (1 thread, ~27 M values/s Q4_0/Q5_0, ~9 M Q4_1/Q5_1).

`make_qx_quants_w` / `make_qkx3_quants_w` are this module's own copies of the ggml helpers (the K-quant kernels of
`k_cpu` need them too; they are plain ports of the same C functions and can be shared once both exist).
"""

from __future__ import annotations

from ckpt.lazy import numpy as np

from ckpt.quant.kquants import Encoder
from ckpt.quant.kquants.jit import cpu_encoder, kernel, nearest_int, put_fp16


@kernel
def qx_pass(n, nmax, x, w, iscale, exact):
    """One candidate scale of make_qx_quants: (sumlx, suml2, ok) of l = clamp(nearest_int(iscale * x[i]), -nmax,
    nmax - 1). Fast form (`exact` False): nearest_int as rint, the clamp in float32 (the same values where
    |iscale * x| <= 4194303, where nearest_int is rint), branch-free; `ok` says whether every value was in that
    range, else the caller runs the pass again `exact` (ggml's bits for any value: NaN, huge)."""
    lo = np.float32(-nmax)
    hi = np.float32(nmax - 1)
    ok = True
    sumlx = np.float32(0.0)
    suml2 = np.float32(0.0)
    for i in range(n):
        v = iscale * x[i]
        if exact:
            fl = np.float32(max(-nmax, min(nmax - 1, nearest_int(v))))
        else:
            ok &= abs(v) <= np.float32(4194303.0)
            fl = min(hi, max(lo, np.rint(v)))
        wi = w[i]
        sumlx += wi * x[i] * fl
        suml2 += wi * fl * fl
    return sumlx, suml2, ok


@kernel
def make_qx_quants_w(n, nmax, x, L, w):
    """ggml's `make_qx_quants(n, nmax, x, L, 1, w)` with weights `w` (the `qw != NULL` path: rmse_type 1 then
    only selects the refinement over 18 extra scales). L[i] = nmax + clamp(l, -nmax, nmax - 1). Returns the scale."""
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
    for i in range(n):
        L[i] = nmax + max(-nmax, min(nmax - 1, nearest_int(iscale * x[i])))
    sumlx, suml2, ok = qx_pass(n, nmax, x, w, iscale, False)
    if not ok:
        sumlx, suml2, ok = qx_pass(n, nmax, x, w, iscale, True)
    scale = sumlx / suml2 if suml2 != np.float32(0.0) else np.float32(0.0)
    best = scale * sumlx
    for step in range(-9, 10):
        if step == 0:
            continue
        iscale = -(np.float32(nmax) + np.float32(0.1) * np.float32(step)) / mx
        sumlx, suml2, ok = qx_pass(n, nmax, x, w, iscale, False)
        if not ok:
            sumlx, suml2, ok = qx_pass(n, nmax, x, w, iscale, True)
        if suml2 > np.float32(0.0) and sumlx * sumlx > best * suml2:
            for i in range(n):
                L[i] = nmax + max(-nmax, min(nmax - 1, nearest_int(iscale * x[i])))
            scale = sumlx / suml2
            best = scale * sumlx
    return scale


@kernel
def qkx3_pass(n, nmax, x, w, mn, iscale, Laux, exact):
    """One candidate scale of make_qkx3_quants: Laux[i] = clamp(nearest_int(iscale * (x[i] - mn)), 0, nmax) (as
    float32: the C code only ever reads it converted) and (sum_l, sum_l2, sum_xl, ok), fast or `exact` as
    `qx_pass`."""
    hi = np.float32(nmax)
    ok = True
    sum_l = np.float32(0.0)
    sum_l2 = np.float32(0.0)
    sum_xl = np.float32(0.0)
    for i in range(n):
        v = iscale * (x[i] - mn)
        if exact:
            fl = np.float32(max(0, min(nmax, nearest_int(v))))
        else:
            ok &= abs(v) <= np.float32(4194303.0)
            fl = min(hi, max(np.float32(0.0), np.rint(v)))
        Laux[i] = fl
        wi = w[i]
        sum_l += wi * fl
        sum_l2 += wi * fl * fl
        sum_xl += wi * fl * x[i]
    return sum_l, sum_l2, sum_xl, ok


@kernel
def make_qkx3_quants_w(n, nmax, x, w, L, Laux, rmin, rdelta, nstep):
    """ggml's `make_qkx3_quants(n, nmax, x, w, L, &the_min, Laux, rmin, rdelta, nstep, false)` with weights
    `w` (use_mad false); `Laux` is float32 here (the C code only reads its integers converted). Returns (scale,
    the_min). A better candidate's min is used from the next candidate on, as the C loop updates `min` in place:
    then iscale * (x - min) is no longer bounded by nmax (nearest_int past its asserted range: the exact pass)."""
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
    best_mad = np.float32(0.0)
    for i in range(n):
        l = max(0, min(nmax, nearest_int(iscale * (x[i] - mn))))
        L[i] = l
        diff = scale * np.float32(l) + mn - x[i]
        best_mad += w[i] * (diff * diff)
    if nstep < 1:
        return scale, -mn
    for step in range(nstep + 1):
        iscale = (rmin + rdelta * np.float32(step) + np.float32(nmax)) / (mx - mn)
        sum_l, sum_l2, sum_xl, ok = qkx3_pass(n, nmax, x, w, mn, iscale, Laux, False)
        if not ok:
            sum_l, sum_l2, sum_xl, ok = qkx3_pass(n, nmax, x, w, mn, iscale, Laux, True)
        D = sum_w * sum_l2 - sum_l * sum_l
        if D > np.float32(0.0):
            this_scale = (sum_w * sum_xl - sum_x * sum_l) / D
            this_min = (sum_l2 * sum_x - sum_l * sum_xl) / D
            if this_min > np.float32(0.0):
                this_min = np.float32(0.0)
                this_scale = sum_xl / sum_l2
            mad = np.float32(0.0)
            for i in range(n):
                diff = this_scale * Laux[i] + this_min - x[i]
                mad += w[i] * (diff * diff)
            if mad < best_mad:
                for i in range(n):
                    L[i] = np.uint8(Laux[i])
                best_mad = mad
                scale = this_scale
                mn = this_min
    return scale, -mn


@kernel
def row_weights(xb, qb, sigma2, weight):
    """weight[j] = qw[j] * sqrtf(sigma2 + xb[j]*xb[j]) for a block of 32."""
    for j in range(32):
        xj = xb[j]
        weight[j] = qb[j] * np.sqrt(sigma2 + xj * xj)


@kernel
def row_sigma2(row):
    """sum_x2 / n_per_row, summed in the C order."""
    s = np.float32(0.0)
    for j in range(row.shape[0]):
        s += row[j] * row[j]
    return s / np.float32(row.shape[0])


@kernel
def legacy_rows(x, qw, out):
    """quantize_<type>(x, out, r, n, qw) with an importance, the type told by its block bytes (out's row length per
    block of 32): 18 Q4_0, 20 Q4_1, 22 Q5_0, 24 Q5_1. One entry kernel for the four: one compilation, not four."""
    r, n = x.shape
    if qw.shape[0] == 0:
        raise ValueError("the legacy CPU kernels encode with an importance only")
    nb = n // 32
    if nb == 0:
        return
    bb = out.shape[1] // nb
    kind = (bb - 18) // 2  # 0 Q4_0, 1 Q4_1, 2 Q5_0, 3 Q5_1
    if bb * nb != out.shape[1] or kind < 0 or kind > 3:
        raise ValueError("the output's blocks are none of Q4_0, Q4_1, Q5_0, Q5_1")
    weight = np.empty(32, dtype=np.float32)
    L = np.empty(32, dtype=np.uint8)
    Laux = np.empty(32, dtype=np.float32)
    for i in range(r):
        row = x[i]
        q = qw[0] if qw.shape[0] == 1 else qw[i]
        o = out[i]
        sigma2 = row_sigma2(row)
        for ib in range(nb):
            off = ib * 32
            xb = row[off:off + 32]  # a slice: its indices provably non-negative (no wrap-around checks)
            row_weights(xb, q[off:off + 32], sigma2, weight)
            p = ib * bb
            if kind == 0 or kind == 2:
                d = make_qx_quants_w(32, 8 if kind == 0 else 16, xb, L, weight)
                put_fp16(o, p, d)
                p += 2
            else:
                d, the_min = make_qkx3_quants_w(32, 15 if kind == 1 else 31, xb, weight, L, Laux,
                                                np.float32(-0.9), np.float32(0.05), 36)
                put_fp16(o, p, d)
                put_fp16(o, p + 2, -the_min)
                p += 4
            if kind >= 2:  # the 5th bits in qh (little-endian uint32), the low nibbles in qs
                qh = np.uint32(0)
                for j in range(16):
                    qh |= np.uint32((L[j] >> 4) & 1) << np.uint32(j)
                    qh |= np.uint32((L[j + 16] >> 4) & 1) << np.uint32(j + 16)
                for k in range(4):
                    o[p + k] = np.uint8((qh >> np.uint32(8 * k)) & np.uint32(0xFF))
                p += 4
            for j in range(16):
                o[p + j] = (L[j] & np.uint8(0x0F)) | ((L[j + 16] & np.uint8(0x0F)) << np.uint8(4))


def _enc(block_bytes: int) -> Encoder:
    return Encoder(cpu_encoder(__name__, "legacy_rows", 32, block_bytes), static=False, weighted=True,
                   devices=("cpu",), rank=10)


ENCODERS = {"Q4_0": _enc(18), "Q4_1": _enc(20), "Q5_0": _enc(22), "Q5_1": _enc(24)}
