"""ckpt's torch encoders of GGUF's legacy types (ckpt/quant/kquants/legacy.py) write the bytes `gguf.quants.quantize`
(the gguf package's numpy quantizers) writes, block for block, on awkward inputs too, and the same bytes on CUDA."""

from __future__ import annotations

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from ckpt.quant.kquants import encoders  # noqa: E402
from ckpt.quant.kquants.legacy import ENCODERS  # noqa: E402

TYPES = list(ENCODERS)  # Q8_0, Q4_0, Q5_0, Q4_1, Q5_1


def numpy_bytes(rows: np.ndarray, t: str) -> np.ndarray:
    with np.errstate(all="ignore"):
        return gguf.quants.quantize(rows, gguf.GGMLQuantizationType[t])


def check(rows: np.ndarray, t: str):
    rows = np.ascontiguousarray(rows, dtype=np.float32)
    ours = ENCODERS[t](torch.from_numpy(rows.copy())).numpy()
    ref = numpy_bytes(rows, t)
    assert ours.shape == ref.shape
    bad = np.nonzero((ours != ref).any(axis=-1))[0]
    assert not len(bad), f"{t}: rows {bad[:5]} differ: {ours[bad[0]][:40]} vs {ref[bad[0]][:40]}"


def cases() -> dict[str, np.ndarray]:
    g = np.random.default_rng(0)
    f32 = np.float32
    c = {
        "random": g.standard_normal((64, 256)).astype(f32),
        "uniform": g.uniform(-1, 1, (64, 256)).astype(f32),
        "zeros": np.zeros((4, 128), f32),
        "constant": np.full((4, 128), 0.37, f32),
        "negative_constant": np.full((4, 128), -3.0, f32),
    }
    z = g.standard_normal((32, 128)).astype(f32)
    z[:, ::3] = 0
    z[::4, :] = 0
    c["some_zeros"] = z
    o = g.standard_normal((32, 128)).astype(f32) * 0.01
    o[np.arange(32), g.integers(0, 128, 32)] = 1000.0 * np.where(np.arange(32) % 2, 1, -1)
    c["outlier"] = o
    t = g.standard_normal((16, 64)).astype(f32)
    t[:, 0], t[:, 1] = 2.0, -2.0  # equal magnitude: the first one wins
    t[:, 32], t[:, 40] = -5.0, 5.0
    c["ties"] = t
    c["denormal"] = (g.standard_normal((32, 128)) * 1e-40).astype(f32)
    c["tiny_normal"] = (g.standard_normal((32, 128)) * 1e-37).astype(f32)
    sc = np.logspace(-45, 38, 32 * 4).astype(f32).reshape(32, 4, 1)  # one magnitude per block, all of float32
    c["scale_sweep"] = (g.standard_normal((32, 4, 32)).astype(f32) * sc).reshape(32, 128)
    h = g.standard_normal((16, 128)).astype(f32)
    h[:, ::2] *= 1e30
    h[:, 1::4] *= 1e-30
    c["huge_range"] = h.astype(f32)
    c["fp16_overflow"] = (g.standard_normal((16, 128)) * 1e7).astype(f32)  # scales past 65504
    mm = g.uniform(-1, 1, (8, 64)).astype(f32)
    mm[:, :32] *= 3e38
    mm[:, 0], mm[:, 1] = 3.4e38, -3.4e38  # max - min overflows to inf
    c["max_minus_min_overflow"] = mm
    r = g.integers(-20, 20, (32, 128)).astype(f32) / 4  # halves: rounding ties
    c["ties_half"] = r
    return c


def nonfinite() -> dict[str, np.ndarray]:
    g = np.random.default_rng(1)
    f32 = np.float32
    x = g.standard_normal((16, 128)).astype(f32)
    x[0, 3] = np.nan
    x[1, 40] = -np.nan
    x[2, 5] = np.inf
    x[3, 70] = -np.inf
    x[4, 0:2] = np.inf, -np.inf
    x[5, 10], x[5, 12] = np.nan, np.nan
    x[6, 1] = np.nan
    x[6, 9] = np.inf
    x[7, :] = np.nan
    x[8, 32:64] = np.inf
    x[9, 96] = np.array(0x7FC12345, dtype=np.uint32).view(f32)  # payload
    x[10, 64] = np.array(0xFF80A000, dtype=np.uint32).view(f32)  # signalling, negative
    return {"nan_inf": x}


@pytest.mark.parametrize("t", TYPES)
@pytest.mark.parametrize("case", list(cases()))
def test_bytes_equal_gguf(t, case):
    check(cases()[case], t)


@pytest.mark.parametrize("t", TYPES)
def test_nan_inf_bytes_equal_gguf(t):
    # numpy's output is deterministic here (x86 casts; the NaNs that are not the default NaN sit in a block's first
    # 17 elements, which numpy's SIMD max/min loop sees with AVX-512: it then returns its default NaN)
    check(nonfinite()["nan_inf"], t)


@pytest.mark.parametrize("t", TYPES)
def test_nan_in_last_element_encodes(t):
    # undefined, not compared: numpy's max/min keeps the bits of a NaN its scalar tail sees (a block's last
    # elements) and returns its default NaN elsewhere, so Q8_0/Q4_1/Q5_1's NaN scale follows the position
    x = np.random.default_rng(2).standard_normal((4, 64)).astype(np.float32)
    x[:, 31] = -np.nan
    x[1, 63] = np.array(0x7FC12345, dtype=np.uint32).view(np.float32)
    out = ENCODERS[t](torch.from_numpy(x))
    assert out.shape == numpy_bytes(x, t).shape


@pytest.mark.parametrize("t", TYPES)
def test_registered_and_used_by_encode(t):
    from ckpt.quant.gguf import can_encode, encode

    T = gguf.GGMLQuantizationType[t]
    assert encoders()[t] is ENCODERS[t] and can_encode(int(T))
    x = torch.randn(8, 96)
    assert torch.equal(encode(x, int(T)), torch.from_numpy(numpy_bytes(x.numpy(), t).reshape(-1)))


@pytest.mark.parametrize("t", TYPES)
def test_bad_shape(t):
    with pytest.raises(ValueError):
        ENCODERS[t](torch.zeros(2, 33))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("t", TYPES)
def test_cuda_same_bytes(t):
    for rows in (*cases().values(), *nonfinite().values()):
        x = torch.from_numpy(np.ascontiguousarray(rows, dtype=np.float32))
        cpu = ENCODERS[t](x)
        gpu = ENCODERS[t](x.cuda())
        assert gpu.device.type == "cuda"
        assert torch.equal(gpu.cpu(), cpu)
        assert np.array_equal(cpu.numpy(), numpy_bytes(rows.astype(np.float32), t))


@pytest.mark.parametrize("t", ["Q4_1", "Q5_1"])
def test_signed_zero_min_differs_at_most_in_its_sign(t):
    # a block whose min (or max) is 0.0 and -0.0 at once: numpy's SIMD min/max returns either zero depending on
    # the lanes (undefined); the fp16 min / scale bytes may differ in the sign bit of that zero, nothing else
    g = np.random.default_rng(5)
    x = np.abs(g.standard_normal((400, 64))).astype(np.float32)
    m = g.random(x.shape) < 0.3
    x[m] = np.where(g.random(m.sum()) < 0.5, 0.0, -0.0).astype(np.float32)
    x[::7] *= -1
    x[::11] = np.where(g.random((len(x[::11]), 64)) < 0.5, 0.0, -0.0)
    size = {"Q4_1": 20, "Q5_1": 24}[t]
    ours = ENCODERS[t](torch.from_numpy(x)).numpy().reshape(-1, size)
    ref = numpy_bytes(x, t).reshape(-1, size)
    zero = ref[:, 0:4].view(np.float16) == 0  # [blocks, 2]: d, m
    mask = np.full(ref.shape, 0xFF, np.uint8)
    mask[:, 1] = np.where(zero[:, 0], 0x7F, 0xFF)
    mask[:, 3] = np.where(zero[:, 1], 0x7F, 0xFF)
    assert np.array_equal(ours & mask, ref & mask)
