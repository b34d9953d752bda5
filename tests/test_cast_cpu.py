"""The CPU casts between fp32, fp16 and bf16, the Caster's torch path and `ckpt.cast_cpu`'s kernels (which a convert
runs without torch on numpy bands), give torch's own cast (NaNs by the one rule of ckpt.cast.nan_bits) and the exact
counts: for every 16-bit pattern, for every fp32 exponent with the rounding boundaries of its mantissa, for values
around every target's range, and (kernels, slow) for every fp32 pattern; fp64 through torch."""

from __future__ import annotations

import pytest
import torch

import numpy as np

import ckpt.cast as cast
from ckpt import cast_cpu
from ckpt.cast import Caster, nan_bits
from ckpt.report import Report

INT = {torch.float64: torch.int64, torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}


def reference(x: torch.Tensor, dst: torch.dtype, clamp: bool):
    """torch's cast, NaNs rewritten by the rule, overflows (finite -> inf) counted and optionally clamped."""
    y = x.to(dst)
    nan = torch.isnan(x)
    if nan.any() and dst != torch.float64:
        y.view(INT[dst])[nan] = nan_bits(x[nan], dst).view(INT[dst])
    bad = ~torch.isfinite(x)
    over = torch.isinf(y) & ~bad
    if clamp:
        top = torch.finfo(dst).max
        y[over & (x > 0)] = top
        y[over & (x < 0)] = -top
    return y, int(bad.sum()), int(over.sum())


def all_patterns(dtype) -> torch.Tensor:
    return torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(dtype)


def around_limits() -> torch.Tensor:
    g = torch.Generator().manual_seed(3)
    vals = [torch.randn(5000, generator=g, dtype=torch.float64)]
    for top in (65504.0, torch.finfo(torch.bfloat16).max):
        vals.append(torch.linspace(0.99, 1.01, 999, dtype=torch.float64) * top)
    x = torch.cat(vals + [-v for v in vals])
    x[::97] = float("nan")
    x[5::211] = float("inf")
    return x


def every_exponent() -> torch.Tensor:
    """Every fp32 exponent (both signs) with the mantissas where a rounding to fp16 or bf16 changes: around the
    halfway points of the 13 and 16 dropped bits, the ends, and the subnormal fp16 boundaries."""
    tails = [0, 1, 2, 0x7FF, 0xFFF, 0x1000, 0x1001, 0x1FFF, 0x2000, 0x3000, 0x7FFF, 0x8000, 0x8001, 0xFFFF, 0x10000,
             0x17FFF, 0x18000, 0x18001, 0x3FFFFF, 0x400000, 0x400001, 0x7FFFFE, 0x7FFFFF]
    g = torch.Generator().manual_seed(5)
    tails = torch.cat([torch.tensor(tails), torch.randint(0, 1 << 23, (200,), generator=g)])
    bits = (torch.arange(256)[:, None] << 23 | tails[None]).reshape(-1)
    bits = torch.cat([bits, bits | (1 << 31)])
    return bits.to(torch.int64).to(torch.int32).view(torch.float32)  # the low 32 bits


CASES = [(torch.bfloat16, torch.float16), (torch.float16, torch.bfloat16), (torch.bfloat16, torch.float32),
         (torch.float16, torch.float32), (torch.float32, torch.float16), (torch.float32, torch.bfloat16)]


def source(src) -> torch.Tensor:
    return all_patterns(src) if src.itemsize == 2 else torch.cat([every_exponent(), around_limits().to(src)])


def counts_of(report: Report) -> tuple[int, int, int]:
    c = {k: v.get("w", 0) for k, v in report.counts.items()}
    return c.get("nonfinite_input", 0), c.get("overflow", 0), c.get("clamped", 0)


@pytest.mark.parametrize("clamp", [False, True])
@pytest.mark.parametrize("src,dst", CASES + [(torch.float64, torch.float16), (torch.float64, torch.bfloat16)], ids=str)
def test_the_casters_cast_is_torch_cast_with_exact_counts(src, dst, clamp):
    """The torch path (a process that runs torch): fused copy and check, the device formulation for NaN/Inf bands."""
    x = source(src)
    want, bad, over = reference(x, dst, clamp)
    report = Report()
    got = Caster(dst, report, clamp=clamp)(x, "w")
    assert torch.equal(got.view(INT[dst]), want.view(INT[dst]))
    assert counts_of(report) == (bad, 0 if clamp else over, over if clamp else 0)


@pytest.mark.parametrize("clamp", [False, True])
@pytest.mark.parametrize("src,dst", CASES, ids=str)
def test_the_cast_without_torch_is_torch_cast_with_exact_counts(src, dst, clamp):
    """`Caster.host_cast` (numpy bands of stored bytes cast by `ckpt.cast_cpu`'s kernels, what a convert runs
    without importing torch): torch's bytes and the exact counts, in a reused host buffer."""
    from ckpt.dtypes import st_name
    from ckpt.io.buffers import Buffers

    x = source(src)
    want, bad, over = reference(x, dst, clamp)
    report = Report()
    fn = Caster(st_name(dst), report, clamp=clamp).host_cast(st_name(src), "w")
    bufs = Buffers()
    raw = x.view(INT[src]).numpy().view(np.uint8)
    got = fn(raw, bufs)
    assert got.dtype == np.uint8 and got.nbytes == want.numel() * dst.itemsize
    assert np.array_equal(got, want.view(INT[dst]).numpy().view(np.uint8))
    assert counts_of(report) == (bad, 0 if clamp else over, over if clamp else 0)
    assert fn(raw[: 2 * src.itemsize], bufs).ctypes.data == got.ctypes.data  # the buffer is reused
    assert Caster("F16", Report()).host_cast("F64", "w") is None  # no kernel: the torch path


@pytest.mark.slow
@pytest.mark.parametrize("dst", [torch.float16, torch.bfloat16], ids=str)
def test_every_fp32_pattern(dst):
    """All 2^32 fp32 patterns, in chunks: the kernel's bytes are torch's cast with the NaN rule, its counts exact."""
    step = 1 << 22  # chunks in cache: fresh 64 M-value tensors spent most of the time in page faults
    y = np.empty(step, dtype=np.uint16)
    for lo in range(-(1 << 31), 1 << 31, step):
        x = torch.arange(lo, lo + step, dtype=torch.int64).to(torch.int32).view(torch.float32)
        want, bad, over = reference(x, dst, False)
        got = cast_cpu.cast("F32", "F16" if dst == torch.float16 else "BF16", x.view(torch.int32).numpy(), y)
        assert np.array_equal(y, want.view(torch.int16).numpy().view(np.uint16)), lo
        assert got == (bad, over), lo


def test_scratch_buffers_and_shapes_are_kept(monkeypatch):
    from ckpt.io.buffers import Buffers

    monkeypatch.setattr(cast, "FUSE_ELEMS", 7)  # several fused steps
    bufs = Buffers()
    x = torch.randn(5, 3, 11)
    y = Caster(torch.float16, Report())(x, "w", bufs)
    assert y.shape == x.shape and torch.equal(y, x.half())
    assert y.data_ptr() == bufs.get("cast", 0).data_ptr()  # written into the reusable buffer
    assert Caster(torch.float16, Report())(torch.zeros(0, 4), "e").shape == (0, 4)


@pytest.mark.parametrize("src", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_upcast_with_a_scale_is_the_upcast_times_the_scale(src):
    """The scaled pair table (one fp32 multiply per table entry) gives every code, NaN payloads included,
    exactly the bits of `x.to(float32) * scale`, for scales that overflow, underflow, are Inf, NaN or negative;
    odd lengths and unaligned views take the per-element path."""
    from ckpt.cast import fp8_upcast
    from ckpt.io.buffers import Buffers

    codes = torch.arange(256, dtype=torch.uint8).repeat(41)[:10001].view(src)
    for s in (0.37, 3e38, 1e-40, float("inf"), float("nan"), -2.0):
        scale = torch.tensor(s, dtype=torch.float32)
        for x in (codes, codes[1:], codes[:-1]):
            want = x.to(torch.float32).mul_(scale)
            got = fp8_upcast(x, torch.float32, Buffers(), role="x", scale=scale)
            assert torch.equal(got.view(torch.int32), want.view(torch.int32)), (src, s, x.numel())
