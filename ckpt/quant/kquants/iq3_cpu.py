"""`IQ3_XXS` and `IQ3_S` block encoders as compiled CPU kernels (`ckpt.quant.kquants.jit`), byte for byte what
llama.cpp's `quantize_iq3_xxs` / `quantize_iq3_s` write (`ggml/src/ggml-quants.c`, MIT; the llama-cpp-python 0.3.36
vendoring): `quantize_row_iq3_xxs_impl(256, ...)` and `quantize_row_iq3_s_impl(32, ...)`, without an importance
(`quant_weights == NULL`: weights x^2, what `quantize_row_*_ref` and a llama-quantize run without an imatrix do)
and with one (weights qw * sqrt(sigma2 + x^2)). Both paths exist in ggml and neither type requires an imatrix.

Kept from the C code on purpose, because they are in the bytes llama.cpp writes:
- IQ3_XXS makes every group of 8 an even number of flips (the 8th sign bit is implied): an odd group flips its
  least weighted value, which then enters the search negative;
- IQ3_S advances its `qs` and `signs` pointers only for sub-blocks of 32 that are not all zero (a zero sub-block
  shifts the following ones' grid indices and signs down), and keeps them when the whole block's scale is 0;
- the scale search's float32 arithmetic in the C order (`jit`'s rules), ggml's `nearest_int`, the fudge factors
  1.0125 / 1.033 of the fp16 block scale.

Where the C code aborts the process (`iq3_find_best_neighbour`'s `GGML_ASSERT(grid_index >= 0)`: every candidate
distance is Inf/NaN: |x| past ~1e13, where weight * diff^2 ~ |x|^3 overflows float32), the kernel raises a
`CkptError`: llama-quantize cannot write such a tensor either.
"""

from __future__ import annotations

from ckpt.errors import CkptError
from ckpt.lazy import numpy as np
from ckpt.quant.kquants import Encoder
from ckpt.quant.kquants.iq3_grids import iq3_tables
from ckpt.quant.kquants.jit import cpu_encoder, kernel, nearest_int, put_fp16  # noqa: F401 (kernels call them)

JIT_TABLES = {
    "IQ3XXS_GRID": lambda np: iq3_tables(np, 256)[0],
    "IQ3XXS_MAP": lambda np: iq3_tables(np, 256)[1],
    "IQ3XXS_NEIGHBOURS": lambda np: iq3_tables(np, 256)[2],
    "IQ3S_GRID": lambda np: iq3_tables(np, 512)[0],
    "IQ3S_MAP": lambda np: iq3_tables(np, 512)[1],
    "IQ3S_NEIGHBOURS": lambda np: iq3_tables(np, 512)[2],
}

TOO_LARGE = ("values too large for ggml's IQ3 grid search (its weighted squared errors overflow float32; "
             "llama-quantize aborts on them)")


@kernel
def iq3_best_neighbour(nbrs, start, grid, xval, waux, o, scale, L):
    """iq3_find_best_neighbour: the neighbour list at nbrs[start] (count, then indices), group xval[o:o+4]."""
    num = np.int64(nbrs[start])
    best_d2 = np.float32(3.4028234663852886e38)  # FLT_MAX
    grid_index = -1
    for j in range(1, num + 1):
        g = np.int64(nbrs[start + j])
        d2 = np.float32(0.0)
        for i in range(4):
            diff = scale * np.float32(grid[g, i]) - xval[o + i]
            d2 += waux[o + i] * diff * diff
        if d2 < best_d2:
            best_d2 = d2
            grid_index = g
    if grid_index < 0:
        raise CkptError(TOO_LARGE)
    for i in range(4):
        L[o + i] = (grid[grid_index, i] - 1) // 2
    return grid_index


@kernel
def iq3_group_index(L, o):
    """The map index of the 4 levels L[o:o+4] (3 bits each)."""
    return np.int64(L[o]) | (np.int64(L[o + 1]) << 3) | (np.int64(L[o + 2]) << 6) | (np.int64(L[o + 3]) << 9)


@kernel
def iq3_search(xval, weight, waux, L, Laux, on_grid, on_grid_aux, vmax, nsteps, xxs, grid, kmap, nbrs):
    """The scale search of one sub-block of 32 (both impls; `xxs`: IQ3_XXS's variant, whose groups start on the
    grid and whose second pass skips the groups on it) over is = -nsteps..nsteps, then the second pass that puts
    the off-grid groups on the grid at the found scale. Leaves the levels in L; returns the scale."""
    best = np.float32(0.0)
    scale = vmax / np.float32(15.0)
    for k in range(8):
        on_grid[k] = xxs
    for step in range(-nsteps, nsteps + 1):
        idv = (np.float32(15.0) + np.float32(step) * np.float32(0.2)) / vmax
        this_scale = np.float32(1.0) / idv
        for k in range(8):
            for i in range(4):
                lv = nearest_int(np.float32(0.5) * (idv * xval[4 * k + i] - np.float32(1.0)))
                Laux[4 * k + i] = max(0, min(7, lv))
            gi = kmap[iq3_group_index(Laux, 4 * k)]
            on_grid_aux[k] = True
            if gi < 0:
                on_grid_aux[k] = False
                iq3_best_neighbour(nbrs, -np.int64(gi) - 1, grid, xval, waux, 4 * k, this_scale, Laux)
        sumqx = np.float32(0.0)
        sumq2 = np.float32(0.0)
        for i in range(32):
            w = weight[i]
            q = np.float32(2 * Laux[i] + 1)
            sumqx += w * xval[i] * q
            sumq2 += w * q * q
        if sumq2 > np.float32(0.0) and sumqx * sumqx > best * sumq2:
            scale = sumqx / sumq2
            best = scale * sumqx
            for i in range(32):
                L[i] = Laux[i]
            for k in range(8):
                on_grid[k] = on_grid_aux[k]
    n_off = 0
    for k in range(8):
        if not on_grid[k]:
            n_off += 1
    if n_off > 0 and scale > np.float32(0.0):
        idv = np.float32(1.0) / scale
        for k in range(8):
            if xxs and on_grid[k]:
                continue
            u = 0
            for i in range(4):
                lv = nearest_int(np.float32(0.5) * (idv * xval[4 * k + i] - np.float32(1.0)))
                u |= max(0, min(7, lv)) << (3 * i)
            gi = np.int64(kmap[u])
            if gi < 0:
                gi = iq3_best_neighbour(nbrs, -gi - 1, grid, xval, waux, 4 * k, scale, L)
            for i in range(4):
                L[4 * k + i] = (grid[gi, i] - 1) // 2
        sumqx = np.float32(0.0)
        sumq2 = np.float32(0.0)
        for i in range(32):
            w = weight[i]
            q = np.float32(2 * L[i] + 1)
            sumqx += w * xval[i] * q
            sumq2 += w * q * q
        if sumq2 > np.float32(0.0):
            scale = sumqx / sumq2
    return scale


@kernel
def iq3_weights(x, xo, qw, qwo, sigma2, weight, waux):
    """The sub-block's weights: x^2 without an importance, qw * sqrt(sigma2 + x^2) with one; waux = sqrt."""
    for i in range(32):
        v = x[xo + i]
        if qwo < 0:
            weight[i] = v * v
        else:
            weight[i] = qw[qwo + i] * np.sqrt(sigma2 + v * v)
        waux[i] = np.sqrt(weight[i])


@kernel
def iq3_sigma2(x, base):
    sumx2 = np.float32(0.0)
    for i in range(256):
        v = x[base + i]
        sumx2 += v * v
    return np.float32(2.0) * sumx2 / np.float32(256.0)


@kernel
def iq3_xxs_rows(x, qw, out):
    """quantize_iq3_xxs: rows [r, n] -> blocks of 98 bytes (d fp16, 64 grid indices, 8 x uint32 scale + signs)."""
    grid = IQ3XXS_GRID  # noqa: F821 (JIT_TABLES)
    kmap = IQ3XXS_MAP  # noqa: F821
    nbrs = IQ3XXS_NEIGHBOURS  # noqa: F821
    r, n = x.shape
    weight = np.empty(32, np.float32)
    waux = np.empty(32, np.float32)
    xval = np.empty(32, np.float32)
    L = np.zeros(32, np.int8)
    Laux = np.zeros(32, np.int8)
    on_grid = np.zeros(8, np.bool_)
    on_grid_aux = np.zeros(8, np.bool_)
    block_signs = np.zeros(4, np.int64)
    scales = np.zeros(8, np.float32)
    sas = np.zeros(8, np.int64)
    for row in range(r):
        xr = x[row]
        qr = xr if qw.shape[0] == 0 else qw[0] if qw.shape[0] == 1 else qw[row]  # xr: unread (no importance)
        orow = out[row]
        for ibl in range(n // 256):
            o = 98 * ibl
            base = 256 * ibl
            for j in range(98):
                orow[o + j] = 0
            max_scale = np.float32(0.0)
            sigma2 = iq3_sigma2(xr, base)
            for ib in range(8):
                xo = base + 32 * ib
                iq3_weights(xr, xo, qr, xo if qw.shape[0] > 0 else -1, sigma2, weight, waux)
                for k in range(4):
                    nflip = 0
                    s = 0
                    for i in range(8):
                        v = xr[xo + 8 * k + i]
                        if v >= np.float32(0.0):
                            xval[8 * k + i] = v
                        else:
                            xval[8 * k + i] = -v
                            nflip += 1
                            s |= 1 << i
                    if nflip % 2:
                        imin = 0
                        v = xr[xo + 8 * k]
                        vmin = weight[8 * k] * v * v
                        for i in range(1, 8):
                            v = xr[xo + 8 * k + i]
                            ax = weight[8 * k + i] * v * v
                            if ax < vmin:
                                vmin = ax
                                imin = i
                        xval[8 * k + imin] = -xval[8 * k + imin]
                        s ^= 1 << imin
                    block_signs[k] = s & 127
                vmax = xval[0]
                for i in range(1, 32):
                    vmax = vmax if vmax > xval[i] else xval[i]
                for i in range(32):
                    L[i] = 0
                sas[ib] = 0
                if vmax < np.float32(1e-8):  # GROUP_MAX_EPS_IQ3_XXS
                    scales[ib] = np.float32(0.0)
                    continue
                scale = iq3_search(xval, weight, waux, L, Laux, on_grid, on_grid_aux, vmax, 15, True, grid, kmap,
                                   nbrs)
                if scale < np.float32(0.0):
                    scale = -scale
                    for k in range(4):
                        block_signs[k] = (~block_signs[k]) & 127
                for k in range(8):
                    gi = kmap[iq3_group_index(L, 4 * k)]
                    if gi < 0:
                        raise CkptError(TOO_LARGE)
                    orow[o + 2 + 8 * ib + k] = np.uint8(gi)
                sas[ib] = block_signs[0] | (block_signs[1] << 7) | (block_signs[2] << 14) | (block_signs[3] << 21)
                if not scale >= np.float32(0.0):
                    raise CkptError(TOO_LARGE)
                scales[ib] = scale
                max_scale = max_scale if max_scale > scale else scale
            if max_scale == np.float32(0.0):
                for j in range(2, 98):
                    orow[o + j] = 0
                continue
            d = max_scale / np.float32(31.0)
            put_fp16(orow, o, d * np.float32(1.0125))
            idv = np.float32(1.0) / d
            for ib in range(8):
                lv = nearest_int(np.float32(0.5) * (idv * scales[ib] - np.float32(1.0)))
                word = sas[ib] | (np.int64(max(0, min(15, lv))) << 28)
                for b in range(4):
                    orow[o + 66 + 4 * ib + b] = np.uint8((word >> (8 * b)) & 255)


@kernel
def iq3_s_rows(x, qw, out):
    """quantize_iq3_s: rows [r, n] -> blocks of 110 bytes (d fp16, qs[64], qh[8], signs[32], scales[4])."""
    grid = IQ3S_GRID  # noqa: F821 (JIT_TABLES)
    kmap = IQ3S_MAP  # noqa: F821
    nbrs = IQ3S_NEIGHBOURS  # noqa: F821
    r, n = x.shape
    weight = np.empty(32, np.float32)
    waux = np.empty(32, np.float32)
    xval = np.empty(32, np.float32)
    L = np.zeros(32, np.int8)
    Laux = np.zeros(32, np.int8)
    on_grid = np.zeros(8, np.bool_)
    on_grid_aux = np.zeros(8, np.bool_)
    block_signs = np.zeros(4, np.int64)
    scales = np.zeros(8, np.float32)
    for row in range(r):
        xr = x[row]
        qr = xr if qw.shape[0] == 0 else qw[0] if qw.shape[0] == 1 else qw[row]  # xr: unread (no importance)
        orow = out[row]
        for ibl in range(n // 256):
            o = 110 * ibl
            base = 256 * ibl
            for j in range(110):
                orow[o + j] = 0
            qs = o + 2  # advanced per sub-block written, as the C pointers are
            signs = o + 74
            max_scale = np.float32(0.0)
            sigma2 = iq3_sigma2(xr, base)
            for ib in range(8):
                xo = base + 32 * ib
                iq3_weights(xr, xo, qr, xo if qw.shape[0] > 0 else -1, sigma2, weight, waux)
                for k in range(4):
                    s = 0
                    for i in range(8):
                        v = xr[xo + 8 * k + i]
                        if v >= np.float32(0.0):
                            xval[8 * k + i] = v
                        else:
                            xval[8 * k + i] = -v
                            s |= 1 << i
                    block_signs[k] = s
                vmax = xval[0]
                for i in range(1, 32):
                    vmax = vmax if vmax > xval[i] else xval[i]
                for i in range(32):
                    L[i] = 0
                if vmax == np.float32(0.0):
                    scales[ib] = np.float32(0.0)
                    continue
                scale = iq3_search(xval, weight, waux, L, Laux, on_grid, on_grid_aux, vmax, 9, False, grid, kmap,
                                   nbrs)
                if scale < np.float32(0.0):
                    scale = -scale
                    for k in range(4):
                        block_signs[k] = (~block_signs[k]) & 255
                for k in range(8):
                    gi = np.int64(kmap[iq3_group_index(L, 4 * k)])
                    if gi < 0:
                        raise CkptError(TOO_LARGE)
                    orow[qs + k] = np.uint8(gi & 255)
                    orow[o + 66 + ib] |= np.uint8((gi >> 8) << k)
                qs += 8
                for k in range(4):
                    orow[signs + k] = np.uint8(block_signs[k])
                signs += 4
                if not scale >= np.float32(0.0):
                    raise CkptError(TOO_LARGE)
                scales[ib] = scale
                max_scale = max_scale if max_scale > scale else scale
            if max_scale == np.float32(0.0):
                continue
            d = max_scale / np.float32(31.0)
            put_fp16(orow, o, d * np.float32(1.033))
            idv = np.float32(1.0) / d
            for ib in range(0, 8, 2):
                l1 = max(0, min(15, nearest_int(np.float32(0.5) * (idv * scales[ib] - np.float32(1.0)))))
                l2 = max(0, min(15, nearest_int(np.float32(0.5) * (idv * scales[ib + 1] - np.float32(1.0)))))
                orow[o + 106 + ib // 2] = np.uint8(l1 | (l2 << 4))


_XXS = Encoder(cpu_encoder(__name__, "iq3_xxs_rows", 256, 98), static=True, weighted=True, devices=("cpu",), rank=10)
_S = Encoder(cpu_encoder(__name__, "iq3_s_rows", 256, 110), static=True, weighted=True, devices=("cpu",), rank=10)

ENCODERS = {"IQ3_XXS": _XXS, "IQ3_S": _S}
