"""The compiled CPU kernels of ckpt.quant.kquants.legacy_cpu (Q4_0, Q4_1, Q5_0, Q5_1 with an importance matrix) and
ckpt.quant.kquants.iq4_cpu (IQ4_NL, IQ4_XS, without and with one) write, byte for byte, what llama.cpp's
`quantize_<type>(src, dst, nrow, n_per_row, quant_weights)` writes (the ctypes oracle of tests/helpers/ggml_ref.py:
ggml-quants.c compiled; its release build, asserts off, for the rows whose values a debug build's `nearest_int`
assert refuses), on random rows at several scales, on rows built to hit the C code's branches, with random
positive importances, importances with zero columns and blocks, importances spanning many decades, and one row of
importance per row (the expert slices of a 3-D tensor). gguf's dequantizer reads both the same."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from helpers import ggml_ref

from ckpt.jit import compiled
from ckpt.quant.kquants import encoder, iq4, iq4_cpu, jit, legacy_cpu

# (ckpt name, ggml name, block, block bytes, static path ours)
LEGACY = [("Q4_0", "q4_0", 32, 18), ("Q4_1", "q4_1", 32, 20), ("Q5_0", "q5_0", 32, 22), ("Q5_1", "q5_1", 32, 24)]
IQ4 = [("IQ4_NL", "iq4_nl", 32, 18), ("IQ4_XS", "iq4_xs", 256, 136)]
# every (type, path) served here: weighted for all, static for the IQ4 types
PATHS = [(*t, True) for t in LEGACY + IQ4] + [(*t, False) for t in IQ4]
PATH_IDS = [f"{t[0]}-{'imatrix' if t[4] else 'static'}" for t in PATHS]


def _edge_rows() -> np.ndarray:
    """Rows of 1024 made of 32-value blocks that probe the corners of the C code (as tests/test_kquants_iq4.py)."""
    rng = np.random.default_rng(7)
    blocks = []
    z = np.zeros(32, np.float32)
    blocks += [z] * 8  # a whole all-zero super-block (IQ4_XS: d = -0.0)
    blocks += [np.full(32, v, np.float32) for v in (1.0, -2.5, 0.37, 1e-3, 7e3)]  # constant blocks
    for pos, big in ((5, 1000.0), (31, -5e4), (0, 300.0)):  # one huge outlier
        o = rng.standard_normal(32).astype(np.float32) * 0.01
        o[pos] = big
        blocks.append(o)
    blocks.append((rng.standard_normal(32) * 1e-20).astype(np.float32))  # below GROUP_MAX_EPS
    blocks.append((rng.standard_normal(32) * 3e-15).astype(np.float32))  # just around it
    blocks.append((rng.standard_normal(32) * 1e-9).astype(np.float32))  # scales underflow fp16
    blocks.append((rng.standard_normal(32) * 1e-6).astype(np.float32))  # scales fp16 subnormal
    blocks.append(-np.abs(rng.standard_normal(32)).astype(np.float32))  # negative only
    blocks.append(np.abs(rng.standard_normal(32)).astype(np.float32))  # positive only (Q4_1: min > 0 -> 0)
    blocks.append(np.abs(rng.standard_normal(32)).astype(np.float32) + 5)  # positive, far from 0
    blocks.append(torch.randn(32, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16).float().numpy())
    blocks.append((rng.standard_normal(32) * 1e4).astype(np.float32))
    blocks.append(rng.integers(-3, 4, 32).astype(np.float32))  # few distinct values, many ties
    t = np.zeros(32, np.float32)
    t[3], t[9] = -2.0, 2.0  # tie in |x|: the first one sets max
    blocks.append(t)
    few = np.zeros(32, np.float32)
    few[[4, 20]] = [0.5, -0.25]  # sparse
    blocks.append(few)
    blocks.append(np.linspace(-1, 1, 32, dtype=np.float32))
    # IQ4: values landing exactly on the midpoints between kvalues (best_index_int8's tie rule: ties go up)
    mids = np.array([-115.5, -93.5, -74, -57, -42, -28.5, -16, -4.5, 7, 19, 31.5, 45.5, 61, 79, 101], np.float32)
    tie = np.concatenate([[-127.0], mids, mids[::-1], [0.0]]).astype(np.float32)
    blocks += [tie, tie * 2, tie / 4, -tie[::-1] * 0.5]
    k = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.float32)
    t2 = np.concatenate([k, k[::-1]])
    t2[[8, 9, 22, 23, 7, 24]] = [-4.5, 7, 7, -4.5, -16, 19]
    blocks += [t2, t2 * 2]
    # Q4_0/Q5_0: values on the rounding ties of the first scale -nmax/max (x = max * (k + 0.5) / nmax)
    blocks.append((np.float32(-8.0) * (np.arange(32, dtype=np.float32) % 16 - 7.5) / 8).astype(np.float32))
    blocks.append((np.float32(16.0) * (np.arange(32, dtype=np.float32) - 15.5) / 16).astype(np.float32))
    while len(blocks) % 32:
        blocks.append((rng.standard_normal(32) * rng.uniform(0.01, 10)).astype(np.float32))
    return np.concatenate(blocks).reshape(-1, 1024)


def _extreme_rows() -> np.ndarray:
    """Rows a debug build of ggml refuses (nearest_int's assert) or where fp16 scales overflow: values near 65504,
    1e7 beside small values, the float32 limits; what a release llama-quantize writes."""
    rng = np.random.default_rng(11)
    x = rng.standard_normal((6, 512)).astype(np.float32)
    x[0] *= np.float32(65504.0) / np.abs(x[0]).max()  # the fp16 limit
    x[1] = np.float32(65504.0) + rng.standard_normal(512).astype(np.float32)  # one-signed near 65504
    x[2, ::37] = 1e7  # 1e7 beside small values
    x[3] *= np.float32(1e7)
    x[4, ::11] = np.float32(3.4e38)  # the float32 limits (Q4_1: max - min overflows to inf)
    x[4, 5::11] = np.float32(-3.4e38)
    x[5] = np.float32(1e38) * np.sign(x[5])
    return x


def _inputs():
    rng = np.random.default_rng(0)
    for shape in ((3, 256), (5, 768), (4, 2048)):
        x = rng.standard_normal(shape).astype(np.float32)
        x[1] *= np.float32(0.02)  # a row at weight scale
        yield f"normal{shape[1]}", x
    yield "scaled", (rng.standard_normal((4, 1024)) * rng.uniform(1e-3, 1e3, (4, 1))).astype(np.float32)
    yield "heavy_tail", rng.standard_t(2, (4, 1024)).astype(np.float32)
    yield "bf16", torch.randn(4, 768, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16).float().numpy()
    yield "edges", _edge_rows()
    x = rng.standard_normal((2, 512)).astype(np.float32)  # super-blocks with some zero or tiny sub-blocks
    x[0, 32:96] = 0
    x[1, 256:480] = 1e-20
    yield "partial", x


CASES = dict(_inputs())


def _importances(n: int, seed: int) -> dict[str, np.ndarray]:
    """Kinds of importance llama-quantize passes: sums of squared activations (positive, widely spread), with
    columns that no token reached (zero), a whole block of them, and the all-ones of an entry of zero count."""
    rng = np.random.default_rng(seed)
    pos = rng.uniform(0.01, 10, n).astype(np.float32)
    zeros = pos.copy()
    zeros[::5] = 0
    zeros[32:64] = 0  # a whole block without importance
    wide = np.exp(rng.uniform(np.log(1e-8), np.log(1e8), n)).astype(np.float32)
    return {"positive": pos, "zeros": zeros, "wide": wide, "ones": np.ones(n, np.float32)}


def _want(ref: str, x: np.ndarray, qw: np.ndarray | None, release: bool = False) -> np.ndarray:
    """The oracle's bytes, [rows, row bytes]; `qw` [n], [rows, n] (one call per row) or None."""
    try:
        if qw is not None and qw.ndim == 2:
            return np.stack([np.frombuffer(ggml_ref.quantize(ref, x[i:i + 1], release, qw[i]), np.uint8)
                             for i in range(x.shape[0])])
        return np.frombuffer(ggml_ref.quantize(ref, x, release, qw), np.uint8).reshape(x.shape[0], -1)
    except ggml_ref.Unavailable as e:
        pytest.skip(str(e))


def _check(name: str, ref: str, bb: int, weighted: bool, x: np.ndarray, qw: np.ndarray | None,
           release: bool = False, label: str = ""):
    import gguf

    want = _want(ref, x, qw if weighted else None, release)
    enc = encoder(name, "cpu", weighted)
    got_t = enc.fn(torch.from_numpy(x), torch.from_numpy(qw) if weighted else None)
    assert got_t.dtype == torch.uint8 and tuple(got_t.shape) == want.shape
    got = got_t.numpy()
    if not np.array_equal(got, want):
        a, b = got.reshape(-1, bb), want.reshape(-1, bb)
        bad = np.nonzero((a != b).any(1))[0]
        i = int(bad[0])
        pytest.fail(f"{name} {label}: {len(bad)}/{len(a)} blocks differ; first block {i}, bytes "
                    f"{np.nonzero(a[i] != b[i])[0][:8]}\n got {a[i][:12]}\nwant {b[i][:12]}")
    qtype = getattr(gguf.GGMLQuantizationType, name)
    with np.errstate(all="ignore"):  # fp16 scales that overflowed (the extreme rows) decode to inf/NaN alike
        np.testing.assert_array_equal(gguf.quants.dequantize(got, qtype), gguf.quants.dequantize(want, qtype))


@pytest.mark.parametrize("name, ref, blk, bb, weighted", PATHS, ids=PATH_IDS)
@pytest.mark.parametrize("case", list(CASES))
def test_bytes_equal_ggml(ggml_lib, name, ref, blk, bb, weighted, case):
    x = CASES[case]
    if x.shape[1] % blk:
        pytest.skip(f"rows of {x.shape[1]} are not whole {name} blocks")
    if not weighted:
        _check(name, ref, bb, False, x, None, label=case)
        return
    # the release oracle for the edge rows: with the 'wide' importance, make_qkx3_quants (Q4_1, Q5_1) moves its min
    # so far that nearest_int gets values beyond 4194303 (a debug build aborts; the kernels' exact fallback runs)
    for kind, qw in _importances(x.shape[1], x.shape[1] + len(case)).items():
        _check(name, ref, bb, True, x, qw, release=case == "edges", label=f"{case}/{kind}")


@pytest.mark.parametrize("name, ref, blk, bb, weighted", PATHS, ids=PATH_IDS)
def test_extreme_values_equal_release_ggml(ggml_lib, name, ref, blk, bb, weighted):
    """What a release llama-quantize writes for values at the fp16 and float32 limits (its asserts are off)."""
    x = _extreme_rows()
    _check(name, ref, bb, weighted, x, _importances(x.shape[1], 3)["positive"] if weighted else None, release=True,
           label="extreme")


@pytest.mark.parametrize("name, ref, blk, bb", LEGACY + IQ4)
def test_one_importance_row_per_row(ggml_lib, name, ref, blk, bb):
    """qw [rows, n] (the expert slices of a 3-D tensor, each with its own importance): each row as ggml encodes
    it with its own."""
    rng = np.random.default_rng(5)
    x = rng.standard_normal((6, 512)).astype(np.float32)
    qw = rng.uniform(0.01, 10, (6, 512)).astype(np.float32)
    qw[2] = 1
    qw[3, ::3] = 0
    _check(name, ref, bb, True, x, qw, label="per-row")


@pytest.mark.parametrize("name, ref, blk, bb", LEGACY + IQ4)
def test_many_pieces_on_threads(ggml_lib, monkeypatch, name, ref, blk, bb):
    """Rows cut in many pieces, taken by two threads (`jit.encode_rows`): the same bytes as one C call."""
    import ckpt.quant.gguf as gguf_mod

    monkeypatch.setattr(jit, "PIECE_ROWS_ELEMS", 4096)
    monkeypatch.setattr(gguf_mod, "quant_workers", lambda pieces: min(2, pieces))
    rng = np.random.default_rng(9)
    x = (rng.standard_normal((40, 1024)) * 0.05).astype(np.float32)
    _check(name, ref, bb, True, x, rng.uniform(0.1, 3, 1024).astype(np.float32), label="pieces")


@pytest.mark.parametrize("name, ref, blk, bb", LEGACY + IQ4)
def test_gguf_encode_with_importance(ggml_lib, name, ref, blk, bb):
    """ckpt.quant.gguf.encode, the one call that encodes, runs these kernels for an importance (bf16 values too)."""
    import gguf

    from ckpt.quant.gguf import encode

    rng = np.random.default_rng(4)
    v = torch.randn(3, 512, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    qw = rng.uniform(0.1, 5, 512).astype(np.float32)
    got = encode(v, getattr(gguf.GGMLQuantizationType, name), torch.from_numpy(qw)).numpy()
    assert np.array_equal(got, _want(ref, v.float().numpy(), qw).reshape(-1))


def test_registered_encoders_are_picked():
    """The CPU kernels serve CPU rows (and CUDA rows with an importance: none runs there); the static legacy path
    stays the gguf package's (no encoder), CUDA's static IQ4 path the torch one."""
    for name in ("Q4_0", "Q4_1", "Q5_0", "Q5_1"):
        ours = legacy_cpu.ENCODERS[name]
        assert ours.devices == ("cpu",) and ours.weighted and not ours.static
        assert encoder(name, "cpu", True) is ours and encoder(name, "cuda", True) is ours
        assert encoder(name, "cpu", False) is None
    for name in ("IQ4_NL", "IQ4_XS"):
        ours = iq4_cpu.ENCODERS[name]
        assert encoder(name, "cpu", False) is ours and encoder(name, "cpu", True) is ours
        assert encoder(name, "cuda", True) is ours
        cuda = encoder(name, "cuda", False)
        assert cuda is not ours and "cuda" in cuda.devices
        x = torch.randn(2, 256)
        assert torch.equal(cuda.fn(x, None), iq4.ENCODERS[name](x))


@pytest.mark.parametrize("name, ref, blk, bb", LEGACY + IQ4)
def test_rejects_bad_shapes(name, ref, blk, bb):
    fn = encoder(name, "cpu", True).fn
    with pytest.raises(ValueError):
        fn(torch.zeros(2, blk + 16), torch.ones(blk + 16))
    with pytest.raises(ValueError):
        fn(torch.zeros(2, blk), torch.ones(blk + 32))  # an importance of another length
    with pytest.raises(ValueError):
        fn(torch.zeros(3, blk), torch.ones(2, blk))  # rows of importance for other rows
    if name.startswith("Q"):
        with pytest.raises(ValueError):
            fn(torch.zeros(2, blk), None)  # the legacy kernels are the importance path only
    assert tuple(fn(torch.zeros(0, blk), torch.ones(blk)).shape) == (0, bb)


def _best_index_int8_c(x: np.float32) -> int:
    """best_index_int8(16, kvalues_iq4nl, x), line by line in numpy float32."""
    kv = np.array(iq4_cpu.KVALUES_IQ4NL_DATA, np.float32)
    if x <= kv[0]:
        return 0
    if x >= kv[15]:
        return 15
    ml, mu = 0, 15
    while mu - ml > 1:
        mav = (ml + mu) // 2
        if x < kv[mav]:
            mu = mav
        else:
            ml = mav
    return mu - 1 if np.float32(x - kv[mu - 1]) < np.float32(kv[mu] - x) else mu


def test_best_index_matches_c():
    """The kernels' floor(2x) look-up equals best_index_int8 on every float within 40 ulps of each midpoint and each
    kvalue, on random floats, on huge values, infinities and NaN."""
    kv = np.array(iq4_cpu.KVALUES_IQ4NL_DATA, np.float32)
    anchors = np.concatenate([kv, (kv[1:] + kv[:-1]) / 2, [0.0, -0.0, 116.0, -116.0, 101.5, 102.0]]).astype(np.float32)
    near = anchors.view(np.int32)[:, None] + np.arange(-40, 41, dtype=np.int32)[None, :]
    near = np.where(anchors[:, None] == 0, np.arange(-40, 41, dtype=np.int32)[None, :], near).view(np.float32)
    rng = np.random.default_rng(5)
    xs = np.concatenate([near.ravel(), rng.uniform(-140, 130, 2000).astype(np.float32),
                         np.array([1e30, -1e30, 3e38, -3e38, np.inf, -np.inf, np.nan, 1e-45, -1e-45], np.float32)])
    best = compiled(iq4_cpu.__name__).best_index_iq4
    got = np.array([best(np.float32(x)) for x in xs])
    want = np.array([_best_index_int8_c(x) for x in xs])
    bad = np.nonzero(got != want)[0]
    assert bad.size == 0, (xs[bad][:5], got[bad][:5], want[bad][:5])
