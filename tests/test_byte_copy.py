"""The byte-copy write path (`ckpt.io.byte_copy`): output tensors whose bytes are stored byte ranges of an input
(a renamed tensor, a row slice of a fused one, pieces stacked back, a tensor a merge leaves alone, a GGUF tensor
kept in its type) are copied by the kernel instead of being read and written.

Oracle: the read/write path itself (`ckpt.io.output.BYTE_COPY = False`, every tensor read band by band as before):
each command below writes the same bytes both ways, and says how many tensors were copied (`byte_copied` in
`--report`), which must be exactly the ones that change no byte. The fallbacks (`sendfile`, then pread/pwrite)
give the same bytes; a source that ends early is an input error, not a short output.
"""

from __future__ import annotations

import errno
import json
import os

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from helpers.keep_format import attention_lora_base, kohya_lora

import ckpt.io.output as output
from ckpt.errors import CkptError


def _files(path) -> dict[str, bytes]:
    if path.is_file():
        return {"": path.read_bytes()}
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def both_ways(run_ckpt, monkeypatch, tmp_path, *args, out_name="out.safetensors"):
    """Run `ckpt ARGS -o OUT --report R` with the byte-copy path and with the read/write path; assert the same
    files, byte for byte; return the copy run's report."""
    results = []
    for copy in (True, False):
        monkeypatch.setattr(output, "BYTE_COPY", copy)
        (tmp_path / str(copy)).mkdir(exist_ok=True)  # the same file name both ways: a torch zip records it
        out, rep = tmp_path / str(copy) / out_name, tmp_path / str(copy) / "r.json"
        code, _, err = run_ckpt(*args, "-o", out, "--report", rep)
        assert code == 0, err
        results.append((_files(out), json.loads(rep.read_text())))
    (copied, report), (read, read_report) = results
    assert copied.keys() == read.keys() and all(copied[k] == read[k] for k in copied)
    assert read_report["byte_copied"] == {"tensors": 0, "bytes": 0}
    return report


def _copied(report) -> int:
    return report["byte_copied"]["tensors"]


def test_layout_conversion_copies_every_tensor(tmp_path, run_ckpt, monkeypatch):
    pytest.importorskip("diffusers")
    from families_util import flux2_bf16_original

    sd, original = flux2_bf16_original(tmp_path / "f2.safetensors")
    monkeypatch.setattr(output, "BAND_ELEMS", 64)  # the read path goes band by band through fused tensors
    rep = both_ways(run_ckpt, monkeypatch, tmp_path, "convert", tmp_path / "f2.safetensors", "--layout", "diffusers",
                    out_name="dif")
    got = load_file(tmp_path / "True" / "dif" / "diffusion_pytorch_model.safetensors")
    assert set(got) == set(sd) and all(torch.equal(got[k], sd[k]) for k in sd)
    assert _copied(rep) == len(sd)
    assert rep["byte_copied"]["bytes"] == sum(v.numel() * v.element_size() for v in sd.values())
    assert any("copied byte for byte from the input by the kernel" in n for n in rep["notes"])
    # and back: the original tensors again (fused ones stacked from their pieces), every tensor copied
    rep = both_ways(run_ckpt, monkeypatch, tmp_path, "convert", tmp_path / "True" / "dif", "--layout", "original")
    back = load_file(tmp_path / "True" / "out.safetensors")
    assert back.keys() == original.keys() and all(torch.equal(back[k], original[k]) for k in original)
    assert _copied(rep) == len(original)


def _mixed(path):
    g = torch.Generator().manual_seed(0)
    sd = {"blocks.0.a.weight": torch.randn(48, 32, generator=g), "blocks.0.b.weight": torch.randn(40, 48, generator=g),
          "blocks.0.a.bias": torch.randn(48, generator=g).bfloat16(), "norm.weight": torch.randn(32, generator=g),
          "norm.bias": torch.randn(32, generator=g).bfloat16(), "step": torch.tensor([7], dtype=torch.int64)}
    sd["blocks.0.a.bias"][3] = float("nan")  # copied unread: the NaN is neither counted nor changed
    save_file(sd, path)
    return sd


def test_convert_copies_what_keeps_its_dtype(tmp_path, run_ckpt, monkeypatch):
    sd = _mixed(tmp_path / "m.safetensors")
    rep = both_ways(run_ckpt, monkeypatch, tmp_path, "convert", tmp_path / "m.safetensors", "--to", "bf16",
                    "--keep", "norm.*")
    # bf16 tensors (already the target), the int step and the fp32 norm.weight kept by --keep: copied
    assert _copied(rep) == 4
    got = load_file(tmp_path / "True" / "out.safetensors")
    assert got["norm.weight"].dtype == torch.float32 and torch.equal(got["norm.weight"], sd["norm.weight"])
    assert got["blocks.0.a.weight"].dtype == torch.bfloat16
    assert torch.equal(got["blocks.0.a.bias"].view(torch.int16), sd["blocks.0.a.bias"].view(torch.int16))


def test_torch_zip_output_is_read_and_written(tmp_path, run_ckpt, monkeypatch):
    """A torch zip records each tensor's CRC32, computed from its bytes: nothing is copied unread."""
    _mixed(tmp_path / "m.safetensors")
    rep = both_ways(run_ckpt, monkeypatch, tmp_path, "convert", tmp_path / "m.safetensors", "--to", "bf16",
                    "--format", "torch", out_name="out.pth")
    assert _copied(rep) == 0
    loaded = torch.load(tmp_path / "True" / "out.pth", weights_only=True)
    assert loaded["step"].tolist() == [7]


def test_merge_lora_copies_the_tensors_it_leaves_alone(tmp_path, run_ckpt, monkeypatch):
    sd, attention, lora = attention_lora_base(tmp_path, (32, 32), seed=1)
    monkeypatch.setattr(output, "BAND_ELEMS", 256)
    rep = both_ways(run_ckpt, monkeypatch, tmp_path, "merge-lora", tmp_path / "base.safetensors", lora)
    assert _copied(rep) == len(sd) - len(attention)
    got = load_file(tmp_path / "True" / "out.safetensors")
    assert all(torch.equal(got[k], sd[k]) for k in sd if k[: -len(".weight")] not in attention)
    assert not torch.equal(got["blocks.0.q.weight"], sd["blocks.0.q.weight"])


def _scaled_fp8(path):
    """ComfyUI's legacy scaled fp8: fp8 weights with a scale each, bf16 biases, the `scaled_fp8` marker."""
    g = torch.Generator().manual_seed(2)
    sd = {"scaled_fp8": torch.zeros(0, dtype=torch.float8_e4m3fn)}
    for name in ("blocks.0.a", "blocks.0.b"):
        sd[f"{name}.weight"] = (torch.randn(32, 32, generator=g) * 20).to(torch.float8_e4m3fn)
        sd[f"{name}.scale_weight"] = torch.tensor(0.01)
        sd[f"{name}.bias"] = torch.randn(32, generator=g).bfloat16()
    save_file(sd, path)
    return sd


def test_dequant_copies_the_unquantized_tensors(tmp_path, run_ckpt, monkeypatch):
    _scaled_fp8(tmp_path / "q.safetensors")
    rep = both_ways(run_ckpt, monkeypatch, tmp_path, "dequant", tmp_path / "q.safetensors", "--to", "bf16")
    assert _copied(rep) == 2  # the two bf16 biases


def test_keep_format_merge_copies_the_stored_keys_it_keeps(tmp_path, run_ckpt, monkeypatch):
    sd = _scaled_fp8(tmp_path / "q.safetensors")
    lora = kohya_lora(tmp_path / "l.safetensors", {"blocks.0.a": (32, 32)})
    rep = both_ways(run_ckpt, monkeypatch, tmp_path, "merge-lora", tmp_path / "q.safetensors", lora, "--keep-format")
    got = load_file(tmp_path / "True" / "out.safetensors")
    kept = [k for k in sd if not k.startswith("blocks.0.a.weight") and k != "blocks.0.a.scale_weight"]
    assert all(torch.equal(got[k].reshape(-1).view(torch.uint8), sd[k].reshape(-1).view(torch.uint8)) for k in kept)
    assert _copied(rep) == len(kept)  # the marker too (a range of no bytes)
    assert not torch.equal(got["blocks.0.a.weight"].view(torch.uint8), sd["blocks.0.a.weight"].view(torch.uint8))


def test_gguf_tensors_kept_in_their_type_are_copied(tmp_path, run_ckpt, monkeypatch):
    pytest.importorskip("gguf")
    from gguf_helpers import tiny_llm_gguf

    src = tiny_llm_gguf(tmp_path / "m.gguf", arch="llama")
    rep = both_ways(run_ckpt, monkeypatch, tmp_path, "convert", src, "--to", "gguf-q8_0", out_name="o.gguf")
    assert _copied(rep) == 1  # output_norm stays F32, as llama-quantize keeps it; the rest is encoded
    import gguf

    out = {t.name: t for t in gguf.GGUFReader(tmp_path / "True" / "o.gguf").tensors}
    norm = {t.name: t for t in gguf.GGUFReader(src).tensors}["output_norm.weight"]
    assert np.array_equal(np.asarray(out["output_norm.weight"].data), np.asarray(norm.data))


def test_passthrough_slices_copy_their_layers(tmp_path, run_ckpt, monkeypatch):
    """`ckpt merge` passthrough slices without a scale write each source tensor as it is stored (as mergekit
    does; tests/test_merge_slices.py compares with mergekit itself): copied unread, the same bytes as reading
    them, every tensor taken from the right layer of the right model."""
    pytest.importorskip("transformers")
    from helpers.merge_oracle import tiny_llama

    a, b = tiny_llama(tmp_path / "a", 1, layers=3), tiny_llama(tmp_path / "b", 2, layers=3)
    (tmp_path / "m.yaml").write_text(f"""merge_method: passthrough
slices:
  - sources:
      - model: {a}
        layer_range: [0, 2]
  - sources:
      - model: {b}
        layer_range: [1, 3]
""")
    rep = both_ways(run_ckpt, monkeypatch, tmp_path, "merge", tmp_path / "m.yaml", out_name="merged")
    got = load_file(tmp_path / "True" / "merged" / "model.safetensors")
    assert _copied(rep) == len(got)
    want = load_file(b / "model.safetensors")
    assert torch.equal(got["model.layers.3.mlp.up_proj.weight"], want["model.layers.2.mlp.up_proj.weight"])


def test_batch_outputs_equal_the_read_path(tmp_path, run_ckpt, monkeypatch):
    """`ckpt batch` runs the same API in worker processes: the outputs are the read path's bytes."""
    (tmp_path / "in").mkdir()
    for i in range(2):
        _mixed(tmp_path / "in" / f"m{i}.safetensors")
    code, _, err = run_ckpt("batch", "convert", tmp_path / "in", "-o", tmp_path / "bout", "--to", "bf16")
    assert code == 0, err
    monkeypatch.setattr(output, "BYTE_COPY", False)
    for i in range(2):
        ref = tmp_path / f"ref{i}.safetensors"
        code, _, err = run_ckpt("convert", tmp_path / "in" / f"m{i}.safetensors", "--to", "bf16", "-o", ref, "-q")
        assert code == 0, err
        (got,) = (tmp_path / "bout").glob(f"m{i}*.safetensors")
        assert got.read_bytes() == ref.read_bytes()


# ------------------------------------------------------------------------------- the copier itself

def _pair(tmp_path, data: bytes):
    src = tmp_path / "src.bin"
    src.write_bytes(data)
    fd_in = os.open(src, os.O_RDONLY)
    fd_out = os.open(tmp_path / "dst.bin", os.O_RDWR | os.O_CREAT | os.O_TRUNC)
    return src, fd_in, fd_out


@pytest.mark.parametrize("broken", [(), ("copy_file_range",), ("copy_file_range", "sendfile")])
def test_fallbacks_give_the_same_bytes(tmp_path, monkeypatch, broken):
    from ckpt.io import byte_copy

    data = np.random.default_rng(0).integers(0, 256, 3 * 1000 + 7, dtype=np.uint8).tobytes()
    src, fd_in, fd_out = _pair(tmp_path, data)
    # EXDEV: copy_file_range across filesystems on older kernels; ENOTSOCK: macOS's sendfile
    why = {"copy_file_range": errno.EXDEV, "sendfile": errno.ENOTSOCK}

    def unsupported(name):
        def refuse(*a, **k):
            raise OSError(why[name], "not here")
        return refuse

    for name in broken:
        monkeypatch.setattr(os, name, unsupported(name))
    monkeypatch.setattr(byte_copy, "CHUNK", 1000)
    monkeypatch.setattr(byte_copy, "FALLBACK_BUFFER", 300)
    try:
        c = byte_copy.Copier(fd_out)
        os.ftruncate(fd_out, 20 + 2000)
        c.copy(fd_in, 5, 2000, 20, src)  # a range from inside the source to an offset inside the output
        assert c.way == byte_copy.WAYS[len(broken)]
    finally:
        os.close(fd_in)
        os.close(fd_out)
    assert (tmp_path / "dst.bin").read_bytes() == b"\0" * 20 + data[5:2005]


def test_a_full_disk_is_a_write_error_not_a_fallback(tmp_path, monkeypatch):
    from ckpt.io import byte_copy

    src, fd_in, fd_out = _pair(tmp_path, b"x" * 100)

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "copy_file_range", full)
    try:
        with pytest.raises(OSError) as e:
            byte_copy.Copier(fd_out).copy(fd_in, 0, 100, 0, src)
        assert e.value.errno == errno.ENOSPC
    finally:
        os.close(fd_in)
        os.close(fd_out)


@pytest.mark.parametrize("way", ["copy_file_range", "sendfile", "pread"])
def test_a_source_that_ends_early_is_an_input_error(tmp_path, way):
    from ckpt.io import byte_copy

    src, fd_in, fd_out = _pair(tmp_path, b"y" * 100)
    try:
        with pytest.raises(CkptError, match="src.bin: unexpected end of file while reading tensor data"):
            byte_copy.Copier(fd_out, ways=(way, "pread")).copy(fd_in, 50, 100, 0, src)
    finally:
        os.close(fd_in)
        os.close(fd_out)


@pytest.mark.parametrize("direct", [True, False])
def test_input_truncated_after_planning_is_one_line_and_nothing_written(tmp_path, run_ckpt, monkeypatch, direct):
    """The file shrank between reading its header and copying its bytes: exit 2, no output, no traceback."""
    _mixed(tmp_path / "m.safetensors")
    from ckpt.io.writer import RegionWriter

    real = RegionWriter.copy

    def shrinking(self, *a):  # the copy is read into an O_DIRECT buffer here, or copied by the kernel
        os.truncate(tmp_path / "m.safetensors", 200)
        return real(self, *a)

    monkeypatch.setattr(RegionWriter, "copy", shrinking)
    monkeypatch.setattr(output, "DIRECT", direct)
    code, out, err = run_ckpt("convert", tmp_path / "m.safetensors", "--to", "bf16", "-o", tmp_path / "o.safetensors")
    assert code == 2 and err.strip().count("\n") == 0 and "unexpected end of file" in err and "Traceback" not in err
    assert not (tmp_path / "o.safetensors").exists() and [p.name for p in tmp_path.iterdir()] == ["m.safetensors"]


# ------------------------------------------------------------------ filesystems that share extents

def _tiny_flux2_file(tmp_path):
    pytest.importorskip("diffusers")
    from families_util import flux2_bf16_original

    flux2_bf16_original(tmp_path / "f2.safetensors")
    return tmp_path / "f2.safetensors"


def _header_len(path) -> int:
    return int.from_bytes(path.read_bytes()[:8], "little")


def _block_deltas(src, out) -> list[tuple[int, int]]:
    """(offset within a 4 KiB block of a tensor's bytes in the source minus in the output, bytes) for every output
    tensor of a block or more, found in the source by its content."""
    from ckpt.io.header import read_header

    src_bytes, out_bytes = src.read_bytes(), out.read_bytes()
    deltas = []
    for info in read_header(out).tensors.values():
        data = out_bytes[info.start: info.end]
        at = src_bytes.find(data[:4096]) if len(data) >= 4096 else -1
        if at >= 0:
            deltas.append(((at - info.start) % 4096, len(data)))
    return deltas


def _header(path) -> dict:
    return json.loads(path.read_bytes()[8: 8 + _header_len(path)])


def _without_offsets(header: dict) -> list:
    return [(k, {f: v for f, v in e.items() if f != "data_offsets"} if k != "__metadata__" else e)
            for k, e in header.items()]


def _aligned(deltas) -> int:
    return sum(n for d, n in deltas if d == 0)


def _best_shift_alone(deltas) -> int:
    """The bytes the best header padding alone could align in a file of this order (found by content)."""
    return max(sum(n for d, n in deltas if (d - shift) % 4096 == 0) for shift in range(0, 4096, 8))


def _sharing(monkeypatch):
    """This run as on a filesystem that shares extents: the padding on (the session turns it off), the statfs
    check answered yes."""
    from ckpt.io import byte_copy

    monkeypatch.delenv(output.NO_PADDING)
    monkeypatch.setattr(byte_copy, "shares_extents", lambda path: True)


def _plain_and_shared(run_ckpt, monkeypatch, args: list, plain, shared) -> None:
    """`ckpt *args -o plain`, then the same run as on a filesystem that shares extents (`_sharing`) `-o shared`."""
    code, _, err = run_ckpt(*args, "-o", plain, "-q")
    assert code == 0, err
    _sharing(monkeypatch)
    code, _, err = run_ckpt(*args, "-o", shared, "-q")
    assert code == 0, err


def test_on_a_sharing_filesystem_copies_keep_their_input_blocks(tmp_path, run_ckpt, monkeypatch):
    """Where copy_file_range shares extents (btrfs, XFS, bcachefs, ZFS), a shared block must start at the same
    offset within a block in both files. A layout conversion renames tensors, so safetensors' order (by name)
    scatters them; the file then takes its copies in their input's order (a gapless buffer in any order is
    valid safetensors: readers sort by data_offsets) and the header padding that aligns them: every copied
    tensor keeps its input's block offset, more than padding alone could do. The header keeps its keys, dtypes
    and shapes; the tensors are the same for safetensors, diffusers and ckpt's own reader."""
    diffusers = pytest.importorskip("diffusers")
    from families_util import flux2_bf16_original, loads_and_converts_back

    sd, original = flux2_bf16_original(tmp_path / "f2.safetensors")
    src = tmp_path / "f2.safetensors"
    _plain_and_shared(run_ckpt, monkeypatch, ["convert", src, "--layout", "diffusers"], tmp_path / "plain",
                      tmp_path / "shared")
    plain, shared = (tmp_path / d / "diffusion_pytorch_model.safetensors" for d in ("plain", "shared"))
    assert _without_offsets(_header(shared)) == _without_offsets(_header(plain))
    assert _header(shared) != _header(plain) and (_header_len(shared) - _header_len(plain)) % 8 == 0
    assert shared.stat().st_size - _header_len(shared) == plain.stat().st_size - _header_len(plain)
    # every copied tensor of a block or more at its input's offset within a block (found by content)
    deltas = _block_deltas(src, shared)
    assert deltas and all(d == 0 for d, _ in deltas)
    assert _aligned(deltas) > _best_shift_alone(_block_deltas(src, plain))
    got, want = load_file(shared), load_file(plain)
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    # diffusers loads it strictly; ckpt reads it back (and lays that output out for sharing too): the original tensors
    loads_and_converts_back(run_ckpt, tmp_path, diffusers.Flux2Transformer2DModel, tmp_path / "shared", sd, original)


def _stored_in_order(path, tensors: dict) -> None:
    """A safetensors file with its data in `tensors`' order (as other writers leave it; safetensors' own sorts by
    dtype and name), its header keys in that order too."""
    import struct

    header, data, pos = {}, b"", 0
    for k, v in tensors.items():
        b = v.reshape(-1).view(torch.uint8).numpy().tobytes()
        header[k] = {"dtype": {torch.bfloat16: "BF16", torch.float32: "F32"}[v.dtype], "shape": list(v.shape),
                     "data_offsets": [pos, pos + len(b)]}
        data, pos = data + b, pos + len(b)
    js = json.dumps(header).encode()
    js += b" " * (-(8 + len(js)) % 8)
    path.write_bytes(struct.pack("<Q", len(js)) + js + data)


def _qkv_base(seed: int) -> tuple[dict, dict]:
    g = torch.Generator().manual_seed(seed)
    shapes = {f"blocks.{i}.{m}": (72, 40) for i in range(3) for m in ("q", "k", "v")}  # 5760 bytes: not whole blocks
    return shapes, {f"{k}.weight": torch.randn(s, generator=g).bfloat16() for k, s in shapes.items()}


def test_on_a_sharing_filesystem_merged_weights_fill_their_bases_places(tmp_path, run_ckpt, monkeypatch):
    """A merge-lora of a base stored in another order than safetensors' (here: reverse name order): the untouched
    weights are copied in their input's order and each merged weight goes where its base was (a computed tensor
    of the size of the input's gap), so every copy keeps its input's block offset; the merged tensors are the
    plain run's."""
    shapes, sd = _qkv_base(3)
    base = tmp_path / "base.safetensors"
    _stored_in_order(base, dict(sorted(sd.items(), reverse=True)))
    lora = kohya_lora(tmp_path / "l.safetensors", {k: s for k, s in shapes.items() if k.endswith(".q")})
    plain, shared = tmp_path / "plain.safetensors", tmp_path / "shared.safetensors"
    _plain_and_shared(run_ckpt, monkeypatch, ["merge-lora", base, lora], plain, shared)
    got, want = load_file(shared), load_file(plain)
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    assert all(torch.equal(got[k], sd[k]) for k in sd if ".q." not in k)
    deltas = _block_deltas(base, shared)
    assert len(deltas) == 6 and all(d == 0 for d, _ in deltas)  # the six untouched weights
    assert _best_shift_alone(_block_deltas(base, plain)) < _aligned(deltas)


def test_on_a_sharing_filesystem_safetensors_order_stays_where_it_aligns_as_much(tmp_path, run_ckpt, monkeypatch):
    """A merge-lora of a base saved by safetensors keeps its order: padding alone aligns every copy, so the data
    region is the unpadded file's, byte for byte (only the header's spaces differ)."""
    shapes, sd = _qkv_base(4)
    base = tmp_path / "base.safetensors"
    save_file(sd, base)
    lora = kohya_lora(tmp_path / "l.safetensors", {k: s for k, s in shapes.items() if k.endswith(".q")})
    plain, shared = tmp_path / "plain.safetensors", tmp_path / "shared.safetensors"
    _plain_and_shared(run_ckpt, monkeypatch, ["merge-lora", base, lora], plain, shared)
    pad = _header_len(shared) - _header_len(plain)
    assert 0 < pad < 4096 and pad % 8 == 0
    a, b = plain.read_bytes(), shared.read_bytes()
    assert b[8: 8 + _header_len(shared)].rstrip(b" ") == a[8: 8 + _header_len(plain)].rstrip(b" ")
    assert b[8 + _header_len(shared):] == a[8 + _header_len(plain):]
    deltas = _block_deltas(base, shared)
    assert len(deltas) == 6 and all(d == 0 for d, _ in deltas)


def test_block_padding_picks_the_shift_of_most_bytes():
    from ckpt.io.byte_copy import block_padding
    from ckpt.io.tensors import ByteRange

    def r(start, length):
        return [ByteRange(None, "s", start, length)]

    # a: 3 blocks whose source offset is 24 past the output's; b: 1 block at 8 past; c: too short to share
    copies = {"a": r(100 + 24, 3 * 4096), "b": r(50_000 + 8, 4096), "c": r(7, 100)}
    regions = {"a": (100, 100 + 3 * 4096), "b": (50_000, 54_096), "c": (60_000, 60_100)}
    assert block_padding(copies, regions) == 24
    assert block_padding({"c": copies["c"]}, regions) == 0


def test_source_order_keeps_item_alignment_and_fills_gaps():
    """The input order never puts a tensor off its item size's alignment (item sizes largest first, as
    safetensors does), fills a gap of the input with a computed tensor of its size modulo the block, and puts
    the other computed tensors after the copies; `block_layout` takes it where it aligns more bytes than
    safetensors' order, and gives None where nothing of a block or more can be aligned."""
    from ckpt.io.tensors import ByteRange
    from ckpt.io.writer import BlockLayout, Entry, block_layout, layout, source_order

    def r(start, length):
        return [ByteRange(None, "s", start, length)]

    # the input: b16 (bf16, 6000 bytes) at 8, a gap of 2000 bytes, c16 (6000) at 8008, f32 (8000) at 14008;
    # x16 (2000 bytes) and y16 are computed
    entries = [Entry("b16", "BF16", (3000,)), Entry("c16", "BF16", (3000,)), Entry("f32", "F32", (2000,)),
               Entry("x16", "BF16", (1000,)), Entry("y16", "BF16", (7,))]
    copies = {"b16": r(8, 6000), "c16": r(8008, 6000), "f32": r(14008, 8000)}
    order = source_order(entries, copies)
    assert order == ["f32", "b16", "x16", "c16", "y16"]
    head, regions = layout(entries, None, 0, order)
    assert all((regions[n][0] - len(head)) % (4 if n == "f32" else 2) == 0 for n in order)
    assert sorted(regions.values()) == [regions[n] for n in order]
    shifts = {(copies[n][0].start - regions[n][0]) % 4096 for n in ("b16", "c16")}
    assert len(shifts) == 1  # both bf16 copies keep one shift: one padding aligns them
    chosen = block_layout(entries, None, copies, copies)
    assert chosen.by_source and (shifts.pop() - chosen.pad) % 4096 == 0
    assert chosen.first(entries, copies) == order and BlockLayout().first(entries, copies) == []
    assert block_layout(entries, None, {"y16": r(0, 14)}, {"y16": r(0, 14)}) is None


def test_ray_shares_lay_a_file_out_as_the_driver_staged_it(tmp_path, run_ckpt, monkeypatch):
    """`--executor ray` on a sharing filesystem: the driver stages each file with its layout (padding, input
    order) and hands it to the workers as RayShares does (pickled), which derive the same order from their own
    plan (`ckpt.io.shares`). Here the workers are this process: the bytes equal the local run's."""
    import pickle

    from ckpt.convert.command import ConvertOptions, convert, plan_convert
    from ckpt.io.checkpoint import open_checkpoint
    from ckpt.io.shares import fingerprint, split_shares, write_share
    from ckpt.report import Report

    src = _tiny_flux2_file(tmp_path)
    _sharing(monkeypatch)
    code, _, err = run_ckpt("convert", src, "--layout", "diffusers", "-o", tmp_path / "local", "-q")
    assert code == 0, err
    layouts = []

    class InProcess:
        def __init__(self, src, opts, fmt, plan, out, report):
            self.src, self.opts, self.fmt, self.plan = src, opts, fmt, plan

        def __call__(self, staged, progress=None):
            layouts.extend(s.layout for s in staged)
            spec = pickle.loads(pickle.dumps([(s.index, str(s.path), s.layout) for s in staged]))
            expected = fingerprint(self.plan, [s.layout for s in staged])
            with open_checkpoint(self.src) as c:
                plan, _ = plan_convert(c, self.opts, Report(), self.fmt)
                for names in split_shares(plan, 3):
                    write_share(plan, spec, names, expected)

        def close(self):
            pass

    convert(str(src), tmp_path / "ray", ConvertOptions(layout="diffusers", executor="ray", quiet=True),
            cluster=InProcess)
    assert [lay.by_source for lay in layouts] == [True]
    assert _files(tmp_path / "ray") == _files(tmp_path / "local")


@pytest.mark.skipif(not os.environ.get("CKPT_TEST_REFLINK_DIR"),
                    reason="set CKPT_TEST_REFLINK_DIR to a folder on XFS (reflink=1) or btrfs to run")
def test_a_reflink_filesystem_shares_the_copied_blocks(run_ckpt, monkeypatch):
    """On a real sharing filesystem (e.g. `mkfs.xfs -m reflink=1` on a loop device), the layout conversion's
    output shares nearly all its copied bytes with the input (FIEMAP's shared flag, as `filefrag -v` prints it):
    all but the blocks a tensor boundary cuts (copied where two tensors meet inside one). It loads in
    safetensors and diffusers (strict) with the tensors of the unpadded run."""
    import shutil
    import subprocess
    import tempfile
    from pathlib import Path

    diffusers = pytest.importorskip("diffusers")
    from ckpt.io.byte_copy import shares_extents
    from ckpt.io.header import read_header

    root = Path(os.environ["CKPT_TEST_REFLINK_DIR"])
    assert shares_extents(root), f"{root} is not on a filesystem that shares extents"
    tmp = Path(tempfile.mkdtemp(dir=root))
    try:
        src = _tiny_flux2_file(tmp)
        code, _, err = run_ckpt("convert", src, "--layout", "diffusers", "-o", tmp / "plain", "-q")  # unpadded
        assert code == 0, err
        monkeypatch.delenv(output.NO_PADDING)
        code, _, err = run_ckpt("convert", src, "--layout", "diffusers", "-o", tmp / "out", "-q")
        assert code == 0, err
        out = tmp / "out" / "diffusion_pytorch_model.safetensors"
        fiemap = subprocess.run(["filefrag", "-v", str(out)], capture_output=True, text=True).stdout
        shared = 4096 * sum(int(line.split(":")[3].strip().split()[0]) for line in fiemap.splitlines()
                            if "shared" in line and line.strip()[:1].isdigit())
        tensors = read_header(out).tensors
        copied = sum(t.end - t.start for t in tensors.values())  # every tensor of a layout conversion is a copy
        assert shared >= copied - 4096 * (len(tensors) + 1) and shared >= 0.9 * copied, fiemap
        got, want = load_file(out), load_file(tmp / "plain" / "diffusion_pytorch_model.safetensors")
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
        loaded, info = diffusers.Flux2Transformer2DModel.from_pretrained(tmp / "out", output_loading_info=True)
        assert not any(info.values()), info
        assert all(torch.equal(v, want[k]) for k, v in loaded.state_dict().items())
    finally:
        shutil.rmtree(tmp)


def test_dry_run_says_what_would_be_copied_and_writes_nothing(tmp_path, run_ckpt):
    _mixed(tmp_path / "m.safetensors")
    code, _, err = run_ckpt("convert", tmp_path / "m.safetensors", "--to", "bf16", "--dry-run",
                            "--report", tmp_path / "r.json")
    assert code == 0, err
    assert "note: 3 tensors (" in err and "would be copied byte for byte from the input by the kernel" in err
    assert json.loads((tmp_path / "r.json").read_text())["byte_copied"]["tensors"] == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.safetensors", "r.json"]
