"""Qwen-Image 2.1 (ckpt/families/qwen_image2.py) against diffusers and ComfyUI.

- Correspondence: a tiny QwenImage21Transformer2DModel's state dict (values unique per element) put into
  ComfyUI's layout from the family's pairs; diffusers' `convert_qwen_image21_transformer_checkpoint_to_diffusers`
  gives the model's state dict back bit for bit (bare and under `model.diffusion_model.`).
- Recognition of both layouts (and kohya-flattened LoRA names), the config class, told from Qwen-Image (1).
- `convert --layout diffusers` loaded strictly by `from_pretrained`, and back to the same bytes.
- merge-lora onto both layouts against diffusers' own LoRA loading (`QwenImage21Pipeline.lora_state_dict`,
  `load_lora_adapter`, `fuse_lora`): a PEFT adapter (diffusers names, `gate_layer`/`proj` landing on the rows
  of the fused `gate_up`), a kohya LoRA, and a ComfyUI LoRA on the fused `gate_up`, whose oracle is the same
  LoRA cut into its gate and up halves as ComfyUI's `comfy/lora.py` cuts it (rows [0, h) gate, [h, 2h) up).
- The quantizing writer's high-precision rule (comfy_quant int8: block weights byte for byte comfy-kitchen's,
  the input/output layers, the timestep embedder and the shared modulation kept), and the refusals.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from families_util import (assert_detected_both_layouts, diffusers_from_pairs, merge_onto, original_from_pairs, shapes,
                           state_dict, tiny_qwen_image, unique_values)
from helpers.layout_round_trips import diffusers_folder_to_original_and_round_trip, original_file_to_diffusers_folder
from helpers.refusals import assert_refused
from helpers.tiny_qwen_image21 import tiny_qwen_image21
from ckpt import families
from ckpt.families import DIFFUSERS, ORIGINAL

diffusers = pytest.importorskip("diffusers")


def convert():
    from diffusers.loaders.single_file_utils import convert_qwen_image21_transformer_checkpoint_to_diffusers as fn

    return fn


@pytest.fixture(scope="module")
def case():
    torch.manual_seed(0)
    model = tiny_qwen_image21()
    sd = state_dict(model)
    original = original_from_pairs(families.get("qwen_image21"), sd)
    fn = convert()
    back = fn({k: v.clone() for k, v in original.items()})
    assert set(back) == set(sd) and all(torch.equal(back[k], sd[k]) for k in sd)
    return model, sd, original, fn


# ------------------------------------------------------------------------------------- correspondence

@pytest.mark.parametrize("prefix", ["", "model.diffusion_model."])
def test_pairs_are_diffusers_converter_bit_for_bit(prefix):
    fam = families.get("qwen_image21")
    sd = unique_values(state_dict(tiny_qwen_image21(head=8)))
    original = original_from_pairs(fam, sd)
    assert len(original) == len(sd) - 2  # gate_layer + proj -> one gate_up per block
    h = sd["transformer_blocks.0.img_mlp.proj.weight"].shape[0]
    assert original["transformer_blocks.1.img_mlp.gate_up.weight"].shape[0] == 2 * h
    back = convert()({prefix + k: v.clone() for k, v in original.items()})
    assert set(back) == set(sd) and all(torch.equal(back[k], sd[k]) for k in sd)
    again = diffusers_from_pairs(fam, original)
    assert set(again) == set(sd) and all(torch.equal(again[k], sd[k]) for k in sd)


def test_both_layouts_lora_names_and_config_class_are_recognised():
    fam = families.get("qwen_image21")
    sd = shapes(state_dict(tiny_qwen_image21(head=8)))
    original = shapes(original_from_pairs(fam, unique_values(state_dict(tiny_qwen_image21(head=8)))))
    assert_detected_both_layouts("qwen_image21", original, sd)
    # a LoRA on attention and the text projection only: the same names in both layouts, read as diffusers
    lora = [f"transformer_blocks.{i}.attn.to_{x}" for i in range(2) for x in "qkv"] + ["txt_in.in_layer"]
    assert (families.detect(lora).family_id, families.detect(lora).layout) == ("qwen_image21", DIFFUSERS)
    # Qwen-Image (1) stays itself, its model and its LoRAs (musubi/kohya names included)
    q1 = shapes(state_dict(tiny_qwen_image()))
    assert families.detect(q1, q1).family_id == "qwen_image"
    q1_lora = [k.rsplit(".", 1)[0].replace(".", "_") for k in q1 if k.endswith(".weight")]
    assert families.detect(q1_lora).family_id == "qwen_image"
    assert families.from_config({"_class_name": "QwenImage21Transformer2DModel"}) is fam
    assert families.from_config({"_class_name": "QwenImageTransformer2DModel"}).family_id == "qwen_image"


# ------------------------------------------------------------------------------------------ layouts

@pytest.mark.parametrize("prefix", ["", "model.diffusion_model."])
def test_original_file_to_diffusers_folder(tmp_path, run_ckpt, case, prefix):
    original_file_to_diffusers_folder(tmp_path, run_ckpt, case, prefix)


def test_diffusers_folder_to_original_and_round_trip(tmp_path, run_ckpt, case):
    diffusers_folder_to_original_and_round_trip(tmp_path, run_ckpt, case)


# ------------------------------------------------------------------------------------------- merges

def _lora_pair(w_rows, w_cols, r, g):
    return torch.randn(r, w_cols, generator=g) * 0.1, torch.randn(w_rows, r, generator=g) * 0.1


def _merged_both_ways(tmp_path, run_ckpt, case, lora_file, want, changed):
    """merge-lora of `lora_file` into the diffusers folder and into the original file: both give diffusers'
    fused weights (the original one through diffusers' converter)."""
    from helpers.merge_compare import compare

    model, sd, original, to_diffusers = case
    for layout in (DIFFUSERS, ORIGINAL):
        got = merge_onto(run_ckpt, tmp_path, model, original, layout, lora_file, to_diffusers, keys_kept=True)
        assert compare(got, want, sd) == changed


def test_peft_lora_onto_both_layouts(tmp_path, run_ckpt, case):
    """A diffusers-format LoRA (the pipeline's `save_lora_weights`): `gate_layer` and `proj` merge into the two
    halves of the original file's `gate_up`."""
    from helpers.merge_compare import diffusers_fused, peft_lora_file

    model, sd, _, _ = case
    lora = peft_lora_file(tiny_qwen_image21(), ["to_q", "to_out.0", "gate_layer", "img_mlp.proj", "in_layer",
                                                "modulation.1"], tmp_path / "peft", diffusers.QwenImage21Pipeline)
    want = diffusers_fused(tiny_qwen_image21, sd, lora, diffusers.QwenImage21Pipeline, 1.0)
    _merged_both_ways(tmp_path, run_ckpt, case, lora, want, 2 * 4 + 2)


def test_kohya_lora_onto_both_layouts(tmp_path, run_ckpt, case):
    """A kohya/musubi LoRA (diffusers names flattened, alpha): diffusers' own Qwen converter reads it."""
    from helpers.merge_compare import diffusers_fused

    _, sd, _, _ = case
    g = torch.Generator().manual_seed(5)
    lora, r = {}, 4
    for mod in ["transformer_blocks.0.attn.to_k", "transformer_blocks.1.img_mlp.proj",
                "transformer_blocks.1.img_mlp.out", "img_in", "proj_out"]:
        w = sd[f"{mod}.weight"]
        name = "lora_unet_" + mod.replace(".", "_")
        lora[f"{name}.lora_down.weight"], lora[f"{name}.lora_up.weight"] = _lora_pair(*w.shape, r, g)
        lora[f"{name}.alpha"] = torch.tensor(2.0)
    save_file(lora, tmp_path / "kohya.safetensors")
    want = diffusers_fused(tiny_qwen_image21, sd, tmp_path / "kohya.safetensors", diffusers.QwenImage21Pipeline, 1.0)
    _merged_both_ways(tmp_path, run_ckpt, case, tmp_path / "kohya.safetensors", want, 5)


def test_comfyui_lora_on_fused_gate_up_onto_both_layouts(tmp_path, run_ckpt, case):
    """A ComfyUI LoRA on its own module names, the fused `gate_up` included; oracle: the same LoRA with
    `gate_up`'s up-factor rows cut as comfy/lora.py cuts them, read by diffusers."""
    from helpers.merge_compare import diffusers_fused

    _, sd, original, _ = case
    g = torch.Generator().manual_seed(7)
    comfy, split, r = {}, {}, 4
    for mod in ["transformer_blocks.0.img_mlp.gate_up", "transformer_blocks.1.img_mlp.gate_up",
                "transformer_blocks.1.attn.to_v", "txt_in.out_layer", "modulation.1"]:
        a, b = _lora_pair(*original[f"{mod}.weight"].shape, r, g)
        comfy[f"diffusion_model.{mod}.lora_A.weight"], comfy[f"diffusion_model.{mod}.lora_B.weight"] = a, b
        if mod.endswith("gate_up"):
            h = b.shape[0] // 2
            for half, rows in (("gate_layer", b[:h]), ("proj", b[h:])):
                name = mod.replace("gate_up", half)
                split[f"diffusion_model.{name}.lora_A.weight"] = a.clone()
                split[f"diffusion_model.{name}.lora_B.weight"] = rows.contiguous()
        else:
            split[f"diffusion_model.{mod}.lora_A.weight"], split[f"diffusion_model.{mod}.lora_B.weight"] = a, b
    save_file(comfy, tmp_path / "comfy.safetensors")
    save_file(split, tmp_path / "split.safetensors")
    want = diffusers_fused(tiny_qwen_image21, sd, tmp_path / "split.safetensors", diffusers.QwenImage21Pipeline, 1.0)
    _merged_both_ways(tmp_path, run_ckpt, case, tmp_path / "comfy.safetensors", want, 4 + 3)


# ----------------------------------------------------------------------------------- quantized writes

def test_comfy_quant_keeps_the_high_precision_layers(tmp_path, run_ckpt, case):
    from helpers.comfy_ref import ck_quantize, same_bytes

    _, _, original, _ = case
    src = {k: v.to(torch.bfloat16) for k, v in original.items()}
    save_file({"model.diffusion_model." + k: v for k, v in src.items()}, tmp_path / "m.safetensors")
    out = tmp_path / "q.safetensors"
    code, _, err = run_ckpt("convert", tmp_path / "m.safetensors", "--to", "int8", "-o", out)
    assert code == 0, err
    assert "Qwen-Image 2.1" in err and "high-precision layers kept" in err
    with safe_open(out, "pt") as f:
        layers = json.loads(f.metadata()["_quantization_metadata"])["layers"]
    blocks = {k[:-len(".weight")] for k, v in src.items()
              if k.startswith("transformer_blocks.") and v.dim() == 2}
    assert {k[len("model.diffusion_model."):] for k in layers} == blocks
    got = load_file(out)
    for layer in ("transformer_blocks.0.img_mlp.gate_up", "transformer_blocks.1.attn.to_q"):
        for suffix, t in ck_quantize("int8_tensorwise", src[f"{layer}.weight"])[2].items():
            assert same_bytes(got[f"model.diffusion_model.{layer}.weight{suffix}"], t), (layer, suffix)
    for kept in ("img_in.weight", "txt_in.in_layer.weight", "modulation.1.weight", "norm_out.linear.weight",
                 "proj_out.weight", "time_text_embed.timestep_embedder.linear_2.weight"):
        assert same_bytes(got["model.diffusion_model." + kept], src[kept]), kept


# ------------------------------------------------------------------------------------------ refusals

def test_bad_inputs_are_refused(tmp_path, run_ckpt, case):
    model, sd, original, _ = case
    # ComfyUI-GGUF names no Qwen-Image 2.1 architecture
    save_file(original, tmp_path / "o.safetensors")
    assert_refused(run_ckpt, tmp_path, ["convert", tmp_path / "o.safetensors", "--to", "gguf-q8_0", "-o",
                                        tmp_path / "o.gguf"], tmp_path / "o.safetensors",
                   "not a diffusion model ComfyUI-GGUF knows")
    # a fused gate_up with an odd number of rows has no gate and up halves
    odd = dict(original)
    odd["transformer_blocks.1.img_mlp.gate_up.weight"] = original["transformer_blocks.1.img_mlp.gate_up.weight"][:-1]
    save_file(odd, tmp_path / "odd.safetensors")
    assert_refused(run_ckpt, tmp_path, ["convert", tmp_path / "odd.safetensors", "--layout", "diffusers", "-o",
                                        tmp_path / "x"], "transformer_blocks.1.img_mlp.gate_up.weight",
                   "767 rows")
    # gate and up halves of different sizes cannot be one gate_up
    model.save_pretrained(tmp_path / "dif")
    part = load_file(tmp_path / "dif" / "diffusion_pytorch_model.safetensors")
    part["transformer_blocks.0.img_mlp.gate_layer.weight"] = part["transformer_blocks.0.img_mlp.gate_layer.weight"][:-2]
    save_file(part, tmp_path / "dif" / "diffusion_pytorch_model.safetensors")
    assert_refused(run_ckpt, tmp_path, ["convert", tmp_path / "dif", "--layout", "original", "-o",
                                        tmp_path / "y.safetensors"],
                   "transformer_blocks.0.img_mlp.gate_up.weight", "img_mlp.gate_layer.weight")
    # heads other than 128: the rope axes are unknown, the config needs --config
    small = original_from_pairs(families.get("qwen_image21"), state_dict(tiny_qwen_image21(head=8)))
    save_file(small, tmp_path / "s.safetensors")
    assert_refused(run_ckpt, tmp_path, ["convert", tmp_path / "s.safetensors", "--layout", "diffusers", "-o",
                                        tmp_path / "z"], tmp_path / "s.safetensors",
                   "head size of 128, not 8")
