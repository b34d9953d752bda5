"""The compiled CPU kernels of IQ3_XXS and IQ3_S (ckpt.quant.kquants.iq3_cpu: both paths) and of TQ1_0, TQ2_0, MXFP4,
Q1_0 and Q2_0 (ckpt.quant.kquants.small_cpu: one kernel, the importance unread) write, byte for byte, what
llama.cpp's quantizers write (tests/helpers/ggml_ref.py compiles ggml-quants.c: `quantize_<type>(..., NULL)` and
`quantize_<type>(..., imatrix)`), on random rows at several scales and on the edge cases where the C code branches
(zero and constant blocks and sub-blocks, outliers, magnitudes below the group epsilon, fp16's subnormal range and
overflow, one-signed rows, ties of the rounding, values next to powers of two), with random positive importances
and importances with zero columns. The grids' init tables match the C init's own arrays, the gguf package (what
loaders read with) quantizes TQ1_0 / TQ2_0 / MXFP4 as ours does, and where ggml's IQ3 search aborts the process
(values whose cubes overflow float32) the kernels refuse with a CkptError."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from helpers import ggml_ref

from ckpt.errors import CkptError
from ckpt.quant.kquants import encoder, iq3_cpu, small_cpu
from ckpt.quant.kquants.iq3_grids import iq3_tables

IQ3 = [("IQ3_XXS", "iq3_xxs"), ("IQ3_S", "iq3_s")]
SMALL = [("TQ1_0", "tq1_0"), ("TQ2_0", "tq2_0"), ("MXFP4", "mxfp4"), ("Q1_0", "q1_0"), ("Q2_0", "q2_0")]
ALL = IQ3 + SMALL
N = 1024  # a row: 4 blocks of 256, 8 of 128, 16 of 64, 32 of 32


def _fn(name):
    return (iq3_cpu.ENCODERS.get(name) or small_cpu.ENCODERS[name]).fn


def _edge_rows() -> np.ndarray:
    """Rows of N values, one kind of block or sub-block each."""
    rng = np.random.default_rng(11)
    n = rng.standard_normal((24, N)).astype(np.float32)
    rows = [np.zeros(N, np.float32)]                                              # all zero
    rows.append(np.repeat(np.array([1, -1, 0.5, -3.25, 1e-3, 7e3, 1e-16, -2e-15], np.float32), N // 8))  # constants
    r = n[0].copy()
    r[[3, 300, 600, 1000]] = [1e4, -1e4, 1e6, -1e6]                               # one huge outlier a block
    rows.append(r)
    rows.append(n[1] * np.float32(1e-20))                                         # below the group epsilons
    rows.append(n[2] * np.float32(1e-16))
    rows.append(n[3] * np.float32(1e-6))                                          # scales in fp16's subnormals
    rows.append(n[4] * np.float32(1e-9))                                          # scales underflow fp16
    rows.append(-np.abs(n[5]))                                                    # one-signed
    rows.append(np.abs(n[6]))
    rows.append(torch.from_numpy(n[7]).to(torch.bfloat16).float().numpy())        # bf16-representable
    r = n[8] / np.abs(n[8]).max() * np.float32(65504)                            # near fp16's max
    r[[0, 256, 512, 768]] = [65504, -65504, 65520, 70000]                         # d at and past fp16 overflow
    rows.append(r.astype(np.float32))
    rows.append(n[9] * np.float32(1e7))
    r = n[10].copy()                                                              # zero / tiny / constant sub-blocks
    r[:32] = 0                                                                    # in live blocks (IQ3_S skips
    r[256 + 64:256 + 96] = 0                                                      # a zero sub-block of 32 and
    r[512 + 224:512 + 256] = 0                                                    # shifts its qs / signs)
    r[768 + 32:768 + 48] = 0
    r[768 + 96:768 + 128] = 1e-17
    r[768 + 128:768 + 160] = 2.0
    rows.append(r)
    r = np.zeros(N, np.float32)                                                   # sparse
    r[rng.choice(N, 12, replace=False)] = n[11][:12] * 3
    rows.append(r)
    rows.append(np.round(n[12] * 2).astype(np.float32))                           # small integers: ties of
    rows.append((np.round(n[13] * 8) / 4).astype(np.float32))                     # round(x/d), of fp4's levels
    rows.append(np.tile(np.linspace(-1, 1, 16, dtype=np.float32), N // 16))       # exact level values
    r = n[14].copy()                                                              # block maxima just below and at
    for b in range(32):                                                           # powers of two (MXFP4's
        r[32 * b] = np.nextafter(np.float32(2.0 ** (b - 12)), np.float32(0)) if b % 2 else np.float32(2.0 ** (b - 12))
    rows.append(r)                                                                # floor(log2f(amax)))
    r = n[15].copy()
    r[::7] = -0.0                                                                 # negative zeros
    rows.append(r)
    rows.append(n[16] * np.float32(1e12))                                         # near the IQ3 abort threshold
    r = n[17].copy()
    r[::3] = 0                                                                    # many zeros in every group
    rows.append(r)
    return np.stack(rows).astype(np.float32)


def _importances(rng) -> list[np.ndarray]:
    """A random positive importance, one with zero columns (a whole sub-block, a whole block of 256 and scattered
    ones) and one spanning 1e-5..1e5 (on the sparse edge row it drives IQ3's second-pass scale so small that
    nearest_int's argument leaves its asserted range: release build only)."""
    pos = (rng.random(N) + 0.01).astype(np.float32)
    wide = np.exp(rng.uniform(-11.5, 11.5, N)).astype(np.float32)
    zeros = (rng.random(N) + 0.01).astype(np.float32)
    zeros[rng.random(N) < 0.15] = 0
    zeros[32:64] = 0
    zeros[512:768] = 0
    return [pos, zeros, wide]


def _check(name: str, ref: str, x: np.ndarray, qw: np.ndarray | None = None, release: bool = False):
    blk, bb = ggml_ref.BLOCKS[ref]
    want = np.frombuffer(ggml_ref.quantize(ref, x, release=release, imatrix=qw), dtype=np.uint8)
    want = want.reshape(x.shape[0], -1)
    got = _fn(name)(torch.from_numpy(x), None if qw is None else torch.from_numpy(qw))
    assert got.dtype == torch.uint8 and tuple(got.shape) == want.shape
    got = got.numpy()
    if not np.array_equal(got, want):
        bad = np.nonzero((got.reshape(-1, bb) != want.reshape(-1, bb)).any(1))[0]
        b = bad[0]
        pos = np.nonzero(got.reshape(-1, bb)[b] != want.reshape(-1, bb)[b])[0]
        pytest.fail(f"{name}: {len(bad)} of {got.size // bb} blocks differ; first block {b} (row "
                    f"{b // (x.shape[1] // blk)}), bytes {pos[:12]}")


@pytest.mark.parametrize("name, ref", ALL)
@pytest.mark.parametrize("seed, scale", [(0, 1.0), (1, 0.02), (2, 300.0), (3, 1e-4)])
def test_random_rows_byte_identical(ggml_lib, name, ref, seed, scale):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((6, N)) * scale).astype(np.float32)
    x[1] = (rng.standard_t(2, N) * scale).astype(np.float32)  # heavy tails: outliers in many sub-blocks
    _check(name, ref, x)
    if name.startswith("IQ3"):
        for qw in _importances(rng):
            _check(name, ref, x, qw)


@pytest.mark.parametrize("name, ref", ALL)
def test_edge_rows_byte_identical(ggml_lib, name, ref):
    x = _edge_rows()
    _check(name, ref, x)
    for qw in _importances(np.random.default_rng(5))[:2]:
        _check(name, ref, x, qw)  # the small types ignore it, as ggml's quantize_<type> does


@pytest.mark.parametrize("name, ref", IQ3)
def test_one_importance_row_per_row(ggml_lib, name, ref):
    """qw [r, n] (the expert slices of a 3-D tensor): each row is encoded with its own importance."""
    rng = np.random.default_rng(8)
    x = rng.standard_normal((3, N)).astype(np.float32)
    qw = np.stack(_importances(rng))
    got = _fn(name)(torch.from_numpy(x), torch.from_numpy(qw)).numpy()
    for i in range(3):
        want = np.frombuffer(ggml_ref.quantize(ref, x[i:i + 1], imatrix=qw[i]), dtype=np.uint8)
        np.testing.assert_array_equal(got[i], want)


@pytest.mark.parametrize("name, ref", SMALL)
def test_many_rows_in_pieces_byte_identical(ggml_lib, name, ref):
    """More rows than one piece of `encode_rows`: the pieces the threads take join to the C bytes."""
    x = np.random.default_rng(4).standard_normal((300, N)).astype(np.float32)
    _check(name, ref, x)


def test_extreme_rows_byte_identical_to_a_release_build(ggml_lib):
    """Where the debug build's nearest_int assert aborts, a release llama-quantize (asserts off) writes what its
    arithmetic gives: blocks whose maximum is a float32 subnormal (IQ3_S's 1/max and the ternary types' 1/d are
    infinite; ggml's nearest_int, lroundf, (int)roundf and (uint8_t) of Inf and NaN give what x86-64 gives), and
    the edge rows under an importance spanning 1e-5..1e5 (IQ3's second-pass scale)."""
    rng = np.random.default_rng(6)
    x = rng.standard_normal((5, N)).astype(np.float32)
    x[0] *= np.float32(1e-40)
    x[1] *= np.float32(1e-44)
    x[2, :512] *= np.float32(1e-39)
    x[3, ::2] = np.float32(1e-45)
    x[4, 256:] *= np.float32(3e-38)
    big = rng.standard_normal((2, N)).astype(np.float32)  # just below IQ3's abort: nearest_int leaves its range
    big[0, ::97] = np.float32(1e13)
    big[1] *= np.float32(1e12)
    e8 = (rng.standard_normal((1, N)) * 1e-39).astype(np.float32)  # MXFP4 exponents 0 and 1 (denormal 2^-128, 2^-127)
    e8[0, ::32] = np.float32(2.5e-38)
    e8[0, 16::64] = np.float32(5e-38)
    x = np.concatenate([x, big, e8])
    for name, ref in ALL:
        _check(name, ref, x, release=True)
        if name.startswith("IQ3"):
            _check(name, ref, x, _importances(rng)[0], release=True)
            edge = _edge_rows()
            for qw in _importances(np.random.default_rng(5)):
                _check(name, ref, edge, qw, release=True)


@pytest.mark.parametrize("name, grid_size", [("IQ3_XXS", 256), ("IQ3_S", 512)])
def test_values_ggml_cannot_search_are_refused_as_llama_quantize_aborts(ggml_lib, tmp_path, name, grid_size):
    """|x| ~ 1e15: the weighted squared distances overflow, iq3_find_best_neighbour finds no point and ggml aborts
    the process (run in a child, the C library called directly); the kernel raises one CkptError instead."""
    x = np.random.default_rng(2).standard_normal((1, 256)).astype(np.float32)
    x[0, 5] = 1e15
    np.save(tmp_path / "x.npy", x)
    child = ("import ctypes, sys, numpy as np\n"
             "lib = ctypes.CDLL(sys.argv[1]); lib.iq3xs_init_impl(int(sys.argv[2]))\n"
             "x = np.load(sys.argv[3]); out = np.zeros(x.size, np.uint8)\n"
             "fn = getattr(lib, sys.argv[4]); fn.restype = ctypes.c_size_t\n"
             "fn.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 2 + [ctypes.c_void_p]\n"
             "fn(x.ctypes.data, out.ctypes.data, x.shape[0], x.shape[1], None)\n")
    r = subprocess.run([sys.executable, "-c", child, ggml_lib._name, str(grid_size), str(tmp_path / "x.npy"),
                        f"quantize_{name.lower()}"], capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "GGML_ASSERT(grid_index >= 0)" in r.stderr, (r.returncode, r.stderr[-300:])
    with pytest.raises(CkptError, match="too large") as e:
        _fn(name)(torch.from_numpy(x), None)
    assert "\n" not in str(e.value)


def test_grid_tables_are_the_c_inits(ggml_lib, tmp_path):
    """iq3_tables rebuilds iq3xs_init_impl's grid, map and neighbour lists: the C init's own arrays (a small
    program that includes ggml-quants.c and dumps `iq3_data`)."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    root = Path(ggml_lib._name).parent / "src"
    (tmp_path / "dump.c").write_text(r"""
#include "ggml-quants.c"
int main(int argc, char ** argv) {
    for (int g = 256; g <= 512; g += 256) {
        iq3xs_init_impl(g);
        const iq3_entry_t * e = &iq3_data[g == 256 ? 0 : 1];
        int end = 0;
        for (int i = 0; i < 4096; ++i) if (e->map[i] < 0) {
            int o = -e->map[i] - 1, last = o + 1 + e->neighbours[o]; if (last > end) end = last;
        }
        FILE * f = fopen(argv[g == 256 ? 1 : 2], "wb");
        fwrite(e->grid, 4, g, f); fwrite(e->map, 4, 4096, f); fwrite(e->neighbours, 2, end, f); fclose(f);
    }
    return 0;
}
""")
    stubs = Path(ggml_lib._name).parent / "stubs.c"
    exe = tmp_path / "dump"
    r = subprocess.run([cc, "-O0", "-I", str(root / "include"), "-I", str(root / "src"), str(tmp_path / "dump.c"),
                        str(stubs), "-lm", "-o", str(exe)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-500:]
    subprocess.run([str(exe), str(tmp_path / "t256"), str(tmp_path / "t512")], check=True, timeout=60)
    for g in (256, 512):
        grid, kmap, nbrs = iq3_tables(np, g)
        b = (tmp_path / f"t{g}").read_bytes()
        np.testing.assert_array_equal(np.frombuffer(b[:4 * g], np.int8).reshape(g, 4), grid)
        np.testing.assert_array_equal(np.frombuffer(b[4 * g:4 * g + 4 * 4096], np.int32), kmap)
        np.testing.assert_array_equal(np.frombuffer(b[4 * g + 4 * 4096:], np.uint16), nbrs)


@pytest.mark.parametrize("name", ["TQ1_0", "TQ2_0", "MXFP4"])
def test_gguf_package_quantizes_the_same(name):
    """The gguf package's numpy quantizers of these types (what ckpt ran before) give the kernels' bytes."""
    import gguf

    x = _edge_rows()
    with np.errstate(all="ignore"):
        want = gguf.quants.quantize(x, getattr(gguf.GGMLQuantizationType, name))
    np.testing.assert_array_equal(_fn(name)(torch.from_numpy(x), None).numpy(), want)


@pytest.mark.parametrize("name", [n for n, _ in ALL])
@pytest.mark.parametrize("weighted", [False, True])
def test_registered_encoder_is_picked(name, weighted):
    """The kernel serves both paths on the CPU, and CUDA rows (no CUDA encoder of these types) are brought to it."""
    mine = iq3_cpu.ENCODERS.get(name) or small_cpu.ENCODERS[name]
    assert mine.static and mine.weighted and mine.devices == ("cpu",) and mine.rank == 10
    assert encoder(name, "cpu", weighted) is mine
    assert encoder(name, "cuda", weighted) is mine


@pytest.mark.parametrize("name, ref", [("IQ3_XXS", "iq3_xxs"), ("IQ3_S", "iq3_s"), ("TQ1_0", "tq1_0"),
                                       ("TQ2_0", "tq2_0"), ("MXFP4", "mxfp4"), ("Q1_0", "q1_0")])
def test_gguf_encode_runs_the_kernels(ggml_lib, name, ref):
    """`ckpt.quant.gguf.encode`, the one call that encodes, gives the C bytes with and without an importance."""
    import gguf

    from ckpt.quant.gguf import encode

    t = int(getattr(gguf.GGMLQuantizationType, name))
    rng = np.random.default_rng(9)
    x = rng.standard_normal((4, N)).astype(np.float32)
    qw = (rng.random(N) + 0.01).astype(np.float32)
    for w in (None, qw):
        got = encode(torch.from_numpy(x), t, None if w is None else torch.from_numpy(w))
        assert got.numpy().tobytes() == ggml_ref.quantize(ref, x, imatrix=w)


@pytest.mark.parametrize("name, block", [(n, ggml_ref.BLOCKS[r][0]) for n, r in ALL])
def test_rows_not_a_whole_number_of_blocks_are_refused(name, block):
    fn = _fn(name)
    assert tuple(fn(torch.zeros(2, 2 * 256), None).shape)[0] == 2
    with pytest.raises(ValueError):
        fn(torch.zeros(2, block + block // 2), None)
    with pytest.raises(ValueError):
        fn(torch.zeros(2, 256), torch.zeros(3, 256))  # an importance of another shape
