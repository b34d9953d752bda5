"""The one-scale block types as compiled CPU kernels (`ckpt.quant.kquants.jit`): `TQ1_0`, `TQ2_0` (ternary,
BitNet b1.58 / TriLM), `MXFP4` (OCP microscaling fp4, gpt-oss), `Q1_0` and `Q2_0`, byte for byte what llama.cpp's
`quantize_row_<type>_ref` writes (`ggml/src/ggml-quants.c`, MIT; the llama-cpp-python 0.3.36 vendoring).

Each is also registered for the importance path (`weighted`) with the same kernel, the importance unread: ggml's
`quantize_tq1_0` / `quantize_tq2_0` / `quantize_mxfp4` ignore `quant_weights`, and `quantize_q1_0` /
`quantize_q2_0` given one run the same `_ref` function row by row; so `llama-quantize --imatrix` writes these
types exactly as without.

What the C code does at the edges is kept, as x86-64 llama.cpp builds do it (the oracle of the tests): a block
scale d below ~3e-39 makes 1/d infinite and every x/d infinite or NaN; `lroundf` of those gives LONG_MIN, whose
int truncation is 0 (TQ: the value encodes as 0), `(int)roundf` gives INT_MIN (Q2_0: clamped to level 0, i.e. -d);
MXFP4's `(uint8_t)` of a negative exponent (amax below 2^-125) keeps the low byte of the int32 conversion.
"""

from __future__ import annotations

import math

from ckpt.lazy import numpy as np
from ckpt.quant.kquants import Encoder
from ckpt.quant.kquants.jit import cpu_encoder, kernel, put_fp16  # noqa: F401 (kernels call them)

JIT_TABLES = {"KVALUES_MXFP4": lambda np: np.array((0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12),
                                                   dtype=np.float32)}  # kvalues_mxfp4 (ggml-common.h, MIT)


@kernel
def c_lroundf_int(v):
    """(int)lroundf(v) (glibc, x86-64): half away from zero; NaN, Inf and |v| >= 2^63 give LONG_MIN, whose low
    32 bits are 0; other results wrap to int32."""
    if not abs(v) < np.float32(9.223372036854775807e18):
        return np.int64(0)
    a = np.floor(abs(np.float64(v)) + 0.5)  # exact: v is float32
    r = np.int64(a) if v >= np.float32(0.0) else -np.int64(a)
    return ((r + 2147483648) & 4294967295) - 2147483648


@kernel
def c_roundf_int(v):
    """(int)roundf(v) as x86-64 converts it (cvttss2si): out of int range, NaN and Inf give INT_MIN."""
    if not abs(v) < np.float32(2147483648.0):
        return np.int64(-2147483648)
    a = np.floor(abs(np.float64(v)) + 0.5)
    return np.int64(a) if v >= np.float32(0.0) else -np.int64(a)


@kernel
def amax_of(x, a, n):
    """MAX(amax, fabsf(v)) over x[a:a+n] from 0."""
    amax = np.float32(0.0)
    for j in range(n):
        v = abs(x[a + j])
        amax = amax if amax > v else v
    return amax


@kernel
def tq1_0_rows(x, qw, out):
    """quantize_row_tq1_0_ref: blocks of 256 -> qs[48] (5 trits a byte), qh[4] (4 trits), d fp16 (54 bytes)."""
    r, n = x.shape
    for row in range(r):
        xr = x[row]
        orow = out[row]
        for ib in range(n // 256):
            base = 256 * ib
            o = 54 * ib
            d = amax_of(xr, base, 256)
            idv = np.float32(1.0) / d if d != np.float32(0.0) else np.float32(0.0)
            put_fp16(orow, o + 52, d)
            p = base
            for m in range(32):
                q = 0
                for k in range(5):
                    q = (q * 3 + c_lroundf_int(xr[p + m + 32 * k] * idv) + 1) & 255
                orow[o + m] = np.uint8(((q * 256 + 242) // 243) & 255)
            p += 160
            for m in range(16):
                q = 0
                for k in range(5):
                    q = (q * 3 + c_lroundf_int(xr[p + m + 16 * k] * idv) + 1) & 255
                orow[o + 32 + m] = np.uint8(((q * 256 + 242) // 243) & 255)
            p += 80
            for j in range(4):
                q = 0
                for k in range(4):
                    q = (q * 3 + c_lroundf_int(xr[p + j + 4 * k] * idv) + 1) & 255
                q = (q * 3) & 255
                orow[o + 48 + j] = np.uint8(((q * 256 + 242) // 243) & 255)


@kernel
def tq2_0_rows(x, qw, out):
    """quantize_row_tq2_0_ref: blocks of 256 -> qs[64] (4 trits a byte, 2 bits each), d fp16 (66 bytes)."""
    r, n = x.shape
    for row in range(r):
        xr = x[row]
        orow = out[row]
        for ib in range(n // 256):
            base = 256 * ib
            o = 66 * ib
            d = amax_of(xr, base, 256)
            idv = np.float32(1.0) / d if d != np.float32(0.0) else np.float32(0.0)
            put_fp16(orow, o + 64, d)
            for j in range(2):
                p = base + 128 * j
                for m in range(32):
                    q = 0
                    for k in range(4):
                        q += ((c_lroundf_int(xr[p + m + 32 * k] * idv) + 1) & 3) << (2 * k)
                    orow[o + 32 * j + m] = np.uint8(q & 255)


@kernel
def mxfp4_best_index(v, d):
    """best_index_mxfp4: the first of the 16 fp4 levels (times d) nearest to v."""
    best = 0
    best_err = abs(KVALUES_MXFP4[0] * d - v)  # noqa: F821 (JIT_TABLES)
    for i in range(1, 16):
        err = abs(KVALUES_MXFP4[i] * d - v)  # noqa: F821
        if err < best_err:
            best = i
            best_err = err
    return best


@kernel
def mxfp4_rows(x, qw, out):
    """quantize_row_mxfp4_ref: blocks of 32 -> e (E8M0 exponent), qs[16] (17 bytes)."""
    r, n = x.shape
    for row in range(r):
        xr = x[row]
        orow = out[row]
        for ib in range(n // 32):
            base = 32 * ib
            o = 17 * ib
            amax = np.float32(0.0)
            for j in range(32):
                a = abs(xr[base + j])
                if amax < a:
                    amax = a
            e = 0
            if amax > np.float32(0.0):
                f = np.floor(np.log2(amax)) - np.float32(2.0) + np.float32(127.0)  # log2f: libm's, as in C
                e = np.int64(np.int32(f)) & 255
            d = np.float32(math.ldexp(1.0, e - 128))  # GGML_E8M0_TO_FP32_HALF: 2^(e-128), exact
            orow[o] = np.uint8(e)
            for j in range(16):
                x0 = mxfp4_best_index(xr[base + j], d)
                x1 = mxfp4_best_index(xr[base + 16 + j], d)
                orow[o + 1 + j] = np.uint8(x0 | (x1 << 4))


@kernel
def q1_0_rows(x, qw, out):
    """quantize_row_q1_0_ref: blocks of 128 -> d fp16 (mean |x|), qs[16] (sign bits: x >= 0 sets) (18 bytes)."""
    r, n = x.shape
    for row in range(r):
        xr = x[row]
        orow = out[row]
        for ib in range(n // 128):
            base = 128 * ib
            o = 18 * ib
            sum_abs = np.float32(0.0)
            for j in range(128):
                sum_abs += abs(xr[base + j])
            put_fp16(orow, o, sum_abs / np.float32(128.0))
            for b in range(16):
                q = 0
                for k in range(8):
                    if xr[base + 8 * b + k] >= np.float32(0.0):
                        q |= 1 << k
                orow[o + 2 + b] = np.uint8(q)


@kernel
def q2_0_rows(x, qw, out):
    """quantize_row_q2_0_ref: blocks of 64 -> d fp16 (amax), qs[16] (round(x/d) + 1 clamped to 0..3, 2 bits
    each) (18 bytes)."""
    r, n = x.shape
    for row in range(r):
        xr = x[row]
        orow = out[row]
        for ib in range(n // 64):
            base = 64 * ib
            o = 18 * ib
            amax = np.float32(0.0)
            for j in range(64):
                a = abs(xr[base + j])
                if a > amax:
                    amax = a
            idv = np.float32(1.0) / amax if amax > np.float32(0.0) else np.float32(0.0)
            put_fp16(orow, o, amax)
            for b in range(16):
                q = 0
                for k in range(4):
                    lv = c_roundf_int(xr[base + 4 * b + k] * idv) + 1
                    lv = 0 if lv < 0 else 3 if lv > 3 else lv
                    q |= lv << (2 * k)
                orow[o + 2 + b] = np.uint8(q)


def _both(kernel_name: str, block: int, block_bytes: int) -> Encoder:
    """One kernel for both paths (ggml's quantizer of these types does not read the importance)."""
    return Encoder(cpu_encoder(__name__, kernel_name, block, block_bytes), static=True, weighted=True,
                   devices=("cpu",), rank=10)


ENCODERS = {
    "TQ1_0": _both("tq1_0_rows", 256, 54),
    "TQ2_0": _both("tq2_0_rows", 256, 66),
    "MXFP4": _both("mxfp4_rows", 32, 17),
    "Q1_0": _both("q1_0_rows", 128, 18),
    "Q2_0": _both("q2_0_rows", 64, 18),
}
