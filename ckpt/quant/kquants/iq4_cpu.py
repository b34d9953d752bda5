"""`IQ4_NL` and `IQ4_XS` as compiled CPU kernels (`ckpt.quant.kquants.jit`), without and with an importance matrix:
byte for byte what llama.cpp's `quantize_iq4_nl` / `quantize_iq4_xs` write with `quant_weights` NULL or not, i.e.
`quantize_row_iq4_nl_impl` (`ntry` 7) in `ggml/src/ggml-quants.c` of llama.cpp 0c1e57098 as vendored by the
llama-cpp-python 0.3.36 sdist (MIT), ported loop for loop in float32.

Why beside the torch encoders of `iq4`: those vectorize across blocks and stay the CUDA path; on the CPU this
scalar search (16 candidate scales per block of 32) with ggml's binary search `best_index_int8` replaced by an exact
table look-up runs ~4.5x faster than they do and than ggml's C (1 thread: ~20 M values/s against ~4.5), and the
importance path (weights qw[j] * sqrt(sigma2 + x[j]^2) instead of x[j]^2) exists only here.
"""

from __future__ import annotations

from ckpt.lazy import numpy as np

from ckpt.quant.kquants import Encoder
from ckpt.quant.kquants.jit import cpu_encoder, kernel, nearest_int, put_fp16

# kvalues_iq4nl (ggml-common.h, MIT)
KVALUES_IQ4NL_DATA = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)


def _index_table(np):
    """best_index_int8(16, kvalues_iq4nl, x) by floor(2x), as a table of 436 rows (floor(2x) = -232 .. 203).

    The C function ends its binary search with kv[mu-1] <= x < kv[mu] and returns `x - kv[mu-1] < kv[mu] - x ?
    mu-1 : mu` in float32; for these integer kvalues both differences are exact near the midpoint (it lies in the
    same binade as the half gap), so the answer switches exactly at the midpoint (ties go up). Midpoints are
    multiples of 1/2, so the index is the number of midpoints <= x, a function of floor(2x) alone (2x is exact);
    x <= kv[0] and x >= kv[15] fall out of the clamp. The same table as `iq4._tables`, checked value by value
    against the C rule in tests/test_kquants_iq4.py and tests/test_kquants_cpu_legacy_iq4.py."""
    kv = np.array(KVALUES_IQ4NL_DATA, dtype=np.float32)
    mids = (kv[:-1] + kv[1:]) * np.float32(0.5)
    rows = np.arange(-232, 204, dtype=np.float32) * np.float32(0.5)
    return np.searchsorted(mids, rows, side="right").astype(np.uint8)


JIT_TABLES = {"KV": lambda np: np.array(KVALUES_IQ4NL_DATA, dtype=np.float32),
              "IQ4_INDEX": _index_table,
              "IQ4_VALUE": lambda np: np.array(KVALUES_IQ4NL_DATA, dtype=np.float32)[_index_table(np)]}
KV = IQ4_INDEX = IQ4_VALUE = None  # the tables above, in the compiled kernels' globals


@kernel
def iq4_bin(x):
    """The row of x in IQ4_INDEX / IQ4_VALUE: floor(2x) clamped to -232 .. 203, plus 232; NaN -> the top row (the C
    binary search sends NaN to 15: all its comparisons fail)."""
    t = np.floor(x * np.float32(2.0))
    if t < np.float32(203.0):
        if t > np.float32(-232.0):
            return np.int64(t) + 232
        return 0
    return 435


@kernel
def best_index_iq4(x):
    """ggml's `best_index_int8(16, kvalues_iq4nl, x)`."""
    return IQ4_INDEX[iq4_bin(x)]


@kernel
def block_scale(x, off, weight):
    """The first loop of `quantize_row_iq4_nl_impl` for the block of 32 at x[off:] (ntry 7): its scale d, 0 for a
    block whose largest |x| is below GROUP_MAX_EPS."""
    amax = np.float32(0.0)
    mx = np.float32(0.0)
    for j in range(32):
        ax = abs(x[off + j])
        if ax > amax:
            amax = ax
            mx = x[off + j]
    if amax < np.float32(1e-15):  # GROUP_MAX_EPS
        return np.float32(0.0)
    d = -mx / KV[0]
    inv = np.float32(1.0) / d
    sumqx = np.float32(0.0)
    sumq2 = np.float32(0.0)
    for j in range(32):
        xj = x[off + j]
        q = IQ4_VALUE[iq4_bin(inv * xj)]
        w = weight[j]
        sumqx += w * q * xj
        sumq2 += w * q * q
    d = sumqx / sumq2 if sumq2 > np.float32(0.0) else np.float32(0.0)
    best = d * sumqx
    for itry in range(-7, 8):
        inv = np.float32(itry - 127) / mx  # (itry + values[0]) / max: an int converted, then divided
        sumqx = np.float32(0.0)
        sumq2 = np.float32(0.0)
        for j in range(32):
            xj = x[off + j]
            q = IQ4_VALUE[iq4_bin(inv * xj)]
            w = weight[j]
            sumqx += w * q * xj
            sumq2 += w * q * q
        if sumq2 > np.float32(0.0) and sumqx * sumqx > best * sumq2:
            d = sumqx / sumq2
            best = d * sumqx
    return d


@kernel
def block_weights(x, off, q, qoff, sigma2, weight):
    """weight[j] of a block: qw[j] * sqrtf(sigma2 + x[j]^2) with an importance (`q` of length > 0), else x[j]^2."""
    if q.shape[0] == 0:
        for j in range(32):
            xj = x[off + j]
            weight[j] = xj * xj
    else:
        for j in range(32):
            xj = x[off + j]
            weight[j] = q[qoff + j] * np.sqrt(sigma2 + xj * xj)


@kernel
def super_sigma2(x, off, size):
    """sigma2 of `quantize_row_iq4_nl_impl`: the sum of squares of the super-block times 2/size."""
    s = np.float32(0.0)
    for j in range(size):
        s += x[off + j] * x[off + j]
    return s * (np.float32(2.0) / np.float32(size))


@kernel
def pack_nibbles(L, out, pos, nvals):
    """q4[16*i + j] = L[32*i + j] | L[32*i + 16 + j] << 4."""
    for i in range(nvals // 32):
        for j in range(16):
            out[pos + 16 * i + j] = np.uint8(L[32 * i + j] | (L[32 * i + 16 + j] << 4))


@kernel
def iq4_nl_rows(x, qw, out):
    """quantize_iq4_nl(x, out, r, n, qw or NULL): blocks {fp16 d; uint8 qs[16]} of 18 bytes."""
    r, n = x.shape
    weight = np.empty(32, dtype=np.float32)
    L = np.empty(32, dtype=np.uint8)
    none = np.empty(0, dtype=np.float32)
    for i in range(r):
        row = x[i]
        q = none if qw.shape[0] == 0 else qw[0] if qw.shape[0] == 1 else qw[i]
        o = out[i]
        for ib in range(n // 32):
            off = ib * 32
            sigma2 = super_sigma2(row, off, 32) if q.shape[0] else np.float32(0.0)
            block_weights(row, off, q, off, sigma2, weight)
            d = block_scale(row, off, weight)
            p = ib * 18
            put_fp16(o, p, d)
            inv = np.float32(1.0) / d if d != np.float32(0.0) else np.float32(0.0)
            for j in range(32):
                L[j] = best_index_iq4(inv * row[off + j])
            pack_nibbles(L, o, p + 2, 32)


@kernel
def iq4_xs_rows(x, qw, out):
    """quantize_iq4_xs(x, out, r, n, qw or NULL): super-blocks of 256 {fp16 d; uint16 scales_h; uint8 scales_l[4];
    uint8 qs[128]} of 136 bytes."""
    r, n = x.shape
    weight = np.empty(32, dtype=np.float32)
    L = np.empty(256, dtype=np.uint8)
    scales = np.empty(8, dtype=np.float32)
    none = np.empty(0, dtype=np.float32)
    for i in range(r):
        row = x[i]
        q = none if qw.shape[0] == 0 else qw[0] if qw.shape[0] == 1 else qw[i]
        o = out[i]
        for ibl in range(n // 256):
            base = ibl * 256
            sigma2 = super_sigma2(row, base, 256) if q.shape[0] else np.float32(0.0)
            max_scale = np.float32(0.0)
            amax_scale = np.float32(0.0)
            for ib in range(8):
                off = base + ib * 32
                block_weights(row, off, q, off, sigma2, weight)
                d = block_scale(row, off, weight)
                scales[ib] = d
                abs_d = abs(d)
                if abs_d > amax_scale:
                    amax_scale = abs_d
                    max_scale = d
            p = ibl * 136
            d = -max_scale / np.float32(32.0)
            put_fp16(o, p, d)
            inv = np.float32(1.0) / d if d != np.float32(0.0) else np.float32(0.0)
            scales_h = 0
            for ib in range(8):
                l = max(-32, min(31, nearest_int(inv * scales[ib])))
                dl = d * np.float32(l)
                idl = np.float32(1.0) / dl if dl != np.float32(0.0) else np.float32(0.0)
                off = base + ib * 32
                for j in range(32):
                    L[ib * 32 + j] = best_index_iq4(idl * row[off + j])
                l += 32
                if ib % 2 == 0:
                    o[p + 4 + ib // 2] = np.uint8(l & 0xF)
                else:
                    o[p + 4 + ib // 2] |= np.uint8((l & 0xF) << 4)
                scales_h |= (l >> 4) << (2 * ib)
            o[p + 2] = np.uint8(scales_h & 0xFF)
            o[p + 3] = np.uint8((scales_h >> 8) & 0xFF)
            pack_nibbles(L, o, p + 8, 256)


def _enc(kernel_name: str, block: int, block_bytes: int) -> Encoder:
    return Encoder(cpu_encoder(__name__, kernel_name, block, block_bytes), static=True, weighted=True,
                   devices=("cpu",), rank=10)


ENCODERS = {"IQ4_NL": _enc("iq4_nl_rows", 32, 18), "IQ4_XS": _enc("iq4_xs_rows", 256, 136)}
