"""Importance-matrix files for tests, written as `llama-imatrix` writes them (tools/imatrix/imatrix.cpp of the
llama.cpp the llama-cpp-python 0.3.36 sdist vendors, MIT), from the statistics it collects (`Stats`: per entry
the sums of squared activations [n_mat, n_per_row] and the tokens each expert saw [n_mat]):

- `write_gguf`: save_imatrix. `general.type` = imatrix, `imatrix.datasets` (strings), `imatrix.chunk_count`,
  `imatrix.chunk_size` (UINT32), then per entry, in name order, `<name>.in_sum2` (F32, ggml dims
  [n_per_row, n_mat]) and `<name>.counts` (F32, [1, n_mat]). Through gguf's GGUFWriter (its
  `general.architecture` dropped: the C writer has none).
- `write_dat`: save_imatrix_legacy. Entries with no data at all are left out; ncall = ceil(max count / chunk size);
  each value stored as (value / count) * ncall in float32 (an expert of count 0 as 1 * ncall); then the chunk
  count and the dataset name.

`random_stats` makes statistics both formats hold exactly (ncall a power of two: multiplying and dividing by it is
exact), so the same data gives the same importances from either file.

`write_bad(path, kind)` writes one damaged file of each `BAD_KINDS` kind (for reader and CLI refusal tests) and
returns a piece of the problem ckpt names; every bad file has an entry of each of `names`.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np


@dataclass
class Stats:
    """What llama-imatrix collected: name -> (values float32 [n_mat, n_per_row], counts int64 [n_mat])."""

    entries: dict
    chunk_count: int = 4
    chunk_size: int = 512
    datasets: list = field(default_factory=lambda: ["calibration.txt"])


def random_stats(shapes: dict, seed: int = 0, chunk_size: int = 512, zero_experts: bool = False,
                 chunk_count: int = 4, datasets=("calibration.txt",)) -> Stats:
    """`shapes`: name -> (n_mat, n_per_row). Sums of squares of random activations over a random number of tokens
    per expert, whose ncall is 1, 2, 4 or 8 (exact through the `.dat`); `zero_experts`: the first expert of every
    entry of several saw no token (counts 0: importance all ones)."""
    rng = np.random.default_rng(seed)
    entries = {}
    for name, (n_mat, n) in shapes.items():
        ncall = int(rng.choice([1, 2, 4, 8]))
        counts = rng.integers(max(1, (ncall - 1) * chunk_size + 1), ncall * chunk_size + 1, size=n_mat)
        counts[int(rng.integers(n_mat))] = ncall * chunk_size  # max count: exactly ncall chunks
        if zero_experts and n_mat > 1:
            counts[0] = 0
        scale = rng.lognormal(0, 2, size=(n_mat, 1)).astype(np.float32)
        values = (rng.gamma(0.5, 1.0, size=(n_mat, n)).astype(np.float32) * scale
                  * counts[:, None].astype(np.float32)).astype(np.float32)
        values[counts == 0] = 0
        entries[name] = (values, counts.astype(np.int64))
    return Stats(entries, chunk_count, chunk_size, list(datasets))


def expected_importance(stats: Stats, name: str) -> np.ndarray:
    """value / count per expert (float32), ones for an expert of count 0: llama-quantize's importance."""
    values, counts = stats.entries[name]
    out = np.ones_like(values)
    for j, c in enumerate(counts):
        if c > 0:
            out[j] = values[j] / np.float32(c)
    return out


# ------------------------------------------------------------------------------------------------------ GGUF


def gguf_parts(stats: Stats) -> tuple[list, list]:
    """(key-values, tensors) as save_imatrix makes them: [(key, value, GGUFValueType)], [(name, float32 array)]."""
    import gguf

    T = gguf.GGUFValueType
    kv = [("general.type", "imatrix", T.STRING), ("imatrix.datasets", list(stats.datasets), T.ARRAY),
          ("imatrix.chunk_count", stats.chunk_count, T.UINT32), ("imatrix.chunk_size", stats.chunk_size, T.UINT32)]
    tensors = []
    for name in sorted(stats.entries):
        values, counts = stats.entries[name]
        tensors.append((f"{name}.in_sum2", np.ascontiguousarray(values, dtype=np.float32)))
        tensors.append((f"{name}.counts", np.asarray(counts, dtype=np.float32).reshape(-1, 1)))
    return kv, tensors


def write_gguf_parts(path, kv, tensors) -> Path:
    """A GGUF of exactly these key-values and tensors (numpy arrays; dtype decides the GGML type)."""
    import gguf

    path = Path(path)
    w = gguf.GGUFWriter(str(path), arch="")
    w.kv_data[0].clear()  # no general.architecture
    for key, value, vtype in kv:
        if vtype == gguf.GGUFValueType.ARRAY:
            w.add_array(key, value)
        else:
            w.add_key_value(key, value, vtype)
    for name, array in tensors:
        w.add_tensor(name, array)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def write_gguf(path, stats: Stats) -> Path:
    return write_gguf_parts(path, *gguf_parts(stats))


# ------------------------------------------------------------------------------------------------------ .dat


def dat_entries(stats: Stats) -> list:
    """[(name, ncall, float32 values)] as save_imatrix_legacy stores them."""
    out = []
    for name in sorted(stats.entries):
        values, counts = stats.entries[name]
        if not np.any(counts):
            continue  # "has no data - skipping"
        ncall = (int(counts.max()) + stats.chunk_size - 1) // stats.chunk_size
        n_mat, n = values.shape
        tmp = np.empty(n_mat * n, np.float32)
        for j in range(n_mat):
            count, v = np.float32(counts[j]), values[j]
            if count == 0:
                v, count = np.ones(n, np.float32), np.float32(1)
            tmp[j * n:(j + 1) * n] = (v / count) * np.float32(ncall)
        out.append((name, ncall, tmp))
    return out


def dat_bytes(entries, chunk_count: int | None = 4, dataset: bytes | None = b"calibration.txt",
              n_entries: int | None = None) -> bytes:
    """A legacy file of [(name, ncall, values)] (`n_entries` overrides the count written); the tail left out where
    `chunk_count` is None, the dataset name where `dataset` is None."""
    out = [struct.pack("<i", len(entries) if n_entries is None else n_entries)]
    for name, ncall, values in entries:
        raw = name.encode() if isinstance(name, str) else name
        v = np.asarray(values, dtype="<f4")
        out += [struct.pack("<i", len(raw)), raw, struct.pack("<ii", ncall, v.size), v.tobytes()]
    if chunk_count is not None:
        out.append(struct.pack("<i", chunk_count))
        if dataset is not None:
            out += [struct.pack("<i", len(dataset)), dataset]
    return b"".join(out)


def write_dat(path, stats: Stats) -> Path:
    path = Path(path)
    path.write_bytes(dat_bytes(dat_entries(stats), stats.chunk_count,
                               stats.datasets[-1].encode() if stats.datasets else b""))
    return path


# ------------------------------------------------------------------------------------------------------ bad files


def _stats(names, n: int) -> Stats:
    return random_stats({name: (1, n) for name in names}, seed=3)


def _gguf_edit(path, names, n, kv_edit=None, tensor_edit=None):
    kv, tensors = gguf_parts(_stats(names, n))
    if kv_edit:
        kv = kv_edit(kv)
    if tensor_edit:
        tensors = tensor_edit(tensors)
    return write_gguf_parts(path, kv, tensors)


def _set_value(tensors, suffix, value, at=(0, 1)):
    out = []
    for tname, a in tensors:
        if tname.endswith(suffix) and not any(t.endswith(suffix) for t, _ in out):
            a = a.copy()
            a[at[0], at[1] % a.shape[1]] = value
        out.append((tname, a))
    return out


def _bad_gguf(kind, path, names, n):
    import gguf

    T = gguf.GGUFValueType
    first = names[0]
    edits = {
        "gguf_counts_missing": dict(tensor_edit=lambda ts: [t for t in ts if t[0] != f"{first}.counts"]),
        "gguf_sums_missing": dict(tensor_edit=lambda ts: [t for t in ts if t[0] != f"{first}.in_sum2"]),
        "gguf_f16": dict(tensor_edit=lambda ts: [(t, a.astype(np.float16) if t == f"{first}.in_sum2" else a)
                                                 for t, a in ts]),
        "gguf_not_divisible": dict(tensor_edit=lambda ts: [  # k counts for n values, k not dividing n
            (t, np.full((next(k for k in range(2, n + 2) if n % k), 1), 512, np.float32)
             if t == f"{first}.counts" else a) for t, a in ts]),
        "gguf_no_counts": dict(tensor_edit=lambda ts: [
            (t, np.zeros((0, 1), np.float32) if t == f"{first}.counts" else a) for t, a in ts]),
        "gguf_no_metadata": dict(kv_edit=lambda kv: [k for k in kv if k[0] != "imatrix.chunk_size"]),
        "gguf_model": dict(kv_edit=lambda kv: [("general.type", "model", T.STRING),
                                               ("general.architecture", "llama", T.STRING)]),
        "gguf_chunk_count_type": dict(kv_edit=lambda kv: [(k, v, T.INT32 if k == "imatrix.chunk_count" else t)
                                                          for k, v, t in kv]),
        "gguf_no_entries": dict(tensor_edit=lambda ts: [(f"{first}.in_sum", ts[0][1])]),
        "gguf_nan": dict(tensor_edit=lambda ts: _set_value(ts, ".in_sum2", np.nan)),
        "gguf_inf": dict(tensor_edit=lambda ts: _set_value(ts, ".in_sum2", np.inf)),
        "gguf_negative": dict(tensor_edit=lambda ts: _set_value(ts, ".in_sum2", -1.0)),
        "gguf_negative_count": dict(tensor_edit=lambda ts: _set_value(ts, ".counts", -3.0, (0, 0))),
        "gguf_nan_count": dict(tensor_edit=lambda ts: _set_value(ts, ".counts", np.nan, (0, 0))),
    }
    if kind == "gguf_truncated":
        _gguf_edit(path, names, n)
        data = path.read_bytes()
        path.write_bytes(data[:len(data) - 64])  # into the last tensor's data, past its padding
        return path
    return _gguf_edit(path, names, n, **edits[kind])


def _bad_dat(kind, path, names, n):
    entries = dat_entries(_stats(names, n))
    first = entries[0]

    def with_value(v):
        values = first[2].copy()
        values[1] = v
        return [(first[0], first[1], values), *entries[1:]]

    data = {
        "dat_no_entries": lambda: dat_bytes([], n_entries=0),
        "dat_negative_count": lambda: dat_bytes(entries, n_entries=-1),
        "dat_truncated": lambda: dat_bytes(entries)[:4 + 4 + len(first[0]) + 8 + 4 * (n // 2)],
        "dat_truncated_tail": lambda: dat_bytes(entries) [:-len(b"calibration.txt") - 2],
        "dat_trailing_bytes": lambda: dat_bytes(entries) + b"\0\0\0",
        "dat_negative_name_length": lambda: struct.pack("<ii", 1, -5) + dat_bytes(entries)[8:],
        "dat_bad_name": lambda: dat_bytes([(b"\xff\xfe" + first[0].encode(), first[1], first[2]), *entries[1:]]),
        "dat_no_values": lambda: dat_bytes([(first[0], first[1], np.zeros(0, np.float32)), *entries[1:]]),
        "dat_misaligned": lambda: _misaligned(entries),
        "dat_nan": lambda: dat_bytes(with_value(np.nan)),
        "dat_inf": lambda: dat_bytes(with_value(-np.inf)),
        "dat_negative": lambda: dat_bytes(with_value(-0.5)),
        "dat_negative_ncall": lambda: dat_bytes([(first[0], -2, first[2]), *entries[1:]]),
    }[kind]()
    path.write_bytes(data)
    return path


def _misaligned(entries) -> bytes:
    """The first entry's value count one more than its values (a writer of another layout): the rest is read
    shifted by 4 bytes."""
    good = dat_bytes(entries)
    name = entries[0][0].encode()
    at = 4 + 4 + len(name) + 4
    return good[:at] + struct.pack("<i", entries[0][2].size + 1) + good[at + 4:]


# kind -> a piece of the problem ckpt names (the culprit is the file)
BAD_KINDS = {
    "gguf_counts_missing": ".in_sum2 without .counts",
    "gguf_sums_missing": ".counts without .in_sum2",
    "gguf_f16": "not F32",
    "gguf_not_divisible": "not a whole row for each",
    "gguf_no_counts": "holds no counts",
    "gguf_no_metadata": "missing imatrix metadata imatrix.chunk_size",
    "gguf_model": "not an importance matrix",
    "gguf_chunk_count_type": "imatrix.chunk_count is INT32, not UINT32",
    "gguf_no_entries": "holds no importance entries",
    "gguf_nan": "not finite",
    "gguf_inf": "not finite",
    "gguf_negative": "negative",
    "gguf_negative_count": "not a token count",
    "gguf_nan_count": "not a token count",
    "gguf_truncated": "truncated",
    "dat_empty": "empty file",
    "dat_no_entries": "entry count is 0",
    "dat_negative_count": "entry count is -1",
    "dat_truncated": "truncated or not an importance matrix",
    "dat_truncated_tail": "truncated or not an importance matrix",
    "dat_trailing_bytes": "bytes after the dataset name",
    "dat_negative_name_length": "name length -5",
    "dat_bad_name": "name is not UTF-8",
    "dat_no_values": "value count is 0",
    "dat_misaligned": "truncated or not an importance matrix",
    "dat_nan": "not finite",
    "dat_inf": "not finite",
    "dat_negative": "negative",
    "dat_negative_ncall": "ncall is -2",
}


def write_bad(path, kind: str, names=("blk.0.attn_q.weight", "blk.0.ffn_down.weight"), n: int = 64) -> str:
    """A damaged importance matrix of this `kind` (`BAD_KINDS`) at `path`, with an entry of each of `names` (rows
    of `n` values); returns the piece of the problem ckpt's one-line refusal names."""
    path = Path(path)
    if kind == "dat_empty":
        path.write_bytes(b"")
    elif kind.startswith("gguf_"):
        _bad_gguf(kind, path, list(names), n)
    else:
        _bad_dat(kind, path, list(names), n)
    return BAD_KINDS[kind]
