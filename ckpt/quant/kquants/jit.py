"""Compiled CPU kernels for the block encoders: ggml's C quantizers written as plain Python over scalars and numpy
arrays and compiled by numba (LLVM) on first use, so they run at the C code's speed with its float32 arithmetic.

Why numba: the torch encoders of this package vectorize across blocks and cap at ~9 M values/s on 2 cores, where
ggml's scalar C does ~24 M/s; the IQ types' searches (grids, neighbour lists) do not vectorize at all. numba ships
wheels for every platform torch does, needs no compiler on the user's machine, and compiles to the same
arithmetic as C when fast-math is off (no FMA contraction, no reassociation: bytes stay ggml's). The torch
encoders stay for CUDA (`Encoder.devices`).

How a kernel module is written and compiled (`@kernel`, `compiled`, `JIT_TABLES`): `ckpt.jit`. Here, what the
encoders share: the scalar helpers below and the runner of an entry kernel over row pieces on threads
(`encode_rows`).

Writing a kernel so that it gives C's bits: every float is float32 (`np.float32(0.5)`, never a bare `0.5`, which
is float64 and promotes the expression), `/` only between floats (int / int is float64), accumulations in the C
loop's order, `nearest_int` as below. The entry kernel of an encoder has the signature
`fn(x: float32[r, n], qw: float32[k, n], out: uint8[r, n / block * block_bytes])` with k = 0 (no importance),
k = 1 (one for every row) or k = r (one row each).
"""

from __future__ import annotations

import math

from ckpt.jit import compiled, kernel
from ckpt.lazy import numpy as np, torch


# ------------------------------------------------------------------------------------------- scalar helpers


@kernel
def nearest_int(fval):
    """ggml's `nearest_int`, its own bit trick: the low 23 bits of the float32 fval + 12582912.f, minus 0x400000.
    For |fval| <= 4194303 that is fval rounded half to even; beyond (a release build: the debug assert is off),
    NaN and inf included, what the C arithmetic gives. A scalar bit cast (`np.float32(v).view(np.int32)`)
    compiles to C's add, move and mask: branch-free, so the hot loops keep their registers."""
    val = np.float32(np.float32(fval) + np.float32(12582912.0))
    return np.int32((np.float32(val).view(np.int32) & 0x007FFFFF) - 0x00400000)


@kernel
def fp16_bits(f):
    """GGML_FP32_TO_FP16 (round to nearest even; NaN -> 0x7E00 with the NaN's sign, as ggml's: x86's inf - inf is
    a negative NaN, 0xFE00) as uint16 bits, from the exact value (float64)."""
    a = np.float64(f)
    sign = np.uint16(0x8000) if np.copysign(1.0, a) < 0.0 else np.uint16(0)
    if a != a:
        return sign | np.uint16(0x7E00)
    a = abs(a)
    if a >= 65520.0:
        return sign | np.uint16(0x7C00)
    if a < 2.0 ** -14:
        return sign | np.uint16(np.rint(a * 2.0 ** 24))
    m, e = math.frexp(a)
    ex = e - 1 + 15
    mant = np.int64(np.rint((m * 2.0 - 1.0) * 1024.0))
    if mant == 1024:
        mant = 0
        ex += 1
    if ex >= 31:
        return sign | np.uint16(0x7C00)
    return sign | np.uint16((ex << 10) | mant)


@kernel
def fp16_value(h):
    """GGML_FP16_TO_FP32 of uint16 bits."""
    hi = np.int64(h)
    ex = (hi >> 10) & 31
    mant = hi & 1023
    if ex == 0:
        v = np.float64(mant) * 2.0 ** -24
    elif ex == 31:
        v = np.inf if mant == 0 else np.nan
    else:
        v = np.float64(1024 + mant) * 2.0 ** (ex - 25)
    return np.float32(-v if hi & 0x8000 else v)


@kernel
def put_fp16(out, pos, f):
    """Store GGML_FP32_TO_FP16(f) little-endian at out[pos:pos + 2]; returns the fp16 value as float32 (what the C
    code reads back with GGML_FP16_TO_FP32)."""
    h = fp16_bits(f)
    out[pos] = np.uint8(h & np.uint16(0xFF))
    out[pos + 1] = np.uint8(h >> np.uint16(8))
    return fp16_value(h)


# ------------------------------------------------------------------------------------------- running a kernel

PIECE_ROWS_ELEMS = 1 << 18  # values per piece a thread takes (1 MiB of fp32: stays in cache)


def encode_rows(module_name: str, kernel_name: str, rows: torch.Tensor, qw, block: int, block_bytes: int):
    """Run the entry kernel `kernel_name` of `module_name` over fp32 `rows` [r, n] with importance `qw` (None, [n]
    or [r, n]) on the CPU: pieces of whole rows, taken in turn by the caller's stage's threads
    (`ckpt.quant.gguf.quant_workers`, the pool `_quantize_pieces` uses). Rows are independent, so the bytes do
    not depend on how the pieces fall. Returns uint8 [r, n / block * block_bytes] on the CPU."""
    from ckpt.quant.gguf import run_pieces

    fn = getattr(compiled(module_name), kernel_name)
    if rows.dim() != 2 or rows.shape[1] % block:
        raise ValueError(f"expected rows [r, n] with n a multiple of {block}, got {tuple(rows.shape)}")
    r, n = rows.shape
    x = rows.detach().to("cpu", torch.float32).contiguous().numpy()
    if qw is None:
        w = np.zeros((0, n), dtype=np.float32)
    else:
        w = qw.detach().to("cpu", torch.float32).contiguous().numpy()
        w = w.reshape(1, n) if w.ndim == 1 else w
        if w.shape not in ((1, n), (r, n)):
            raise ValueError(f"importance of shape {tuple(qw.shape)} for rows {tuple(rows.shape)}")
    out = np.empty((r, n // block * block_bytes), dtype=np.uint8)
    if r == 0:
        return torch.from_numpy(out)
    step = max(1, PIECE_ROWS_ELEMS // max(1, n))
    run_pieces(r, step, lambda a, b: fn(x[a:b], w if w.shape[0] <= 1 else w[a:b], out[a:b]))
    return torch.from_numpy(out)


def cpu_encoder(module_name: str, kernel_name: str, block: int, block_bytes: int):
    """An `Encoder.fn` running a compiled entry kernel (`encode_rows`)."""

    def fn(rows, qw=None):
        return encode_rows(module_name, kernel_name, rows, qw, block, block_bytes)

    fn.__qualname__ = fn.__name__ = f"{kernel_name}_cpu"
    return fn


