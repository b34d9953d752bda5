"""The compiled CPU kernels of IQ2_XXS, IQ2_XS, IQ2_S (ckpt.quant.kquants.iq2_cpu) and IQ1_S, IQ1_M
(ckpt.quant.kquants.iq1_cpu) write, byte for byte, what llama.cpp's quantizers write (tests/helpers/ggml_ref.py
compiles ggml-quants.c: `quantize_<type>(..., imatrix)` for all five, `quantize_<type>(..., NULL)` for IQ2_S and
IQ1_M, the two that run without one), on random rows at several scales and on the edge cases where the C code
branches (zero, constant and tiny sub-blocks, outliers, one-signed groups, odd sign counts, ties of IQ1's sort,
fp16's subnormal range and overflow, huge values), with random positive importances, importances with zero columns
and ones spanning ten decades, one importance for all rows or one per row. The map and neighbour lists the kernels
search are the C init's own (for every point the quantizers can look up), and where ggml aborts the process (values
whose squares overflow float32) the kernels refuse with a CkptError, which the CLI prints as one line (exit 2)."""

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
from ckpt.quant.kquants import encoder, iq1_cpu, iq2_cpu
from ckpt.quant.kquants.iq2_grids import GRIDS, KMAP_SIZE, UNREACHABLE, q2xs_tables

# (ckpt name, ggml name, runs without an importance)
TYPES = [("IQ2_XXS", "iq2_xxs", False), ("IQ2_XS", "iq2_xs", False), ("IQ2_S", "iq2_s", True),
         ("IQ1_S", "iq1_s", False), ("IQ1_M", "iq1_m", True)]
N = 1024  # a row: 4 blocks of 256


def _mine(name):
    return iq2_cpu.ENCODERS.get(name) or iq1_cpu.ENCODERS[name]


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
    rows.append(n[2] * np.float32(1e-13))                                         # between IQ1_S's and IQ2_XXS's
    rows.append(n[3] * np.float32(1e-6))                                          # scales in fp16's subnormals
    rows.append(n[4] * np.float32(1e-9))                                          # scales underflow fp16
    rows.append(-np.abs(n[5]))                                                    # one-signed: odd groups flip
    rows.append(np.abs(n[6]))
    rows.append(torch.from_numpy(n[7]).to(torch.bfloat16).float().numpy())        # bf16-representable
    r = n[8] / np.abs(n[8]).max() * np.float32(65504)                            # near fp16's max
    r[[0, 256, 512, 768]] = [65504, -65504, 65520, 70000]                         # d at and past fp16 overflow
    rows.append(r.astype(np.float32))
    rows.append(n[9] * np.float32(1e7))
    r = n[10].copy()                                                              # zero / tiny / constant
    r[:32] = 0                                                                    # sub-blocks in live blocks
    r[256 + 16:256 + 32] = 0
    r[512 + 224:512 + 256] = 1e-17
    r[768 + 32:768 + 48] = 2.0
    r[768 + 96:768 + 104] = -0.5
    rows.append(r)
    r = np.zeros(N, np.float32)                                                   # sparse
    r[rng.choice(N, 12, replace=False)] = n[11][:12] * 3
    rows.append(r)
    rows.append(np.round(n[12] * 2).astype(np.float32))                           # small integers: ties of
    rows.append((np.round(n[13] * 8) / 4).astype(np.float32))                     # IQ1's sort and of the rounding
    rows.append(np.tile(np.array([1, -1, 1, 1, -1, 0, 0, 1], np.float32), N // 8))  # ternary values, all ties
    rows.append(np.tile(np.linspace(-1, 1, 16, dtype=np.float32), N // 16))       # level values
    r = n[15].copy()
    r[::7] = -0.0                                                                 # negative zeros (tie with 0)
    r[3::7] = 0.0
    rows.append(r)
    rows.append(n[16] * np.float32(1e12))                                         # large (squares ~1e24)
    r = n[17].copy()
    r[::3] = 0                                                                    # many zeros in every group
    rows.append(r)
    r = n[18].copy()                                                              # one value dominates each
    r[::8] *= np.float32(50)                                                      # group of 8
    rows.append(r)
    return np.stack(rows).astype(np.float32)


def _importances(rng) -> list[np.ndarray]:
    """A random positive importance, one with zero columns (a whole group of 8, a sub-block, a whole block of 256
    and scattered ones) and one spanning 1e-5..1e5."""
    pos = (rng.random(N) + 0.01).astype(np.float32)
    zeros = (rng.random(N) + 0.01).astype(np.float32)
    zeros[rng.random(N) < 0.15] = 0
    zeros[8:16] = 0
    zeros[32:64] = 0
    zeros[512:768] = 0
    wide = np.exp(rng.uniform(-11.5, 11.5, N)).astype(np.float32)
    return [pos, zeros, wide]


def _check(name: str, ref: str, x: np.ndarray, qw: np.ndarray | None = None, release: bool = False):
    blk, bb = ggml_ref.BLOCKS[ref]
    want = ggml_ref.quantize(ref, x, release=release, imatrix=qw)
    want = np.frombuffer(want, dtype=np.uint8).reshape(x.shape[0], -1)
    got = _mine(name).fn(torch.from_numpy(x), None if qw is None else torch.from_numpy(qw))
    assert got.dtype == torch.uint8 and tuple(got.shape) == want.shape
    got = got.numpy()
    if not np.array_equal(got, want):
        bad = np.nonzero((got.reshape(-1, bb) != want.reshape(-1, bb)).any(1))[0]
        b = bad[0]
        pos = np.nonzero(got.reshape(-1, bb)[b] != want.reshape(-1, bb)[b])[0]
        pytest.fail(f"{name} ({'static' if qw is None else 'imatrix'}): {len(bad)} of {got.size // bb} blocks "
                    f"differ; first block {b} (row {b // (x.shape[1] // blk)}), bytes {pos[:12]}")


@pytest.mark.parametrize("name, ref, static", TYPES)
@pytest.mark.parametrize("seed, scale", [(0, 1.0), (1, 0.02), (2, 300.0), (3, 1e-4)])
def test_random_rows_byte_identical(ggml_lib, name, ref, static, seed, scale):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((4, N)) * scale).astype(np.float32)
    x[1] = (rng.standard_t(2, N) * scale).astype(np.float32)  # heavy tails: outliers in many sub-blocks
    for qw in _importances(rng):
        _check(name, ref, x, qw)
    if static:
        _check(name, ref, x)


@pytest.mark.parametrize("name, ref, static", TYPES)
def test_edge_rows_byte_identical(ggml_lib, name, ref, static):
    x = _edge_rows()
    for qw in _importances(np.random.default_rng(5))[:2]:  # the wide one: test_extreme_rows_...
        _check(name, ref, x, qw)
    if static:
        _check(name, ref, x)


def test_extreme_rows_byte_identical_to_a_release_build(ggml_lib):
    """Where the debug build's nearest_int assert aborts, a release llama-quantize (asserts off) writes what its
    arithmetic gives: the edge rows under an importance spanning 1e-5..1e5 (IQ2_XXS's make_qp_quants on the sparse
    row), and blocks of float32 subnormals and of magnitudes next to each type's group epsilon."""
    rng = np.random.default_rng(6)
    x = rng.standard_normal((6, N)).astype(np.float32)
    x[0] *= np.float32(1e-40)
    x[1, ::2] = np.float32(1e-45)
    x[2, :512] *= np.float32(1e-39)
    x[3] *= np.float32(1.1e-12)  # IQ1_S's 1e-12
    x[4] *= np.float32(1.1e-7)   # IQ1_M's 1e-7
    x[5] *= np.float32(1.1e-8)   # IQ2_S's 1e-8
    edge = _edge_rows()
    for name, ref, static in TYPES:
        for qw in _importances(np.random.default_rng(5)):
            _check(name, ref, edge, qw, release=True)
            _check(name, ref, x, qw, release=True)
        if static:
            _check(name, ref, x, release=True)


@pytest.mark.parametrize("name, ref, static", TYPES)
def test_one_importance_row_per_row(ggml_lib, name, ref, static):
    """qw [r, n] (the expert slices of a 3-D tensor): each row is encoded with its own importance."""
    rng = np.random.default_rng(8)
    x = rng.standard_normal((3, N)).astype(np.float32)
    qw = np.stack(_importances(rng))
    got = _mine(name).fn(torch.from_numpy(x), torch.from_numpy(qw)).numpy()
    for i in range(3):
        want = np.frombuffer(ggml_ref.quantize(ref, x[i:i + 1], imatrix=qw[i]), dtype=np.uint8)
        np.testing.assert_array_equal(got[i], want)


@pytest.mark.parametrize("name, ref, static", TYPES)
def test_many_rows_in_pieces_byte_identical(ggml_lib, name, ref, static):
    """More rows than one piece of `encode_rows`: the pieces the threads take join to the C bytes."""
    rng = np.random.default_rng(4)
    x = (rng.standard_normal((300, N)) * 0.02).astype(np.float32)
    _check(name, ref, x, _importances(rng)[0])


@pytest.mark.parametrize("name, ref, static", TYPES)
def test_huge_values_byte_identical_or_refused_where_ggml_aborts(tmp_path, name, ref, static):
    """One value of 1e15 .. 3.4e38 in a block of ordinary ones (an Inf reaches the encoders as float32's max), and
    a whole block at 1e15: a release llama-quantize writes bytes the kernel writes too, or it aborts the process
    (`GGML_ASSERT(grid_index >= 0)`: the squared distances overflow; checked in a child that calls the C library
    directly) where the kernel raises one CkptError line instead."""
    try:
        lib = ggml_ref.library(release=True)
    except ggml_ref.Unavailable as e:
        pytest.skip(str(e))
    rng = np.random.default_rng(2)
    qw = (rng.random(256) + 0.01).astype(np.float32)
    cases = []
    for v in (1e15, 1e18, 1e20, 3.4028235e38):
        x = rng.standard_normal((1, 256)).astype(np.float32)
        x[0, 5] = v
        cases.append(x)
    cases.append((rng.standard_normal((1, 256)) * 1e15).astype(np.float32))
    refused = []
    for x in cases:
        try:
            got = _mine(name).fn(torch.from_numpy(x), torch.from_numpy(qw)).numpy().tobytes()
        except CkptError as e:
            assert "too large" in str(e) and "\n" not in str(e)
            refused.append(x)
            continue
        assert got == ggml_ref.quantize(ref, x, release=True, imatrix=qw), float(np.abs(x).max())
    for x in refused:
        np.save(tmp_path / "x.npy", x)
        np.save(tmp_path / "qw.npy", qw)
        child = ("import ctypes, sys, numpy as np\n"
                 "lib = ctypes.CDLL(sys.argv[1]); lib.iq2xs_init_impl(int(sys.argv[2]))\n"
                 "x = np.load(sys.argv[3]); qw = np.load(sys.argv[4]); out = np.zeros(x.size, np.uint8)\n"
                 "fn = getattr(lib, sys.argv[5]); fn.restype = ctypes.c_size_t\n"
                 "fn.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 2 + [ctypes.c_void_p]\n"
                 "fn(x.ctypes.data, out.ctypes.data, x.shape[0], x.shape[1], qw.ctypes.data)\n")
        r = subprocess.run([sys.executable, "-c", child, lib._name, str(ggml_ref.TYPE_IDS[ref]),
                            str(tmp_path / "x.npy"), str(tmp_path / "qw.npy"), f"quantize_{ref}"],
                           capture_output=True, text=True, timeout=300)
        assert r.returncode != 0 and "GGML_ASSERT" in r.stderr, (r.returncode, r.stderr[-300:])


def test_iq2_grid_tables_are_the_c_inits(ggml_lib, tmp_path):
    """q2xs_tables rebuilds iq2xs_init_impl's grid, map and neighbour lists: the C init's own arrays (a small
    program that includes ggml-quants.c and dumps `iq2_data`), for every point with levels 0..2 (the only ones the
    quantizers look up: the lists of the others are left out)."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    root = Path(ggml_lib._name).parent / "src"
    (tmp_path / "dump.c").write_text(r"""
#include "ggml-quants.c"
int main(int argc, char ** argv) {
    const enum ggml_type types[4] = {GGML_TYPE_IQ2_XXS, GGML_TYPE_IQ2_XS, GGML_TYPE_IQ2_S, GGML_TYPE_IQ1_S};
    for (int t = 0; t < 4; ++t) {
        iq2xs_init_impl(types[t]);
        const iq2_entry_t * e = &iq2_data[iq2_data_index(types[t])];
        int end = 0;
        for (int i = 0; i < 43692; ++i) if (e->map[i] < 0) {
            int o = -e->map[i] - 1, last = o + 1 + e->neighbours[o]; if (last > end) end = last;
        }
        FILE * f = fopen(argv[1 + t], "wb");
        fwrite(e->grid, 8, iq2_grid_size(types[t]), f); fwrite(e->map, 4, 43692, f);
        fwrite(e->neighbours, 2, end, f); fclose(f);
    }
    return 0;
}
""")
    stubs = Path(ggml_lib._name).parent / "stubs.c"
    exe = tmp_path / "dump"
    r = subprocess.run([cc, "-O2", "-I", str(root / "include"), "-I", str(root / "src"), str(tmp_path / "dump.c"),
                        str(stubs), "-lm", "-o", str(exe)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-500:]
    kinds = ["IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ1"]
    subprocess.run([str(exe), *(str(tmp_path / k) for k in kinds)], check=True, timeout=300)
    for kind in kinds:
        grid, kmap, nbrs = q2xs_tables(np, kind)
        g = len(GRIDS[kind][0])
        b = (tmp_path / kind).read_bytes()
        np.testing.assert_array_equal(np.frombuffer(b[:8 * g], np.uint8).reshape(g, 8), grid)
        c_map = np.frombuffer(b[8 * g:8 * g + 4 * KMAP_SIZE], np.int32)
        c_nbrs = np.frombuffer(b[8 * g + 4 * KMAP_SIZE:], np.uint16)
        levels = (np.arange(KMAP_SIZE)[:, None] >> (2 * np.arange(8))) & 3
        reachable = (levels < 3).all(1)
        assert (kmap[~reachable] == UNREACHABLE).all()
        np.testing.assert_array_equal(kmap[reachable & (c_map >= 0)], c_map[reachable & (c_map >= 0)])
        off = np.nonzero(reachable & (c_map < 0))[0]
        assert (kmap[off] < 0).all() and len(off) == len(np.unique(kmap[off]))
        for u in off:
            o, c = -kmap[u] - 1, -c_map[u] - 1
            np.testing.assert_array_equal(nbrs[o:o + 1 + nbrs[o]], c_nbrs[c:c + 1 + c_nbrs[c]], err_msg=f"{kind} {u}")


@pytest.mark.parametrize("name, ref, static", TYPES)
def test_registered_encoder_is_picked(name, ref, static):
    """The kernel serves the paths ggml has (IQ2_XXS, IQ2_XS and IQ1_S only with an importance:
    ggml_quantize_requires_imatrix), on the CPU, and CUDA rows (no CUDA encoder of these types) are brought to it."""
    mine = _mine(name)
    assert mine.weighted and mine.static == static and mine.devices == ("cpu",) and mine.rank == 10
    assert encoder(name, "cpu", True) is mine and encoder(name, "cuda", True) is mine
    assert encoder(name, "cpu", False) is (mine if static else None)


@pytest.mark.parametrize("name, ref, static", TYPES)
def test_gguf_encode_runs_the_kernels(ggml_lib, name, ref, static):
    """`ckpt.quant.gguf.encode`, the one call that encodes, gives the C bytes (with an importance, and without one
    for the types that run without)."""
    import gguf

    from ckpt.quant.gguf import encode

    t = int(getattr(gguf.GGMLQuantizationType, name))
    rng = np.random.default_rng(9)
    x = rng.standard_normal((4, N)).astype(np.float32)
    qw = (rng.random(N) + 0.01).astype(np.float32)
    for w in ((None, qw) if static else (qw,)):
        got = encode(torch.from_numpy(x), t, None if w is None else torch.from_numpy(w))
        assert got.numpy().tobytes() == ggml_ref.quantize(ref, x, imatrix=w)


@pytest.mark.parametrize("name, ref, static", TYPES)
def test_bad_shapes_are_refused(name, ref, static):
    fn = _mine(name).fn
    qw = torch.ones(2 * 256)
    assert tuple(fn(torch.zeros(2, 2 * 256), qw).shape) == (2, 2 * ggml_ref.BLOCKS[ref][1])
    with pytest.raises(ValueError):
        fn(torch.zeros(2, 384), torch.ones(384))  # not a whole number of blocks
    with pytest.raises(ValueError):
        fn(torch.zeros(2, 256), torch.zeros(3, 256))  # an importance of another shape
    if not static:
        with pytest.raises(ValueError, match="importance"):
            fn(torch.zeros(2, 256), None)  # ggml asserts one


@pytest.mark.parametrize("tensor_type", ["iq2_xs", "iq2_s"])
def test_values_ggml_aborts_on_are_refused_through_the_cli(run_ckpt, capsys, tmp_path, tensor_type):
    """A weight of 1e20 in a tensor made IQ2_XS / IQ2_S (`--tensor-type`, with an imatrix): llama-quantize aborts
    there (test_huge_values_...); ckpt refuses in one line, exit 2, nothing written."""
    pytest.importorskip("transformers")
    from safetensors.torch import load_file, save_file

    from helpers import imatrix_files
    from helpers.hf_llm import model_folder
    from helpers.refusals import assert_refused

    folder = model_folder(tmp_path / "llama", "llama", tokenizer="spm")
    sd = load_file(folder / "model.safetensors")
    sd["model.layers.0.self_attn.q_proj.weight"][3, 5] = 1e20
    save_file(sd, folder / "model.safetensors", metadata={"format": "pt"})
    im = imatrix_files.write_gguf(tmp_path / "im.gguf", imatrix_files.random_stats(
        {f"blk.{i}.attn_q.weight": (1, 256) for i in range(2)}))
    capsys.readouterr()  # the progress bar of save_pretrained
    # the culprit is left open: the kernel knows no tensor name (the line is "error: [<tensor>: ]values too large ...")
    assert_refused(run_ckpt, tmp_path, ("convert", folder, "--to", "gguf-q4_k_m", "--tensor-type",
                                        f"attn_q={tensor_type}", "--imatrix", im, "-o", tmp_path / "o.gguf"),
                   "", "values too large for ggml's IQ2 grid search")
