"""Writing: the header-first writer against safetensors' own serializer, shard planning against
huggingface_hub's planner, layouts kept, sidecars and config edits, and atomic output (exceptions,
Ctrl-C, SIGTERM, a full disk: no partial output and no temp file)."""

from __future__ import annotations

import errno
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from huggingface_hub import save_torch_state_dict, split_torch_state_dict_into_shards
from safetensors import safe_open
from safetensors.torch import load_file, save, save_file

from ckpt.convert import ConvertOptions, convert
from ckpt.errors import CkptError
from ckpt.io.plan import parse_size
from ckpt.io.writer import Entry, SafetensorsWriter

ROOT = Path(__file__).resolve().parents[1]


def mixed_tensors(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {
        "z.f64": torch.randn(3, 2, generator=g).double(),
        "a.f32": torch.randn(7, 3, generator=g),
        "m.f16": torch.randn(5, generator=g).half(),
        "b.bf16": torch.randn(3, 3, generator=g).to(torch.bfloat16),
        "c.i8": torch.randint(-5, 5, (9,), dtype=torch.int8, generator=g),
        "d.bool": torch.tensor([True, False, True]),
        "e.fp8": torch.randn(11, generator=g).to(torch.float8_e4m3fn),
        "f.i64": torch.arange(4),
        "g.scalar": torch.tensor(1.5),
        "h.empty": torch.zeros(0, 3),
        "ünïcode.name": torch.ones(2),
    }


def header_of(path):
    raw = Path(path).read_bytes()
    n = int.from_bytes(raw[:8], "little")
    return n, json.loads(raw[8:8 + n])


def assert_aligned(path):
    n, header = header_of(path)
    assert (8 + n) % 8 == 0, "data must start 8-byte aligned"
    with safe_open(path, "pt") as f:
        for name in f.keys():
            dtype = f.get_slice(name).get_dtype()
            item = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2,
                    "I16": 2, "U16": 2}.get(dtype, 1)
            assert (8 + n + header[name]["data_offsets"][0]) % item == 0, name


def test_writer_is_byte_identical_to_safetensors_save(tmp_path):
    """Tensors written in random order and in row bands give exactly `safetensors.torch.save`'s bytes."""
    tensors = mixed_tensors()
    meta = {"ss_x": "ü"}  # one key: safetensors orders metadata keys by a randomly seeded hash
    path = tmp_path / "out.safetensors"
    w = SafetensorsWriter(path, [Entry(k, v.dtype, tuple(v.shape)) for k, v in tensors.items()], meta)
    order = list(tensors)
    random.Random(1).shuffle(order)
    for name in order:
        v = tensors[name]
        if v.dim() and v.shape[0] > 2:
            for a in range(0, v.shape[0], 2):
                w.write(name, v[a:a + 2].contiguous())
        else:
            w.write(name, v)
    w.close()
    assert path.read_bytes() == save(tensors, metadata=meta)
    assert_aligned(path)
    got = load_file(path)
    for k, v in tensors.items():
        assert got[k].dtype == v.dtype and got[k].shape == v.shape
        assert torch.equal(got[k].reshape(-1).view(torch.uint8), v.reshape(-1).view(torch.uint8))


def test_writer_refuses_short_or_long_tensors(tmp_path):
    w = SafetensorsWriter(tmp_path / "x.safetensors", [Entry("a", torch.float32, (4,))], None)
    with pytest.raises(RuntimeError, match="more bytes than planned"):
        w.write("a", torch.ones(5))
    w.write("a", torch.ones(2))
    with pytest.raises(RuntimeError, match="not fully written"):
        w.close()


@pytest.mark.parametrize("text,n", [("5GB", 5 * 10**9), ("500MB", 5 * 10**8), ("2GiB", 2 * 2**30),
                                    ("1000B", 1000), ("1.5kb", 1500)])
def test_parse_size_units(text, n):
    assert parse_size(text) == n


@pytest.mark.parametrize("text", ["", "5XB", "0", "-1GB", "GB"])
def test_parse_size_rejects(text):
    with pytest.raises(CkptError, match="invalid size"):
        parse_size(text)


def opts(**kw):
    return ConvertOptions(**{"to": "fp16", "quiet": True, **kw})


def test_single_file_gives_single_file_with_metadata_and_provenance(tmp_path):
    src = tmp_path / "lora.safetensors"
    save_file({"w": torch.randn(4, 4)}, src, metadata={"ss_network_dim": "8"})
    out, report = convert(str(src), None, opts())
    assert out == tmp_path / "lora-fp16.safetensors" and out.is_file()
    assert_aligned(out)
    with safe_open(out, "pt") as f:
        meta = f.metadata()
    assert meta["ss_network_dim"] == "8" and meta["ckpt_operation"] == "convert --to fp16"
    assert "ckpt_version" in meta and meta["format"] == "pt"


def test_max_shard_size_matches_huggingface_hub_planner(tmp_path):
    g = torch.Generator().manual_seed(0)
    sd = {f"layers.{i}.weight": torch.randn(40 + i, 16, generator=g) for i in range(8)}
    sd["big"] = torch.randn(300, 16, generator=g)  # bigger than a shard: gets its own
    src = tmp_path / "m.safetensors"
    save_file(sd, src)
    out, _ = convert(str(src), tmp_path / "out", opts(max_shard_size="4KB"))
    index = json.loads((out / "m.safetensors.index.json").read_text())
    _, header = header_of(src)  # the planner fills shards in the input's stored order
    stored = sorted(sd, key=lambda k: header[k]["data_offsets"][0])
    want = split_torch_state_dict_into_shards({k: sd[k].half() for k in stored}, max_shard_size=4000,
                                              filename_pattern="m{suffix}.safetensors")
    assert index["weight_map"] == want.tensor_to_filename
    assert index["metadata"]["total_size"] == sum(v.numel() * 2 for v in sd.values())
    assert sorted(p.name for p in out.iterdir()) == sorted([*want.filename_to_tensors, "m.safetensors.index.json"])
    for fn, names in want.filename_to_tensors.items():
        assert_aligned(out / fn)
        got = load_file(out / fn)
        assert set(got) == set(names)
        for k in names:
            assert torch.equal(got[k], sd[k].half())


def test_sharded_input_keeps_its_layout(tmp_path):
    sd = {f"layer.{i}.weight": torch.randn(64, 16) for i in range(6)}
    src = tmp_path / "model"
    src.mkdir()
    save_torch_state_dict(sd, src, max_shard_size=10_000)
    (src / "config.json").write_text(json.dumps({"architectures": ["Toy"], "torch_dtype": "float32", "n": 1}))
    (src / "tokenizer.json").write_text('{"x": 1}')
    (src / "pytorch_model.bin").write_bytes(b"old twin, not used")  # left out, with a note
    in_index = json.loads((src / "model.safetensors.index.json").read_text())
    out, report = convert(str(src), None, opts(to="bf16"))
    assert out == tmp_path / "model-bf16"
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert index["weight_map"] == in_index["weight_map"]
    assert index["metadata"]["total_size"] == sum(v.numel() * 2 for v in sd.values())
    for shard in set(in_index["weight_map"].values()):
        got = load_file(out / shard)
        for k, v in got.items():
            assert torch.equal(v, sd[k].to(torch.bfloat16))
    cfg = json.loads((out / "config.json").read_text())
    assert cfg == {"architectures": ["Toy"], "torch_dtype": "bfloat16", "n": 1}
    assert (out / "tokenizer.json").read_text() == '{"x": 1}'
    assert not (out / "pytorch_model.bin").exists()
    assert any("pytorch_model.bin" in n for n in report.notes)


def test_pickle_folder_output_uses_safetensors_names(tmp_path):
    src = tmp_path / "model"
    src.mkdir()
    torch.save({"w": torch.randn(3, 3)}, src / "pytorch_model-00001-of-00002.bin")
    torch.save({"v": torch.randn(2)}, src / "pytorch_model-00002-of-00002.bin")
    (src / "pytorch_model.bin.index.json").write_text(json.dumps({"metadata": {}, "weight_map": {
        "w": "pytorch_model-00001-of-00002.bin", "v": "pytorch_model-00002-of-00002.bin"}}))
    out, _ = convert(str(src), None, opts())
    assert sorted(p.name for p in out.iterdir()) == [
        "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", "model.safetensors.index.json"]
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert index["weight_map"] == {"w": "model-00001-of-00002.safetensors", "v": "model-00002-of-00002.safetensors"}


# --- refusing to clobber ----------------------------------------------------------------------------

def test_existing_output_needs_overwrite_and_inputs_are_never_overwritten(tmp_path, run_ckpt):
    src = tmp_path / "m.safetensors"
    save_file({"w": torch.ones(4)}, src)
    dst = tmp_path / "m-fp16.safetensors"
    dst.write_bytes(b"previous")
    code, _, err = run_ckpt("convert", src, "--to", "fp16")
    assert code == 2 and "already exists (pass --overwrite" in err and dst.read_bytes() == b"previous"
    code, _, err = run_ckpt("convert", src, "--to", "fp16", "--overwrite", "-q")
    assert code == 0 and torch.equal(load_file(dst)["w"], torch.ones(4, dtype=torch.float16))
    before = src.read_bytes()
    # The input itself, or (for a folder output) a folder holding it.
    for extra in (["-o", src], ["-o", tmp_path, "--max-shard-size", "1GB"]):
        code, _, err = run_ckpt("convert", src, "--to", "fp16", "--overwrite", *extra)
        assert code == 2 and "refusing to write over an input" in err
    assert src.read_bytes() == before


def test_a_sidecar_is_an_input_too(tmp_path, run_ckpt):
    src = tmp_path / "model"
    src.mkdir()
    save_file({"w": torch.ones(4)}, src / "model.safetensors")
    (src / "config.json").write_text("{}")
    code, _, err = run_ckpt("convert", src, "--to", "fp16", "-o", src / "config.json", "--overwrite")
    assert code == 2 and "refusing to write over an input" in err
    assert (src / "config.json").read_text() == "{}"


def test_output_into_existing_folder(tmp_path, run_ckpt):
    src = tmp_path / "m.safetensors"
    save_file({"w": torch.ones(4)}, src)
    (tmp_path / "outdir").mkdir()
    code, out, err = run_ckpt("convert", src, "--to", "fp16", "-o", tmp_path / "outdir", "-q")
    assert code == 0, err
    assert (tmp_path / "outdir" / "m-fp16.safetensors").is_file()


def test_not_enough_free_space_is_refused_up_front(tmp_path, monkeypatch, run_ckpt):
    import shutil

    src = tmp_path / "m.safetensors"
    save_file({"w": torch.ones(1000)}, src)
    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda p: real(p)._replace(free=1000))
    before = sorted(os.listdir(tmp_path))
    code, _, err = run_ckpt("convert", src, "--to", "fp16")
    assert code == 2 and "not enough free space" in err and str(tmp_path / "m-fp16.safetensors") in err
    assert sorted(os.listdir(tmp_path)) == before


# --- atomic output ----------------------------------------------------------------------------------

def sharded_source(tmp_path):
    src = tmp_path / "model"
    src.mkdir()
    save_torch_state_dict({f"l{i}": torch.randn(32, 32) for i in range(6)}, src, max_shard_size=9000)
    (src / "config.json").write_text("{}")
    return src


def _fail_on_nth_write(monkeypatch, n, exc):
    import ckpt.io.writer as writer

    calls = {"n": 0}
    real = writer.SafetensorsWriter.write

    def write(self, name, data):
        calls["n"] += 1
        if calls["n"] == n:
            raise exc
        return real(self, name, data)

    monkeypatch.setattr(writer.SafetensorsWriter, "write", write)


@pytest.mark.parametrize("layout", ["file", "folder"])
def test_exception_mid_write_leaves_nothing(tmp_path, monkeypatch, layout):
    src = tmp_path / "m.safetensors" if layout == "file" else sharded_source(tmp_path)
    if layout == "file":
        save_file({f"t{i}": torch.randn(8, 8) for i in range(5)}, src)
    before = sorted(str(p) for p in tmp_path.rglob("*"))
    _fail_on_nth_write(monkeypatch, 3, RuntimeError("boom"))
    with pytest.raises(RuntimeError, match="boom"):
        convert(str(src), None, opts())
    assert sorted(str(p) for p in tmp_path.rglob("*")) == before


def test_failed_overwrite_keeps_the_previous_output(tmp_path, monkeypatch):
    src = sharded_source(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("previous output")
    _fail_on_nth_write(monkeypatch, 2, RuntimeError("boom"))
    with pytest.raises(RuntimeError):
        convert(str(src), out, opts(overwrite=True))
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model", "out"]


def test_keyboard_interrupt_mid_write(tmp_path, monkeypatch, run_ckpt):
    src = sharded_source(tmp_path)
    before = sorted(str(p) for p in tmp_path.rglob("*"))
    _fail_on_nth_write(monkeypatch, 2, KeyboardInterrupt())
    code, out, err = run_ckpt("convert", src, "--to", "fp16")
    assert code == 130 and "interrupted: nothing was written" in err
    assert sorted(str(p) for p in tmp_path.rglob("*")) == before


@pytest.mark.parametrize("direct", [True, False])
@pytest.mark.parametrize("layout", ["file", "folder"])
def test_disk_full_from_pwrite(tmp_path, monkeypatch, run_ckpt, layout, direct):
    """A full disk on the first write that reaches it: with O_DIRECT that is the buffer's first flush (the
    header and bands are gathered in it), through the page cache the header's pwrite."""
    import ckpt.io.output as output

    monkeypatch.setattr(output, "DIRECT", direct)
    src = tmp_path / "m.safetensors" if layout == "file" else sharded_source(tmp_path)
    if layout == "file":
        save_file({f"t{i}": torch.randn(8, 8) for i in range(5)}, src)
    before = sorted(str(p) for p in tmp_path.rglob("*"))
    real, calls = os.pwrite, {"n": 0}

    def pwrite(fd, data, offset):
        calls["n"] += 1
        if calls["n"] >= (1 if direct else 3):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", pwrite)
    code, out, err = run_ckpt("convert", src, "--to", "fp16")
    assert code == 2
    assert err.count("\n") == 1 and "No space left on device" in err and "nothing written" in err
    assert sorted(str(p) for p in tmp_path.rglob("*")) == before


def test_sigterm_to_a_running_convert_leaves_nothing(tmp_path):
    """A real `ckpt convert` process, sent SIGTERM while it streams a 64 MB file (Ctrl-C takes the same
    KeyboardInterrupt path, tested in-process above)."""
    src = tmp_path / "big.safetensors"
    save_file({f"t{i:02d}": torch.full((1024, 1024), float(i)) for i in range(16)}, src)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "ckpt.cli", "convert", str(src), "--to", "fp16", "-q"],
                            cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 60
        while not any(".ckpt-tmp-" in n for n in os.listdir(tmp_path)):
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "convert never started writing"
            time.sleep(0.002)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err
    assert b"interrupted: nothing was written" in err
    assert os.listdir(tmp_path) == ["big.safetensors"]


def test_missing_parent_folders_are_created_and_removed_if_the_run_fails(tmp_path, monkeypatch, run_ckpt):
    src = tmp_path / "m.safetensors"
    save_file({f"t{i}": torch.randn(8, 8) for i in range(3)}, src)
    dst = tmp_path / "no" / "such" / "x.safetensors"
    _fail_on_nth_write(monkeypatch, 2, OSError(errno.EIO, os.strerror(errno.EIO)))
    code, _, err = run_ckpt("convert", src, "--to", "fp16", "-o", dst)
    assert code == 2 and err.count("\n") == 1 and "nothing written" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.safetensors"]  # no/ and no/such/ removed again
    (tmp_path / "no").mkdir()  # a folder that was there before is never removed
    _fail_on_nth_write(monkeypatch, 2, OSError(errno.EIO, os.strerror(errno.EIO)))
    code, _, err = run_ckpt("convert", src, "--to", "fp16", "-o", dst)
    assert code == 2 and sorted(p.name for p in tmp_path.rglob("*")) == ["m.safetensors", "no"]
    monkeypatch.undo()
    code, _, err = run_ckpt("convert", src, "--to", "fp16", "-o", dst, "-q")
    assert code == 0, err
    assert torch.equal(load_file(dst)["t1"], load_file(src)["t1"].half())
    # a parent that is a file is refused in one line
    code, _, err = run_ckpt("convert", src, "--to", "fp16", "-o", src / "x.safetensors")
    assert code == 2 and err.startswith("error: ") and err.count("\n") == 1 and "is not a folder" in err


def test_pipeline_folder_output_keeps_structure_and_edits_configs(tmp_path):
    from helpers.folders import make_pipeline

    src = tmp_path / "pipe"
    make_pipeline(src)
    out, _ = convert(str(src), None, opts())
    assert out == tmp_path / "pipe-fp16"
    files = sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())
    assert files == sorted(str(p.relative_to(src)) for p in src.rglob("*") if p.is_file())
    for rel in ("model_index.json", "tokenizer/vocab.json", "tokenizer/merges.txt", "scheduler/scheduler_config.json",
                "unet/config.json"):  # diffusers configs carry no dtype: copied as they are
        assert (out / rel).read_bytes() == (src / rel).read_bytes(), rel
    cfg = json.loads((out / "text_encoder/config.json").read_text())
    assert cfg == {"architectures": ["CLIPTextModel"], "torch_dtype": "float16"}
    for rel in ("unet/diffusion_pytorch_model.safetensors", "text_encoder/model.safetensors"):
        got = load_file(out / rel)
        for k, v in load_file(src / rel).items():
            assert torch.equal(got[k], v.half())


def test_trailing_slash_names_a_folder(tmp_path, run_ckpt):
    src = tmp_path / "m.safetensors"
    save_file({"w": torch.ones(2)}, src)
    code, _, err = run_ckpt("convert", src, "--to", "fp16", "-o", f"{tmp_path}/new/", "-q")
    assert code == 0, err
    assert load_file(tmp_path / "new" / "m-fp16.safetensors")["w"].dtype == torch.float16


def test_training_state_is_not_copied(tmp_path, run_ckpt):
    src = tmp_path / "checkpoint-10"
    src.mkdir()
    save_file({"w": torch.randn(4, 4)}, src / "model.safetensors")
    (src / "config.json").write_text(json.dumps({"architectures": ["X"], "torch_dtype": "float32"}))
    torch.save({"state": {}}, src / "optimizer.pt")
    torch.save(torch.get_rng_state(), src / "rng_state.pth")
    (src / "trainer_state.json").write_text('{"global_step": 10}')  # HF Trainer; accelerate and SimpleTuner:
    (src / "random_states_0.pkl").write_bytes(b"rng")
    (src / "training_state.json").write_text('{"global_step": 10}')
    (src / "scheduler_config.json").write_text("{}")  # a model's sidecar, not trainer state: copied
    code, out, err = run_ckpt("convert", src, "--to", "fp16")
    assert code == 0, err
    dst = tmp_path / "fp16-checkpoint-10"  # a name no trainer takes for one of its checkpoints
    assert sorted(p.name for p in dst.iterdir()) == ["config.json", "model.safetensors", "scheduler_config.json"]
    for name in ("optimizer.pt", "rng_state.pth", "trainer_state.json", "random_states_0.pkl", "training_state.json"):
        assert f"{name}: training state, not copied" in err
    assert torch.equal(load_file(dst / "model.safetensors")["w"], load_file(src / "model.safetensors")["w"].half())
