"""The one file planner (`ckpt.io.plan.plan_files`): output tensors, a stem, a format, a shard size and
metadata -> the OutFiles (format, relpath, the zip's archive name) and the index, named as transformers and
diffusers write them.

Oracles: `torch.load` reads every torch shard written, the index's weight_map names the file each tensor
is in, and its total_size is the tensors' bytes; `--layout original --format torch --max-shard-size`
(which once wrote safetensors shards under safetensors names) writes torch shards holding the same
tensors as the safetensors single file of the same conversion.
"""

from __future__ import annotations

import json
import re

import pytest
import torch
from safetensors.torch import load_file

from families_util import state_dict
from ckpt.io.plan import OutTensor, index_name, plan_files, weights_name


def _outs(sizes: dict[str, int]) -> list[OutTensor]:
    return [OutTensor(n, torch.float32, (k,), None, lambda x, b: x) for n, k in sizes.items()]


@pytest.mark.parametrize("stem, fmt, name, index", [
    ("model", "safetensors", "model.safetensors", "model.safetensors.index.json"),
    ("model", "torch", "pytorch_model.bin", "pytorch_model.bin.index.json"),
    ("diffusion_pytorch_model", "safetensors", "diffusion_pytorch_model.safetensors",
     "diffusion_pytorch_model.safetensors.index.json"),
    ("diffusion_pytorch_model", "torch", "diffusion_pytorch_model.bin", "diffusion_pytorch_model.bin.index.json"),
    ("adapter_model", "safetensors", "adapter_model.safetensors", "adapter_model.safetensors.index.json"),
])
def test_names_are_the_loaders(stem, fmt, name, index):
    assert weights_name(stem, fmt) == name
    assert index_name(stem, fmt) == index
    files, indexes = plan_files(_outs({"a": 4, "b": 4}), stem, fmt, metadata={"format": "pt"}, prefix="sub/")
    assert [(f.relpath, f.format, f.archive) for f in files] == [(f"sub/{name}", fmt, name.rsplit(".", 1)[0])]
    assert indexes == {}  # one file: no index, as save_pretrained writes it


@pytest.mark.parametrize("fmt", ["safetensors", "torch"])
def test_shards_and_index(fmt):
    outs = _outs({f"t{i}": 100 for i in range(5)})  # 400 bytes each
    meta = {"format": "pt"}
    files, indexes = plan_files(outs, "model", fmt, 900, meta)
    ext = ".bin" if fmt == "torch" else ".safetensors"
    stem = "pytorch_model" if fmt == "torch" else "model"
    assert [f.relpath for f in files] == [f"{stem}-0000{i}-of-00003{ext}" for i in (1, 2, 3)]
    assert all(f.format == fmt and f.archive == f.relpath[: -len(ext)] for f in files)
    assert all(f.metadata == meta and f.metadata is not meta for f in files)  # each file its own copy
    assert len({id(f.metadata) for f in files}) == len(files)
    (rel, index), = indexes.items()
    assert rel == f"{stem}{ext}.index.json"
    assert index["metadata"] == {"total_size": 2000}
    assert index["weight_map"] == {t.name: f.relpath for f in files for t in f.tensors}


def test_single_file_output():
    """Stem "": the output is one file named by OUT (its archive name follows OUT: `name_single_file`)."""
    outs = _outs({"a": 3})
    files, indexes = plan_files(outs, "", "torch", metadata={"x": "1"})
    assert [(f.relpath, f.format, f.archive, f.metadata) for f in files] == [("", "torch", "archive", {"x": "1"})]
    assert files[0].tensors == outs and indexes == {}
    with pytest.raises(ValueError):
        plan_files(outs, "", "safetensors", 10)


def test_layout_original_torch_shards(tmp_path, run_ckpt):
    """`--format torch` with `--max-shard-size` writes torch shards (pytorch_model-0000x-of-0000y.bin and
    pytorch_model.bin.index.json), not safetensors ones."""
    diffusers = pytest.importorskip("diffusers")
    torch.manual_seed(0)
    model = diffusers.WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=128,
                                            in_channels=4, out_channels=4, text_dim=16, freq_dim=8, ffn_dim=32,
                                            num_layers=2)
    state_dict(model)
    model.save_pretrained(tmp_path / "dif")
    code, _, err = run_ckpt("convert", tmp_path / "dif", "--layout", "original", "-o", tmp_path / "one.safetensors", "-q")
    assert code == 0, err
    want = load_file(tmp_path / "one.safetensors")
    out = tmp_path / "out"
    code, _, err = run_ckpt("convert", tmp_path / "dif", "--layout", "original", "--format", "torch",
                            "--max-shard-size", "300kB", "-o", out, "-q")
    assert code == 0, err
    names = sorted(p.name for p in out.iterdir())
    shards = [n for n in names if n.endswith(".bin")]
    assert len(shards) > 1 and all(re.fullmatch(rf"pytorch_model-\d{{5}}-of-{len(shards):05d}\.bin", n) for n in shards)
    assert not [n for n in names if "safetensors" in n], names
    index = json.loads((out / "pytorch_model.bin.index.json").read_text())
    got = {}
    for n in shards:
        sd = torch.load(out / n, weights_only=True)
        assert all(index["weight_map"][k] == n for k in sd)
        got.update(sd)
    assert set(got) == set(want) == set(index["weight_map"])
    assert all(got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]) for k in want)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in want.values())
