"""The write stages (ckpt.io.write_stages): output bytes do not depend on how many bands are in flight or
how small they are; reads stay on one thread and in order (stateful reads: merges, mapped pickles);
stages are long-lived threads; memory is a fixed set of slots; a failing stage fails the run cleanly.

References are independent of ckpt: safetensors' own `save_file` / torch's `torch.save` of torch's own
casts, and the LoRA formula computed here."""

from __future__ import annotations

import json
import struct
import threading

import pytest
import torch
from safetensors.torch import load_file, save_file

import ckpt.io.output as output
import ckpt.io.write_stages as pipeline

DEPTHS = [1, 2, 3, 6]


def tensor_part(path) -> tuple[dict, bytes]:
    """A safetensors file's tensor entries and data bytes (ckpt adds its provenance to the metadata)."""
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    head = json.loads(raw[8: 8 + n])
    head.pop("__metadata__", None)
    return head, raw[8 + n:]


def model() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    big = torch.randn(37, 24, generator=g) * 30000  # some values overflow fp16 (max 65504)
    big[3, 4], big[9, 0], big[20, 7] = float("nan"), float("inf"), -float("inf")
    return {
        "big.weight": big,
        "conv.weight": torch.randn(9, 3, 2, 2, generator=g),
        "bias": torch.randn(50, generator=g),
        "scalar": torch.tensor(3.5),
        "empty": torch.zeros(0, 4),
        "ids": torch.arange(30, dtype=torch.int64).reshape(10, 3),
        "half": torch.randn(13, 5, generator=g).half(),
    }


def _run_threads() -> list[str]:
    """The threads one write starts and must stop: the stages' and the O_DIRECT writer's flusher (the GGUF
    encoders' pool, "ckpt-gguf-quant", lives as long as the process, by design)."""
    return [t.name for t in threading.enumerate() if t.name in ("ckpt-compute", "ckpt-write")
            or t.name.startswith("ckpt-direct")]


def small(monkeypatch, depth, band=64):
    monkeypatch.setattr(output, "BAND_ELEMS", band)
    monkeypatch.setattr(pipeline, "DEPTH", depth)


@pytest.mark.parametrize("band", [64, 8 << 20])
def test_convert_bytes_are_safetensors_own_whatever_the_depth(tmp_path, monkeypatch, run_ckpt, band):
    tensors = model()
    src = tmp_path / "m.safetensors"
    save_file(tensors, src)
    ref = tmp_path / "ref.safetensors"
    save_file({k: v.half() if v.is_floating_point() else v for k, v in tensors.items()}, ref)
    want_overflow = int((torch.isinf(tensors["big.weight"].half()) & torch.isfinite(tensors["big.weight"])).sum())
    for depth in DEPTHS:
        small(monkeypatch, depth, band)
        out = tmp_path / f"d{depth}.safetensors"
        code, _, err = run_ckpt("convert", src, "--to", "fp16", "-o", out, "-q")
        assert code == 0, err
        assert tensor_part(out) == tensor_part(ref), depth
        assert f"warning: {want_overflow} values overflowed" in err
        assert "warning: 3 NaN/Inf values were already in the input" in err


def test_torch_zip_bytes_do_not_depend_on_depth(tmp_path, monkeypatch, run_ckpt):
    """The torch zip keeps a running CRC per tensor: bands must reach the writer in order."""
    tensors = {k: v for k, v in model().items()}
    src = tmp_path / "m.safetensors"
    save_file(tensors, src)
    outs = []
    for depth in DEPTHS:
        small(monkeypatch, depth)
        out = tmp_path / f"d{depth}" / "model.pth"  # the zip's top folder is named after the file
        code, _, err = run_ckpt("convert", src, "--to", "bf16", "-o", out, "-q")
        assert code == 0, err
        outs.append(out.read_bytes())
    assert all(o == outs[0] for o in outs)
    got = torch.load(tmp_path / "d1" / "model.pth", weights_only=True)
    for k, v in tensors.items():
        want = v.bfloat16() if v.is_floating_point() else v
        assert torch.equal(got[k].view(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8)), k


def test_merges_read_in_order_on_one_thread_whatever_the_depth(tmp_path, monkeypatch, run_ckpt):
    """Merged tensors keep adapter caches released after each tensor's last band, and one adapter may patch
    row slices of a fused target: reads must stay serial. Several depths, many bands: identical bytes,
    equal to the formula."""
    g = torch.Generator().manual_seed(1)
    W = {f"l{i}.weight": torch.randn(40, 16, generator=g) for i in range(4)}
    base = tmp_path / "b.safetensors"
    save_file(W, base)
    lora = {}
    for i in range(4):
        lora[f"l{i}.lora_down.weight"] = torch.randn(3, 16, generator=g)
        lora[f"l{i}.lora_up.weight"] = torch.randn(40, 3, generator=g)
    lo = tmp_path / "l.safetensors"
    save_file(lora, lo)
    readers, outs = set(), []
    import ckpt.adapters.merged as merged

    real = merged.MergedTensor.read

    def read(self, *a, **k):
        readers.add(threading.get_ident())
        return real(self, *a, **k)

    monkeypatch.setattr(merged.MergedTensor, "read", read)
    for depth in DEPTHS:
        small(monkeypatch, depth)
        out = tmp_path / f"d{depth}.safetensors"
        code, _, err = run_ckpt("merge-lora", base, lo, "-o", out, "-q", "--ratio", "0.5")
        assert code == 0, err
        outs.append(out.read_bytes())
    assert all(o == outs[0] for o in outs) and readers == {threading.get_ident()}
    got = load_file(tmp_path / "d1.safetensors")
    for i in range(4):
        d, u = lora[f"l{i}.lora_down.weight"], lora[f"l{i}.lora_up.weight"]
        torch.testing.assert_close(got[f"l{i}.weight"], W[f"l{i}.weight"] + 0.5 * u @ d, rtol=1e-5, atol=1e-5)


def test_mapped_pickle_bands_whatever_the_depth(tmp_path, monkeypatch, run_ckpt):
    """A zip pickle is read through its memory map, each band's pages given back after the next read:
    pages a later stage still reads come back from the file."""
    tensors = {f"t{i}": torch.randn(64, 32) for i in range(3)}
    src = tmp_path / "m.pth"
    torch.save(tensors, src)
    for depth in DEPTHS:
        small(monkeypatch, depth)
        out = tmp_path / f"d{depth}.safetensors"
        code, _, err = run_ckpt("convert", src, "--to", "fp16", "-o", out, "-q")
        assert code == 0, err
        got = load_file(out)
        assert all(torch.equal(got[k], v.half()) for k, v in tensors.items())


def test_long_lived_stages_and_a_fixed_set_of_slots(tmp_path, monkeypatch, run_ckpt):
    """Hundreds of bands: every write on one thread, every cast on another, `depth` slots made per file."""
    import ckpt.io.writer as writer

    src = tmp_path / "m.safetensors"
    save_file({"w": torch.randn(300, 8), "v": torch.randn(100, 8)}, src)
    small(monkeypatch, 3, band=8)  # one row per band: 400 bands
    writers, casters, slots = set(), set(), []
    real_write, real_init = writer.SafetensorsWriter.write, pipeline.Slot.__init__

    def write(self, name, data):
        writers.add(threading.get_ident())
        return real_write(self, name, data)

    def init(self):
        slots.append(self)
        real_init(self)

    import ckpt.cast_cpu as cast_cpu

    real_cast = cast_cpu.cast  # the kernels cast every band, with torch or without (this plan: without)

    def cast_(*a):
        casters.add(threading.get_ident())
        return real_cast(*a)

    monkeypatch.setattr(writer.SafetensorsWriter, "write", write)
    monkeypatch.setattr(pipeline.Slot, "__init__", init)
    monkeypatch.setattr(cast_cpu, "cast", cast_)
    before = threading.active_count()
    code, _, err = run_ckpt("convert", src, "--to", "fp16", "-q")
    assert code == 0, err
    assert len(writers) == 1 and len(casters) == 1 and writers != casters
    assert threading.get_ident() not in writers | casters
    assert len(slots) == 3 and threading.active_count() == before
    # every per-band buffer is bounded by the band, not the tensor (8 elements of fp32 / fp16)
    assert max(b.nbytes for s in slots for b in s._bufs.values()) <= 8 * 4


@pytest.mark.parametrize("kernels", [True, False], ids=["without-torch", "torch"])
def test_a_failing_compute_stage_fails_the_run_and_writes_nothing(tmp_path, monkeypatch, run_ckpt, kernels):
    """Both pipelines: numpy bands cast by the kernels without torch, and torch's (where the kernels cannot run)."""
    import ckpt.cast as cast
    import ckpt.cast_cpu as cast_cpu

    src = tmp_path / "m.safetensors"
    save_file({f"t{i}": torch.randn(40, 8) for i in range(3)}, src)
    small(monkeypatch, 2)
    calls = {"n": 0}
    owner, attr = (cast_cpu, "cast") if kernels else (cast.Caster, "_cast")
    real = getattr(owner, attr)

    def boom(*a):
        calls["n"] += 1
        if calls["n"] == 7:
            raise RuntimeError("boom in the compute stage")
        return real(*a)

    if not kernels:
        monkeypatch.setattr(cast_cpu, "_AVAILABLE", False)
    monkeypatch.setattr(owner, attr, boom)
    before = sorted(tmp_path.iterdir())
    with pytest.raises(RuntimeError, match="boom in the compute stage"):
        from ckpt.convert import ConvertOptions, convert

        convert(str(src), None, ConvertOptions(to="fp16", quiet=True))
    assert calls["n"] == 7
    assert sorted(tmp_path.iterdir()) == before
    assert not _run_threads()


@pytest.mark.parametrize("kernels", [True, False], ids=["without-torch", "torch"])
def test_a_read_error_stops_the_stages(tmp_path, monkeypatch, run_ckpt, kernels):
    import ckpt.cast_cpu as cast_cpu
    import ckpt.io.tensors as tensors
    from ckpt.io.buffers import Buffers

    src = tmp_path / "m.safetensors"
    save_file({f"t{i}": torch.randn(40, 8) for i in range(3)}, src)
    small(monkeypatch, 3)
    calls = {"n": 0}
    # the band's read: RawTensor.read with torch, a host buffer filled from the file without
    owner, attr = (Buffers, "host") if kernels else (tensors.RawTensor, "read")
    real = getattr(owner, attr)

    def read(self, *a, **k):
        if not kernels or a[0] == "raw":
            calls["n"] += 1
            if calls["n"] == 9:
                raise KeyboardInterrupt
        return real(self, *a, **k)

    if not kernels:
        monkeypatch.setattr(cast_cpu, "_AVAILABLE", False)
    monkeypatch.setattr(owner, attr, read)
    before = sorted(tmp_path.iterdir())
    code, _, err = run_ckpt("convert", src, "--to", "fp16")
    assert code == 130 and "interrupted: nothing was written" in err
    assert calls["n"] == 9
    assert sorted(tmp_path.iterdir()) == before
    assert not _run_threads()


def test_a_cast_that_reads_tensors_stays_on_the_reading_thread(tmp_path, monkeypatch, run_ckpt):
    """Scaled fp8 output computes each weight's scale with a pass over the weight, lazily, from its cast:
    such casts are not `stateless` and run on the reading thread, in order."""
    import ckpt.targets.planners.fp8_out as fp8_out

    g = torch.Generator().manual_seed(2)
    tensors = {f"blocks.{i}.w.weight": torch.randn(48, 16, generator=g) for i in range(3)}
    src = tmp_path / "m.safetensors"
    save_file(tensors, src)
    seen = set()
    real = fp8_out.AmaxScale.value

    def value(self, *a, **k):
        seen.add(threading.get_ident())
        return real(self, *a, **k)

    monkeypatch.setattr(fp8_out.AmaxScale, "value", value)
    outs = []
    for depth in (1, 3):
        small(monkeypatch, depth)
        out = tmp_path / f"d{depth}.safetensors"
        code, _, err = run_ckpt("convert", src, "--to", "fp8_e4m3fn", "--scaled", "-o", out, "-q")
        assert code == 0, err
        outs.append(out.read_bytes())
    assert outs[0] == outs[1] and seen == {threading.get_ident()}


@pytest.mark.parametrize("busy, compute, reader", [(None, 1, 1), ("compute", 4, 1), ("read", 1, 4)])
def test_each_stage_runs_with_the_threads_it_was_given(tmp_path, busy, compute, reader):
    """With 4 cores, the stage that holds the work gets all 4 and the other one (4 - 2) // 2 = 1. Each stage
    thread sets its own count: torch gives a thread that has not set one whatever count was set last, which
    once left the compute stage of a K-quant GGUF write with the reader's single thread."""
    from ckpt.io.writer import Entry, SafetensorsWriter

    before = torch.get_num_threads()
    torch.set_num_threads(4)
    seen = []
    w = SafetensorsWriter(tmp_path / "o.safetensors", [Entry("x", torch.float32, (4,))], None)
    try:
        stages = pipeline.WriteStages(w, torch.device("cpu"), busy_stage=busy)
        slot = stages.band()
        seen.append(torch.get_num_threads())  # the reader: this thread

        def cast(x, b):
            seen.append(torch.get_num_threads())
            return x

        stages.submit(slot, "x", torch.float32, torch.zeros(4), cast)
        stages.finish()
        w.close()
    finally:
        torch.set_num_threads(before)
    assert seen == [reader, compute]
