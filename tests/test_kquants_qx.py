"""ckpt.quant.kquants.qx (Q6_K, Q3_K) writes, byte for byte, what llama.cpp's reference quantizers write
(tests/helpers/ggml_ref.py compiles ggml-quants.c and calls `quantize_q6_K` / `quantize_q3_K` without an importance
matrix), on random rows and on the edge cases where the C code branches: all-zero blocks and sub-blocks, constant
blocks, one huge outlier, magnitudes below GROUP_MAX_EPS or fp16's range, one-signed blocks, bf16-representable
values, large magnitudes. gguf's dequantizer reads both the same."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from helpers import ggml_ref

from ckpt.quant.kquants import qx

TYPES = [("Q6_K", "q6_K", 210), ("Q3_K", "q3_K", 110)]


def _edge_rows() -> np.ndarray:
    """Rows of 8 blocks of 256, one kind of block each (plus mixed sub-blocks)."""
    rng = np.random.default_rng(7)
    n = rng.standard_normal((12, 8, 256)).astype(np.float32)
    rows = []
    rows.append(np.zeros((8, 256), np.float32))                                # all zero
    rows.append(np.stack([np.full(256, v, np.float32) for v in (1, -1, 0.5, -3.25, 1e-3, 7e3, 1e-16, -2e-15)]))
    out = n[0].copy()
    out[np.arange(8), np.arange(8) * 31] = [1e4, -1e4, 300, -50, 1e6, -1e6, 64, -7]  # one huge outlier
    rows.append(out)
    rows.append(n[1] * np.float32(1e-20))                                      # below GROUP_MAX_EPS
    rows.append(n[2] * np.float32(1e-9))                                       # d underflows fp16
    rows.append(n[3] * np.float32(1e-6))                                       # d fp16 subnormal
    rows.append(-np.abs(n[4]))                                                 # negative only
    rows.append(np.abs(n[5]))                                                  # positive only
    rows.append(torch.from_numpy(n[6]).to(torch.bfloat16).float().numpy())     # bf16-representable
    rows.append(n[7] * np.float32(1e4))                                        # large magnitudes
    mixed = n[8].copy()
    mixed[:, :16] = 0                                                          # zero sub-blocks in live blocks
    mixed[::2, 64:80] = 1e-17
    mixed[1::2, 128:144] = 2.0                                                 # constant sub-block
    mixed[:, 200] = 0
    rows.append(mixed)
    few = np.zeros((8, 256), np.float32)                                       # sparse: few nonzeros
    few[np.arange(8), np.arange(8) * 17] = n[9][:, 0]
    few[np.arange(8), 255 - np.arange(8)] = n[9][:, 1] * 3
    rows.append(few)
    ints = np.round(n[10] * 4).astype(np.float32)                              # small integers (ties)
    rows.append(ints)
    rows.append(np.tile(np.linspace(-1, 1, 16, dtype=np.float32), (8, 16)))   # exact grid values
    return np.concatenate(rows).reshape(-1, 8 * 256)


def _check(name: str, ref: str, bb: int, x: np.ndarray):
    import gguf

    want = np.frombuffer(ggml_ref.quantize(ref, x), dtype=np.uint8).reshape(x.shape[0], -1)
    got = qx.ENCODERS[name](torch.from_numpy(x))  # the torch encoder (CUDA's; CPU kernels: test_kquants_cpu)
    assert got.dtype == torch.uint8 and tuple(got.shape) == want.shape
    got = got.numpy()
    if not np.array_equal(got, want):
        blocks = np.nonzero((got.reshape(-1, bb) != want.reshape(-1, bb)).any(1))[0]
        b = blocks[0]
        pos = np.nonzero(got.reshape(-1, bb)[b] != want.reshape(-1, bb)[b])[0]
        pytest.fail(f"{name}: {len(blocks)} of {got.size // bb} blocks differ; first block {b}, bytes {pos[:12]}")
    qtype = getattr(gguf.GGMLQuantizationType, name)
    np.testing.assert_array_equal(gguf.quants.dequantize(got, qtype), gguf.quants.dequantize(want, qtype))


@pytest.mark.parametrize("name, ref, bb", TYPES)
@pytest.mark.parametrize("shape", [(3, 256), (5, 768), (4, 2048)])
def test_random_rows_byte_identical(ggml_lib, name, ref, bb, shape):
    x = np.random.default_rng(shape[1]).standard_normal(shape).astype(np.float32)
    x[1] *= np.float32(0.02)  # a row at weight scale
    _check(name, ref, bb, x)


@pytest.mark.parametrize("name, ref, bb", TYPES)
def test_edge_cases_byte_identical(ggml_lib, name, ref, bb):
    _check(name, ref, bb, _edge_rows())


@pytest.mark.parametrize("name, ref, bb", TYPES)
def test_heavy_tailed_byte_identical(ggml_lib, name, ref, bb):
    """Student-t rows (outliers in many sub-blocks): the scale searches take many different branches."""
    x = np.random.default_rng(3).standard_t(2, (16, 1024)).astype(np.float32)
    _check(name, ref, bb, x)


@pytest.mark.parametrize("name, bb", [("Q6_K", 210), ("Q3_K", 110)])
def test_shape_and_refusal(name, bb):
    fn = qx.ENCODERS[name]
    assert fn(torch.zeros(2, 512)).shape == (2, 2 * bb)
    with pytest.raises(ValueError):
        fn(torch.zeros(2, 100))
