"""Lazy reading of every supported input layout, checked against safetensors' and torch's own loaders.

Each test builds a tiny checkpoint with the reference library (safetensors.save_file, torch.save,
huggingface_hub's shard writer) and compares what ckpt reads, band by band, with what that library
loads back.
"""

from __future__ import annotations

import json
import os
import zipfile
from pathlib import Path

import pytest
import torch
from huggingface_hub import save_torch_state_dict
from safetensors.torch import load_file, save_file

from ckpt.errors import CkptError
from ckpt.io.buffers import Buffers
from ckpt.io.checkpoint import open_checkpoint
from helpers.folders import make_pipeline

CPU = torch.device("cpu")


def tiny_state(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {
        "emb.weight": torch.randn(37, 8, generator=g),
        "blocks.0.attn.weight": torch.randn(16, 8, generator=g).half(),
        "blocks.0.attn.bias": torch.randn(16, generator=g).to(torch.bfloat16),
        "blocks.0.norm.weight": torch.randn(8, generator=g).double(),
        "blocks.0.f8": torch.randn(5, 4, generator=g).to(torch.float8_e4m3fn),
        "blocks.0.f8b": torch.randn(5, 4, generator=g).to(torch.float8_e5m2),
        "pos_ids": torch.arange(37, dtype=torch.int64).reshape(1, 37),
        "mask": torch.rand(6, 3, generator=g) > 0.5,
        "i8": torch.randint(-128, 127, (4, 4), dtype=torch.int8, generator=g),
        "u16": torch.randint(0, 60000, (3,), dtype=torch.int32, generator=g).to(torch.uint16),
        "scalar": torch.tensor(2.5),
        "empty": torch.zeros(0, 4),
    }


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-identical (NaN payloads included): compare the raw bytes."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.numel() == 0:
        return True
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


def read_in_bands(t, step):
    if not t.shape:
        return t.read(0, 1, CPU)
    parts = [t.read(a, min(t.rows, a + step), CPU).clone() for a in range(0, t.rows, step)]
    return torch.cat(parts) if parts else t.read(0, 0, CPU)


def test_single_safetensors_file_reads_lazily_and_exactly(tmp_path):
    sd = tiny_state()
    path = tmp_path / "m.safetensors"
    save_file(sd, path, metadata={"ss_network_dim": "4"})
    with open_checkpoint(str(path)) as ck:
        assert ck.kind == "file" and len(ck.components) == 1
        comp = ck.components[0]
        assert comp.files[0].metadata == {"ss_network_dim": "4"}
        assert set(comp.tensors) == set(sd)
        want = load_file(path)
        scratch = Buffers()
        for name, t in comp.tensors.items():
            assert t.dtype == sd[name].dtype and t.shape == tuple(sd[name].shape) and t.home == "m.safetensors"
            assert same(read_in_bands(t, 3), want[name]), name
            if t.shape and t.rows >= 4:  # a band read into reused scratch buffers
                assert same(t.read(1, 4, CPU, scratch), want[name][1:4]), name


def test_sharded_folder_with_index(tmp_path):
    sd = {f"layer.{i}.weight": torch.randn(64, 16) for i in range(6)}
    save_torch_state_dict(sd, tmp_path, max_shard_size=10_000)  # huggingface_hub's own sharded layout
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["X"], "torch_dtype": "float32"}))
    with open_checkpoint(str(tmp_path)) as ck:
        assert ck.kind == "folder"
        (comp,) = ck.components
        assert comp.sharded and comp.index_name == "model.safetensors.index.json"
        assert comp.config["architectures"] == ["X"]
        assert ck.copies == ["config.json"]
        for name, t in comp.tensors.items():
            assert t.home == index["weight_map"][name]
            assert same(read_in_bands(t, 5), sd[name])
    # The index file itself may be passed: the same set, output as a folder with its sidecars.
    with open_checkpoint(str(tmp_path / "model.safetensors.index.json")) as ck:
        assert ck.kind == "folder" and ck.path == tmp_path and ck.copies == ["config.json"]
        assert set(ck.components[0].tensors) == set(sd)


def test_transformers_model_folder(tmp_path):
    from transformers import GPT2Config, GPT2Model

    torch.manual_seed(0)
    model = GPT2Model(GPT2Config(n_layer=1, n_embd=8, n_head=2, n_positions=16, vocab_size=50))
    model.save_pretrained(tmp_path)
    with open_checkpoint(str(tmp_path)) as ck:
        (comp,) = ck.components
        assert comp.config["model_type"] == "gpt2" and "config.json" in ck.copies
        want = load_file(tmp_path / "model.safetensors")
        assert set(comp.tensors) == set(want)
        for name, t in comp.tensors.items():
            assert same(t.read_all(CPU), want[name])


def test_diffusers_pipeline_folder(tmp_path):
    make_pipeline(tmp_path)
    with open_checkpoint(str(tmp_path)) as ck:
        assert ck.kind == "pipeline"
        assert [c.subdir for c in ck.components] == ["text_encoder", "unet"]
        assert set(ck.copies) == {"model_index.json", "unet/config.json", "text_encoder/config.json",
                                  "tokenizer/vocab.json", "tokenizer/merges.txt", "scheduler/scheduler_config.json"}
        unet = ck.components[1]
        assert unet.config == {"_class_name": "UNet2DConditionModel"}
        assert same(unet.tensors["conv.weight"].read_all(CPU),
                    load_file(tmp_path / "unet" / "diffusion_pytorch_model.safetensors")["conv.weight"])


def test_unused_weight_twins_and_variants_are_skipped_not_copied(tmp_path):
    save_file({"w": torch.randn(3)}, tmp_path / "diffusion_pytorch_model.safetensors")
    save_file({"w": torch.randn(3).half()}, tmp_path / "diffusion_pytorch_model.fp16.safetensors")
    torch.save({"w": torch.randn(3)}, tmp_path / "diffusion_pytorch_model.bin")
    (tmp_path / "config.json").write_text("{}")
    with open_checkpoint(str(tmp_path)) as ck:
        (comp,) = ck.components
        assert [f.relpath for f in comp.files] == ["diffusion_pytorch_model.safetensors"]
        assert ck.copies == ["config.json"]
        text = " ".join(comp.notes)
        assert "diffusion_pytorch_model.fp16.safetensors" in text and "diffusion_pytorch_model.bin" in text


# --- torch pickles -------------------------------------------------------------------------------

@pytest.mark.parametrize("zipped", [True, False], ids=["zip", "legacy"])
def test_torch_pickle(tmp_path, zipped):
    sd = {k: v for k, v in tiny_state().items() if k != "empty"}
    if not zipped:  # torch's legacy format has no storage types for these dtypes
        sd = {k: v for k, v in sd.items() if v.dtype not in (torch.float8_e4m3fn, torch.float8_e5m2, torch.uint16)}
    path = tmp_path / "model.pt"
    torch.save(sd, path, _use_new_zipfile_serialization=zipped)
    with open_checkpoint(str(path)) as ck:
        (comp,) = ck.components
        assert comp.files[0].kind == "pickle"
        want = torch.load(path, weights_only=True)
        for name, t in comp.tensors.items():
            assert same(read_in_bands(t, 2), want[name]), name


def test_lightning_ckpt_uses_nested_state_dict(tmp_path):
    sd = {"model.diffusion_model.w": torch.randn(4, 3), "first_stage_model.b": torch.randn(3)}
    path = tmp_path / "sd.ckpt"
    torch.save({"state_dict": sd, "global_step": 1234, "epoch": 3}, path)
    with open_checkpoint(str(path)) as ck:
        (comp,) = ck.components
        assert set(comp.tensors) == set(sd)
        assert any("state_dict" in n and "global_step" in n for n in comp.notes)
        for name, t in comp.tensors.items():
            assert same(t.read_all(CPU), sd[name])


def test_zip_pickle_is_memory_mapped_not_read(tmp_path):
    """Band reads come from an mmap of the file: the tensors' bytes are never loaded whole."""
    if not Path("/proc/self/maps").exists():
        pytest.skip("needs /proc")
    path = tmp_path / "mapped.pt"
    torch.save({"w": torch.randn(256, 64)}, path)
    with open_checkpoint(str(path)) as ck:
        t = ck.components[0].tensors["w"]
        assert str(path) in Path("/proc/self/maps").read_text()
        band = t.read(10, 20, CPU)
        # The band is a view of the mapped storage (no copy of the band, let alone of the file).
        assert band.untyped_storage().data_ptr() == t.value.untyped_storage().data_ptr()
        assert same(band, torch.load(path, weights_only=True)["w"][10:20])


class _Payload:
    """Unpickling this would create a file: proof of execution if it ever ran."""

    def __init__(self, target):
        self.target = target

    def __reduce__(self):
        return (open, (self.target, "w"))


@pytest.mark.parametrize("zipped", [True, False], ids=["zip", "legacy"])
def test_pickle_needing_unsafe_globals_is_refused_never_run(tmp_path, zipped, run_ckpt):
    marker = tmp_path / "PWNED"
    path = tmp_path / "evil.ckpt"
    torch.save({"state_dict": {"w": torch.ones(2)}, "x": _Payload(str(marker))}, path,
               _use_new_zipfile_serialization=zipped)
    assert zipfile.is_zipfile(path) == zipped
    before = set(os.listdir(tmp_path))
    code, out, err = run_ckpt("convert", path, "--to", "fp16", "-q")
    assert code == 2
    assert not marker.exists()
    assert set(os.listdir(tmp_path)) == before
    line = err.strip()
    assert "\n" not in line and str(path) in line and "io.open" in line and "refusing" in line


def test_meta_tensors_in_pickle_are_an_error_naming_keys(tmp_path):
    path = tmp_path / "meta.pt"
    torch.save({"real": torch.ones(2), "ghost.weight": torch.empty(3, device="meta")}, path)
    with pytest.raises(CkptError, match=r"meta\.pt: 1 tensor has no data \(meta device\): ghost\.weight"):
        open_checkpoint(str(path))


def test_pickle_without_tensors_is_an_error(tmp_path):
    path = tmp_path / "args.bin"
    torch.save({"lr": 1e-4}, path)
    with pytest.raises(CkptError, match="args.bin: holds no tensors"):
        open_checkpoint(str(path))


# --- Hugging Face Hub ids, offline from a local cache --------------------------------------------

def make_hub_cache(cache: Path, repo="owner/tiny", commit="a" * 40, branch="main", files=None) -> Path:
    """The huggingface_hub cache layout: models--owner--name/{refs/<branch>, snapshots/<commit>/...}."""
    base = cache / f"models--{repo.replace('/', '--')}"
    snap = base / "snapshots" / commit
    for rel, writer in (files or {}).items():
        (snap / rel).parent.mkdir(parents=True, exist_ok=True)
        writer(snap / rel)
    (base / "refs").mkdir(parents=True, exist_ok=True)
    (base / "refs" / branch).write_text(commit)
    return snap


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    cache = tmp_path / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return cache


def test_hub_repo_id_resolves_from_offline_cache(hub_cache):
    w = torch.randn(4, 4)
    make_hub_cache(hub_cache, files={
        "model.safetensors": lambda p: save_file({"w": w}, p),
        "config.json": lambda p: p.write_text("{}"),
    })
    make_hub_cache(hub_cache, commit="b" * 40, branch="v2", files={
        "model.safetensors": lambda p: save_file({"w": w * 2}, p),
        "unet/diffusion_pytorch_model.safetensors": lambda p: save_file({"u": w * 3}, p),
    })
    with open_checkpoint("owner/tiny") as ck:
        assert ck.kind == "folder" and "snapshots/" + "a" * 40 in str(ck.path)
        assert same(ck.components[0].tensors["w"].read_all(CPU), w)
    with open_checkpoint("owner/tiny@v2") as ck:
        assert same(ck.components[0].tensors["w"].read_all(CPU), w * 2)
    with open_checkpoint("owner/tiny@v2/unet") as ck:
        assert same(ck.components[0].tensors["u"].read_all(CPU), w * 3)
    with open_checkpoint("owner/tiny@" + "b" * 40 + "/model.safetensors") as ck:
        assert ck.kind == "file"


def test_hub_pickle_only_repo(hub_cache):
    make_hub_cache(hub_cache, repo="owner/old", files={
        "pytorch_model.bin": lambda p: torch.save({"w": torch.ones(3)}, p)})
    with open_checkpoint("owner/old") as ck:
        assert same(ck.components[0].tensors["w"].read_all(CPU), torch.ones(3))


def test_hub_repo_missing_from_offline_cache(hub_cache, tmp_path, monkeypatch, run_ckpt):
    monkeypatch.chdir(tmp_path)
    code, out, err = run_ckpt("convert", "nobody/nothing", "--to", "fp16")
    assert code == 2
    assert "nobody/nothing" in err and "not a local path" in err and "cache" in err
    assert err.count("\n") == 1


def test_missing_local_path_is_not_sent_to_the_hub(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "out").mkdir()
    with pytest.raises(CkptError, match="out/typo.safetensors: no such file or directory"):
        open_checkpoint("out/typo.safetensors")
