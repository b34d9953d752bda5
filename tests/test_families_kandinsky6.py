"""Kandinsky 6 (ckpt/families/kandinsky6.py), for which diffusers ships no single-file converter.

The oracle of the original layout is ComfyUI's own rename of a diffusers Kandinsky 6 checkpoint to the
names its model class holds (`comfy/ldm/kandinsky6/detection.py`, `_DIFFUSERS_PREFIXES` and
`_DIFFUSERS_INNER_NAMES`, Comfy-Org/ComfyUI master), written out below as data:
- the family's table covers the model class exactly, both ways, and is that rename, tensor for tensor;
- both layouts, kohya-flattened LoRA names and the config class are recognised; Kandinsky 5 is not this family;
- `convert --layout diffusers` is loaded strictly by `Kandinsky6Transformer3DModel.from_pretrained` with the
  tiny model's config, and `--layout original` gives ComfyUI's names back, byte-identical round trip;
- merge-lora onto both layouts against diffusers/PEFT (`KandinskyLoraLoaderMixin.lora_state_dict`,
  `load_lora_adapter`, `fuse_lora`): a PEFT adapter, and ComfyUI/kohya LoRAs on the native names, whose
  oracle is the same LoRA under ComfyUI's diffusers names;
- the quantizing writer's high-precision rule, and the refusals.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from families_util import (assert_detected_both_layouts, diffusers_from_pairs, merge_onto, original_from_pairs, shapes,
                           state_dict, unique_values)
from helpers.layout_round_trips import diffusers_folder_to_original_and_round_trip, original_file_to_diffusers_folder
from helpers.refusals import assert_refused
from helpers.tiny_kandinsky6 import tiny_kandinsky6
from ckpt import families
from ckpt.families import DIFFUSERS, ORIGINAL

diffusers = pytest.importorskip("diffusers")

# ComfyUI comfy/ldm/kandinsky6/detection.py: diffusers name -> native name (prefixes at the start, then the
# inner names anywhere), the rename its loader applies to a diffusers-layout file.
COMFY_PREFIXES = (("visual_transformer_blocks.", "visual_blocks."), ("audio_out_layer.", "audio_outLayer."))
COMFY_INNER = ((".timestep_embedder.linear_1.", ".in_layer."), (".timestep_embedder.linear_2.", ".out_layer."),
               (".video_dec_block.", ".videoT."), (".audio_dec_block.", ".audioT."),
               (".feed_forward.net.0.proj.", ".feed_forward.in_layer."),
               (".feed_forward.net.2.", ".feed_forward.out_layer."),
               (".attn.", ".self_attention."))


def comfy_name(key: str) -> str:
    for source, target in COMFY_PREFIXES:
        if key.startswith(source):
            key = target + key[len(source):]
            break
    for source, target in COMFY_INNER:
        key = key.replace(source, target)
    return key


def comfy_to_diffusers(model_keys):
    """The original -> diffusers direction of ComfyUI's rename, for the keys of one diffusers model."""
    inverse = {comfy_name(k): k for k in model_keys}
    assert len(inverse) == len(list(model_keys))
    return lambda sd: {inverse[k]: v for k, v in sd.items()}


@pytest.fixture(scope="module")
def case():
    torch.manual_seed(0)
    model = tiny_kandinsky6()
    sd = state_dict(model)
    original = original_from_pairs(families.get("kandinsky6"), sd)
    assert original.keys() == {comfy_name(k) for k in sd}
    return model, sd, original, comfy_to_diffusers(sd)


# ------------------------------------------------------------------------------------- correspondence

@pytest.mark.parametrize("token_types,cross_gates", [(2, True), (0, False)])
def test_table_is_comfyuis_rename_both_ways(token_types, cross_gates):
    fam = families.get("kandinsky6")
    sd = unique_values(state_dict(tiny_kandinsky6(token_types, cross_gates)))
    original = original_from_pairs(fam, sd)
    want = {comfy_name(k): v for k, v in sd.items()}
    assert set(original) == set(want) and all(torch.equal(original[k], want[k]) for k in want)
    back = diffusers_from_pairs(fam, original)
    assert set(back) == set(sd) and all(torch.equal(back[k], sd[k]) for k in sd)


def test_both_layouts_lora_names_and_config_class_are_recognised(case):
    _, sd, original, _ = case
    assert_detected_both_layouts("kandinsky6", shapes(original), shapes(sd))
    fam = families.get("kandinsky6")
    assert families.from_config({"_class_name": "Kandinsky6Transformer3DModel"}) is fam
    k5 = shapes(state_dict(diffusers.Kandinsky5Transformer3DModel(
        in_visual_dim=4, out_visual_dim=4, in_text_dim=12, in_text_dim2=8, time_dim=16, model_dim=32, ff_dim=48,
        num_text_blocks=1, num_visual_blocks=1, axes_dims=(4, 6, 6))))
    m = families.detect(k5, k5)
    assert m is None or m.family_id != "kandinsky6"


# ------------------------------------------------------------------------------------------ layouts

@pytest.mark.parametrize("prefix", ["", "model.diffusion_model."])
def test_original_file_to_diffusers_folder(tmp_path, run_ckpt, case, prefix):
    original_file_to_diffusers_folder(tmp_path, run_ckpt, case, prefix)


def test_diffusers_folder_to_original_and_round_trip(tmp_path, run_ckpt, case):
    diffusers_folder_to_original_and_round_trip(tmp_path, run_ckpt, case)


# ------------------------------------------------------------------------------------------- merges

def _merged_both_ways(tmp_path, run_ckpt, case, lora_file, want, changed):
    from helpers.merge_compare import compare

    model, sd, original, to_diffusers = case
    for layout in (DIFFUSERS, ORIGINAL):
        got = merge_onto(run_ckpt, tmp_path, model, original, layout, lora_file, to_diffusers, keys_kept=True)
        assert compare(got, want, sd) == changed


def _mixin():
    from diffusers.loaders.lora_pipeline import KandinskyLoraLoaderMixin

    return KandinskyLoraLoaderMixin


def test_peft_lora_onto_both_layouts(tmp_path, run_ckpt, case):
    from helpers.merge_compare import diffusers_fused, peft_lora_file

    _, sd, _, _ = case
    targets = ["to_query", "to_value", "feed_forward.net.0.proj", "va_modulation.out_layer", "linear_1"]
    lora = peft_lora_file(tiny_kandinsky6(), targets, tmp_path / "peft", _mixin())
    want = diffusers_fused(tiny_kandinsky6, sd, lora, _mixin(), 1.0)
    # to_query and to_value of 6 attentions a visual block (2 blocks) and of 1 a text block (2 streams); 2
    # feed-forwards a visual block, 1 a text block; va_modulation of each visual block; 2 time embeddings' linear_1
    _merged_both_ways(tmp_path, run_ckpt, case, lora, want, 2 * (2 * 6 + 2) + (2 * 2 + 2) + 2 + 2)


@pytest.mark.parametrize("naming", ["comfy", "kohya"])
def test_comfyui_and_kohya_loras_onto_both_layouts(tmp_path, run_ckpt, case, naming):
    """Original-named LoRAs as ComfyUI maps them (`diffusion_model.` + its module path, `lora_unet_` + that
    path flattened); oracle: the same factors under ComfyUI's diffusers names, read by diffusers."""
    from helpers.merge_compare import diffusers_fused

    _, sd, original, _ = case
    native = {comfy_name(k)[:-len(".weight")]: k[:-len(".weight")] for k in sd if k.endswith(".weight")}
    g = torch.Generator().manual_seed(11)
    lora, oracle, r = {}, {}, 4
    for mod in ("visual_blocks.1.videoT.self_attention.to_key", "visual_blocks.0.audioT.feed_forward.out_layer",
                "visual_blocks.0.av_cross_attention.out_layer",
                "audio_text_transformer_blocks.0.self_attention.to_query",
                "video_time_embeddings.out_layer", "audio_outLayer.out_layer"):
        rows, cols = original[f"{mod}.weight"].shape
        a, b = torch.randn(r, cols, generator=g) * 0.1, torch.randn(rows, r, generator=g) * 0.1
        if naming == "comfy":
            lora[f"diffusion_model.{mod}.lora_A.weight"], lora[f"diffusion_model.{mod}.lora_B.weight"] = a, b
        else:
            name = "lora_unet_" + mod.replace(".", "_")
            lora[f"{name}.lora_down.weight"], lora[f"{name}.lora_up.weight"] = a, b
        oracle[f"transformer.{native[mod]}.lora_A.weight"] = a.clone()
        oracle[f"transformer.{native[mod]}.lora_B.weight"] = b.clone()
    save_file(lora, tmp_path / "l.safetensors")
    save_file(oracle, tmp_path / "oracle.safetensors")
    want = diffusers_fused(tiny_kandinsky6, sd, tmp_path / "oracle.safetensors", _mixin(), 1.0)
    _merged_both_ways(tmp_path, run_ckpt, case, tmp_path / "l.safetensors", want, 6)


# ----------------------------------------------------------------------------------- quantized writes

def test_comfy_quant_keeps_the_high_precision_layers(tmp_path, run_ckpt, case):
    from helpers.comfy_ref import ck_quantize, same_bytes

    _, _, original, _ = case
    src = {k: v.to(torch.bfloat16) for k, v in original.items()}
    save_file(src, tmp_path / "m.safetensors")
    out = tmp_path / "q.safetensors"
    code, _, err = run_ckpt("convert", tmp_path / "m.safetensors", "--to", "int8", "-o", out)
    assert code == 0, err
    assert "Kandinsky 6" in err and "high-precision layers kept" in err
    with safe_open(out, "pt") as f:
        layers = set(json.loads(f.metadata()["_quantization_metadata"])["layers"])
    # every attention and feed-forward matrix of the blocks, nothing else (no modulation, no input/output layer)
    want = {k[:-len(".weight")] for k, v in src.items() if v.dim() == 2 and "_blocks." in k
            and "modulation" not in k and ("attention." in k or "feed_forward." in k)}
    assert layers == want and len(want) == 2 * (6 * 4 + 2 * 2) + 2 * (4 + 2)  # 6 attentions, 2 FFs a block
    got = load_file(out)
    for layer in ("visual_blocks.0.va_cross_attention.to_key", "video_text_transformer_blocks.0.feed_forward.in_layer"):
        for suffix, t in ck_quantize("int8_tensorwise", src[f"{layer}.weight"])[2].items():
            assert same_bytes(got[f"{layer}.weight{suffix}"], t), (layer, suffix)
    for kept in ("visual_embeddings.in_layer.weight", "out_layer.out_layer.weight", "audio_outLayer.out_layer.weight",
                 "visual_blocks.1.videoT.visual_modulation.out_layer.weight",
                 "visual_blocks.0.av_modulation.out_layer.weight",
                 "audio_text_transformer_blocks.0.text_modulation.out_layer.weight",
                 "audio_time_embeddings.in_layer.weight"):
        assert same_bytes(got[kept], src[kept]), kept


# ------------------------------------------------------------------------------------------ refusals

def test_bad_inputs_are_refused(tmp_path, run_ckpt, case):
    _, _, original, _ = case
    save_file(original, tmp_path / "o.safetensors")
    assert_refused(run_ckpt, tmp_path, ["convert", tmp_path / "o.safetensors", "--to", "gguf-q8_0", "-o",
                                        tmp_path / "o.gguf"], tmp_path / "o.safetensors",
                   "not a diffusion model ComfyUI-GGUF knows")
    # heads other than the releases' 128 and 64: the rope axes are unknown, the config needs --config
    small = diffusers.Kandinsky6Transformer3DModel(
        in_visual_dim=4, out_visual_dim=4, in_text_dim=12, in_text_dim2=8, time_dim=16, model_dim=32, ff_dim=48,
        num_text_blocks=1, num_visual_blocks=1, axes_dims=(4, 6, 6), in_audio_dim=6, out_audio_dim=6, model_dim_a=16,
        time_dim_a=16, ff_dim_a=24, axes_dims_a=(2, 3, 3), cross_gates=True)
    save_file(original_from_pairs(families.get("kandinsky6"), state_dict(small)), tmp_path / "s.safetensors")
    assert_refused(run_ckpt, tmp_path, ["convert", tmp_path / "s.safetensors", "--layout", "diffusers", "-o",
                                        tmp_path / "x"], tmp_path / "s.safetensors", "not 16 (video) and 8 (audio)")
    # a video input projection that is no (2C + 1) channels of patches (no visual conditioning)
    bad = dict(original)
    bad["visual_embeddings.in_layer.weight"] = torch.zeros(128, 4 * 4)
    save_file(bad, tmp_path / "b.safetensors")
    assert_refused(run_ckpt, tmp_path, ["convert", tmp_path / "b.safetensors", "--layout", "diffusers", "-o",
                                        tmp_path / "y"], tmp_path / "b.safetensors", "(2C + 1)")
    # a native checkpoint missing a tensor the config needs
    short = {k: v for k, v in original.items() if not k.startswith("audio_embeddings.in_layer.")}
    save_file(short, tmp_path / "m.safetensors")
    assert_refused(run_ckpt, tmp_path, ["convert", tmp_path / "m.safetensors", "--layout", "diffusers", "-o",
                                        tmp_path / "z"], tmp_path / "m.safetensors", "audio_embeddings.in_layer.weight")
