"""The CPU casts between fp32, fp16 and bf16 as compiled kernels over bit patterns: torch's bytes, its NaN rule and
the Caster's counts, without torch.

Why: the cast of a convert (`--to fp16` of a bf16 model) was torch's one-core `copy_` (about 1 ns a value for
bf16 -> fp16) followed by an `aminmax` check, and it needed `import torch` (1.1-2 s) before the first byte. Here a
band is cast in one vectorized pass (0.4-0.8 ns a value from memory, 8 M-value bands, measured against 0.9-1.9 for
the torch path), and a plan whose computed tensors are all such casts of stored bytes is written without torch
(`ckpt.io.output.host_casts`, `ckpt.cast.Caster.host_cast`). A process that runs torch anyway keeps torch's cast
(`ckpt.cast`: loading numba there cost more than the kernels saved).

The rules are the Caster's, decided here for the CPU: round to nearest even, no flush of subnormals (fp32 <-> fp16
by LLVM's float/half conversions, the F16C instructions on x86; bf16 by integer rounding); a NaN becomes the bytes
torch 2.13 writes on x86 (`nan_of`, the rule `ckpt.cast.nan_bits` states for torch's device path); an overflow is a
finite input that becomes infinite, with --clamp the signed finite maximum instead. Each cast kernel only casts
and returns the largest magnitude it wrote (a max reduction vectorizes, counting in the loop did not: 1.2 ns a
value against 0.6); an exponent of all ones there (a NaN/Inf input or an overflow) sends the band through
`recount`, which sets the NaNs, counts both kinds and clamps. `cast` returns the counts; the Caster reports them.
Checked against torch's own cast plus `nan_bits` on every 16-bit pattern and on every fp32 exponent with the
rounding boundaries of each (tests/test_cast_cpu.py; every fp32 pattern in a slow test).

Imports neither numba nor numpy (tests/test_layering.py): `compiled(__name__)` builds the kernels on first use.
"""

from __future__ import annotations

from ckpt.lazy import numpy as np

from ckpt.jit import kernel

# safetensors dtype names -> (the kernel's unsigned view, the exponent's bits, the mantissa's, the largest finite
# magnitude's bits)
FORMATS = {"F32": ("uint32", 0x7F800000, 0x7FFFFF, 0x7F7FFFFF), "F16": ("uint16", 0x7C00, 0x3FF, 0x7BFF),
           "BF16": ("uint16", 0x7F80, 0x7F, 0x7F7F)}
PAIRS = {("F32", "F16"): "f32_to_f16", ("F32", "BF16"): "f32_to_bf16", ("F16", "F32"): "f16_to_f32",
         ("BF16", "F32"): "bf16_to_f32", ("F16", "BF16"): "f16_to_bf16", ("BF16", "F16"): "bf16_to_f16"}


def _half_intrinsic(to_half: bool):
    """uint32 (fp32 bits) -> uint16 (fp16 bits), rounded to nearest even (`to_half`), or back (exact): LLVM's
    `fptrunc` / `fpext` between float and half, one F16C instruction for 8 or 16 values on x86 (`available`
    requires it there), a native one on ARM. A NaN comes out a NaN, its bits set by `recount`."""
    from llvmlite import ir
    from numba.core import types
    from numba.extending import intrinsic

    def codegen(context, builder, signature, args):
        if to_half:
            return builder.bitcast(builder.fptrunc(builder.bitcast(args[0], ir.FloatType()), ir.HalfType()),
                                   ir.IntType(16))
        return builder.bitcast(builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType()), ir.IntType(32))

    def typer(typingctx, x):
        return (types.uint16(types.uint32) if to_half else types.uint32(types.uint16)), codegen

    typer.__name__ = "f32_bits_to_f16" if to_half else "f16_bits_to_f32"
    return intrinsic(typer)


JIT_INTRINSICS = {"f32_bits_to_f16": lambda: _half_intrinsic(True), "f16_bits_to_f32": lambda: _half_intrinsic(False)}


@kernel
def f32_bits_to_bf16(u):
    """bf16 bits of the fp32 bits `u`, round to nearest even; every NaN is 0xFFFF (torch on x86)."""
    r = (u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
    return np.uint32(0xFFFF) if (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000) else r


# Each cast kernel writes `y` from `x` and returns the largest magnitude bits it wrote: an exponent of all ones
# among them (a NaN/Inf input or an overflow) sends the band through `recount`. A max reduction vectorizes;
# counting in the loop did not (1.2 ns a value against 0.6).


@kernel
def f32_to_f16(x, y):
    top = np.uint32(0)
    for i in range(x.shape[0]):
        h = np.uint32(f32_bits_to_f16(x[i]))  # noqa: F821 (JIT_INTRINSICS)
        top = max(top, h & np.uint32(0x7FFF))
        y[i] = np.uint16(h)
    return top


@kernel
def f32_to_bf16(x, y):
    top = np.uint32(0)
    for i in range(x.shape[0]):
        b = f32_bits_to_bf16(x[i])
        top = max(top, b & np.uint32(0x7FFF))
        y[i] = np.uint16(b)
    return top


@kernel
def f16_to_f32(x, y):
    top = np.uint32(0)
    for i in range(x.shape[0]):
        f = f16_bits_to_f32(x[i])  # noqa: F821 (JIT_INTRINSICS)
        top = max(top, f & np.uint32(0x7FFFFFFF))
        y[i] = f
    return top


@kernel
def bf16_to_f32(x, y):
    top = np.uint32(0)
    for i in range(x.shape[0]):
        f = np.uint32(x[i]) << np.uint32(16)
        top = max(top, f & np.uint32(0x7FFFFFFF))
        y[i] = f
    return top


@kernel
def f16_to_bf16(x, y):
    """Through the exact fp32 value (one rounding, as torch); every NaN is 0x7FC0 (torch on x86). No fp16 value
    overflows bf16."""
    top = np.uint32(0)
    for i in range(x.shape[0]):
        h = x[i]
        b = f32_bits_to_bf16(f16_bits_to_f32(h))  # noqa: F821 (JIT_INTRINSICS)
        b = np.uint32(0x7FC0) if (h & np.uint16(0x7FFF)) > np.uint16(0x7C00) else b
        top = max(top, b & np.uint32(0x7FFF))
        y[i] = np.uint16(b)
    return top


@kernel
def bf16_to_f16(x, y):
    """Through the exact fp32 value (one rounding, as torch); a NaN keeps sign and payload, quiet bit set."""
    top = np.uint32(0)
    for i in range(x.shape[0]):
        h = np.uint32(f32_bits_to_f16(np.uint32(x[i]) << np.uint32(16)))  # noqa: F821
        top = max(top, h & np.uint32(0x7FFF))
        y[i] = np.uint16(h)
    return top


@kernel
def nan_of(u, pair):
    """The output bits of the NaN input `u` (its bits, uint64) for pair number `pair` (`PAIRS`' order): torch's
    rule on x86 (`ckpt.cast.nan_bits`): a fixed NaN into bf16 from fp32 or fp16; bf16 -> fp32 shifted as it is;
    else the sign kept, the quiet bit set, the payload's top bits kept (narrowing) or zero-extended (widening)."""
    if pair == 0:  # fp32 -> fp16
        return ((u >> np.uint64(16)) & np.uint64(0x8000)) | np.uint64(0x7E00) | ((u >> np.uint64(13)) & np.uint64(0x3FF))
    if pair == 1 or pair == 4:  # fp32 -> bf16, fp16 -> bf16
        return np.uint64(0xFFFF) if pair == 1 else np.uint64(0x7FC0)
    if pair == 2:  # fp16 -> fp32
        return ((u & np.uint64(0x8000)) << np.uint64(16)) | np.uint64(0x7FC00000) | ((u & np.uint64(0x3FF)) << np.uint64(13))
    if pair == 3:  # bf16 -> fp32
        return u << np.uint64(16)
    return (u & np.uint64(0x8000)) | np.uint64(0x7E00) | ((u & np.uint64(0x7F)) << np.uint64(3))  # bf16 -> fp16


@kernel
def recount(x, y, x_exp, x_man, y_exp, y_max, clamp, pair):
    """The rare pass over a band whose output holds an exponent of all ones (`y_exp`): each NaN input gets the NaN
    rule's bits (`nan_of`); NaN/Inf inputs (an exponent of all ones, `x_exp`) and overflows (an infinite output from
    any other input) are counted, an overflow set to the signed finite maximum `y_max` where `clamp`."""
    bad = 0
    over = 0
    for i in range(x.shape[0]):
        u = np.uint64(x[i])
        v = np.uint64(y[i])
        if (u & x_exp) == x_exp:
            bad += 1
            if (u & x_man) != np.uint64(0):
                y[i] = nan_of(u, pair)
        elif (v & y_exp) == y_exp:
            over += 1
            if clamp:
                y[i] = (v & ~(y_exp | y_max)) | y_max  # the sign bit kept
    return bad, over


# ------------------------------------------------------------------------------------------- running the kernels


def available() -> bool:
    """The kernels can run here: numba imports (without it the Caster casts with torch) and, on x86, the CPU
    converts halves itself (F16C: every x86 CPU since 2012; without it LLVM would call a runtime function numba
    does not link)."""
    global _AVAILABLE
    if _AVAILABLE is None:
        from ckpt.jit import available as jit_available

        _AVAILABLE = jit_available() and _converts_halves()
    return _AVAILABLE


_AVAILABLE: bool | None = None


def _converts_halves() -> bool:
    import platform

    if platform.machine().lower() not in ("x86_64", "amd64", "i386", "i686"):
        return True
    try:
        import llvmlite.binding as llvm

        return bool(llvm.get_host_cpu_features().get("f16c", False))
    except Exception:
        return False


def supports(src: str, dst: str) -> bool:
    """Whether a kernel casts safetensors dtype `src` to `dst` (names)."""
    return (src, dst) in PAIRS


def cast(src: str, dst: str, x, y, clamp: bool = False) -> tuple[int, int]:
    """Cast `x` (a flat numpy array of `src` values, any dtype of that width) into `y` (flat, `dst`'s width);
    (NaN/Inf inputs, overflows: finite inputs made infinite, or with `clamp` the signed finite maximum)."""
    from ckpt.jit import compiled

    numpy = _np()
    k = compiled(__name__)
    (xv, x_exp, x_man, _), (yv, y_exp, _, y_max) = FORMATS[src], FORMATS[dst]
    x, y = x.view(getattr(numpy, xv)), y.view(getattr(numpy, yv))
    if getattr(k, PAIRS[(src, dst)])(x, y) < y_exp:
        return 0, 0
    u64 = numpy.uint64
    bad, over = k.recount(x, y, u64(x_exp), u64(x_man), u64(y_exp), u64(y_max), bool(clamp), list(PAIRS).index((src, dst)))
    return int(bad), int(over)


def _np():
    from ckpt.lazy import resolve

    return resolve(np)
