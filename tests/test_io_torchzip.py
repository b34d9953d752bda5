"""The streaming torch zip writer against `torch.save` itself: byte-identical files (but for the
serialization id's first 20 digits), identical zip directories, and `torch.load` (mmap and not, the
latter checking every CRC32) giving back the same tensors. Zip64 framing is exercised by lowering
its threshold; a real > 4 GiB file was checked by hand (see the report in ckpt/io/torchzip.py's commit)."""

from __future__ import annotations

import os
import zipfile

import pytest
import torch

from ckpt.io import torchzip
from ckpt.io.torchzip import TorchZipWriter, file_size
from ckpt.io.writer import Entry

SID = ".data/serialization_id"


def mixed(seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)
    return {
        "f32": r(7, 3), "f64": r(3, 2).double(), "f16": r(5).half(), "bf16": r(3, 3).bfloat16(),
        "fp8.e4m3": r(11).to(torch.float8_e4m3fn), "fp8.e5m2": r(4, 2).to(torch.float8_e5m2),
        "i8": torch.randint(-9, 9, (9,), dtype=torch.int8, generator=g),
        "i16": torch.randint(-9, 9, (2, 3), dtype=torch.int16, generator=g),
        "i32": torch.randint(-9, 9, (5,), dtype=torch.int32, generator=g),
        "i64": torch.arange(4), "u8": torch.randint(0, 255, (6,), dtype=torch.uint8, generator=g),
        "u16": torch.arange(3).to(torch.uint16), "u32": torch.arange(2).to(torch.uint32),
        "u64": torch.arange(5).to(torch.uint64), "c64": torch.randn(3, dtype=torch.complex64, generator=g),
        "bool": torch.tensor([True, False, True]), "scalar": torch.tensor(1.5), "scalar.i64": torch.tensor(7),
        "empty": torch.zeros(0, 3), "empty.mid": torch.zeros(2, 0, 4, dtype=torch.int8),
        "empty.fp8": torch.zeros(0, dtype=torch.float8_e4m3fn), "ünïcode.名前": torch.ones(2),
    }


def entries(tensors):
    return [Entry(k, v.dtype, tuple(v.shape)) for k, v in tensors.items()]


def write(path, tensors, band=None, archive=None):
    ents = entries(tensors)
    w = TorchZipWriter(path, ents, archive or path.stem)
    for k, v in tensors.items():
        flat = v.reshape(-1)
        step = band or max(flat.numel(), 1)
        for a in range(0, max(flat.numel(), 1), step):
            w.write(k, flat[a:a + step] if flat.numel() else v)
    w.close()
    assert path.stat().st_size == file_size(ents, archive or path.stem)
    return w


def same(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.reshape(-1).view(torch.uint8),
                                                                     b.reshape(-1).view(torch.uint8))


def assert_loads(path, tensors):
    for mmap in (False, True):  # mmap=False reads through miniz, which checks every CRC32
        got = torch.load(path, weights_only=True, mmap=mmap)
        assert type(got) is dict and list(got) == list(tensors)
        assert all(same(got[k], v) and not got[k].requires_grad for k, v in tensors.items())


def assert_like_torch(tmp_path, tensors, band=None):
    ref, out = tmp_path / "ref" / "model.pth", tmp_path / "out" / "model.pth"
    ref.parent.mkdir()
    out.parent.mkdir()
    torch.save(tensors, ref)
    write(out, tensors, band)
    a, b = ref.read_bytes(), out.read_bytes()
    za, zb = zipfile.ZipFile(ref), zipfile.ZipFile(out)
    ia, ib = za.infolist(), zb.infolist()
    assert len(a) == len(b)
    assert ia[-1].filename == f"model/{SID}"
    assert a[:ia[-1].header_offset] == b[:ia[-1].header_offset]
    key = lambda i: (i.filename, i.header_offset, i.file_size, i.compress_size, i.flag_bits, i.extra,
                     i.CRC if not i.filename.endswith(SID) else None)
    assert [key(i) for i in ia] == [key(i) for i in ib]
    sid_a, sid_b = za.read(ia[-1]), zb.read(ib[-1])
    assert len(sid_b) == 40 and sid_b.isdigit()
    assert sid_a[20:] == sid_b[20:]  # torch's combined CRC of every record, reproduced
    assert zb.testzip() is None
    assert_loads(out, tensors)
    return out


def test_matches_torch_save_all_dtypes(tmp_path):
    assert_like_torch(tmp_path, mixed())


def test_matches_torch_save_in_bands(tmp_path):
    g = torch.Generator().manual_seed(1)
    tensors = {"w": torch.randn(1000, 37, generator=g), "b": torch.randn(333, generator=g).bfloat16(),
               "q": torch.randn(4097, generator=g).to(torch.float8_e4m3fn)}
    assert_like_torch(tmp_path, tensors, band=1000)  # uneven bands: the CRC runs across them


@pytest.mark.parametrize("runtime", [False, True])
def test_matches_torch_save_memo_reuse(tmp_path, runtime):
    # Names equal to strings torch pickles itself ("storage", "cpu", storage keys "0".."9"): torch's pickle
    # memo reuses them by identity; the same names built at run time are other objects, not reused.
    names = ["5", "cpu", "storage", "storage.x", "0", "data.pkl", "3", "a", "1", "2", "4"]
    if runtime:
        names = [n.upper().lower() if len(n) > 1 else n for n in names]
        assert names[2] == "storage" and names[2] is not "storage"  # noqa: F632
    tensors = {n: torch.full((i + 1,), float(i)) for i, n in enumerate(names)}
    out = assert_like_torch(tmp_path, tensors)
    memo_hits = zipfile.ZipFile(out).read("model/data.pkl").count(b"h\x03")  # BINGET of 'storage'
    assert memo_hits == len(names) - 1 + (not runtime)


def test_matches_torch_save_many_entries(tmp_path):
    # > 255 memo entries and storage keys: LONG_BINPUT / LONG_BINGET in the pickle.
    tensors = {f"layers.{i}.{'weight' if i % 2 else 'bias'}": torch.full((i % 5, 2), float(i), dtype=dt)
               for i, dt in zip(range(400), [torch.float16, torch.float32, torch.float8_e5m2, torch.int64] * 100)}
    assert_like_torch(tmp_path, tensors)


def test_matches_torch_save_empty_dict(tmp_path):
    assert_like_torch(tmp_path, {})


def test_regions_aligned_and_hold_the_bytes(tmp_path):
    tensors = mixed()
    w = write(tmp_path / "m.pth", tensors)
    raw = (tmp_path / "m.pth").read_bytes()
    for k, v in tensors.items():
        a, b = w.regions[k]
        assert a % 64 == 0 and b - a == v.numel() * v.element_size()
        assert raw[a:b] == v.reshape(-1).view(torch.uint8).numpy().tobytes()


def test_zip64_framing(tmp_path, monkeypatch):
    """With the threshold lowered, later records carry zip64 offsets and big ones zip64 sizes, as miniz
    writes them past 4 GiB; Python's zipfile and torch.load (mmap and not) must read that."""
    monkeypatch.setattr(torchzip, "ZIP64_LIMIT", 4096)
    g = torch.Generator().manual_seed(2)
    tensors = {"small": torch.ones(3), "big": torch.randn(1500, generator=g), "big2": torch.randn(1100, generator=g),
               "tail": torch.arange(7), "empty": torch.zeros(0), **mixed()}
    out = tmp_path / "z.pth"
    write(out, tensors, band=123)
    z = zipfile.ZipFile(out)
    assert z.testzip() is None
    infos = {i.filename: i for i in z.infolist()}
    pkl, big, big2, tail = (infos[f"z/{n}"] for n in ("data.pkl", "data/1", "data/2", "data/3"))
    assert pkl.extra == b"" and pkl.header_offset == 0
    assert big.header_offset < 4096 <= big.file_size and big.extra[:4] == b"\x01\x00\x10\x00"  # sizes
    assert big2.header_offset >= 4096 and big2.file_size >= 4096 and big2.extra[:4] == b"\x01\x00\x18\x00"
    assert tail.file_size < 4096 <= tail.header_offset and tail.extra[:4] == b"\x01\x00\x08\x00"  # offset
    raw = out.read_bytes()
    for i in (big, big2, tail):
        h = i.header_offset + 30 + len(i.filename)
        local = raw[h:h + int.from_bytes(raw[i.header_offset + 28:i.header_offset + 30], "little")]
        assert local[:4] == i.extra[:4] and local[len(i.extra):][:2] == b"FB"  # zip64 field, then padding
        assert (h + len(local)) % 64 == 0
        desc = raw[h + len(local) + i.file_size:][:24]
        assert desc[:4] == b"PK\x07\x08" and desc[4:8] == i.CRC.to_bytes(4, "little")
        assert desc[8:] == i.file_size.to_bytes(8, "little") * 2  # 8-byte sizes
    assert raw.count(b"PK\x07\x08") >= len(tensors)
    assert_loads(out, tensors)


def test_errors(tmp_path):
    ents = [Entry("a", torch.float32, (4,)), Entry("b", torch.float16, (2,))]
    with pytest.raises(ValueError, match="duplicate"):
        TorchZipWriter(tmp_path / "d.pth", ents + [Entry("a", torch.int8, (1,))], "d")
    w = TorchZipWriter(tmp_path / "x.pth", ents, "x")
    w.write("a", torch.ones(3))
    with pytest.raises(RuntimeError, match="'?a'?.*more bytes"):
        w.write("a", torch.ones(2))
    w.write("b", torch.ones(2, dtype=torch.float16))
    with pytest.raises(RuntimeError, match="not fully written.*'a'"):
        w.close()
    assert w.fd == -1
    w = TorchZipWriter(tmp_path / "y.pth", ents, "y")
    fd = w.fd
    w.abort()
    assert w.fd == -1
    with pytest.raises(OSError):
        os.fstat(fd)
