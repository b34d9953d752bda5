"""Structural fuzzing of ckpt's GGUF reader (issue #20): mutants of small files gguf's own GGUFWriter wrote
(every count, string length, value type, n_dims, dim, tensor type, data offset and the alignment set to
edge values, truncations, seeded random byte changes in the header). Each mutant is either refused as one
`CkptError` line naming the file, or read exactly as gguf's GGUFReader reads it (every key's value, every
tensor's type, shape and bytes through ckpt's own pread path); either way within a time bound and a
bound on what Python and numpy allocate (tracemalloc). A sample goes through the CLI (`ckpt inspect`):
exit 0, or exit 2 with one `error: FILE: ...` line.

CI runs a fixed seeded set (`CASES`); CKPT_FUZZ_CASES=N runs N cases (CKPT_FUZZ_SEED picks another seed).
"""

from __future__ import annotations

import os
import random
import signal
import struct
import tracemalloc

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf import GGUFValueType as V

from gguf_helpers import quantized, tiny_llm_gguf, write_gguf

CASES = int(os.environ.get("CKPT_FUZZ_CASES", "2000"))
SEED = int(os.environ.get("CKPT_FUZZ_SEED", "20"))
SECONDS = 5  # per read; the files are a few kB
MAX_ALLOC = 32 << 20  # bytes Python and numpy may hold at once while reading one mutant
CLI_EVERY = 20  # every 20th mutant also goes through `ckpt inspect`

_SCALAR = {V.UINT8: 1, V.INT8: 1, V.UINT16: 2, V.INT16: 2, V.UINT32: 4, V.INT32: 4, V.FLOAT32: 4, V.BOOL: 1,
           V.UINT64: 8, V.INT64: 8, V.FLOAT64: 8}


def slots(data: bytes):
    """Every structural field of a valid GGUF: (byte offset, struct format, kind, value); and the header's end."""
    out, pos = [], 4

    def take(fmt, kind):
        nonlocal pos
        v = struct.unpack_from(fmt, data, pos)[0]
        out.append((pos, fmt, kind, v))
        pos += struct.calcsize(fmt)
        return v

    def string():
        nonlocal pos
        n = take("<Q", "length")  # (not `pos += take(...)`: that adds to pos as it was before take moved it)
        pos += n

    def value(vt, key=None):
        nonlocal pos
        if vt == V.STRING:
            string()
        elif vt == V.ARRAY:
            sub, n = take("<I", "value type"), take("<Q", "count")
            for _ in range(n):
                value(sub)
        elif key == "general.alignment":
            take("<I", "alignment")
        else:
            pos += _SCALAR[vt]

    take("<I", "version")
    n_tensors, n_kv = take("<Q", "count"), take("<Q", "count")
    for _ in range(n_kv):
        n = struct.unpack_from("<Q", data, pos)[0]
        key = data[pos + 8:pos + 8 + n].decode()
        string()
        value(take("<I", "value type"), key)
    for _ in range(n_tensors):
        string()
        for _ in range(take("<I", "n_dims")):
            take("<Q", "dim")
        take("<I", "ggml type")
        take("<Q", "offset")
    return out, pos


def edge_values(kind: str, v: int, rng: random.Random) -> list[int]:
    big = [2 ** 31, 2 ** 32 - 1, 2 ** 63, 2 ** 64 - 1, 7_900_000_000_000_000_000]
    return {
        "version": [0, 1, 2, 4, 3 << 24],
        "count": [0, 1, v - 1, v + 1, v * 2] + big,
        "length": [0, 1, v - 1, v + 1, v + 1000] + big,
        "value type": [rng.randrange(13), rng.randrange(13), 13, 255, 2 ** 31],
        "n_dims": [0, 1, 2, 3, 5, 8, 9, 2 ** 31],
        "dim": [0, 1, v - 1, v + 1, v * 2, 2 ** 32, 2 ** 40] + big[2:],
        "ggml type": [rng.choice(list(gguf.GGML_QUANT_SIZES)), rng.choice(list(gguf.GGML_QUANT_SIZES)), 4, 99, 2 ** 31],
        "offset": [0, v + 1, v + 32, max(0, v - 32), 2 ** 40, 2 ** 64 - 1],
        "alignment": [0, 1, 3, 16, 48, 2 ** 31],
    }[kind]


def mutants(bases: list[bytes], n: int, seed: int):
    """`n` (description, bytes) pairs, the same for the same seed."""
    rng = random.Random(seed)
    fields = [slots(b) for b in bases]
    for i in range(n):
        b = rng.randrange(len(bases))
        data, (sl, header_end) = bytearray(bases[b]), fields[b]
        what = rng.random()
        if what < 0.6:  # one structural field set to an edge value
            pos, fmt, kind, v = rng.choice(sl)
            new = rng.choice(edge_values(kind, v, rng)) % (1 << (8 * struct.calcsize(fmt)))
            struct.pack_into(fmt, data, pos, new)
            desc = f"base {b}: {kind} at byte {pos}: {v} -> {new}"
        elif what < 0.75:  # truncated, mostly inside the header
            cut = rng.randrange(header_end + 16) if rng.random() < 0.8 else rng.randrange(len(data))
            del data[cut:]
            desc = f"base {b}: truncated to {cut} bytes"
        else:  # random bytes in the header
            k = rng.randint(1, 4)
            spots = [rng.randrange(4, header_end) for _ in range(k)]
            for p in spots:
                data[p] = rng.randrange(256)
            desc = f"base {b}: header bytes {spots} changed"
        yield i, desc, bytes(data)


@pytest.fixture(scope="module")
def bases(tmp_path_factory) -> list[bytes]:
    d = tmp_path_factory.mktemp("bases")
    rng = np.random.default_rng(6)
    flux = d / "flux.gguf"
    write_gguf(flux, "flux", {
        "a.weight": (quantized(rng.standard_normal((4, 64)).astype(np.float32), T.Q8_0)[0], T.Q8_0),
        "b.weight": rng.standard_normal((4, 64)).astype(np.float32),
        "c.weight": rng.standard_normal((2, 3, 32)).astype(np.float16),
        "d.weight": (quantized(rng.standard_normal((2, 32)).astype(np.float32), T.Q4_0)[0], T.Q4_0)},
        kv={"general.alignment": 64, "general.name": "tiny", "x.flag": True, "x.scale": 0.5,
            "x.ints": ([3, -1, 7], V.ARRAY, V.INT32), "x.words": ["a", "bc", "", "déf", "g"],
            "x.floats": ([0.5, 1.5], V.ARRAY, V.FLOAT32), "x.big": (2 ** 40, V.UINT64)})
    llm = tiny_llm_gguf(d / "llm.gguf")
    return [flux.read_bytes(), llm.read_bytes()]


class _Slow(Exception):
    pass


def _alarm(signum, frame):
    raise _Slow()


def bounded(fn):
    """fn() within SECONDS and MAX_ALLOC; returns its result or the exception it raised."""
    old = signal.signal(signal.SIGALRM, _alarm)
    tracemalloc.start()
    signal.setitimer(signal.ITIMER_REAL, SECONDS)
    try:
        try:
            result = fn()
        except _Slow:
            raise
        except Exception as e:  # noqa: BLE001 - the caller decides which are allowed
            result = e
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        signal.signal(signal.SIGALRM, old)
    assert peak < MAX_ALLOC, f"allocated {peak} bytes"
    return result


def read_both(path):
    """ckpt's header and every tensor's bytes read through ckpt; then gguf's reader on the same file."""
    from ckpt.io.gguf import read_gguf_header
    from ckpt.io.tensors import FileHandles

    handles = FileHandles()
    try:
        header = read_gguf_header(path, handles, path.name)
        values = {k: header.value(k) for k in header.fields}
        data = {n: t.read(0, t.rows, torch.device("cpu")).reshape(-1).view(torch.uint8).numpy().tobytes()
                for n, t in header.tensors.items()}
    finally:
        handles.close()
    return header, values, data, gguf.GGUFReader(path)


def check_same(header, values, data, reader):
    assert list(values) == list(reader.fields)
    for k, f in reader.fields.items():
        assert repr(values[k]) == repr(f.contents()), k  # (repr: a mutant float may be NaN)
    got = list(header.tensors.values())
    assert [t.name for t in got] == [t.name for t in reader.tensors]
    for mine, theirs in zip(got, reader.tensors):
        assert mine.ggml_type == int(theirs.tensor_type), mine.name
        assert mine.stored_shape == tuple(int(d) for d in reversed(theirs.shape.tolist())), mine.name
        assert data[mine.name] == np.asarray(theirs.data).tobytes(), mine.name


def test_bases_read_as_gguf_reads_them(bases, tmp_path):
    for i, b in enumerate(bases):
        p = tmp_path / f"{i}.gguf"
        p.write_bytes(b)
        check_same(*read_both(p))


def test_mutants_are_refused_in_one_line_or_read_as_gguf_reads_them(bases, tmp_path, run_ckpt):
    from ckpt.errors import CkptError

    outcomes = {"refused": 0, "read": 0}
    for i, desc, data in mutants(bases, CASES, SEED):
        p = tmp_path / f"m{i}.gguf"
        p.write_bytes(data)
        try:
            result = bounded(lambda: read_both(p))
        except _Slow:
            pytest.fail(f"case {i} ({desc}): no answer within {SECONDS} s")
        if isinstance(result, CkptError):
            msg = str(result)
            assert "\n" not in msg and msg.startswith(f"{p}: "), f"case {i} ({desc}): {msg!r}"
            outcomes["refused"] += 1
        elif isinstance(result, Exception):
            pytest.fail(f"case {i} ({desc}): {type(result).__name__}: {result}")
        else:
            check_same(*result)
            outcomes["read"] += 1
        if i % CLI_EVERY == 0:
            code, out, err = run_ckpt("inspect", p)
            if isinstance(result, CkptError):
                assert code == 2, f"case {i} ({desc})"
            assert code in (0, 2), f"case {i} ({desc}): exit {code}: {err}"
            if code == 2:
                assert err.count("\n") == 1 and err.startswith(f"error: {p}: "), f"case {i} ({desc}): {err}"
        p.unlink()
    print(outcomes)
    assert outcomes["refused"] and outcomes["read"], outcomes  # the mutants reach both sides
