"""ckpt.quant.kquants.iq4 writes, byte for byte, what llama.cpp's `quantize_iq4_nl` / `quantize_iq4_xs` write without
an importance matrix (the ctypes oracle of tests/helpers/ggml_ref.py), and gguf reads both back the same."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ckpt.quant.kquants import iq4
from helpers import ggml_ref

TYPES = [("IQ4_NL", "iq4_nl", 32, 18), ("IQ4_XS", "iq4_xs", 256, 136)]


def _edge_rows() -> np.ndarray:
    """Rows of 512 made of 32-value blocks that probe the corners of the C code."""
    rng = np.random.default_rng(7)
    blocks = []
    z = np.zeros(32, np.float32)
    blocks += [z, z, z, z, z, z, z, z]  # a whole all-zero super-block (IQ4_XS: d = -0.0)
    blocks += [np.full(32, 1.0, np.float32), np.full(32, -2.5, np.float32), np.full(32, 0.37, np.float32)]
    o = rng.standard_normal(32).astype(np.float32) * 0.01
    o[5] = 1000.0
    blocks.append(o)
    o = rng.standard_normal(32).astype(np.float32)
    o[31] = -5e4
    blocks.append(o)
    blocks.append((rng.standard_normal(32) * 1e-20).astype(np.float32))  # below GROUP_MAX_EPS
    blocks.append((rng.standard_normal(32) * 1e-14).astype(np.float32))  # denormal products
    blocks.append((rng.standard_normal(32) * 3e-15).astype(np.float32))
    blocks.append(-np.abs(rng.standard_normal(32)).astype(np.float32))  # negative only
    blocks.append(np.abs(rng.standard_normal(32)).astype(np.float32))  # positive only
    blocks.append(torch.randn(32, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16).float().numpy())
    blocks.append((rng.standard_normal(32) * 1e4).astype(np.float32))
    blocks.append(rng.integers(-3, 4, 32).astype(np.float32))  # few distinct values, many ties
    t = np.zeros(32, np.float32)
    t[3], t[9] = -2.0, 2.0  # tie in |x|: the first one sets max
    blocks.append(t)
    blocks.append(np.linspace(-1, 1, 32, dtype=np.float32))
    # max = -127 (or a power of two times it): the try id = (0 + values[0]) / max is exact, so x scaled lands exactly
    # on the midpoints between kvalues (best_index_int8's tie rule: ties go up)
    mids = np.array([-115.5, -93.5, -74, -57, -42, -28.5, -16, -4.5, 7, 19, 31.5, 45.5, 61, 79, 101], np.float32)
    tie = np.concatenate([[-127.0], mids, mids[::-1], [0.0]]).astype(np.float32)
    blocks += [tie, tie * 2, tie / 4, -tie[::-1] * 0.5]
    # mostly exact kvalues (the try id = 1 fits best) with a few midpoints: the tie rule moves the chosen scale
    k = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.float32)
    t2 = np.concatenate([k, k[::-1]])
    t2[[8, 9, 22, 23, 7, 24]] = [-4.5, 7, 7, -4.5, -16, 19]
    t3 = np.concatenate([k, k[::-1]])
    t3[[20, 21, 22]] = [31.5, 19, 45.5]
    blocks += [t2, t3, t2 * 2, t3 / 8]
    while len(blocks) % 16:
        blocks.append((rng.standard_normal(32) * rng.uniform(0.01, 10)).astype(np.float32))
    return np.concatenate(blocks).reshape(-1, 512)


def _inputs():
    rng = np.random.default_rng(0)
    yield "normal", np.concatenate([rng.standard_normal((3, n)).astype(np.float32).reshape(-1, 256)
                                    for n in (256, 512, 2048)]).reshape(-1, 256)
    yield "normal_rows", rng.standard_normal((5, 2048)).astype(np.float32)
    yield "scaled", (rng.standard_normal((4, 1024)) * rng.uniform(1e-3, 1e3, (4, 1))).astype(np.float32)
    yield "heavy_tail", rng.standard_t(2, (4, 1024)).astype(np.float32)
    yield "bf16", torch.randn(4, 768, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16).float().numpy()
    yield "edges", _edge_rows()
    # super-blocks where only some of the 8 sub-blocks are zero or tiny (IQ4_XS scale packing)
    x = rng.standard_normal((2, 512)).astype(np.float32)
    x[0, 32:96] = 0
    x[1, 256:480] = 1e-20
    yield "partial", x


CASES = [(name, arr) for name, arr in _inputs()]


@pytest.mark.parametrize("qname, ggml_name, blk, nbytes", TYPES)
@pytest.mark.parametrize("case", [c[0] for c in CASES])
def test_bytes_equal_ggml(ggml_lib, qname, ggml_name, blk, nbytes, case):
    import gguf

    x = dict(CASES)[case]
    want = ggml_ref.quantize(ggml_name, x)
    got_t = iq4.ENCODERS[qname](torch.from_numpy(x))
    assert got_t.dtype == torch.uint8 and got_t.shape == (x.shape[0], x.shape[1] // blk * nbytes)
    got = got_t.numpy().tobytes()
    if got != want:
        a = np.frombuffer(got, np.uint8).reshape(-1, nbytes)
        b = np.frombuffer(want, np.uint8).reshape(-1, nbytes)
        bad = np.nonzero((a != b).any(1))[0]
        i = int(bad[0])
        pytest.fail(f"{len(bad)}/{len(a)} blocks differ; first block {i}: bytes {np.nonzero(a[i] != b[i])[0][:8]}"
                    f"\n got {a[i][:12]}\nwant {b[i][:12]}")
    qtype = getattr(gguf.GGMLQuantizationType, qname)
    y_got = gguf.quants.dequantize(got_t.numpy(), qtype)
    y_want = gguf.quants.dequantize(np.frombuffer(want, np.uint8).reshape(x.shape[0], -1), qtype)
    np.testing.assert_array_equal(y_got, y_want)


def test_registered():
    """The torch encoders serve CUDA rows (the registry wraps a plain function as a static, any-device Encoder)."""
    from ckpt.quant.kquants import encoder

    x = torch.randn(2, 256)
    for name, fn in (("IQ4_NL", iq4.encode_iq4_nl), ("IQ4_XS", iq4.encode_iq4_xs)):
        assert torch.equal(encoder(name, "cuda").fn(x, None), fn(x))


@pytest.mark.parametrize("qname, blk", [("IQ4_NL", 32), ("IQ4_XS", 256)])
def test_rejects_bad_shapes(qname, blk):
    with pytest.raises(ValueError):
        iq4.ENCODERS[qname](torch.zeros(2, blk + 16))
    with pytest.raises(ValueError):
        iq4.ENCODERS[qname](torch.zeros(blk))


def _best_index_int8_c(x: np.float32) -> int:
    """best_index_int8(16, kvalues_iq4nl, x), line by line in numpy float32."""
    kv = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.float32)
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
    """The floor(2x) table look-up equals best_index_int8 on every float within 40 ulps of each midpoint and each
    kvalue, on random floats, on huge values, infinities and NaN."""
    kv = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.float32)
    anchors = np.concatenate([kv, (kv[1:] + kv[:-1]) / 2, [0.0, -0.0]]).astype(np.float32)
    near = anchors.view(np.int32)[:, None] + np.arange(-40, 41, dtype=np.int32)[None, :]
    near = np.where(anchors[:, None] == 0, np.arange(-40, 41, dtype=np.int32)[None, :], near).view(np.float32)
    rng = np.random.default_rng(5)
    xs = np.concatenate([near.ravel(), rng.uniform(-140, 130, 3000).astype(np.float32),
                         np.array([1e30, -1e30, 3e38, -3e38, np.inf, -np.inf, np.nan, 1e-45, -1e-45], np.float32)])
    want = np.array([_best_index_int8_c(x) for x in xs])
    got = iq4._best_index(torch.from_numpy(xs)).numpy()
    bad = np.nonzero(got != want)[0]
    assert bad.size == 0, (xs[bad][:5], got[bad][:5], want[bad][:5])
