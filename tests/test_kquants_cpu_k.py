"""The compiled CPU kernels of ckpt.quant.kquants.k_cpu_qkx (Q2_K, Q4_K, Q5_K) and k_cpu_qx (Q3_K, Q6_K) write, byte
for byte, what llama.cpp's `quantize_<type>(src, dst, nrow, n_per_row, quant_weights)` writes, without an importance
(the `quantize_row_*_ref` path) and with one (the `_impl` path): the ctypes oracle of tests/helpers/ggml_ref.py,
its release build (asserts off) for the rows whose values a debug build's `nearest_int` assert refuses. Rows:
random at several scales, heavy-tailed, and built to hit the C code's branches (all-zero and constant blocks and
sub-blocks, outliers, magnitudes below GROUP_MAX_EPS and in fp16's subnormal range, one-signed, ties, bf16 values,
values near 65504, 1e7 and the float32 limit). Importances: random positive, spanning many decades, with zero
columns, zero sub-blocks and a zero row, and one row of importance per row (the expert slices of a 3-D tensor)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from helpers import ggml_ref

from ckpt.quant.kquants import encoder, jit, k_cpu_qkx, k_cpu_qx

# (ckpt name, ggml name, block bytes, kernel module)
TYPES = [("Q2_K", "q2_K", 84, k_cpu_qkx), ("Q3_K", "q3_K", 110, k_cpu_qx), ("Q4_K", "q4_K", 144, k_cpu_qkx),
         ("Q5_K", "q5_K", 176, k_cpu_qkx), ("Q6_K", "q6_K", 210, k_cpu_qx)]
PATHS = [(*t, w) for t in TYPES for w in (False, True)]
PATH_IDS = [f"{t[0]}-{'imatrix' if w else 'static'}" for *t, w in PATHS]


def _edge_rows() -> np.ndarray:
    """Rows of 1024 made of 256-value super-blocks, each probing corners of the C code (and mixtures of 16/32-value
    sub-blocks inside one super-block)."""
    rng = np.random.default_rng(7)
    g = lambda: rng.standard_normal(256).astype(np.float32)  # noqa: E731
    blocks = [np.zeros(256, np.float32)]                                   # all zero
    blocks += [np.full(256, v, np.float32) for v in (0.75, -3.0, 1e-3, 7e3, 1e-20, -2e-15)]  # constant
    for pos, big in ((17, 1e4), (200, -1e4), (0, 300.0), (255, 1e6)):       # one huge outlier
        o = g() * np.float32(0.01)
        o[pos] = big
        blocks.append(o)
    blocks += [g() * np.float32(1e-20), g() * np.float32(3e-15)]           # below / around GROUP_MAX_EPS
    blocks += [g() * np.float32(1e-9), g() * np.float32(1e-6)]             # scales underflow fp16 / subnormal
    blocks += [-np.abs(g()), np.abs(g()), np.abs(g()) + 5, -np.abs(g()) - 5]  # one-signed
    blocks.append(torch.randn(256, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16).float().numpy())
    blocks += [g() * np.float32(1e4), g() * np.float32(3e4)]               # large magnitudes
    blocks += [rng.integers(-4, 5, 256).astype(np.float32), rng.integers(0, 16, 256).astype(np.float32),
               (rng.integers(-32, 32, 256) * 0.5).astype(np.float32)]     # small integers: nearest_int's ties
    blocks.append(np.tile(np.linspace(-1, 1, 16, dtype=np.float32), 16))   # exact grid values
    r = g() * np.float32(1e-3)
    r[:32] *= np.float32(1e6)                                              # sub-blocks whose scale rounds to 0
    blocks.append(r)
    r = np.zeros(256, np.float32)
    r[64:96] = g()[:32]                                                    # zero sub-blocks beside live ones
    blocks.append(r)
    r = g()
    r[0:16], r[128:160] = 2.5, -1.0                                        # constant sub-blocks beside random
    blocks.append(r)
    r = g()
    r[::2], r[1::4] = 0.0, -0.0                                            # signed zeros
    blocks.append(r)
    r = np.zeros(256, np.float32)
    r[5] = -1.0                                                            # one nonzero value
    blocks.append(r)
    t = np.zeros(256, np.float32)
    t[3], t[9] = -2.0, 2.0                                                 # a tie in |x|: the first sets max
    blocks.append(t)
    blocks += [np.exp(g() * 4), g() ** 3]                                  # wide dynamic range
    while len(blocks) % 4:
        blocks.append(g() * np.float32(rng.uniform(0.01, 10)))
    return np.concatenate(blocks).reshape(-1, 1024).astype(np.float32)


def _extreme_rows() -> np.ndarray:
    """Rows a debug build of ggml refuses (nearest_int's assert) or where fp16 scales overflow: what a release
    llama-quantize writes."""
    rng = np.random.default_rng(11)
    x = rng.standard_normal((8, 512)).astype(np.float32)
    x[0] *= np.float32(65504.0) / np.abs(x[0]).max()                      # the fp16 limit
    x[1] = np.float32(65504.0) + rng.standard_normal(512).astype(np.float32)  # one-signed near 65504
    x[2, ::37] = 1e7                                                       # 1e7 beside small values
    x[3] *= np.float32(1e7)
    x[4, ::11] = np.float32(3.4e38)                                        # the float32 limits: sums overflow
    x[5, 3] = np.float32(-3.4e38)
    x[6] = np.float32(1e-38) * rng.standard_normal(512).astype(np.float32)  # float32 subnormal products
    x[7, :256] = np.float32(1e5) * rng.standard_normal(256).astype(np.float32)  # fp16 d overflows
    return x


def _importances(n: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """The importance vectors [n] the tests run (llama-imatrix writes mean squared activations: >= 0)."""
    out = {"uniform": rng.uniform(0.1, 10, n), "decades": np.exp(rng.uniform(-20, 20, n))}
    z = rng.uniform(0.1, 10, n)
    z[rng.random(n) < 0.2] = 0.0  # zero columns
    z[16:32] = 0.0  # a zero Q2_K/Q3_K/Q6_K sub-block
    z[64:96] = 0.0  # a zero Q4_K/Q5_K sub-block
    out["zeros"] = z
    out["zero"] = np.zeros(n)  # an all-zero importance (llama-quantize would pass it as it is)
    return {k: v.astype(np.float32) for k, v in out.items()}


def _kernel(name: str, weighted: bool):
    enc = encoder(name, "cpu", weighted)
    assert enc is not None and enc.devices == ("cpu",) and enc.rank == 10, enc
    return enc


def _encode(name: str, x: np.ndarray, qw: np.ndarray | None) -> np.ndarray:
    enc = _kernel(name, qw is not None)
    out = enc.fn(torch.from_numpy(x), None if qw is None else torch.from_numpy(qw))
    assert out.dtype == torch.uint8 and out.device.type == "cpu"
    return out.numpy()


def _oracle(ref: str, x: np.ndarray, qw: np.ndarray | None, release: bool) -> np.ndarray:
    if qw is not None and qw.ndim == 2:  # one importance row per row: ggml's call is per row (per expert)
        return np.concatenate([_oracle(ref, x[i:i + 1], qw[i], release) for i in range(x.shape[0])])
    return np.frombuffer(ggml_ref.quantize(ref, x, release=release, imatrix=qw), np.uint8).reshape(x.shape[0], -1)


def _assert_same(name: str, ref: str, bb: int, x: np.ndarray, qw: np.ndarray | None = None, release: bool = False):
    x = np.ascontiguousarray(x, dtype=np.float32)
    want = _oracle(ref, x, qw, release)
    got = _encode(name, x, qw)
    assert got.shape == want.shape
    if not np.array_equal(got, want):
        diff = np.nonzero((got.reshape(-1, bb) != want.reshape(-1, bb)).any(1))[0]
        b = diff[0]
        pos = np.nonzero(got.reshape(-1, bb)[b] != want.reshape(-1, bb)[b])[0]
        pytest.fail(f"{name}: {len(diff)} of {got.size // bb} blocks differ; first block {b}, bytes {pos[:12]}")
    return got


@pytest.mark.parametrize("name, ref, bb, mod, weighted", PATHS, ids=PATH_IDS)
def test_random_rows_byte_identical(ggml_lib, name, ref, bb, mod, weighted):
    for seed, (r, n), scale in ((0, (3, 256), 1.0), (1, (5, 768), 0.02), (2, (4, 2048), 30.0), (3, (2, 4096), 1e-3)):
        rng = np.random.default_rng(seed)
        x = (rng.standard_normal((r, n)) * scale).astype(np.float32)
        _assert_same(name, ref, bb, x, rng.uniform(0.1, 10, n).astype(np.float32) if weighted else None)
    rng = np.random.default_rng(4)
    x = np.concatenate([rng.standard_t(2, (4, 1024)), rng.laplace(size=(2, 1024)) * 100,
                        rng.uniform(-1, 1, (2, 1024))]).astype(np.float32)  # heavy tails: many search branches
    _assert_same(name, ref, bb, x, rng.uniform(0.1, 10, 1024).astype(np.float32) if weighted else None)
    _assert_same(name, ref, bb, torch.from_numpy(x).to(torch.bfloat16).float().numpy(),
                 rng.uniform(0.1, 10, 1024).astype(np.float32) if weighted else None)


@pytest.mark.parametrize("name, ref, bb, mod, weighted", PATHS, ids=PATH_IDS)
def test_edge_rows_byte_identical(ggml_lib, name, ref, bb, mod, weighted):
    x = _edge_rows()
    if not weighted:
        _assert_same(name, ref, bb, x)
        return
    for kind, qw in _importances(x.shape[1], np.random.default_rng(5)).items():
        _assert_same(name, ref, bb, x, qw, release=kind in ("decades", "zero"))


@pytest.mark.parametrize("name, ref, bb, mod, weighted", PATHS, ids=PATH_IDS)
def test_extreme_rows_as_a_release_build(ggml_lib, name, ref, bb, mod, weighted):
    x = _extreme_rows()
    qws = _importances(x.shape[1], np.random.default_rng(6)).values() if weighted else [None]
    for qw in qws:
        _assert_same(name, ref, bb, x, qw, release=True)


@pytest.mark.parametrize("name, ref, bb, mod", TYPES, ids=[t[0] for t in TYPES])
def test_sparse_importances_byte_identical(ggml_lib, name, ref, bb, mod):
    """Importances mostly zero (columns no calibration token reached) spanning decades, on heavy-tailed, one-signed
    and half-zero rows: the sub-block searches then return negative or NaN-free-but-odd scales, and ggml's
    `make_qp_quants` stores negative levels in a `uint8_t` (Q4_K's _impl writes them wrapped, Q5_K's clamps them to
    63): the paths where the C code's integer types, not its arithmetic, decide the bytes."""
    rng = np.random.default_rng(12)
    n = 2048
    for kind in range(8):
        x = rng.standard_normal((4, n)).astype(np.float32)
        if kind % 4 == 1:
            x = -np.abs(x) - np.float32(rng.uniform(0, 3))
        elif kind % 4 == 2:
            x = rng.standard_t(1.5, (4, n)).astype(np.float32)
        elif kind % 4 == 3:
            x[:, rng.random(n) < 0.5] = 0.0
        qw = np.exp(rng.uniform(-10, 10, n)).astype(np.float32)
        qw[rng.random(n) < rng.uniform(0.8, 0.95)] = 0.0
        _assert_same(name, ref, bb, x, qw, release=True)


@pytest.mark.parametrize("name, ref, bb, mod", TYPES, ids=[t[0] for t in TYPES])
def test_importance_per_row(ggml_lib, name, ref, bb, mod):
    """qw [r, n]: each row with its own importance (the expert slices of a 3-D tensor), as ggml quantizes each
    expert with its own slice of the imatrix."""
    rng = np.random.default_rng(8)
    x = rng.standard_normal((6, 512)).astype(np.float32)
    qw = rng.uniform(0.1, 10, (6, 512)).astype(np.float32)
    qw[2] = 0.0
    qw[4, :100] = 0.0
    _assert_same(name, ref, bb, x, qw)


@pytest.mark.parametrize("name, ref, bb, mod", TYPES, ids=[t[0] for t in TYPES])
def test_many_rows_split_across_threads(ggml_lib, name, ref, bb, mod):
    """More values than one piece (`jit.PIECE_ROWS_ELEMS`): the pieces the threads take give the same bytes, with
    one importance for all rows and with one per row (each piece takes its rows' slice)."""
    rng = np.random.default_rng(9)
    x = (rng.standard_normal((jit.PIECE_ROWS_ELEMS // 512 * 2 + 3, 512)) * 0.02).astype(np.float32)
    _assert_same(name, ref, bb, x)
    _assert_same(name, ref, bb, x, rng.uniform(0.1, 10, 512).astype(np.float32))
    _assert_same(name, ref, bb, x, rng.uniform(0.1, 10, x.shape).astype(np.float32))


@pytest.mark.parametrize("name, ref, bb, mod", TYPES, ids=[t[0] for t in TYPES])
def test_registered_and_picked(name, ref, bb, mod):
    """The kernels serve both paths on the CPU (rank over the torch encoders); CUDA rows keep the torch encoder for
    the static path and come to the CPU kernel for the importance path (the only one there is)."""
    for weighted in (False, True):
        enc = _kernel(name, weighted)
        assert enc is mod.ENCODERS[name] and enc.static and enc.weighted
        assert encoder(name, "cuda", weighted=True) is enc
    cuda_static = encoder(name, "cuda", weighted=False)
    assert cuda_static is not mod.ENCODERS[name] and "cuda" in cuda_static.devices


@pytest.mark.parametrize("name, ref, bb, mod", TYPES, ids=[t[0] for t in TYPES])
def test_same_bytes_as_the_torch_encoder_and_gguf_reads_them(ggml_lib, name, ref, bb, mod):
    """The static path: the CPU kernel and the torch encoder (CUDA's) agree, and gguf dequantizes the bytes."""
    import gguf

    x = np.random.default_rng(10).standard_normal((4, 512)).astype(np.float32)
    got = _assert_same(name, ref, bb, x)
    torch_enc = encoder(name, "cuda", weighted=False).fn(torch.from_numpy(x), None)
    np.testing.assert_array_equal(torch_enc.cpu().numpy(), got)
    back = gguf.quants.dequantize(got, getattr(gguf.GGMLQuantizationType, name))
    assert back.shape == x.shape and np.isfinite(back).all()


@pytest.mark.parametrize("name, ref, bb, mod", TYPES, ids=[t[0] for t in TYPES])
def test_shapes_and_refusals(name, ref, bb, mod):
    fn = _kernel(name, False).fn
    assert tuple(fn(torch.zeros(3, 512), None).shape) == (3, 2 * bb)
    assert tuple(fn(torch.zeros(0, 256), None).shape) == (0, bb)
    assert tuple(fn(torch.zeros(2, 256), torch.ones(256)).shape) == (2, bb)
    with pytest.raises(ValueError):
        fn(torch.zeros(2, 100), None)
    with pytest.raises(ValueError):
        fn(torch.zeros(2, 256), torch.ones(3, 256))  # an importance of neither [n] nor [r, n]


@pytest.mark.parametrize("name, ref, bb, mod", TYPES, ids=[t[0] for t in TYPES])
def test_gguf_encode_runs_the_kernels(ggml_lib, name, ref, bb, mod):
    """`ckpt.quant.gguf.encode`, the one call every GGUF writer makes, gives ggml's bytes on both paths (bf16 rows
    as a checkpoint holds them, an importance per column)."""
    import gguf

    from ckpt.quant.gguf import encode

    t = int(getattr(gguf.GGMLQuantizationType, name))
    rng = np.random.default_rng(13)
    x = torch.from_numpy(rng.standard_normal((8, 512)).astype(np.float32) * np.float32(0.02)).to(torch.bfloat16)
    qw = rng.uniform(0.1, 10, 512).astype(np.float32)
    xf = x.float().numpy()
    np.testing.assert_array_equal(encode(x, t).numpy(), _oracle(ref, xf, None, False).reshape(-1))
    np.testing.assert_array_equal(encode(x, t, torch.from_numpy(qw)).numpy(), _oracle(ref, xf, qw, False).reshape(-1))
