"""The Caster casts and checks in one pass over memory (cache-sized steps, `ckpt.cast.FUSE_ELEMS`): its
bytes are torch's own cast (NaNs by the one rule of ckpt.cast.nan_bits) and its counts are the exact
counts, for every 16-bit pattern and for fp32 values around every target's range, whatever the step."""

from __future__ import annotations

import pytest
import torch

import ckpt.cast as cast
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


CASES = [(torch.bfloat16, torch.float16), (torch.float16, torch.bfloat16), (torch.bfloat16, torch.float32),
         (torch.float16, torch.float32)]


@pytest.mark.parametrize("step", [8, 1000, 1 << 16])
@pytest.mark.parametrize("clamp", [False, True])
@pytest.mark.parametrize("src,dst", CASES + [(torch.float32, torch.float16), (torch.float32, torch.bfloat16),
                                             (torch.float64, torch.float16)], ids=str)
def test_fused_cast_is_torch_cast_with_exact_counts(monkeypatch, src, dst, clamp, step):
    monkeypatch.setattr(cast, "FUSE_ELEMS", step)
    x = all_patterns(src) if src.itemsize == 2 else around_limits().to(src)
    want, bad, over = reference(x, dst, clamp)
    report = Report()
    got = Caster(dst, report, clamp=clamp)(x, "w")
    assert torch.equal(got.view(INT[dst]), want.view(INT[dst]))
    counts = {k: v.get("w", 0) for k, v in report.counts.items()}
    assert counts.get("nonfinite_input", 0) == bad
    assert counts.get("clamped" if clamp else "overflow", 0) == over


def test_scratch_buffers_and_shapes_are_kept(monkeypatch):
    from ckpt.io.buffers import Buffers

    monkeypatch.setattr(cast, "FUSE_ELEMS", 7)
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
