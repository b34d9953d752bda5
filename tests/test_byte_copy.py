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

from helpers.keep_format import kohya_lora

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
    g = torch.Generator().manual_seed(1)
    shapes = {f"blocks.{i}.{m}": (32, 32) for i in range(3) for m in ("q", "k", "v", "mlp")}
    sd = {f"{k}.weight": torch.randn(s, generator=g).bfloat16() for k, s in shapes.items()}
    sd |= {f"blocks.{i}.norm.weight": torch.randn(32, generator=g).bfloat16() for i in range(3)}
    save_file(sd, tmp_path / "base.safetensors")
    attention = {k: s for k, s in shapes.items() if k.endswith((".q", ".v"))}
    lora = kohya_lora(tmp_path / "l.safetensors", attention)
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


def test_on_a_sharing_filesystem_the_header_is_padded_to_keep_blocks_aligned(tmp_path, run_ckpt, monkeypatch):
    """Where copy_file_range shares extents (btrfs, XFS, bcachefs, ZFS), a shared block must start at the same
    offset within a block in both files: the header (whose length is the one free choice in a gapless
    safetensors file) gets the spaces that align the most copied bytes. The tensors are the same; only the
    header's trailing spaces differ from the unpadded file."""
    from ckpt.io import byte_copy

    src = _tiny_flux2_file(tmp_path)
    code, _, err = run_ckpt("convert", src, "--layout", "diffusers", "-o", tmp_path / "plain", "-q")
    assert code == 0, err
    monkeypatch.delenv(output.NO_PADDING)
    monkeypatch.setattr(byte_copy, "shares_extents", lambda path: True)
    code, _, err = run_ckpt("convert", src, "--layout", "diffusers", "-o", tmp_path / "padded", "-q")
    assert code == 0, err
    plain, padded = (tmp_path / d / "diffusion_pytorch_model.safetensors" for d in ("plain", "padded"))
    pad = _header_len(padded) - _header_len(plain)
    assert 0 < pad < 4096 and pad % 8 == 0
    a, b = plain.read_bytes(), padded.read_bytes()
    assert b[8: 8 + _header_len(padded)].rstrip(b" ") == a[8: 8 + _header_len(plain)].rstrip(b" ")
    assert b[8 + _header_len(padded):] == a[8 + _header_len(plain):]  # the same data region
    got, want = load_file(padded), load_file(plain)
    assert all(torch.equal(got[k], want[k]) for k in want)
    # the padding aligns as many bytes as the best of every possible shift would (found by content here)
    deltas = _block_deltas(src, plain)
    best = max(sum(n for d, n in deltas if (d - shift) % 4096 == 0) for shift in range(0, 4096, 8))
    assert sum(n for d, n in _block_deltas(src, padded) if d == 0) == best > 0


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


@pytest.mark.skipif(not os.environ.get("CKPT_TEST_REFLINK_DIR"),
                    reason="set CKPT_TEST_REFLINK_DIR to a folder on XFS (reflink=1) or btrfs to run")
def test_a_reflink_filesystem_shares_the_copied_blocks(run_ckpt, monkeypatch):
    """On a real sharing filesystem (e.g. `mkfs.xfs -m reflink=1` on a loop device), the layout conversion's
    output shares most of its blocks with the input (FIEMAP's shared flag, as `filefrag -v` prints it)."""
    import shutil
    import subprocess
    import tempfile
    from pathlib import Path

    from ckpt.io.byte_copy import shares_extents

    monkeypatch.delenv(output.NO_PADDING)
    root = Path(os.environ["CKPT_TEST_REFLINK_DIR"])
    assert shares_extents(root), f"{root} is not on a filesystem that shares extents"
    tmp = Path(tempfile.mkdtemp(dir=root))
    try:
        src = _tiny_flux2_file(tmp)
        code, _, err = run_ckpt("convert", src, "--layout", "diffusers", "-o", tmp / "out", "-q")
        assert code == 0, err
        out = tmp / "out" / "diffusion_pytorch_model.safetensors"
        fiemap = subprocess.run(["filefrag", "-v", str(out)], capture_output=True, text=True).stdout
        shared = sum(int(line.split(":")[3].strip().split()[0]) for line in fiemap.splitlines()
                     if "shared" in line and line.strip()[:1].isdigit())
        aligned = [n for d, n in _block_deltas(src, out) if d == 0]
        # every aligned tensor shares its whole blocks (a partial block at either end is copied)
        assert shared * 4096 >= sum(aligned) - 2 * 4096 * len(aligned) > 0, fiemap
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
