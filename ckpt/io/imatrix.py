"""Importance matrices (what `llama-imatrix` writes) read as `llama-quantize --imatrix FILE` reads them.

Both formats llama.cpp reads (common/imatrix-loader.cpp, tools/quantize/quantize.cpp's load_imatrix, of the llama.cpp
the llama-cpp-python 0.3.36 sdist vendors):

- GGUF (`general.type` = imatrix): keys `imatrix.datasets` (strings), `imatrix.chunk_count`, `imatrix.chunk_size`
  (UINT32); per entry two F32 tensors, `<name>.in_sum2` (ggml dims [n_per_row, n_mat]: the sums of squared
  activations, one row per expert) and `<name>.counts` ([1, n_mat]: the tokens each expert saw). The importance of
  expert j is in_sum2[j] / lround(counts[j]) (float32 division); a count of 0 (an expert the calibration text never
  reached) gives all ones, as llama-quantize does. Other tensors (`<name>.in_sum`, ...) are ignored, as there. Only
  element counts matter there (n_per_row = values / counts), so they are all that is checked here.
- Legacy `imatrix.dat`: int32 entry count; per entry an int32 name length, the name, int32 ncall, int32 nval and
  float32[nval] (already normalised, times ncall), whose importance is values / ncall (as is for an ncall of 0);
  then, optionally, int32 chunk count, int32 dataset name length and the name. A `.dat` does not say how many
  experts an entry has: `shape` is (1, nval) there, and the planner compares sizes as llama-quantize does
  (`ne[0] * ne[2]`) before reshaping.

A file is GGUF when it starts with the GGUF magic, else legacy (llama.cpp tries GGUF, then legacy).
`include` / `exclude` are `--include-weights` / `--exclude-weights`: substrings of entry names (std::string::find),
exclusion first, an entry kept when it contains any include pattern; giving both is refused (llama-quantize prints
its usage). Filtering may leave no entry: llama-quantize then quantizes as without an imatrix and writes no
quantize.imatrix.* key. `entries_count`, `datasets`, `chunk_count` are what it writes as quantize.imatrix.* (the
entries left after filtering, the first dataset, the chunk count as llama.cpp's int32: written where positive).

Refused in one line naming the file and the entry (`CkptError`) where llama-quantize refuses too: a GGUF without
tensors or a `.dat` entry count below 1, a GGUF without the three imatrix.* keys, `.in_sum2` without `.counts` or
the reverse, a tensor not F32, tensor data not where gguf_init_from_file reads it (each at the padded end of the one
before, the last one's padding in the file), a truncated `.dat`, an entry of no values, a non-finite importance
(llama-quant.cpp's check, made after filtering: an excluded entry is not checked). Refused here where llama.cpp
reads garbage, crashes or quietly ignores damage: a GGUF of tensors but no entry (an empty matrix there), a chunk
count or size not UINT32 (a GGML_ASSERT abort there), counts not a divisor of the values (zeros there), no counts
(a division by zero), a count that is negative, NaN or infinite, a negative importance (nothing llama-imatrix
writes: sums of squares), a negative ncall or name length, a name that is not UTF-8, a damaged tail of a `.dat` (a
partial chunk count or dataset name, bytes after it). Accepted as llama.cpp accepts: a zero count (ones), an ncall
of 0 (values as they are), `imatrix.datasets` of another type (no dataset), no `general.type`, a repeated `.dat`
name (the last one wins), a `.dat` without the chunk count and dataset name (chunk count 0), a NUL inside a `.dat`
name or dataset (cut there), a dataset name that is not UTF-8 (decoded with U+FFFD).

Only the header and an index are kept: `importance` reads an entry with pread when it is asked for. Loading reads
each entry left after filtering once, one at a time, for the checks above: a bad value is refused before any
output is begun. Torch-free; numpy through `ckpt.lazy`.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass, field
from pathlib import Path

from ckpt.errors import CkptError, file_error
from ckpt.io.small_inputs import check_regular
from ckpt.lazy import numpy as np

GGUF_MAGIC = b"GGUF"
KEY_DATASETS, KEY_CHUNK_COUNT, KEY_CHUNK_SIZE = "imatrix.datasets", "imatrix.chunk_count", "imatrix.chunk_size"
IN_SUM2, COUNTS = ".in_sum2", ".counts"
# ggml type F32; GGUF value types ARRAY, STRING, UINT32
F32, ARRAY, STRING, UINT32 = 0, 9, 8, 4
# llama.cpp lrounds a count into an int64
MAX_COUNT = float(1 << 63)


@dataclass(frozen=True)
class Entry:
    """Where one entry's values are: `n_values` float32 at byte `at`; GGUF: `n_mat` float32 counts at `counts_at`;
    `.dat`: `ncall`."""

    at: int
    n_values: int
    n_mat: int = 1
    counts_at: int | None = None
    ncall: int = 0


@dataclass
class Imatrix:
    """One importance matrix: its metadata and an index of its entries (offsets, not values)."""

    path: Path
    format: str  # "gguf" | "dat"
    datasets: list[str]
    chunk_count: int
    chunk_size: int | None
    entries: dict[str, Entry] = field(repr=False, default_factory=dict)  # after filtering, by name
    all_entries_count: int = 0  # in the file

    def names(self) -> list[str]:
        """Entry names left after --include-weights / --exclude-weights, sorted."""
        return sorted(self.entries)

    def __contains__(self, name) -> bool:
        return name in self.entries

    def shape(self, name: str) -> tuple[int, int]:
        """(n_mat, n_per_row): one importance row per expert (GGUF); (1, nval) in a `.dat`."""
        e = self.entries[name]
        return e.n_mat, e.n_values // e.n_mat

    @property
    def entries_count(self) -> int:
        return len(self.entries)

    def importance(self, name: str):
        """float32 [n_mat, n_per_row]: what llama-quantize hands the quantizer (module docstring), read now."""
        return _importance(self.path, name, self.entries[name], self.format)


def load_imatrix(path, include: tuple[str, ...] = (), exclude: tuple[str, ...] = ()) -> Imatrix:
    """The importance matrix at `path` (either format), filtered and checked (module docstring)."""
    path = Path(path)
    if include and exclude:
        raise CkptError("--include-weights and --exclude-weights: choose one (llama-quantize takes one of them)")
    st = check_regular(path)
    if st.st_size == 0:
        raise file_error(path, "empty file, not an importance matrix")
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise file_error(path, f"cannot read: {e.strerror or e}") from None
    im = _read_gguf(path) if magic == GGUF_MAGIC else _read_dat(path, st.st_size)
    im.all_entries_count = len(im.entries)
    if not im.entries:
        raise file_error(path, "holds no importance entries (no <name>.in_sum2 tensors)")
    kept = sorted(im.entries)
    for pattern in exclude:
        kept = [n for n in kept if pattern not in n]
    if include:
        kept = [n for n in kept if any(p in n for p in include)]
    im.entries = {n: im.entries[n] for n in kept}
    for name in kept:
        _check_values(im, name)
    return im


# ------------------------------------------------------------------------------------------------------ GGUF


def _read_gguf(path: Path) -> Imatrix:
    from ckpt.io.gguf import read_gguf_header
    from ckpt.io.tensors import FileHandles

    handles = FileHandles()
    try:
        header = read_gguf_header(path, handles, path.name, whole_set=False)
    finally:
        handles.close()
    if not header.tensors:
        raise file_error(path, "holds no importance entries (a GGUF without tensors)")
    _check_layout(path, header)
    missing = [k for k in (KEY_DATASETS, KEY_CHUNK_COUNT, KEY_CHUNK_SIZE) if k not in header.fields]
    if missing:
        kind = header.value("general.type")
        if kind != "imatrix" and isinstance(kind, str):
            raise file_error(path, f"a GGUF of general.type {_short(kind)!r}, not an importance matrix "
                                   f"(no {missing[0]})")
        raise file_error(path, f"missing imatrix metadata {', '.join(missing)}")
    datasets = []
    if header.field_type(KEY_DATASETS) == [ARRAY, STRING]:  # llama.cpp ignores another type
        datasets = [str(d) for d in header.value(KEY_DATASETS)]
    chunk_count, chunk_size = (_u32_as_int32(path, header, k) for k in (KEY_CHUNK_COUNT, KEY_CHUNK_SIZE))
    pairs: dict[str, list] = {}
    for tname, t in header.tensors.items():
        if not tname:
            continue
        for i, suffix in enumerate((IN_SUM2, COUNTS)):
            if tname.endswith(suffix):
                pairs.setdefault(tname[:-len(suffix)], [None, None])[i] = t
                break
    entries = {}
    for name in sorted(pairs):
        sums, counts = pairs[name]
        where = f"entry {_short(name)!r}"
        if sums is None or counts is None:
            have, lack = (COUNTS, IN_SUM2) if sums is None else (IN_SUM2, COUNTS)
            raise file_error(path, f"{where}: {have} without {lack}")
        for t, suffix in ((sums, IN_SUM2), (counts, COUNTS)):
            if t.ggml_type != F32:
                raise file_error(path, f"{where}: {suffix} is {t.type_name}, not F32")
        n_values, n_mat = sums.logical_numel, counts.logical_numel
        if n_mat == 0:
            raise file_error(path, f"{where}: {COUNTS} holds no counts")
        if n_values == 0:
            raise file_error(path, f"{where}: {IN_SUM2} holds no values")
        if n_values % n_mat:
            raise file_error(path, f"{where}: {IN_SUM2} holds {n_values} values, not a whole row for each of its "
                                   f"{n_mat} counts")
        entries[name] = Entry(sums.info.start, n_values, n_mat, counts.info.start)
    return Imatrix(path, "gguf", datasets, chunk_count, chunk_size, entries)


def _check_layout(path: Path, header) -> None:
    """llama.cpp's gguf_init_from_file reads the data section whole: each tensor at the running sum of the padded
    sizes before it, the last one's padding included (gguf's Python reader, under ckpt.io.gguf, is laxer)."""
    expected = 0
    for tname, t in header.tensors.items():
        offset = t.info.start - header.data_start
        if offset != expected:
            raise file_error(path, f"tensor {_short(tname)!r} data at offset {offset}, llama.cpp expects {expected}")
        nbytes = t.info.end - t.info.start
        expected += -(-nbytes // header.alignment) * header.alignment
    size = os.stat(path).st_size
    if header.data_start + expected > size:
        raise file_error(path, f"truncated: its data section ends at byte {header.data_start + expected} with "
                               f"its padding, the file has {size} bytes")


def _u32_as_int32(path: Path, header, key: str) -> int:
    """A UINT32 key as llama.cpp keeps it (int32_t): anything else aborts there (gguf_get_val_u32's assert)."""
    types = header.field_type(key)
    if types != [UINT32]:
        from ckpt.io.ggml_types import gguf_package

        names = {int(t): t.name for t in gguf_package().GGUFValueType}
        got = "/".join(names.get(int(t), str(t)) for t in types)
        raise file_error(path, f"metadata {key} is {got}, not UINT32")
    v = int(header.value(key))
    return v - (1 << 32) if v >= 1 << 31 else v


# ------------------------------------------------------------------------------------------------------ .dat


class _Cursor:
    """Reads a `.dat` front to back; every read past the end is one line."""

    def __init__(self, f, path: Path, size: int):
        self.f, self.path, self.size, self.pos = f, path, size, 0

    def left(self) -> int:
        return self.size - self.pos

    def take(self, n: int, what: str) -> bytes:
        if n > self.left():
            raise file_error(self.path, f"truncated or not an importance matrix: {what} at byte {self.pos} needs "
                                        f"{n} bytes, {self.left()} are left")
        b = self.f.read(n)
        if len(b) != n:
            raise file_error(self.path, "changed while it was read")
        self.pos += n
        return b

    def i32(self, what: str) -> int:
        return struct.unpack("<i", self.take(4, what))[0]

    def skip(self, n: int, what: str) -> int:
        if n > self.left():
            raise file_error(self.path, f"truncated or not an importance matrix: {what} at byte {self.pos} needs "
                                        f"{n} bytes, {self.left()} are left")
        at = self.pos
        self.pos += n
        self.f.seek(self.pos)
        return at


def _read_dat(path: Path, size: int) -> Imatrix:
    try:
        with open(path, "rb") as f:
            return _parse_dat(_Cursor(f, path, size))
    except OSError as e:
        raise file_error(path, f"cannot read: {e.strerror or e}") from None


def _parse_dat(c: _Cursor) -> Imatrix:
    path = c.path
    n_entries = c.i32("the entry count")
    if n_entries < 1:
        raise file_error(path, f"not an importance matrix: its entry count is {n_entries} "
                               "(a legacy imatrix.dat starts with a positive count)")
    if n_entries > c.left() // 16:  # each entry takes at least 16 bytes
        raise file_error(path, f"truncated or not an importance matrix: {n_entries} entries cannot fit in "
                               f"{c.size} bytes")
    entries = {}
    for i in range(n_entries):
        where = f"entry {i + 1} of {n_entries}"
        length = c.i32(f"the name length of {where}")
        if length < 0:
            raise file_error(path, f"{where}: name length {length} (a damaged file)")
        raw = c.take(length, f"the name of {where}").split(b"\0", 1)[0]  # llama.cpp reads it as a C string
        try:
            name = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise file_error(path, f"{where}: its name is not UTF-8 ({raw[:40]!r}): a damaged or misaligned "
                                   "file") from None
        where = f"entry {_short(name)!r}"
        ncall = c.i32(f"ncall of {where}")
        nval = c.i32(f"the value count of {where}")
        if ncall < 0:
            raise file_error(path, f"{where}: ncall is {ncall} (a damaged file)")
        if nval < 1:
            raise file_error(path, f"{where}: its value count is {nval}")
        at = c.skip(4 * nval, f"the {nval} values of {where}")
        entries[name] = Entry(at, nval, 1, None, ncall)  # a repeated name: the last one wins, as in llama.cpp
    chunk_count, datasets = 0, []
    if c.left():
        chunk_count = c.i32("the chunk count after the entries")
        if c.left():
            n = c.i32("the dataset name length after the chunk count")
            if n < 0:
                raise file_error(path, f"dataset name length {n} after the entries (a damaged file)")
            raw = c.take(n, "the dataset name")
            if n:
                datasets.append(raw.split(b"\0", 1)[0].decode("utf-8", "replace"))
            if c.left():
                raise file_error(path, f"{c.left()} bytes after the dataset name, where the file should end: "
                                       "a damaged or misaligned file")
    return Imatrix(path, "dat", datasets, chunk_count, None, entries)


# -------------------------------------------------------------------------------------------- values, checks


def _read_f32(path: Path, at: int, count: int):
    """`count` little-endian float32 at byte `at`, with pread."""
    out = np.empty(count, dtype="<f4")
    view, got = memoryview(out).cast("B"), 0
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise file_error(path, f"cannot read: {e.strerror or e}") from None
    try:
        while got < len(view):
            n = os.preadv(fd, [view[got:]], at + got)
            if n <= 0:
                raise file_error(path, "changed since it was read (shorter now)")
            got += n
    except OSError as e:
        raise file_error(path, f"cannot read: {e.strerror or e}") from None
    finally:
        os.close(fd)
    return out.astype(np.float32, copy=False)


def _counts(path: Path, name: str, e: Entry):
    """The counts as llama.cpp divides by them: (float) lround(count)."""
    raw = _read_f32(path, e.counts_at, e.n_mat)
    bad = ~np.isfinite(raw) | (raw < 0) | (raw >= MAX_COUNT)
    if bad.any():
        j = int(np.argmax(bad))
        raise file_error(path, f"entry {_short(name)!r}: count {j} is {float(raw[j])!r}, not a token count")
    return np.floor(raw.astype(np.float64) + 0.5).astype(np.int64).astype(np.float32)


def _importance(path: Path, name: str, e: Entry, fmt: str):
    sums = _read_f32(path, e.at, e.n_values)
    if fmt == "dat":
        return (sums / np.float32(e.ncall) if e.ncall > 0 else sums).reshape(1, e.n_values)
    counts = _counts(path, name, e)
    rows = sums.reshape(e.n_mat, e.n_values // e.n_mat)
    seen = counts > 0
    out = rows / np.where(seen, counts, np.float32(1))[:, None]
    out[~seen] = np.float32(1)
    return out


def _check_values(im: Imatrix, name: str) -> None:
    values = im.importance(name)
    bad = ~np.isfinite(values) | (values < 0)
    if bad.any():
        j, i = (int(k) for k in np.unravel_index(int(np.argmax(bad)), values.shape))
        v = float(values[j, i])
        what = "not finite" if not np.isfinite(v) else "negative (importances are sums of squares)"
        at = f"value {i}" if values.shape[0] == 1 else f"expert {j}, value {i}"
        raise file_error(im.path, f"entry {_short(name)!r}: {at} is {v!r}, {what}")


def _short(s: str, n: int = 80) -> str:
    return s if len(s) <= n else s[:n - 3] + "..."
