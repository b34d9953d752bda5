"""Ideogram 4 (`ckpt/families/ideogram4.py`), for which diffusers 0.42 ships no single-file converter.

What is checked: the table covers the diffusers model class exactly both ways (every tensor of a tiny
Ideogram4Transformer2DModel has one reference name, and back); its attention pieces are what diffusers' LoRA
converter (`_convert_non_diffusers_ideogram4_lora_to_diffusers`) makes of the reference names (`attention.qkv`
-> thirds on `to_q/to_k/to_v`, `attention.o` -> `to_out.0`, the rest one to one); both layouts and kohya-style
names are recognised and told from Z-Image and Lumina 2 (which share `layers.N.attention.qkv`); convert
--layout (from_pretrained strict, and back to the same bytes); merge-lora of PEFT and ai-toolkit LoRAs onto
both layouts against the pipeline's loader + `fuse_lora`; the int8 writer's high-precision layers."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from families_util import (assert_detected_both_layouts, convert_both_ways, diffusers_from_pairs, merge_onto,
                           original_from_pairs, shapes, state_dict, tiny_lumina2, tiny_z_image, unique_values)
from helpers.refusals import assert_refused
from helpers.tiny_ideogram4 import tiny_ideogram4
from ckpt import families
from ckpt.families import DIFFUSERS, ORIGINAL

diffusers = pytest.importorskip("diffusers")
peft = pytest.importorskip("peft")
from helpers.merge_compare import compare, diffusers_fused, peft_lora_file  # noqa: E402

FAM = families.get("ideogram4")
LORA_MODULES = ("attention.qkv", "attention.o", "feed_forward.w1", "feed_forward.w2", "feed_forward.w3",
                "adaln_modulation")



def _reference(seed=0):
    torch.manual_seed(seed)
    model = tiny_ideogram4()
    sd = state_dict(model)
    return model, sd, original_from_pairs(FAM, sd)


def test_table_covers_the_model_class_both_ways():
    sd = unique_values(state_dict(tiny_ideogram4()))
    original = original_from_pairs(FAM, sd)
    assert len(original) == len(sd) - 2 * 2  # per block: to_q/k/v fused into one qkv
    assert original["layers.1.attention.qkv.weight"].shape == (3 * 256, 256)
    back = diffusers_from_pairs(FAM, original)
    assert set(back) == set(sd) and all(torch.equal(back[k], sd[k]) for k in sd)


def test_attention_pieces_are_diffusers_lora_converters():
    """A reference-named LoRA on every block linear, through diffusers' converter: the delta it gives each
    diffusers weight is the delta of that weight's rows in the table's reference tensor."""
    from diffusers.loaders.lora_conversion_utils import _convert_non_diffusers_ideogram4_lora_to_diffusers

    _, sd, original = _reference()
    torch.manual_seed(2)
    lora = {}
    for i in range(2):
        for m in LORA_MODULES:
            w = original[f"layers.{i}.{m}.weight"]
            lora[f"diffusion_model.layers.{i}.{m}.lora_A.weight"] = torch.randn(2, w.shape[1], dtype=torch.float64)
            lora[f"diffusion_model.layers.{i}.{m}.lora_B.weight"] = torch.randn(w.shape[0], 2, dtype=torch.float64)
    converted = _convert_non_diffusers_ideogram4_lora_to_diffusers(dict(lora))
    pairs = {p.diffusers: p for p in FAM.pairs(shapes(sd), DIFFUSERS)}
    seen = 0
    for key in converted:
        if not key.endswith(".lora_A.weight"):
            continue
        mod = key.removeprefix("transformer.").removesuffix(".lora_A.weight")
        p = pairs[mod + ".weight"]
        got = converted[f"transformer.{mod}.lora_B.weight"] @ converted[key]
        src = p.original.removesuffix(".weight")
        delta = lora[f"diffusion_model.{src}.lora_B.weight"] @ lora[f"diffusion_model.{src}.lora_A.weight"]
        assert torch.equal(got, delta[p.rows[0]:p.rows[1]] if p.rows else delta), mod
        seen += 1
    assert seen == 2 * (len(LORA_MODULES) + 2)


def test_both_layouts_and_kohya_names_are_recognised_and_told_from_z_image():
    sd = shapes(state_dict(tiny_ideogram4()))
    original = shapes(original_from_pairs(FAM, unique_values(state_dict(tiny_ideogram4()))))
    assert_detected_both_layouts("ideogram4", original, sd)
    lora = [f"layers_{i}_{m.replace('.', '_')}" for i in range(2) for m in LORA_MODULES]
    assert (families.detect(lora).family_id, families.detect(lora).layout) == ("ideogram4", ORIGINAL)
    for make, fid in ((tiny_z_image, "z_image"), (tiny_lumina2, "lumina2")):
        fam = families.get(fid)
        z = state_dict(make())
        for keys in (shapes(z), shapes(original_from_pairs(fam, unique_values(z)))):
            assert families.detect(keys, keys).family_id == fid
    assert families.from_config({"_class_name": "Ideogram4Transformer2DModel"}) is FAM


def test_convert_layout_both_ways(tmp_path, run_ckpt):
    model, sd, original = _reference()
    cfg = convert_both_ways(run_ckpt, tmp_path, diffusers.Ideogram4Transformer2DModel, sd, original)
    assert {k: cfg[k] for k in ("mrope_section", "rope_theta", "llm_features_dim")} == {
        "mrope_section": list(model.config.mrope_section), "rope_theta": model.config.rope_theta,
        "llm_features_dim": 32}


def _ai_toolkit_lora(original: dict, r=4, alpha=2.0) -> dict:
    """ai-toolkit's naming as diffusers' converter reads it: `diffusion_model.` + reference names, kohya factors."""
    torch.manual_seed(5)
    lora = {}
    for i in range(2):
        for m in LORA_MODULES:
            w = original[f"layers.{i}.{m}.weight"]
            name = f"diffusion_model.layers.{i}.{m}"
            lora[f"{name}.lora_down.weight"] = torch.randn(r, w.shape[1]) * 0.1
            lora[f"{name}.lora_up.weight"] = torch.randn(w.shape[0], r) * 0.1
            lora[f"{name}.alpha"] = torch.tensor(alpha)
    return lora


@pytest.mark.parametrize("naming", ["peft", "ai-toolkit"])
@pytest.mark.parametrize("base_layout", [DIFFUSERS, ORIGINAL])
def test_merge_lora_onto_both_layouts_as_diffusers_fuses_it(tmp_path, run_ckpt, naming, base_layout):
    model, sd, original = _reference(seed=1)
    if naming == "peft":
        lora_file = peft_lora_file(tiny_ideogram4(), ["to_q", "to_v", "to_out.0", "w2", "adaln_modulation",
                                                      "llm_cond_proj"], tmp_path / "peft", diffusers.Ideogram4Pipeline)
        n = 2 * 5 + 1 + 1  # per block 5; llm_cond_proj; the final layer's adaln_modulation
    else:
        lora_file = tmp_path / "l.safetensors"
        save_file(_ai_toolkit_lora(original), lora_file)
        n = 2 * (len(LORA_MODULES) + 2)
    want = diffusers_fused(tiny_ideogram4, sd, lora_file, diffusers.Ideogram4Pipeline, 1.0)
    got = merge_onto(run_ckpt, tmp_path, model, original, base_layout, lora_file,
                     lambda merged: diffusers_from_pairs(FAM, merged))
    assert compare(got, want, sd) == n


def test_int8_keeps_the_input_output_and_conditioning_layers(tmp_path, run_ckpt):
    _, sd, original = _reference()
    save_file({"model.diffusion_model." + k: v.to(torch.bfloat16) for k, v in original.items()}, tmp_path / "i.safetensors")
    code, _, err = run_ckpt("convert", tmp_path / "i.safetensors", "--to", "int8", "-o", tmp_path / "q.safetensors", "-q")
    assert code == 0, err
    got = load_file(tmp_path / "q.safetensors")
    quantized = {k[:-len(".comfy_quant")].removeprefix("model.diffusion_model.") + ".weight"
                 for k in got if k.endswith(".comfy_quant")}
    want = {f"layers.{i}.{m}.weight" for i in range(2) for m in LORA_MODULES}
    assert quantized == want, quantized ^ want
    for k in ("input_proj.weight", "llm_cond_proj.weight", "adaln_proj.weight", "final_layer.linear.weight"):
        assert got["model.diffusion_model." + k].dtype == torch.bfloat16, k


def test_a_qkv_that_is_not_three_equal_parts_is_refused(tmp_path, run_ckpt):
    _, _, original = _reference()
    bad = dict(original)
    bad["layers.0.attention.qkv.weight"] = torch.zeros(3 * 256 + 1, 256)
    save_file(bad, tmp_path / "bad.safetensors")
    assert_refused(run_ckpt, tmp_path, ("convert", tmp_path / "bad.safetensors", "--layout", "diffusers", "-o",
                                        tmp_path / "d"), "layers.0.attention.qkv.weight", "769 rows")
