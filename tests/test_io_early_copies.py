"""Early copies (`ckpt.io.early_copies`): in a file that mixes copied and computed tensors, the copied tensors'
block-aligned interiors are written by a thread of their own, the stages' stream writes their ends and steps over
the interiors (`DirectSink.skip`).

Oracles: the one-stream path (`early_copies.ENABLED = False`, itself checked against the read/write path and
safetensors' own writer in tests/test_byte_copy.py and tests/test_io_write.py) must give the same bytes, with
O_DIRECT and through the page cache; torch's own cast and the base's own values for what the outputs hold (the
sink's skip itself: tests/test_io_direct.py). Errors on the copying thread and interrupts leave nothing.
"""

from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from helpers.keep_format import attention_lora_base

import ckpt.io.direct as direct
import ckpt.io.early_copies as early_copies
import ckpt.io.output as output


@pytest.fixture
def small(monkeypatch):
    """Every copied tensor with a whole block inside goes early; small buffers and bands: many flushes."""
    monkeypatch.setattr(early_copies, "MIN_BYTES", 1)
    monkeypatch.setattr(direct, "BUFFER", 3 * 4096)
    monkeypatch.setattr(output, "BAND_ELEMS", 1000)


def _mixed(path):
    """bf16 tensors a --to bf16 copies (several blocks each, at unaligned offsets) between fp32 ones it casts."""
    g = torch.Generator().manual_seed(3)
    sd = {}
    for i in range(4):
        sd[f"blocks.{i}.a.weight"] = torch.randn(97, 131, generator=g).bfloat16()  # 25 kB: copied
        sd[f"blocks.{i}.b.weight"] = torch.randn(61, 89, generator=g)  # fp32: cast
        sd[f"blocks.{i}.a.bias"] = torch.randn(7, generator=g).bfloat16()  # no whole block: in the stream
    save_file(sd, path)
    return sd


def _outputs(run_ckpt, monkeypatch, tmp_path, *args) -> bytes:
    """ARGS written four ways (early copies on/off, O_DIRECT on/off): the same bytes; returns them."""
    outs = {}
    for enabled in (True, False):
        for d in (True, False):
            monkeypatch.setattr(early_copies, "ENABLED", enabled)
            monkeypatch.setattr(output, "DIRECT", d)
            out = tmp_path / f"{enabled}-{d}" / "o.safetensors"
            out.parent.mkdir()
            code, _, err = run_ckpt(*args, "-o", out, "-q")
            assert code == 0, err
            outs[enabled, d] = out.read_bytes()
    assert len(set(outs.values())) == 1
    return outs[True, True]


def test_convert_of_a_mixed_file_writes_the_one_stream_bytes(tmp_path, run_ckpt, monkeypatch, small):
    sd = _mixed(tmp_path / "m.safetensors")
    _outputs(run_ckpt, monkeypatch, tmp_path, "convert", tmp_path / "m.safetensors", "--to", "bf16")
    got = load_file(tmp_path / "True-True" / "o.safetensors")
    for k, v in sd.items():
        assert torch.equal(got[k].view(torch.int16), v.to(torch.bfloat16).view(torch.int16)), k


def test_merge_lora_writes_the_one_stream_bytes(tmp_path, run_ckpt, monkeypatch, small):
    sd, attention, lora = attention_lora_base(tmp_path, (96, 80), seed=4)
    _outputs(run_ckpt, monkeypatch, tmp_path, "merge-lora", tmp_path / "base.safetensors", lora)
    got = load_file(tmp_path / "True-True" / "o.safetensors")
    assert all(torch.equal(got[k], sd[k]) for k in sd if k[: -len(".weight")] not in attention)
    assert not torch.equal(got["blocks.0.q.weight"], sd["blocks.0.q.weight"])


def test_interiors_are_whole_blocks_of_large_enough_copies(monkeypatch):
    monkeypatch.setattr(early_copies, "MIN_BYTES", 4096)
    regions = {"a": (100, 100 + 3 * 4096), "b": (8192, 8192 + 4096), "c": (5, 4000)}
    got = early_copies.interiors({"a": [], "b": [], "c": []}, regions)
    assert got == {"a": (4096 - 100, 3 * 4096 - 100), "b": (0, 4096)}  # c holds no whole block


@pytest.mark.parametrize("d", [True, False])
def test_input_truncated_under_the_copying_thread_is_one_line_and_nothing_written(tmp_path, run_ckpt, monkeypatch,
                                                                                  small, d):
    _mixed(tmp_path / "m.safetensors")
    real = early_copies.EarlyCopies.__init__

    def shrinking(self, *a, **k):  # after planning, before the thread's first read
        os.truncate(tmp_path / "m.safetensors", 300)
        real(self, *a, **k)

    monkeypatch.setattr(early_copies.EarlyCopies, "__init__", shrinking)
    monkeypatch.setattr(output, "DIRECT", d)
    code, _, err = run_ckpt("convert", tmp_path / "m.safetensors", "--to", "bf16", "-o", tmp_path / "o.safetensors")
    assert code == 2 and err.strip().count("\n") == 0 and "unexpected end of file" in err and "Traceback" not in err
    assert [p.name for p in tmp_path.iterdir()] == ["m.safetensors"]


def test_a_full_disk_on_the_copying_thread_is_a_write_error(tmp_path, run_ckpt, monkeypatch, small):
    import errno

    _mixed(tmp_path / "m.safetensors")
    monkeypatch.setattr(output, "DIRECT", False)  # the kernel's copy
    from ckpt.io import byte_copy

    def full(self, *a):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(byte_copy.Copier, "copy", full)
    code, _, err = run_ckpt("convert", tmp_path / "m.safetensors", "--to", "bf16", "-o", tmp_path / "o.safetensors")
    assert code == 2 and err.strip().count("\n") == 0 and "No space left" in err and "Traceback" not in err
    assert [p.name for p in tmp_path.iterdir()] == ["m.safetensors"]


def test_an_interrupt_stops_the_copying_thread_and_leaves_nothing(tmp_path, monkeypatch, small):
    """Ctrl-C while the stages run: the copying thread is stopped and joined, the temp output removed."""
    import threading

    from ckpt.convert.command import ConvertOptions, convert

    _mixed(tmp_path / "m.safetensors")
    seen = []
    gate = threading.Event()  # holds the copying thread after each write until the interrupt has seen it alive:
    real_moved = early_copies.EarlyCopies._moved  # on its own, it sometimes finished first (2 runs in 10)

    def moved(self, n):
        real_moved(self, n)
        gate.wait(10)

    def interrupted(*a):
        seen.append([t.name for t in threading.enumerate()])
        gate.set()
        raise KeyboardInterrupt

    monkeypatch.setattr(early_copies.EarlyCopies, "_moved", moved)
    monkeypatch.setattr(output, "_stream_tensor", interrupted)
    with pytest.raises(KeyboardInterrupt):
        convert(str(tmp_path / "m.safetensors"), tmp_path / "o.safetensors", ConvertOptions(to="bf16", quiet=True))
    assert seen and "ckpt-early-copies" in seen[0]
    assert "ckpt-early-copies" not in [t.name for t in threading.enumerate()]
    assert [p.name for p in tmp_path.iterdir()] == ["m.safetensors"]
