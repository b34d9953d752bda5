"""Krea 2 (`ckpt/families/krea2.py`) against diffusers 0.42: its single-file converter
(`convert_krea2_transformer_checkpoint_to_diffusers`) for the correspondence, bit for bit, including the one
reshape (a block's flattened `mod.lin` is the [6, w] `scale_shift_table`); `from_pretrained` (strict) for
`convert --layout diffusers`; the pipeline's LoRA loader (which converts the reference and ai-toolkit namings
itself) + `fuse_lora` for merge-lora on both layouts; the int8 writer for the high-precision rule."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from families_util import (assert_detected_both_layouts, convert_both_ways, diffusers_from_pairs, merge_onto,
                           original_from_pairs, shapes, state_dict, unique_values)
from helpers.refusals import assert_refused
from helpers.tiny_krea2 import tiny_krea2
from ckpt import families
from ckpt.families import DIFFUSERS, ORIGINAL

diffusers = pytest.importorskip("diffusers")
peft = pytest.importorskip("peft")
from helpers.merge_compare import compare, diffusers_fused, peft_lora_file  # noqa: E402

FAM = families.get("krea2")
BLOCK_LINEARS = ("attn.wq", "attn.wk", "attn.wv", "attn.wo", "attn.gate", "mlp.gate", "mlp.up", "mlp.down")



def _converter(original: dict) -> dict:
    from diffusers.loaders.single_file_utils import convert_krea2_transformer_checkpoint_to_diffusers

    return convert_krea2_transformer_checkpoint_to_diffusers({k: v.clone() for k, v in original.items()})


def _reference(seed=0):
    """(model, its state dict, the reference layout made from the table; the converter gives the model back)."""
    torch.manual_seed(seed)
    model = tiny_krea2()
    sd = state_dict(model)
    original = original_from_pairs(FAM, sd)
    back = _converter(original)
    assert set(back) == set(sd) and all(torch.equal(back[k], sd[k]) for k in sd)
    return model, sd, original


def test_correspondence_is_diffusers_converter_bit_for_bit():
    sd = unique_values(state_dict(tiny_krea2()))
    original = original_from_pairs(FAM, sd)
    assert len(original) == len(sd)  # nothing fused, nothing one-sided
    assert original["blocks.1.mod.lin"].shape == (6 * 32,) and sd["transformer_blocks.1.scale_shift_table"].shape == (6, 32)
    assert original["last.modulation.lin"].shape == (2, 32)
    back = _converter(original)
    assert set(back) == set(sd) and all(torch.equal(back[k], sd[k]) for k in sd)
    ours = diffusers_from_pairs(FAM, original)
    assert set(ours) == set(sd) and all(torch.equal(ours[k], sd[k]) for k in sd)


def test_both_layouts_lora_names_and_config_class_are_recognised():
    sd = shapes(state_dict(tiny_krea2()))
    original = shapes(original_from_pairs(FAM, unique_values(state_dict(tiny_krea2()))))
    assert_detected_both_layouts("krea2", original, sd)
    # a LoRA on the blocks' linears only, as trainers target them
    lora = [f"blocks.{i}.{m}" for i in range(2) for m in BLOCK_LINEARS]
    assert (families.detect(lora).family_id, families.detect(lora).layout) == ("krea2", ORIGINAL)
    assert families.from_config({"_class_name": "Krea2Transformer2DModel"}) is FAM


def test_derived_config_is_the_models(tmp_path):
    model = tiny_krea2()
    cfg = FAM.diffusers_config(shapes(state_dict(model)))
    want = {k: list(v) if isinstance(v, tuple) else v for k, v in model.config.items() if not k.startswith("_")}
    assert {k: cfg[k] for k in want} == want


def test_convert_layout_both_ways(tmp_path, run_ckpt):
    _, sd, original = _reference()
    cfg = convert_both_ways(run_ckpt, tmp_path, diffusers.Krea2Transformer2DModel, sd, original)
    assert cfg["_class_name"] == "Krea2Transformer2DModel"


def _original_lora(original: dict, prefix: str, r=4) -> dict:
    torch.manual_seed(5)
    lora = {}
    mods = [f"blocks.{i}.{m}" for i in range(2) for m in BLOCK_LINEARS]
    mods += ["txtfusion.layerwise_blocks.0.attn.wq", "txtfusion.refiner_blocks.0.mlp.down", "first", "tproj.1",
             "txtmlp.1", "last.linear", "txtfusion.projector"]
    for mod in mods:
        w = original[f"{mod}.weight"]
        lora[f"{prefix}{mod}.lora_A.weight"] = torch.randn(r, w.shape[1]) * 0.1
        lora[f"{prefix}{mod}.lora_B.weight"] = torch.randn(w.shape[0], r) * 0.1
    return lora


@pytest.mark.parametrize("naming", ["peft", "comfyui", "ai-toolkit"])
@pytest.mark.parametrize("base_layout", [DIFFUSERS, ORIGINAL])
def test_merge_lora_onto_both_layouts_as_diffusers_fuses_it(tmp_path, run_ckpt, naming, base_layout):
    model, sd, original = _reference(seed=1)
    if naming == "peft":
        lora_file = peft_lora_file(tiny_krea2(), ["to_q", "to_k", "to_gate", "to_out.0", "ff.up", "ff.down",
                                                  "img_in", "time_mod_proj", "projector"],
                                   tmp_path / "peft", diffusers.Krea2Pipeline)
        n = 5 * 6 + 3  # 4 attention + 2 ff linears in 2 blocks and 3 text-fusion blocks; img_in, time_mod_proj, projector
    else:
        lora_file = tmp_path / "l.safetensors"
        save_file(_original_lora(original, "diffusion_model." if naming == "comfyui" else "base_model.model."), lora_file)
        n = 2 * 8 + 7
    want = diffusers_fused(tiny_krea2, sd, lora_file, diffusers.Krea2Pipeline, 1.0)
    got = merge_onto(run_ckpt, tmp_path, model, original, base_layout, lora_file, _converter)
    changed = compare(got, want, sd)
    assert changed == n, changed


def test_int8_keeps_what_the_comfy_org_release_keeps(tmp_path, run_ckpt):
    """Only the blocks' linears are quantized (as in `krea2_turbo_int8_convrot`), in either layout."""
    model, sd, original = _reference()
    save_file({"model.diffusion_model." + k: v.to(torch.bfloat16) for k, v in original.items()}, tmp_path / "k.safetensors")
    model.to(torch.bfloat16).save_pretrained(tmp_path / "d")
    for src, out, inner in ((tmp_path / "k.safetensors", tmp_path / "q.safetensors", original),
                            (tmp_path / "d", tmp_path / "qd", sd)):
        code, _, err = run_ckpt("convert", src, "--to", "int8", "-o", out, "-q")
        assert code == 0, err
        got = load_file(out if out.suffix else out / "diffusion_pytorch_model.safetensors")
        quantized = {k[:-len(".comfy_quant")].removeprefix("model.diffusion_model.") + ".weight"
                     for k in got if k.endswith(".comfy_quant")}
        trunk = "blocks." if inner is original else "transformer_blocks."
        want = {k for k, v in inner.items() if k.startswith(trunk) and v.dim() == 2 and k.endswith(".weight")}
        assert quantized == want, quantized ^ want
        assert len(want) == 2 * 8


def test_a_modulation_table_that_is_not_six_rows_is_refused(tmp_path, run_ckpt):
    _, _, original = _reference()
    bad = dict(original)
    bad["blocks.0.mod.lin"] = torch.zeros(6 * 32 + 1)
    save_file(bad, tmp_path / "bad.safetensors")
    assert_refused(run_ckpt, tmp_path, ("convert", tmp_path / "bad.safetensors", "--layout", "diffusers", "-o",
                                        tmp_path / "d"), "blocks.0.mod.lin", "cannot view [193] as six rows")
