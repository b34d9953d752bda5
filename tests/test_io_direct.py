"""O_DIRECT output (`ckpt.io.direct`): a file written in order through one aligned buffer has exactly the bytes the
page-cache path writes, gaps included, whatever the buffer size; a filesystem that refuses O_DIRECT (on open or
on the first write) gets the same bytes through the ordinary descriptor.

Oracles: a bytearray model of the file for the sink itself (its writes, and the block-aligned spans it skips for
another writer, `ckpt.io.early_copies`); the page-cache path (`ckpt.io.output.DIRECT = False`,
pwrite as before, itself checked against safetensors' and gguf's own writers elsewhere) for whole commands.
"""

from __future__ import annotations

import errno
import os

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

import ckpt.io.direct as direct
import ckpt.io.output as output


def _sink(tmp_path, monkeypatch, buffer=8192):
    monkeypatch.setattr(direct, "BUFFER", buffer)
    path = tmp_path / "o.bin"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC)
    fd_direct = direct.open_direct(path)
    if fd_direct is None:
        os.close(fd)
        pytest.skip(f"{tmp_path} does not take O_DIRECT")
    return path, fd, direct.DirectSink(fd, fd_direct)


def test_sink_writes_what_a_model_of_the_file_holds(tmp_path, monkeypatch):
    """Pieces in order with gaps (GGUF's alignment), pieces across buffer boundaries, a gap longer than the
    buffer, and a final part that is not a whole block: the file is the model's bytes and its size exactly."""
    path, fd, sink = _sink(tmp_path, monkeypatch)
    rng = np.random.default_rng(0)
    model = bytearray()
    pos = 0
    for length, gap in [(100, 0), (5000, 28), (9000, 0), (3, 4), (20000, 9000), (1, 0), (4095, 0), (777, 31)]:
        pos += gap
        data = rng.integers(0, 256, length, dtype=np.uint8).tobytes()
        model[len(model):] = bytes(pos - len(model))
        model[pos:pos + length] = data
        sink.put(pos, data)
        pos += length
    size = len(model) + 13  # the file's size is planned: a tail of zeros, as a sparse file reads
    os.ftruncate(fd, size)
    sink.close(size)
    os.close(fd)
    assert path.read_bytes() == bytes(model) + bytes(13)


def test_a_write_refused_with_einval_goes_through_the_page_cache(tmp_path, monkeypatch):
    path, fd, sink = _sink(tmp_path, monkeypatch)
    real = os.pwrite

    def pwrite(f, data, offset):
        if f == sink.fd_direct:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(f, data, offset)

    monkeypatch.setattr(os, "pwrite", pwrite)
    data = np.random.default_rng(1).integers(0, 256, 20000, dtype=np.uint8).tobytes()
    sink.put(0, data[:10000])
    sink.put(10000, data[10000:])
    assert sink.fd_direct == -1  # given up after the first refusal
    sink.close(len(data))
    os.close(fd)
    assert path.read_bytes() == data


def test_tmpfs_output_has_the_same_bytes(tmp_path, monkeypatch, run_ckpt):
    """tmpfs refuses O_DIRECT on open (before Linux 6.6) or takes it: either way the output is the page-cache
    path's bytes."""
    import shutil
    import tempfile
    from pathlib import Path

    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm")
    shm = Path(tempfile.mkdtemp(dir="/dev/shm"))
    try:
        save_file({"a": torch.randn(300, 70), "b": torch.randn(5)}, tmp_path / "m.safetensors")
        _both(run_ckpt, monkeypatch, shm, "convert", tmp_path / "m.safetensors", "--to", "bf16", name="o.safetensors")
    finally:
        shutil.rmtree(shm)


def _both(run_ckpt, monkeypatch, tmp_path, *args, name):
    outs = []
    for d in (True, False):
        monkeypatch.setattr(output, "DIRECT", d)
        out = tmp_path / str(d) / name
        out.parent.mkdir()
        code, _, err = run_ckpt(*args, "-o", out, "-q")
        assert code == 0, err
        outs.append(out.read_bytes())
    assert outs[0] == outs[1]
    return outs[0]


@pytest.mark.parametrize("to", ["fp16", "gguf-q8_0", "gguf-q4_k_m"])
def test_commands_write_the_page_cache_paths_bytes(tmp_path, monkeypatch, run_ckpt, to):
    monkeypatch.setattr(direct, "BUFFER", 3 * 4096)  # many flushes, bands across them
    monkeypatch.setattr(output, "BAND_ELEMS", 1000)
    from helpers.flux_names import tiny_flux

    save_file(tiny_flux(), tmp_path / "m.safetensors")  # GGUF: an architecture ComfyUI-GGUF knows
    _both(run_ckpt, monkeypatch, tmp_path, "convert", tmp_path / "m.safetensors", "--to", to,
          name="o.gguf" if to.startswith("gguf") else "o.safetensors")


def test_put_from_reads_stored_ranges_into_the_buffer(tmp_path, monkeypatch):
    """Stored tensors copied into a file written with O_DIRECT are read straight into its buffer: ranges in
    order, after a small gap, across buffers, longer than a buffer, and past a gap longer than the buffer (the
    general way, through `put`)."""
    path, fd, sink = _sink(tmp_path, monkeypatch)
    src = tmp_path / "src.bin"
    data = np.random.default_rng(2).integers(0, 256, 60000, dtype=np.uint8).tobytes()
    src.write_bytes(data)
    fd_in = os.open(src, os.O_RDONLY)
    model = bytearray(70000)
    try:
        for pos, start, length in [(0, 5, 100), (132, 1000, 8000), (8132, 9000, 20000), (40000, 30000, 9)]:
            sink.put_from(pos, fd_in, start, length, src)
            model[pos:pos + length] = data[start:start + length]
        size = 40009
        os.ftruncate(fd, size)
        sink.close(size)
    finally:
        os.close(fd_in)
        os.close(fd)
    assert path.read_bytes() == bytes(model[:40009])


def test_sink_skip_leaves_the_skipped_blocks_to_the_other_writer(tmp_path, monkeypatch):
    """Pieces, gaps (zeros) and skipped block-aligned spans written buffered by another descriptor, across buffer
    boundaries: the file is the model's bytes."""
    path, fd, sink = _sink(tmp_path, monkeypatch)
    rng = np.random.default_rng(5)
    model = bytearray()
    other = os.open(path, os.O_WRONLY)
    pos = 0

    def put(length, gap=0):
        nonlocal pos
        pos += gap
        data = rng.integers(0, 256, length, dtype=np.uint8).tobytes()
        model[len(model):] = bytes(pos + length - len(model))
        model[pos:pos + length] = data
        sink.put(pos, data)
        pos += length

    def skip(blocks, gap_blocks=0):
        nonlocal pos
        pos += gap_blocks * 4096
        data = rng.integers(0, 256, blocks * 4096, dtype=np.uint8).tobytes()
        model[len(model):] = bytes(pos + len(data) - len(model))
        model[pos:pos + len(data)] = data
        sink.skip(pos, pos + len(data))
        os.pwrite(other, data, pos)  # the other writer, through the page cache
        pos += len(data)

    try:
        put(100)
        put(4096 - 100)  # up to a block boundary
        skip(3)  # right after a flush-sized piece
        put(5000, gap=8)
        put(-pos % 4096 + 8192)  # across the buffer's end, to a boundary
        skip(1)
        skip(2, gap_blocks=5)  # a gap of zeros longer than the buffer, then a skip
        put(300)
        put(-pos % 4096)
        skip(4)
        put(123)
        size = pos + 9  # the file's planned size: a tail of zeros
        model[len(model):] = bytes(size - len(model))
        os.ftruncate(fd, size)
        sink.close(size)
    finally:
        os.close(other)
        os.close(fd)
    assert path.read_bytes() == bytes(model)


def test_a_misaligned_skip_is_refused(tmp_path):
    path = tmp_path / "o.bin"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC)
    sink = direct.DirectSink(fd, -1)
    try:
        with pytest.raises(ValueError):
            sink.skip(100, 4096)
    finally:
        sink.release()
        os.close(fd)
