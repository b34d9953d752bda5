"""ckpt/quant/kquants/qkx2.py (Q2_K, Q4_K, Q5_K) writes byte for byte what llama.cpp's reference quantizers write
(tests/helpers/ggml_ref.py: ggml-quants.c compiled and called through ctypes), on random rows and on the blocks
where the C code takes its special paths: all-zero and constant sub-blocks, outliers, values below fp16's range,
one-signed blocks, ties of nearest_int, sub-blocks whose 4- or 6-bit scale rounds to 0 (the C code then keeps the
levels make_qkx2_quants chose), bf16-representable and large values; and gguf's dequantizer reads the bytes back as
it reads ggml's."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from helpers import ggml_ref

TYPES = [("Q2_K", "q2_K"), ("Q4_K", "q4_K"), ("Q5_K", "q5_K")]


def _encode(name: str, x: np.ndarray) -> np.ndarray:
    from ckpt.quant.kquants.qkx2 import ENCODERS

    out = ENCODERS[name](torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32)))
    assert out.dtype == torch.uint8 and out.device.type == "cpu"
    return out.numpy()


def _assert_same(name: str, ref_name: str, x: np.ndarray):
    x = np.ascontiguousarray(x, dtype=np.float32)
    want = np.frombuffer(ggml_ref.quantize(ref_name, x), dtype=np.uint8).reshape(x.shape[0], -1)
    got = _encode(name, x)
    assert got.shape == want.shape
    if not np.array_equal(got, want):
        _, bpb = ggml_ref.BLOCKS[ref_name]
        r, c = np.nonzero(got != want)
        pytest.fail(f"{name}: {len(r)} bytes differ, first at row {r[0]} block {c[0] // bpb} byte {c[0] % bpb}")
    return got, want


def _edge_rows(rng: np.random.Generator) -> np.ndarray:
    """One 256-value super-block per row, each row a special case (and mixtures within a super-block)."""
    n = 256
    rows = []
    g = lambda: rng.standard_normal(n).astype(np.float32)  # noqa: E731
    rows.append(np.zeros(n))                                   # all zero
    rows.append(np.full(n, 0.75))                              # constant positive
    rows.append(np.full(n, -3.0))                              # constant negative
    rows.append(np.full(n, 1e-20))                             # constant tiny
    r = g(); r[17] = 1e4; rows.append(r)                       # one huge outlier
    r = g(); r[200] = -1e4; rows.append(r)
    rows.append(g() * 1e-20)                                   # below fp16 range
    rows.append(g() * 1e-6)                                    # fp16 subnormal d
    rows.append(-np.abs(g()))                                  # negative only
    rows.append(np.abs(g()))                                   # positive only
    rows.append(np.abs(g()) + 5.0)                             # positive, far from 0
    rows.append(-np.abs(g()) - 5.0)
    rows.append(rng.integers(-4, 5, n))                        # small integers: ties of nearest_int
    rows.append(rng.integers(0, 16, n))
    rows.append(rng.integers(-32, 32, n) * 0.5)
    rows.append(np.arange(n) % 32)
    rows.append((np.arange(n) % 16) * 0.25 - 1.0)
    rows.append(g() * 1e4)                                     # large magnitudes
    rows.append(g() * 3e4)
    r = g() * 1e-3; r[:32] *= 1e6; rows.append(r)              # small sub-blocks: their scale rounds to 0
    r = g() * 1e-3; r[240:] *= 1e6; rows.append(r)
    r = np.zeros(n); r[64:96] = g()[:32]; rows.append(r)       # zero sub-blocks beside nonzero ones
    r = g(); r[0:16] = 2.5; r[128:160] = -1.0; rows.append(r)  # constant sub-blocks beside random ones
    r = g(); r[::2] = 0.0; r[1::4] = -0.0; rows.append(r)      # signed zeros
    r = np.zeros(n); r[5] = 1.0; rows.append(r)                # one nonzero value
    r = np.zeros(n); r[5] = -1.0; rows.append(r)
    rows.append(np.where(np.arange(n) % 2, 1.0, -1.0))         # two values
    rows.append(np.exp(g() * 4))                               # wide dynamic range
    rows.append(g() ** 3)
    return np.stack(rows).astype(np.float32)


@pytest.mark.parametrize("name, ref_name", TYPES)
def test_random_rows_byte_identical(ggml_lib, name, ref_name):
    rng = np.random.default_rng(0)
    for n, r in ((256, 5), (512, 3), (1024, 2), (2048, 3)):
        _assert_same(name, ref_name, rng.standard_normal((r, n)).astype(np.float32))
    x = (rng.standard_normal((4, 768)) * rng.uniform(0.01, 10, (4, 1))).astype(np.float32)
    _assert_same(name, ref_name, x)


@pytest.mark.parametrize("name, ref_name", TYPES)
def test_varied_distributions_byte_identical(ggml_lib, name, ref_name):
    """Heavy tails, uniform, integer grids, tiny and wide-range values (in fp32 and bf16): these reach roundings the
    normal rows rarely do (e.g. Q4_K/Q5_K's sqrtf of the sub-block's mean square, one ulp off in torch's float32
    sqrt on CPU)."""
    rng = np.random.default_rng(123)
    x = np.concatenate([rng.standard_t(2, (4, 4096)), rng.uniform(-1, 1, (2, 4096)), rng.integers(-8, 9, (2, 4096)),
                        rng.standard_normal((2, 4096)) * 1e-5, rng.laplace(size=(6, 4096)) * 100,
                        np.exp(rng.standard_normal((4, 4096)) * 1.5) * rng.choice([-1, 1], (4, 4096))]).astype(np.float32)
    _assert_same(name, ref_name, x)
    _assert_same(name, ref_name, torch.from_numpy(x).to(torch.bfloat16).float().numpy())


@pytest.mark.parametrize("name, ref_name", TYPES)
def test_edge_blocks_byte_identical(ggml_lib, name, ref_name):
    x = _edge_rows(np.random.default_rng(1))
    _assert_same(name, ref_name, x)
    # the same blocks laid end to end in one row (super-blocks of one row are independent)
    _assert_same(name, ref_name, x.reshape(1, -1))


@pytest.mark.parametrize("name, ref_name", TYPES)
def test_bf16_values_byte_identical(ggml_lib, name, ref_name):
    x = torch.randn(6, 1024, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16).float().numpy()
    _assert_same(name, ref_name, x)
    _assert_same(name, ref_name, x * 0.02)


@pytest.mark.parametrize("name, ref_name", TYPES)
def test_round_trip_through_gguf_dequantize(ggml_lib, name, ref_name):
    import gguf

    qtype = getattr(gguf.GGMLQuantizationType, name)
    x = np.concatenate([np.random.default_rng(3).standard_normal((4, 512)).astype(np.float32),
                        _edge_rows(np.random.default_rng(4))[:8].reshape(4, 512)])
    got, want = _assert_same(name, ref_name, x)
    ours = gguf.quants.dequantize(got, qtype)
    theirs = gguf.quants.dequantize(want, qtype)
    assert ours.shape == x.shape
    np.testing.assert_array_equal(ours, theirs)


@pytest.mark.parametrize("name, bpb", [("Q2_K", 84), ("Q4_K", 144), ("Q5_K", 176)])
def test_shapes_and_refusals(name, bpb):
    from ckpt.quant.kquants.qkx2 import ENCODERS

    fn = ENCODERS[name]
    assert tuple(fn(torch.zeros(3, 512)).shape) == (3, 2 * bpb)
    assert tuple(fn(torch.zeros(0, 256)).shape) == (0, bpb)
    with pytest.raises(ValueError):
        fn(torch.zeros(2, 100))


def test_registered():
    """The torch encoders serve CUDA rows (the registry wraps a plain function as a static, any-device Encoder)."""
    from ckpt.quant.kquants import encoder
    from ckpt.quant.kquants.qkx2 import ENCODERS

    x = torch.randn(2, 256)
    for name, fn in ENCODERS.items():
        assert torch.equal(encoder(name, "cuda").fn(x, None), fn(x))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("name, ref_name", TYPES)
def test_cuda_byte_identical(ggml_lib, name, ref_name):
    from ckpt.quant.kquants.qkx2 import ENCODERS

    rng = np.random.default_rng(5)
    x = np.concatenate([rng.standard_normal((8, 1024)).astype(np.float32), _edge_rows(rng)[:28].reshape(7, 1024)])
    want = np.frombuffer(ggml_ref.quantize(ref_name, x), dtype=np.uint8).reshape(x.shape[0], -1)
    got = ENCODERS[name](torch.from_numpy(x).cuda())
    assert got.device.type == "cuda"
    np.testing.assert_array_equal(got.cpu().numpy(), want)
