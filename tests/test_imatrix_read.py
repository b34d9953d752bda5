"""ckpt.io.imatrix reads importance matrices as `llama-quantize --imatrix` does (issue 34, items 1 and 6).

The oracle is llama.cpp's own loader (tests/helpers/imatrix_ref.py: common/imatrix-loader.cpp and quantize.cpp's
load_imatrix/prepare_imatrix compiled as they are): for every file, `importance` gives bitwise the float32 values
llama-quantize hands its quantizers, the same entries after --include-weights / --exclude-weights, the same
datasets and chunk count (what it writes as quantize.imatrix.*). The files are written as llama-imatrix writes them
(tests/helpers/imatrix_files.py): the same statistics as GGUF and as legacy `.dat` give the same importances.
Bad files are refused in one line naming the file and the entry; which of them llama.cpp refuses too is checked
against it, as is every mutant of the fuzz test ckpt accepts. CKPT_FUZZ_CASES=N runs more mutants.
"""

from __future__ import annotations

import os
import random
import struct
import tracemalloc

import numpy as np
import pytest

from helpers import imatrix_files as F
from helpers import imatrix_ref

from ckpt.errors import CkptError
from ckpt.io.imatrix import load_imatrix

SHAPES = {"blk.0.attn_q.weight": (1, 64), "blk.0.attn_k.weight": (1, 64), "blk.0.ffn_down_exps.weight": (4, 32),
          "blk.1.attn_q.weight": (1, 64), "blk.1.ffn_gate_exps.weight": (3, 96), "output.weight": (1, 96),
          "token_embd.weight": (1, 32)}
CASES = int(os.environ.get("CKPT_FUZZ_CASES", "160"))
SEED = int(os.environ.get("CKPT_FUZZ_SEED", "34"))


@pytest.fixture(scope="module", autouse=True)
def oracle():
    try:
        imatrix_ref.executable()
    except imatrix_ref.Unavailable as e:
        pytest.skip(str(e))


def same_as_llama(path, include=(), exclude=()):
    """Load `path` with ckpt and with llama.cpp's loader; everything llama-quantize takes from it must agree."""
    im = load_imatrix(path, include, exclude)
    ref = imatrix_ref.load(path, include, exclude)
    assert im.names() == sorted(ref.entries)
    assert im.entries_count == len(ref.entries)
    for name in im.names():
        got = im.importance(name)
        assert got.dtype == np.float32 and got.shape == im.shape(name), (name, got.shape)
        assert got.ravel().view(np.uint32).tolist() == ref.entries[name].view(np.uint32).tolist(), name
        assert name in im
    assert im.datasets == [d.decode("utf-8", "replace") for d in ref.datasets]
    assert im.chunk_count == ref.chunk_count
    return im


def both(tmp_path, stats, stem="im"):
    return F.write_gguf(tmp_path / f"{stem}.gguf", stats), F.write_dat(tmp_path / f"{stem}.dat", stats)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("zero_experts", [False, True])
def test_the_same_statistics_in_either_format_give_llamas_importances(tmp_path, seed, zero_experts):
    stats = F.random_stats(SHAPES, seed=seed, zero_experts=zero_experts)
    g, d = both(tmp_path, stats)
    ig, idat = same_as_llama(g), same_as_llama(d)
    assert (ig.format, idat.format) == ("gguf", "dat")
    assert ig.names() == idat.names() == sorted(SHAPES)
    for name, (n_mat, n) in SHAPES.items():
        assert ig.shape(name) == (n_mat, n)
        assert idat.shape(name) == (1, n_mat * n)  # a .dat does not say how many experts
        want = F.expected_importance(stats, name)
        assert np.array_equal(ig.importance(name), want)
        assert np.array_equal(idat.importance(name).reshape(n_mat, n), want)
    assert ig.datasets == idat.datasets == ["calibration.txt"]
    assert ig.chunk_count == idat.chunk_count == 4 and ig.chunk_size == 512 and idat.chunk_size is None
    if zero_experts:  # an expert the calibration text never reached: ones
        assert np.all(ig.importance("blk.0.ffn_down_exps.weight")[0] == 1)


@pytest.mark.parametrize("include,exclude", [
    ((), ("attn",)), ((), ("ffn_down", "output")), (("attn_q",), ()), (("blk.1.", "output"), ()),
    (("",), ()), ((), ("",)), (("nothing matches",), ()), (("attn_q", "blk.0.attn"), ()), ((), ("blk.0.", "blk.")),
])
def test_include_and_exclude_weights_pick_the_entries_llama_quantize_picks(tmp_path, include, exclude):
    g, d = both(tmp_path, F.random_stats(SHAPES, seed=5))
    for path in (g, d):
        im = same_as_llama(path, include, exclude)
        assert all(im.importance(n) is not None for n in im.names())
        for name in set(SHAPES) - set(im.names()):
            assert name not in im


def test_include_and_exclude_together_are_refused(tmp_path):
    g = F.write_gguf(tmp_path / "im.gguf", F.random_stats(SHAPES))
    with pytest.raises(CkptError, match="choose one"):
        load_imatrix(g, include=("attn",), exclude=("ffn",))


def test_what_llama_quantize_writes_as_quantize_imatrix_keys(tmp_path):
    stats = F.random_stats(SHAPES, seed=1, chunk_count=123, datasets=("wiki.train.raw", "code.txt"))
    g, d = both(tmp_path, stats)
    for path, datasets in ((g, ["wiki.train.raw", "code.txt"]), (d, ["code.txt"])):  # .dat: the last one
        im = same_as_llama(path, include=("attn",))
        ref = imatrix_ref.load(path, include=("attn",))
        kv = ref.quantize_kv(str(path))
        assert im.datasets == datasets and kv["quantize.imatrix.dataset"] == datasets[0].encode()
        assert im.entries_count == kv["quantize.imatrix.entries_count"] == 3
        assert im.chunk_count == kv["quantize.imatrix.chunks_count"] == 123


def _dat(tmp_path, name, entries, **kw):
    path = tmp_path / name
    path.write_bytes(F.dat_bytes(entries, **kw))
    return path


def _gguf(tmp_path, name, stats, kv_edit=None, tensor_edit=None):
    kv, tensors = F.gguf_parts(stats)
    return F.write_gguf_parts(tmp_path / name, kv_edit(kv) if kv_edit else kv,
                              tensor_edit(tensors) if tensor_edit else tensors)


def test_what_llama_cpp_accepts_is_read_as_it_reads_it(tmp_path):
    """The files llama.cpp reads without complaint, though llama-imatrix does not write them so (module
    docstring of ckpt.io.imatrix): each read bitwise as llama.cpp reads it."""
    import gguf

    T = gguf.GGUFValueType
    v = np.arange(1, 65, dtype=np.float32) / 7
    stats = F.random_stats({"a.weight": (3, 32), "b.weight": (1, 32)}, seed=9)

    def counts(values):
        return lambda ts: [(t, np.array(values, np.float32).reshape(-1, 1) if t == "a.weight.counts" else a)
                           for t, a in ts]

    cases = {
        # .dat: no tail; a chunk count only; an empty dataset name; ncall 0 (values as they are); a huge ncall;
        # a repeated name (the last wins); NUL inside a name and a dataset (cut there); an empty name
        "no_tail.dat": _dat(tmp_path, "no_tail.dat", [("a", 2, v)], chunk_count=None),
        "count_only.dat": _dat(tmp_path, "count_only.dat", [("a", 2, v)], chunk_count=7, dataset=None),
        "empty_dataset.dat": _dat(tmp_path, "empty_dataset.dat", [("a", 2, v)], dataset=b""),
        "ncall0.dat": _dat(tmp_path, "ncall0.dat", [("a", 0, v), ("b", 3, v)]),
        "big_ncall.dat": _dat(tmp_path, "big_ncall.dat", [("a", 2**31 - 1, v)], chunk_count=-5),
        "repeated.dat": _dat(tmp_path, "repeated.dat", [("a", 1, v), ("b", 1, v), ("a", 4, v[:32])]),
        "nul.dat": _dat(tmp_path, "nul.dat", [(b"a\0junk", 1, v)], dataset=b"data\0set.txt"),
        "empty_name.dat": _dat(tmp_path, "empty_name.dat", [("", 1, v), ("a", 1, v)]),
        "latin1_dataset.dat": _dat(tmp_path, "latin1_dataset.dat", [("a", 1, v)], dataset=b"caf\xe9.txt"),
        # GGUF: counts of 0 for every expert, fractional counts (lround), huge counts; NaN sums of an expert of
        # count 0 (ones replace them); a datasets key of another type (ignored); extra tensors (.in_sum); 1-D
        # tensors (element counts are what llama.cpp reads); a chunk count past int32
        "zero_counts.gguf": _gguf(tmp_path, "zero_counts.gguf", stats, tensor_edit=counts([0, 0, 0])),
        "fractional.gguf": _gguf(tmp_path, "fractional.gguf", stats, tensor_edit=counts([2.5, 0.4, 1.49999])),
        "huge_counts.gguf": _gguf(tmp_path, "huge_counts.gguf", stats, tensor_edit=counts([1e12, 3e18, 0.5])),
        "nan_unseen.gguf": _gguf(tmp_path, "nan_unseen.gguf", stats, tensor_edit=lambda ts: [
            (t, np.where(np.arange(3)[:, None] == 1, np.nan, a).astype(np.float32) if t == "a.weight.in_sum2" else a)
            for t, a in counts([5, 0, 7])(ts)]),
        "datasets_string.gguf": _gguf(tmp_path, "datasets_string.gguf", stats, kv_edit=lambda kv: [
            (k, "one.txt", T.STRING) if k == "imatrix.datasets" else (k, x, t) for k, x, t in kv]),
        "in_sum.gguf": _gguf(tmp_path, "in_sum.gguf", stats, tensor_edit=lambda ts: ts + [
            ("a.weight.in_sum", np.full((3, 32), -1, np.float32)), ("c.weight.in_sum", np.ones(4, np.float32))]),
        "flat.gguf": _gguf(tmp_path, "flat.gguf", stats, tensor_edit=lambda ts: [(t, a.reshape(-1)) for t, a in ts]),
        "chunks_u32.gguf": _gguf(tmp_path, "chunks_u32.gguf", F.random_stats({"a": (1, 32)}, chunk_count=2**32 - 3)),
        "no_general_type.gguf": _gguf(tmp_path, "no_general_type.gguf", stats,
                                      kv_edit=lambda kv: [k for k in kv if k[0] != "general.type"]),
    }
    read = {name: same_as_llama(path) for name, path in cases.items()}
    assert read["no_tail.dat"].chunk_count == 0 and read["no_tail.dat"].datasets == []
    assert read["count_only.dat"].chunk_count == 7 and read["count_only.dat"].datasets == []
    assert read["repeated.dat"].shape("a") == (1, 32) and read["repeated.dat"].entries_count == 2
    assert read["nul.dat"].names() == ["a"] and read["nul.dat"].datasets == ["data"]
    assert read["empty_name.dat"].names() == ["", "a"]
    assert read["ncall0.dat"].importance("a").tolist() == [v.tolist()]
    assert np.all(read["zero_counts.gguf"].importance("a.weight") == 1)
    assert read["chunks_u32.gguf"].chunk_count == -3  # llama.cpp's int32: no quantize.imatrix.chunks_count
    assert read["datasets_string.gguf"].datasets == []
    assert read["in_sum.gguf"].names() == ["a.weight", "b.weight"]


def test_a_non_finite_value_in_an_entry_left_out_is_not_checked(tmp_path):
    """llama-quant.cpp checks the entries left after --include/--exclude-weights only."""
    stats = F.random_stats({"a.weight": (1, 32), "b.weight": (1, 32)}, seed=2)
    stats.entries["b.weight"][0][0, 3] = np.nan
    g, d = both(tmp_path, stats)
    for path in (g, d):
        assert same_as_llama(path, exclude=("b.",)).names() == ["a.weight"]
        assert same_as_llama(path, include=("a.",)).names() == ["a.weight"]
        with pytest.raises(CkptError, match="'b.weight': value 3 is nan, not finite"):
            load_imatrix(path)


# llama.cpp refuses these too (exit 1 from its loader, 3 from llama-quant.cpp's non-finite check)
LLAMA_REFUSES = {"gguf_counts_missing", "gguf_sums_missing", "gguf_f16", "gguf_no_metadata", "gguf_model",
                 "gguf_nan", "gguf_inf", "gguf_truncated", "dat_empty", "dat_no_entries", "dat_negative_count",
                 "dat_truncated", "dat_no_values", "dat_nan", "dat_inf"}
# llama.cpp takes these: values of no meaning (zeros where counts do not divide the sums, a negative importance,
# a negative or NaN count as ones), a damaged tail, or no entry at all (then it quantizes without an imatrix)
LLAMA_ACCEPTS = {"gguf_not_divisible", "gguf_negative", "gguf_negative_count", "gguf_nan_count", "gguf_no_entries",
                 "dat_truncated_tail", "dat_trailing_bytes", "dat_bad_name", "dat_negative", "dat_negative_ncall"}
# not run through it: these crash it (a GGML_ASSERT abort, a division by zero, std::length_error), and it refuses
# the misaligned file only after allocating the 778 MB its misread name length asks for
LLAMA_NOT_RUN = {"gguf_chunk_count_type", "gguf_no_counts", "dat_negative_name_length", "dat_misaligned"}


def test_every_bad_kind_is_classified():
    assert LLAMA_REFUSES | LLAMA_ACCEPTS | LLAMA_NOT_RUN == set(F.BAD_KINDS)
    assert not (LLAMA_REFUSES & LLAMA_ACCEPTS) and not (LLAMA_NOT_RUN & (LLAMA_REFUSES | LLAMA_ACCEPTS))


@pytest.mark.parametrize("kind", sorted(F.BAD_KINDS))
def test_a_bad_file_is_refused_in_one_line_naming_it(tmp_path, kind):
    path = tmp_path / f"bad-{kind}.{'gguf' if kind.startswith('gguf') else 'dat'}"
    problem = F.write_bad(path, kind)
    before = path.read_bytes()
    with pytest.raises(CkptError) as e:
        load_imatrix(path)
    msg = str(e.value)
    assert msg.startswith(f"{path}: ") and "\n" not in msg and len(msg) < 300, msg
    assert problem in msg, msg
    if kind in ("gguf_counts_missing", "gguf_sums_missing", "gguf_f16", "gguf_not_divisible", "gguf_nan",
                "gguf_negative", "gguf_negative_count", "dat_nan", "dat_negative", "dat_negative_ncall",
                "dat_no_values"):
        assert "entry 'blk.0.attn_q.weight'" in msg, msg
    assert path.read_bytes() == before
    if kind in LLAMA_REFUSES:
        with pytest.raises(imatrix_ref.Refused) as r:
            imatrix_ref.load(path, tmp=tmp_path)
        assert r.value.code in (1, 3), r.value
    elif kind in LLAMA_ACCEPTS:
        imatrix_ref.load(path, tmp=tmp_path)


def test_what_is_not_a_readable_file_is_refused_in_one_line(tmp_path):
    folder = tmp_path / "imatrix.gguf"
    folder.mkdir()
    fifo = tmp_path / "fifo.dat"
    os.mkfifo(fifo)
    for path, problem in ((folder, "is a folder"), (tmp_path / "missing.dat", "does not exist"),
                          (fifo, "is a FIFO")):
        with pytest.raises(CkptError, match=problem) as e:
            load_imatrix(path)
        assert str(e.value).startswith(str(path))
    if os.geteuid() != 0:
        locked = F.write_gguf(tmp_path / "locked.gguf", F.random_stats(SHAPES))
        locked.chmod(0)
        with pytest.raises(CkptError, match="permission denied|cannot read"):
            load_imatrix(locked)


def test_loading_holds_one_entry_at_a_time(tmp_path):
    """The index is kept, not the values: loading a 16 MB imatrix (the checks read every entry) and asking for one
    entry allocate about one entry's worth."""
    shapes = {f"blk.{i}.ffn_up_exps.weight": (8, 16384) for i in range(32)}  # 512 kB an entry
    stats = F.random_stats(shapes, seed=4)
    g, d = both(tmp_path, stats)
    del stats
    for path in (g, d):
        tracemalloc.start()
        try:
            im = load_imatrix(path)
            im.importance("blk.7.ffn_up_exps.weight")
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < 6 * 8 * 16384 * 4, peak


# ------------------------------------------------------------------------------------------------------ fuzzing


def _dat_slots(data: bytes) -> list[tuple[int, str]]:
    """Byte offsets of every int32 field of a valid `.dat` (counts, lengths, ncall, nval, the tail)."""
    out, pos = [(0, "n_entries")], 4
    for _ in range(struct.unpack_from("<i", data, 0)[0]):
        n = struct.unpack_from("<i", data, pos)[0]
        out.append((pos, "name length"))
        pos += 4 + n
        out += [(pos, "ncall"), (pos + 4, "nval")]
        pos += 8 + 4 * struct.unpack_from("<i", data, pos + 4)[0]
    if pos < len(data):
        out.append((pos, "chunk count"))
        out.append((pos + 4, "dataset length"))
    return out


SPECIAL = [np.nan, np.inf, -np.inf, -1.0, -0.0, 0.0, 0.4, 0.5, 2.5, 1e-45, 3e38, 1e19]
EDGES = [-(2**31), -1, 0, 1, 2, 3, 4, 7, 8, 15, 16, 31, 32, 63, 64, 65, 255, 256, 1000, 2**31 - 1]


def _mutant(rng: random.Random, data: bytes, fmt: str, value_spans) -> bytes:
    b = bytearray(data)
    kind = rng.randrange(6)
    if kind == 0:  # truncated
        return bytes(b[:rng.randrange(len(b))])
    if kind == 1:  # a special float in the values or counts
        start, end = rng.choice(value_spans)
        at = start + 4 * rng.randrange((end - start) // 4)
        struct.pack_into("<f", b, at, rng.choice(SPECIAL))
        return bytes(b)
    if kind == 2:  # random bytes changed
        for _ in range(rng.randrange(1, 4)):
            b[rng.randrange(len(b))] = rng.randrange(256)
        return bytes(b)
    if kind == 3:  # bytes appended
        return bytes(b) + bytes(rng.randrange(256) for _ in range(rng.choice([1, 3, 4, 8, 20])))
    if fmt == "dat":  # a structural field set to an edge value, or moved by one
        at, _ = rng.choice(_dat_slots(data))
        old = struct.unpack_from("<i", b, at)[0]
        new = rng.choice(EDGES + [old - 1, old + 1, old * 2, -old])
        struct.pack_into("<i", b, at, max(-(2**31), min(2**31 - 1, new)))
        return bytes(b)
    # GGUF: the chunk count / size values (little-endian u32 after their keys)
    key = rng.choice([b"imatrix.chunk_count", b"imatrix.chunk_size"])
    at = data.index(key) + len(key) + 4
    struct.pack_into("<I", b, at, rng.choice([0, 1, 2**31 - 1, 2**31, 2**32 - 1, 77]))
    return bytes(b)


def _value_spans(path, fmt):
    if fmt == "dat":
        data = path.read_bytes()
        spans, slots = [], _dat_slots(data)
        for (at, what) in slots:
            if what == "nval":
                n = struct.unpack_from("<i", data, at)[0]
                spans.append((at + 4, at + 4 + 4 * n))
        return spans
    import gguf

    r = gguf.GGUFReader(path)
    return [(int(t.data_offset), int(t.data_offset) + int(t.n_bytes)) for t in r.tensors]


@pytest.mark.parametrize("fmt", ["gguf", "dat"])
def test_mutants_are_refused_in_one_line_or_read_as_llama_cpp_reads_them(tmp_path, fmt):
    """Seeded mutants of a valid file (truncations, special floats in values and counts, random bytes, appended
    bytes, `.dat` int fields and GGUF chunk keys set to edge values): each is refused as one `CkptError` line
    naming the file, or read exactly as llama.cpp's loader reads it (which must then load it)."""
    stats = F.random_stats({"blk.0.attn_q.weight": (1, 32), "blk.0.ffn_down_exps.weight": (3, 32),
                            "output.weight": (1, 64)}, seed=11, zero_experts=True)
    good = (F.write_gguf if fmt == "gguf" else F.write_dat)(tmp_path / f"good.{fmt}", stats)
    data, spans = good.read_bytes(), _value_spans(good, fmt)
    rng = random.Random(SEED + (fmt == "dat"))
    path = tmp_path / f"mutant.{fmt}"
    accepted = 0
    for case in range(CASES):
        mutant = _mutant(rng, data, fmt, spans)
        path.write_bytes(mutant)
        try:
            im = load_imatrix(path)
        except CkptError as e:
            msg = str(e)
            assert msg.startswith(f"{path}: ") and "\n" not in msg, (case, msg)
            continue
        try:
            same_as_llama(path)
        except imatrix_ref.Refused as e:
            raise AssertionError(f"case {case}: ckpt read {im.names()}, llama.cpp refused it: {e}") from None
        accepted += 1
    print(f"{fmt}: {accepted} of {CASES} mutants read")
    assert 0 < accepted < CASES
