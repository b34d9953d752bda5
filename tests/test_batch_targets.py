"""What `ckpt batch` covers (convert, dequant, merge-lora, inspect) and how: `batch convert` takes every --to of
`ckpt convert`, the GGUF ones included, and --layout; each output is the single command's, byte for byte, under
the single command's name and container (`x.gguf`, a diffusers model folder). `batch merge-lora --to gguf-TYPE`
writes `.gguf` files. A --glob that matches nothing is a bad command line: one line, exit 2, nothing written."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from families_util import original_from_pairs, state_dict
from helpers.batch import manifest_lines, st
from helpers.flux_names import tiny_flux
from helpers.keep_format import kohya_lora
from helpers.refusals import assert_refused

from ckpt import families
from ckpt.batch.discover import Found, made_by_ckpt
from ckpt.batch.operations import make_operation


def _flux_tree(root):
    """Two tiny Flux files (fp32, so Q8_0 is gguf's quantize of the stored values), one in a subfolder."""
    made = {"a.safetensors": tiny_flux(torch.float32), "sub/b.safetensors": tiny_flux(torch.float32)}
    for rel, sd in made.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        save_file(sd, root / rel)
    return made


def test_batch_convert_to_gguf_is_the_single_command_and_ggufs_quantize(tmp_path, run_ckpt):
    root, out = tmp_path / "in", tmp_path / "out"
    made = _flux_tree(root)
    code, stdout, err = run_ckpt("batch", "convert", root, "--to", "gguf-q8_0", "-o", out)
    assert code == 0 and "2 ok, 0 skipped, 0 failed" in stdout, err
    for rel, sd in made.items():
        got = out / rel.replace(".safetensors", ".gguf")
        single = tmp_path / "single.gguf"
        assert run_ckpt("convert", root / rel, "--to", "gguf-q8_0", "-o", single, "-q", "--overwrite")[0] == 0
        assert got.read_bytes() == single.read_bytes(), rel
        r = gguf.GGUFReader(got)
        assert r.fields["general.architecture"].contents() == "flux"
        for t in r.tensors:
            if t.tensor_type == gguf.GGMLQuantizationType.Q8_0:
                want = gguf.quants.quantize(sd[t.name].numpy(), t.tensor_type)
                assert np.array_equal(np.asarray(t.data).reshape(-1).view(np.uint8), want.reshape(-1).view(np.uint8))
    # its own outputs: recognised by their provenance (a killed run's published output is resumed, not redone)
    op = make_operation("convert", {"to": "gguf-q8_0"})
    assert op.owns(made_by_ckpt(out / "a.gguf"), Found(root / "a.safetensors", "a.safetensors", False))
    code, stdout, err = run_ckpt("batch", "convert", root, "--to", "gguf-q8_0", "-o", out)
    assert code == 0 and "0 ok, 2 skipped, 0 failed" in stdout, err
    # beside the inputs: the single command's default names
    code, stdout, err = run_ckpt("batch", "convert", root, "--to", "gguf-q8_0", "--pure", "-q")
    assert code == 0, err
    assert (root / "a-Q8_0.gguf").is_file() and (root / "sub" / "b-Q8_0.gguf").is_file()
    assert {r["operation"] for r in manifest_lines(root / ".ckpt-batch.jsonl")} == {"convert --to gguf-q8_0 --pure"}


def _wan_models():
    """Two tiny Wan transformers."""
    import diffusers

    models = []
    for i in range(2):
        torch.manual_seed(i)
        models.append(diffusers.WanTransformer3DModel(
            patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=128, in_channels=4, out_channels=4,
            text_dim=16, freq_dim=8, ffn_dim=32, num_layers=1))
    return dict(zip(("w1", "deep/w2"), models))


def test_batch_convert_layout_both_ways(tmp_path, run_ckpt):
    """--layout diffusers: each original-layout file becomes a diffusers model folder that diffusers loads with
    no missing or unexpected key; --layout original on folders diffusers saved: one file each, holding the
    family's original tensors."""
    diffusers = pytest.importorskip("diffusers")
    root, dif = tmp_path / "in", tmp_path / "dif"
    models = _wan_models()
    for rel, m in models.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        save_file(original_from_pairs(families.get("wan"), state_dict(m)), root / f"{rel}.safetensors")
    code, stdout, err = run_ckpt("batch", "convert", root, "--layout", "diffusers", "--to", "bf16", "-o", dif, "-q")
    assert code == 0, err
    for rel, m in models.items():
        assert (dif / rel / "config.json").is_file()
        loaded, info = diffusers.WanTransformer3DModel.from_pretrained(dif / rel, output_loading_info=True,
                                                                       torch_dtype=torch.bfloat16)
        assert not info["missing_keys"] and not info["unexpected_keys"], info
        sd = state_dict(m)
        assert all(torch.equal(v, sd[k].bfloat16()) for k, v in loaded.state_dict().items()), rel
    # without -o: the single command's default names beside each input
    code, stdout, err = run_ckpt("batch", "convert", root, "--layout", "diffusers", "-q")
    assert code == 0, err
    assert (root / "w1-diffusers" / "config.json").is_file() and (root / "deep" / "w2-diffusers").is_dir()

    saved, back = tmp_path / "saved", tmp_path / "back"
    for rel, m in models.items():
        m.save_pretrained(saved / rel)
    code, stdout, err = run_ckpt("batch", "convert", saved, "--layout", "original", "-o", back, "-q")
    assert code == 0, err
    for rel, m in models.items():
        want = original_from_pairs(families.get("wan"), state_dict(m))
        got = load_file(back / f"{rel}.safetensors")  # the folder `w1` -> the file `w1.safetensors`
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want), rel


def test_batch_merge_lora_to_gguf_writes_gguf_files(tmp_path, run_ckpt):
    root, out = tmp_path / "in", tmp_path / "out"
    _flux_tree(root)
    lora = kohya_lora(tmp_path / "l.safetensors", {"double_blocks.0.img_attn.proj": (64, 64)})
    code, stdout, err = run_ckpt("batch", "merge-lora", root, "--lora", lora, "--to", "gguf-q8_0", "-o", out, "-q")
    assert code == 0, err
    single = tmp_path / "single.gguf"
    assert run_ckpt("merge-lora", root / "a.safetensors", lora, "--to", "gguf-q8_0", "-o", single, "-q")[0] == 0
    assert (out / "a.gguf").read_bytes() == single.read_bytes()
    assert gguf.GGUFReader(out / "sub" / "b.gguf").fields["general.architecture"].contents() == "flux"


@pytest.mark.parametrize("args, culprit, problem", [
    (["--glob", "zzz*", "-o", "{out}", "--to", "fp16"], "--glob zzz*", "matches no checkpoint under"),
    (["--glob", "zzz*", "--to", "fp16"], "--glob zzz*", "nothing run, nothing written"),
    (["--glob", "zzz*", "--to", "fp16", "--dry-run"], "--glob zzz*", "matches no checkpoint"),
    (["-o", "{out}"], "batch convert", "give --to DTYPE, --layout diffusers|original, or both"),
    (["--to", "gguf-q8_0", "--max-shard-size", "1MB", "-o", "{out}"], "batch convert",
     "split GGUF parts, whose names depend on each model's size"),
    (["--to", "gguf-q8_0", "--layout", "diffusers", "-o", "{out}"], "--layout with --to gguf-q8_0", "layout first"),
    (["--to", "gguf-q4_k_xl", "-o", "{out}"], "--to gguf-q4_k_xl", "unknown GGUF type"),
], ids=["glob-o", "glob-beside", "glob-dry-run", "no-target", "gguf-split", "gguf-layout", "gguf-unknown"])
def test_batch_convert_refusals(tmp_path, run_ckpt, args, culprit, problem):
    root = tmp_path / "in"
    _flux_tree(root)
    args = [a.format(out=tmp_path / "out") for a in args]
    assert_refused(run_ckpt, tmp_path, ["batch", "convert", root, *args], culprit, problem)


@pytest.mark.parametrize("op", [["dequant"], ["inspect"], ["merge-lora", "--lora", "{lora}"]])
def test_glob_matching_nothing_is_refused_for_every_operation(tmp_path, run_ckpt, op):
    root = tmp_path / "in"
    st(root / "a.safetensors")
    lora = kohya_lora(tmp_path / "l.safetensors", {"x": (8, 4)})
    op = [a.format(lora=lora) for a in op]
    assert_refused(run_ckpt, tmp_path, ["batch", *op, root, "--glob", "nothing-*", "-o", tmp_path / "out"]
                   if op[0] != "inspect" else ["batch", *op, root, "--glob", "nothing-*"], "--glob nothing-*",
                   "matches no checkpoint")


def test_glob_matching_only_finished_work_and_an_empty_folder_write_nothing_new(tmp_path, run_ckpt):
    """A glob that matches checkpoints already done is no mistake (they are skipped); a folder with no checkpoint
    at all says so and leaves no output folder or manifest behind."""
    root, out = tmp_path / "in", tmp_path / "out"
    st(root / "a.safetensors")
    assert run_ckpt("batch", "convert", root, "--to", "fp16", "-o", out, "-q")[0] == 0
    code, stdout, err = run_ckpt("batch", "convert", root, "--to", "fp16", "--glob", "a.*", "-o", out)
    assert code == 0 and "0 ok, 1 skipped, 0 failed" in stdout, err
    empty = tmp_path / "empty"
    empty.mkdir()
    code, stdout, err = run_ckpt("batch", "convert", empty, "--to", "fp16", "-o", tmp_path / "out2")
    assert code == 0 and "no checkpoints found" in err and "manifest:" not in stdout, err
    assert not (tmp_path / "out2").exists() and not any(empty.iterdir())
