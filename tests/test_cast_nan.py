"""NaN payloads are written the same on every device: the bytes torch's own CPU cast writes.

`ckpt.cast.nan_bits` states torch 2.13's x86 CPU rule with integer operations (so a CUDA cast, whose NaNs
differ, can be rewritten to it); these tests check it against torch's CPU cast for random payloads of
every source/target pair, and that the Caster leaves CPU bytes as torch writes them.
"""

from __future__ import annotations

import pytest
import torch

from ckpt.cast import Caster, nan_bits
from ckpt.report import Report

INT = {torch.float64: torch.int64, torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}
LAYOUT = {torch.float64: (52, 11), torch.float32: (23, 8), torch.float16: (10, 5), torch.bfloat16: (7, 8)}
SOURCES = (torch.float64, torch.float32, torch.float16, torch.bfloat16)
TARGETS = (torch.float32, torch.float16, torch.bfloat16)
# Pairs where torch's CPU kernels give one NaN in their vector body and another in their scalar tail:
# the rule follows the vector body, so only the first elements of a long run are compared for them.
TAIL_DIFFERS = {(torch.float16, torch.float32), (torch.float64, torch.bfloat16)}


def nans(dtype: torch.dtype, n: int, seed: int) -> torch.Tensor:
    """`n` NaNs of `dtype` with random signs and payloads (quiet and signalling), plus the edge payloads."""
    m, e = LAYOUT[dtype]
    bits = 1 + m + e
    g = torch.Generator().manual_seed(seed)
    frac = [int(v) for v in torch.randint(1, 2 ** min(m, 62), (n,), generator=g)]
    frac[:4] = [1 << (m - 1), (1 << m) - 1, 1, (1 << (m - 1)) | 1]
    signs = torch.randint(0, 2, (n,), generator=g).tolist()
    vals = [(s << (bits - 1)) | (((1 << e) - 1) << m) | f for s, f in zip(signs, frac)]
    vals = [v - (1 << bits) if v >= 1 << (bits - 1) else v for v in vals]
    x = torch.tensor(vals, dtype=torch.int64).to(INT[dtype]).view(dtype)
    assert torch.isnan(x).all()
    return x


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(INT[t.dtype])


@pytest.mark.parametrize("dst", TARGETS, ids=str)
@pytest.mark.parametrize("src", SOURCES, ids=str)
def test_nan_rule_is_torch_cpu_cast(src, dst):
    if src == dst:
        pytest.skip("no cast")
    x = nans(src, 4096, seed=10 * SOURCES.index(src) + TARGETS.index(dst))
    ref = x.to(dst)  # torch's CPU cast: the reference
    got = nan_bits(x, dst)
    assert got.dtype == dst and torch.isnan(got).all()
    n = 4096 - 128 if (src, dst) in TAIL_DIFFERS else 4096  # vector body only (any SIMD width up to 64 lanes)
    assert torch.equal(bits(got)[:n], bits(ref)[:n]), (src, dst)


@pytest.mark.parametrize("dst", TARGETS, ids=str)
@pytest.mark.parametrize("src", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_caster_on_cpu_keeps_torch_bytes_and_repairs_other_nans(src, dst):
    if src == dst:
        pytest.skip("no cast")
    g = torch.Generator().manual_seed(7)
    x = (torch.randn(64, 33, generator=g) * 100).to(src)
    flat = x.view(-1)
    idx = torch.randperm(flat.numel(), generator=g)[:300]
    flat[idx] = nans(src, 300, seed=3)
    flat[idx[:5]] = float("inf")
    y = Caster(dst, Report())(x, "w")
    if (src, dst) not in TAIL_DIFFERS:
        assert torch.equal(bits(y), bits(x.to(dst)))  # CPU bytes exactly as torch writes them
    assert torch.equal(bits(y[torch.isnan(x)]), bits(nan_bits(x[torch.isnan(x)], dst)))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dst", TARGETS, ids=str)
@pytest.mark.parametrize("src", SOURCES, ids=str)
def test_cuda_cast_nans_match_cpu(src, dst):
    if src == dst:
        pytest.skip("no cast")
    x = nans(src, 4096, seed=11)
    cpu = Caster(dst, Report())(x, "w")
    gpu = Caster(dst, Report())(x.cuda(), "w").cpu()
    assert torch.equal(bits(gpu), bits(cpu))


@pytest.mark.parametrize("dst", TARGETS, ids=str)
@pytest.mark.parametrize("src", SOURCES, ids=str)
def test_a_lone_nan_gets_the_rule_too(src, dst):
    """One NaN in a band: assigning one float element goes through a C++ scalar that canonicalises NaNs
    (0x7FC0 for bf16); the rule's bytes must survive it."""
    if src == dst:
        pytest.skip("no cast")
    x = torch.randn(48, generator=torch.Generator().manual_seed(1)).to(src)
    x[28] = nans(src, 1, seed=4)[0]
    y = Caster(dst, Report())(x, "w")
    assert torch.equal(bits(y[28:29]), bits(nan_bits(x[28:29], dst)))
