"""`IQ2_XXS`, `IQ2_XS` and `IQ2_S` block encoders as compiled CPU kernels (`ckpt.quant.kquants.jit`): byte for byte
what llama.cpp's `quantize_iq2_xxs` / `quantize_iq2_xs` / `quantize_iq2_s` write (`quantize_row_iq2_*_impl` and
their helpers `make_qp_quants`, `iq2_find_best_neighbour` in `ggml/src/ggml-quants.c`, llama.cpp 0c1e57098 as
vendored by the llama-cpp-python 0.3.36 sdist; MIT), statement for statement in the C order in float32.

Which paths exist is ggml's: IQ2_XXS and IQ2_XS assert an importance (`GGML_ASSERT(quant_weights)`, and
`ggml_quantize_requires_imatrix` says so), so they are registered for the weighted path only; IQ2_S runs with one
or without (its `quantize_row_iq2_s_ref` is the NULL path), so it is registered for both.

Kept from the C code because they are in the bytes: IQ2_XXS and IQ2_XS store 7 sign bits per group of 8, so an odd
group flips its least weighted value, which then enters the search negative; IQ2_XXS starts its search from
`make_qp_quants` (whose uint8 levels wrap for that negative value); the fudge factor 0.9875 of IQ2_S's scale.

Where the C code aborts the process (`iq2_find_best_neighbour`'s `GGML_ASSERT(grid_index >= 0)`: every distance
NaN or past FLT_MAX; "found point not on grid"; `GGML_ASSERT(scale >= 0)` on a NaN scale: all only from values
past ~1e19, whose squares overflow float32), the kernel raises a `CkptError`: llama-quantize writes no such tensor.
"""

from __future__ import annotations

from ckpt.errors import CkptError
from ckpt.lazy import numpy as np
from ckpt.quant.kquants import Encoder
from ckpt.quant.kquants.iq2_grids import KMAP_SIZE, q2xs_tables
from ckpt.quant.kquants.jit import cpu_encoder, kernel, nearest_int, put_fp16  # noqa: F401 (kernels call them)

JIT_TABLES = {  # grids flat (point j = GRID[8j:8j + 8]), maps and neighbour lists: ckpt.quant.kquants.iq2_grids
    "XXS_GRID": lambda np: q2xs_tables(np, "IQ2_XXS")[0].reshape(-1),
    "XXS_MAP": lambda np: q2xs_tables(np, "IQ2_XXS")[1],
    "XXS_NEIGHBOURS": lambda np: q2xs_tables(np, "IQ2_XXS")[2],
    "XS_GRID": lambda np: q2xs_tables(np, "IQ2_XS")[0].reshape(-1),
    "XS_MAP": lambda np: q2xs_tables(np, "IQ2_XS")[1],
    "XS_NEIGHBOURS": lambda np: q2xs_tables(np, "IQ2_XS")[2],
    "S_GRID": lambda np: q2xs_tables(np, "IQ2_S")[0].reshape(-1),
    "S_MAP": lambda np: q2xs_tables(np, "IQ2_S")[1],
    "S_NEIGHBOURS": lambda np: q2xs_tables(np, "IQ2_S")[2],
}

QK_K = 256
FLT_MAX = 3.4028234663852886e38
TOO_LARGE = "values too large for ggml's IQ2 grid search (squares overflow float32; llama-quantize aborts on them)"


@kernel
def make_qp_quants(n, nmax, x, L, quant_weights):
    """ggml's make_qp_quants: levels 0..nmax of x[:n] into L and their scale under the weights. L is uint8 as in
    C: a negative level (IQ2_XXS's flipped value) wraps, and is read back wrapped."""
    mx = np.float32(0.0)
    for i in range(n):
        mx = mx if mx > x[i] else x[i]
    if mx < np.float32(1e-15):
        for i in range(n):
            L[i] = 0
        return np.float32(0.0)
    iscale = np.float32(nmax) / mx
    for i in range(n):
        L[i] = np.uint8(np.int64(nearest_int(iscale * x[i])) & 255)
    scale = np.float32(1.0) / iscale
    best_mse = np.float32(0.0)
    for i in range(n):
        diff = x[i] - scale * np.float32(L[i])
        w = quant_weights[i]
        best_mse += w * diff * diff
    for is_ in range(-4, 5):
        if is_ == 0:
            continue
        iscale_is = (np.float32(0.1) * np.float32(is_) + np.float32(nmax)) / mx
        scale_is = np.float32(1.0) / iscale_is
        mse = np.float32(0.0)
        for i in range(n):
            l = min(nmax, np.int64(nearest_int(iscale_is * x[i])))
            diff = x[i] - scale_is * np.float32(l)
            w = quant_weights[i]
            mse += w * diff * diff
        if mse < best_mse:
            best_mse = mse
            iscale = iscale_is
    sumlx = np.float32(0.0)
    suml2 = np.float32(0.0)
    for i in range(n):
        l = min(nmax, np.int64(nearest_int(iscale * x[i])))
        L[i] = np.uint8(l & 255)
        w = quant_weights[i]
        sumlx += w * x[i] * np.float32(l)
        suml2 += w * np.float32(l) * np.float32(l)
    for itry in range(5):
        n_changed = 0
        for i in range(n):
            w = quant_weights[i]
            li = np.float32(L[i])
            slx = sumlx - w * x[i] * li
            sl2 = suml2 - w * li * li
            if slx > np.float32(0.0) and sl2 > np.float32(0.0):
                new_l = min(nmax, np.int64(nearest_int(x[i] * sl2 / slx)))
                if new_l != np.int64(L[i]):
                    slx += w * x[i] * np.float32(new_l)
                    sl2 += w * np.float32(new_l) * np.float32(new_l)
                    if slx * slx * suml2 > sumlx * sumlx * sl2:
                        L[i] = np.uint8(new_l & 255)
                        sumlx = slx
                        suml2 = sl2
                        n_changed += 1
        if n_changed == 0:
            break
    return sumlx / suml2 if suml2 > np.float32(0.0) else np.float32(0.0)


@kernel
def iq2_place(ngroups, xval, waux, id_, scale, L, on_grid, skip_on_grid, grid, kmap, nb, sqv):
    """One step of the IQ2 searches for every group of 8 (but those with on_grid[k] when `skip_on_grid`): the
    levels MAX(0, MIN(kMaxQ-1, nearest_int(0.5f*(id*xval-1)))) into L, and where they are on no grid point, the
    neighbour `iq2_find_best_neighbour` picks at `scale` (closest under the weights waux) instead; on_grid[k] says
    which groups were on the grid (not written when skipping). One call per candidate scale, the neighbour search
    inline (a call per group cost a fifth of the speed): its list is nb[o] (length, then grid indices) for
    kmap[u] = -(o+1); `sqv` is scratch for scale * q of the 4 grid bytes q, the products C forms per element."""
    for k in range(ngroups):
        if skip_on_grid and on_grid[k]:
            continue
        o = 8 * k
        u = 0
        for i in range(8):
            l = max(0, min(2, np.int64(nearest_int(np.float32(0.5) * (id_ * xval[o + i] - np.float32(1.0))))))
            L[o + i] = l
            u |= l << (2 * i)
        code = np.int64(kmap[u])  # u <= 0xAAAA: levels 0..2
        if not skip_on_grid:
            on_grid[k] = code >= 0
        if code >= 0:
            continue
        start = -code - 1
        x0, x1, x2, x3 = xval[o], xval[o + 1], xval[o + 2], xval[o + 3]
        x4, x5, x6, x7 = xval[o + 4], xval[o + 5], xval[o + 6], xval[o + 7]
        w0, w1, w2, w3 = waux[o], waux[o + 1], waux[o + 2], waux[o + 3]
        w4, w5, w6, w7 = waux[o + 4], waux[o + 5], waux[o + 6], waux[o + 7]
        for i in range(4):  # scale * q for the grid bytes q = 2 * level + 1 (level = q >> 1): C's products
            sqv[i] = scale * np.float32(2 * i + 1)
        best_d2 = np.float32(FLT_MAX)
        grid_index = -1
        for j in range(1, np.int64(nb[start]) + 1):
            p = 8 * np.int64(nb[start + j])
            diff = sqv[grid[p] >> 1] - x0
            d2 = np.float32(0.0) + w0 * diff * diff
            diff = sqv[grid[p + 1] >> 1] - x1
            d2 += w1 * diff * diff
            diff = sqv[grid[p + 2] >> 1] - x2
            d2 += w2 * diff * diff
            diff = sqv[grid[p + 3] >> 1] - x3
            d2 += w3 * diff * diff
            diff = sqv[grid[p + 4] >> 1] - x4
            d2 += w4 * diff * diff
            diff = sqv[grid[p + 5] >> 1] - x5
            d2 += w5 * diff * diff
            diff = sqv[grid[p + 6] >> 1] - x6
            d2 += w6 * diff * diff
            diff = sqv[grid[p + 7] >> 1] - x7
            d2 += w7 * diff * diff
            if d2 < best_d2:
                best_d2 = d2
                grid_index = np.int64(nb[start + j])
        if grid_index < 0:
            raise CkptError(TOO_LARGE)
        for i in range(8):
            L[o + i] = (np.int64(grid[8 * grid_index + i]) - 1) // 2


@kernel
def iq2_sums(weight, xval, L, n):
    """sumqx, sumq2 over q = 2*L+1, in C's order."""
    sumqx = np.float32(0.0)
    sumq2 = np.float32(0.0)
    for i in range(n):
        w = weight[i]
        q = np.float32(2 * np.int64(L[i]) + 1)
        sumqx += w * xval[i] * q
        sumq2 += w * q * q
    return sumqx, sumq2


@kernel
def iq2_search16(grid, kmap, nb, xval, weight, waux, mx, L, Laux, on_grid, on_grid_aux, sqv):
    """The scale search IQ2_XS and IQ2_S share (16 values, two groups of 8, candidate scales max/(5 + is/10),
    is = -9..9; then the groups off the grid redone at the best scale): levels into L; returns the scale."""
    best = np.float32(0.0)
    scale = mx / np.float32(5.0)
    on_grid[0] = True
    on_grid[1] = True
    for is_ in range(-9, 10):
        id_ = (np.float32(5.0) + np.float32(is_) * np.float32(0.1)) / mx
        iq2_place(2, xval, waux, id_, np.float32(1.0) / id_, Laux, on_grid_aux, False, grid, kmap, nb, sqv)
        sumqx, sumq2 = iq2_sums(weight, xval, Laux, 16)
        if sumq2 > np.float32(0.0) and sumqx * sumqx > best * sumq2:
            scale = sumqx / sumq2
            best = scale * sumqx
            for i in range(16):
                L[i] = Laux[i]
            on_grid[0] = on_grid_aux[0]
            on_grid[1] = on_grid_aux[1]
    if (not on_grid[0] or not on_grid[1]) and scale > np.float32(0.0):
        iq2_place(2, xval, waux, np.float32(1.0) / scale, scale, L, on_grid, True, grid, kmap, nb, sqv)
        sumqx, sumq2 = iq2_sums(weight, xval, L, 16)
        if sumq2 > np.float32(0.0):
            scale = sumqx / sumq2
    return scale


@kernel
def final_index(kmap, L, o):
    """The grid index of the levels L[o:o + 8]; C aborts ("found point not on grid") where they are on none,
    which only a NaN scale leaves behind."""
    u = 0
    for i in range(8):
        u |= np.int64(L[o + i]) << (2 * i)
    code = np.int64(kmap[u]) if 0 <= u < KMAP_SIZE else np.int64(-1)
    if code < 0:
        raise CkptError(TOO_LARGE)
    return code


@kernel
def signs_of(x, row, xo, weight, xval, k, even):
    """The sign bits of x[row, xo + 8k : +8], |x| into xval[8k : 8k + 8]; with `even` (IQ2_XXS, IQ2_XS: 7 bits
    stored, the 8th implied) an odd count is made even by flipping the value of least weight*x^2."""
    nflip = 0
    s = 0
    for i in range(8):
        v = x[row, xo + 8 * k + i]
        if v >= np.float32(0.0):
            xval[8 * k + i] = v
        else:
            xval[8 * k + i] = -v
            nflip += 1
            s |= 1 << i
    if even and nflip % 2:
        imin = 0
        v = x[row, xo + 8 * k]
        mn = weight[8 * k] * v * v
        for i in range(1, 8):
            v = x[row, xo + 8 * k + i]
            ax = weight[8 * k + i] * v * v
            if ax < mn:
                mn = ax
                imin = i
        xval[8 * k + imin] = -xval[8 * k + imin]
        s ^= 1 << imin
    return s


@kernel
def sum_squares(x, row, base):
    """sumx2 of the block of 256 at x[row, base:]."""
    sumx2 = np.float32(0.0)
    for i in range(QK_K):
        v = x[row, base + i]
        sumx2 += v * v
    return sumx2


@kernel
def quantize_iq2_xxs(x, qw, out):
    """quantize_iq2_xxs(x, out, rows, n, qw): 256 values -> 66 bytes (fp16 d, then per 32 values 4 grid indices
    and a uint32 of 4 x 7 sign bits and the 4-bit scale)."""
    r, n = x.shape
    if qw.shape[0] == 0:
        raise ValueError("IQ2_XXS needs an importance matrix")
    grid, kmap, nb = XXS_GRID, XXS_MAP, XXS_NEIGHBOURS
    scales = np.zeros(8, np.float32)
    weight = np.zeros(32, np.float32)
    xval = np.zeros(32, np.float32)
    waux = np.zeros(32, np.float32)
    L = np.zeros(32, np.int64)
    Laux = np.zeros(32, np.int64)
    sqv = np.zeros(4, np.float32)
    Lq = np.zeros(32, np.uint8)
    on_grid = np.zeros(4, np.bool_)
    block_signs = np.zeros(4, np.int64)
    q2 = np.zeros(16, np.int64)
    for row in range(r):
        wr = 0 if qw.shape[0] == 1 else row
        for ibl in range(n // QK_K):
            base = QK_K * ibl
            ob = 66 * ibl
            for i in range(66):
                out[row, ob + i] = 0
            for i in range(16):
                q2[i] = 0
            max_scale = np.float32(0.0)
            sigma2 = sum_squares(x, row, base) / np.float32(QK_K)
            for ib in range(8):
                xo = base + 32 * ib
                for i in range(32):
                    v = x[row, xo + i]
                    weight[i] = qw[wr, xo + i] * np.sqrt(sigma2 + v * v)
                for i in range(32):
                    waux[i] = np.sqrt(weight[i])
                for k in range(4):
                    block_signs[k] = signs_of(x, row, xo, weight, xval, k, True) & 127
                mx = xval[0]
                for i in range(1, 32):
                    mx = mx if mx > xval[i] else xval[i]
                if mx < np.float32(1e-15):
                    scales[ib] = 0
                    continue
                scale = make_qp_quants(32, 4, xval, Lq, weight)
                for i in range(32):
                    L[i] = np.int64(np.int8(Lq[i]))  # C reads the uint8 levels back as int8_t
                eff_max = scale * np.float32(3.0)
                if eff_max <= np.float32(0.0):
                    scales[ib] = 0
                    continue
                best = np.float32(0.0)
                for is_ in range(-6, 7):
                    id_ = (np.float32(5.0) + np.float32(is_) * np.float32(0.1)) / eff_max
                    iq2_place(4, xval, waux, id_, np.float32(1.0) / id_, Laux, on_grid, False, grid, kmap, nb, sqv)
                    sumqx, sumq2 = iq2_sums(weight, xval, Laux, 32)
                    if sumq2 > np.float32(0.0) and sumqx * sumqx > best * sumq2:
                        scale = sumqx / sumq2
                        best = scale * sumqx
                        for i in range(32):
                            L[i] = Laux[i]
                if scale > np.float32(0.0):
                    # every group again at the best scale, L from the grid (a group on it keeps its levels)
                    iq2_place(4, xval, waux, np.float32(1.0) / scale, scale, L, on_grid, False, grid, kmap, nb, sqv)
                    sumqx, sumq2 = iq2_sums(weight, xval, L, 32)
                    if sumq2 > np.float32(0.0):
                        scale = sumqx / sumq2
                if scale < np.float32(0.0):
                    scale = -scale
                    for k in range(4):
                        block_signs[k] = (~block_signs[k]) & 127
                for k in range(4):
                    q2[2 * ib] |= final_index(kmap, L, 8 * k) << (8 * k)
                    q2[2 * ib + 1] |= block_signs[k] << (7 * k)
                if not scale >= np.float32(0.0):
                    raise CkptError(TOO_LARGE)
                scales[ib] = scale
                max_scale = max_scale if max_scale > scale else scale
            if max_scale == np.float32(0.0):
                continue  # d = 0, qs all zero
            d = max_scale / np.float32(31.0)
            put_fp16(out[row], ob, d)
            id_ = np.float32(1.0) / d
            for ib in range(8):
                l = max(0, min(15, np.int64(nearest_int(np.float32(0.5) * (id_ * scales[ib] - np.float32(1.0))))))
                q2[2 * ib + 1] |= l << 28
            for i in range(16):
                for b in range(4):
                    out[row, ob + 2 + 4 * i + b] = np.uint8((q2[i] >> (8 * b)) & 255)


@kernel
def quantize_iq2_xs(x, qw, out):
    """quantize_iq2_xs(x, out, rows, n, qw): 256 values -> 74 bytes (fp16 d, 32 uint16 of a 9-bit grid index and
    7 sign bits, 16 4-bit scales)."""
    r, n = x.shape
    if qw.shape[0] == 0:
        raise ValueError("IQ2_XS needs an importance matrix")
    grid, kmap, nb = XS_GRID, XS_MAP, XS_NEIGHBOURS
    scales = np.zeros(16, np.float32)
    weight = np.zeros(16, np.float32)
    xval = np.zeros(16, np.float32)
    waux = np.zeros(16, np.float32)
    L = np.zeros(16, np.int64)
    Laux = np.zeros(16, np.int64)
    sqv = np.zeros(4, np.float32)
    on_grid = np.zeros(2, np.bool_)
    on_grid_aux = np.zeros(2, np.bool_)
    block_signs = np.zeros(2, np.int64)
    q2 = np.zeros(32, np.int64)
    for row in range(r):
        wr = 0 if qw.shape[0] == 1 else row
        for ibl in range(n // QK_K):
            base = QK_K * ibl
            ob = 74 * ibl
            for i in range(74):
                out[row, ob + i] = 0
            for i in range(32):
                q2[i] = 0
            max_scale = np.float32(0.0)
            sigma2 = sum_squares(x, row, base) / np.float32(QK_K)
            for ib in range(16):
                xo = base + 16 * ib
                for i in range(16):
                    v = x[row, xo + i]
                    weight[i] = qw[wr, xo + i] * np.sqrt(sigma2 + v * v)
                for i in range(16):
                    waux[i] = np.sqrt(weight[i])
                for k in range(2):
                    block_signs[k] = signs_of(x, row, xo, weight, xval, k, True) & 127
                mx = xval[0]
                for i in range(1, 16):
                    mx = mx if mx > xval[i] else xval[i]
                for i in range(16):
                    L[i] = 0
                if mx < np.float32(1e-15):
                    scales[ib] = 0
                    continue
                scale = iq2_search16(grid, kmap, nb, xval, weight, waux, mx, L, Laux, on_grid, on_grid_aux, sqv)
                if scale < np.float32(0.0):
                    scale = -scale
                    for k in range(2):
                        block_signs[k] = (~block_signs[k]) & 127
                for k in range(2):
                    q2[2 * ib + k] = final_index(kmap, L, 8 * k) | (block_signs[k] << 9)
                if not scale >= np.float32(0.0):
                    raise CkptError(TOO_LARGE)
                scales[ib] = scale
                max_scale = max_scale if max_scale > scale else scale
            if max_scale == np.float32(0.0):
                continue  # d = 0, qs and scales all zero
            d = max_scale / np.float32(31.0)
            put_fp16(out[row], ob, d)
            id_ = np.float32(1.0) / d
            for ib in range(16):
                l = max(0, min(15, np.int64(nearest_int(np.float32(0.5) * (id_ * scales[ib] - np.float32(1.0))))))
                out[row, ob + 66 + ib // 2] |= np.uint8(l << (4 * (ib % 2)))
            for i in range(32):
                out[row, ob + 2 + 2 * i] = np.uint8(q2[i] & 255)
                out[row, ob + 3 + 2 * i] = np.uint8((q2[i] >> 8) & 255)


@kernel
def quantize_iq2_s(x, qw, out):
    """quantize_iq2_s(x, out, rows, n, qw or NULL): 256 values -> 82 bytes (fp16 d, 32 low bytes of the 10-bit
    grid indices, 32 sign bytes, 8 bytes of their high bits, 16 4-bit scales)."""
    r, n = x.shape
    grid, kmap, nb = S_GRID, S_MAP, S_NEIGHBOURS
    scales = np.zeros(16, np.float32)
    weight = np.zeros(16, np.float32)
    xval = np.zeros(16, np.float32)
    waux = np.zeros(16, np.float32)
    L = np.zeros(16, np.int64)
    Laux = np.zeros(16, np.int64)
    sqv = np.zeros(4, np.float32)
    on_grid = np.zeros(2, np.bool_)
    on_grid_aux = np.zeros(2, np.bool_)
    block_signs = np.zeros(2, np.int64)
    for row in range(r):
        wr = 0 if qw.shape[0] <= 1 else row
        for ibl in range(n // QK_K):
            base = QK_K * ibl
            ob = 82 * ibl
            for i in range(82):
                out[row, ob + i] = 0
            max_scale = np.float32(0.0)
            sigma2 = np.float32(2.0) * sum_squares(x, row, base) / np.float32(QK_K)
            for ib in range(16):
                xo = base + 16 * ib
                if qw.shape[0] > 0:
                    for i in range(16):
                        v = x[row, xo + i]
                        weight[i] = qw[wr, xo + i] * np.sqrt(sigma2 + v * v)
                else:
                    for i in range(16):
                        v = x[row, xo + i]
                        weight[i] = np.float32(0.25) * sigma2 + v * v
                for i in range(16):
                    waux[i] = np.sqrt(weight[i])
                for k in range(2):
                    block_signs[k] = signs_of(x, row, xo, weight, xval, k, False)
                mx = xval[0]
                for i in range(1, 16):
                    mx = mx if mx > xval[i] else xval[i]
                for i in range(16):
                    L[i] = 0
                if mx < np.float32(1e-8):
                    scales[ib] = 0
                    continue
                scale = iq2_search16(grid, kmap, nb, xval, weight, waux, mx, L, Laux, on_grid, on_grid_aux, sqv)
                if scale < np.float32(0.0):
                    scale = -scale
                    for k in range(2):
                        block_signs[k] = (~block_signs[k]) & 255
                for k in range(2):
                    gi = final_index(kmap, L, 8 * k)
                    i8 = 2 * ib + k
                    out[row, ob + 2 + i8] = np.uint8(gi & 255)
                    out[row, ob + 66 + i8 // 4] |= np.uint8((gi >> 8) << (2 * (i8 % 4)))
                    out[row, ob + 2 + QK_K // 8 + i8] = np.uint8(block_signs[k])
                if not scale >= np.float32(0.0):
                    raise CkptError(TOO_LARGE)
                scales[ib] = scale
                max_scale = max_scale if max_scale > scale else scale
            if max_scale == np.float32(0.0):
                continue  # d = 0; the grid indices and signs stay, as in C
            d = max_scale / np.float32(31.0)
            put_fp16(out[row], ob, d * np.float32(0.9875))
            id_ = np.float32(1.0) / d
            for ib in range(16):
                l = max(0, min(15, np.int64(nearest_int(np.float32(0.5) * (id_ * scales[ib] - np.float32(1.0))))))
                out[row, ob + 74 + ib // 2] |= np.uint8(l << (4 * (ib % 2)))


ENCODERS = {
    "IQ2_XXS": Encoder(cpu_encoder(__name__, "quantize_iq2_xxs", 256, 66), static=False, weighted=True,
                       devices=("cpu",), rank=10),
    "IQ2_XS": Encoder(cpu_encoder(__name__, "quantize_iq2_xs", 256, 74), static=False, weighted=True,
                      devices=("cpu",), rank=10),
    "IQ2_S": Encoder(cpu_encoder(__name__, "quantize_iq2_s", 256, 82), static=True, weighted=True,
                     devices=("cpu",), rank=10),
}
