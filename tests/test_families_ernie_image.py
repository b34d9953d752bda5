"""ERNIE-Image (ckpt/families/ernie_image.py) against diffusers 0.42's ErnieImageTransformer2DModel.

One naming: diffusers' `convert_ernie_image_transformer_checkpoint_to_diffusers` only strips ComfyUI's
`model.diffusion_model.` prefix, so the single file and the model folder differ in their container alone.
- the converter gives the tiny model's state dict back from the prefixed single file (the oracle of the identity);
- detection of the names, kohya-flattened LoRA names and the config class, told from a Llama-style language
  model (`layers.N.mlp.gate_proj`) and Z-Image (`layers.N.attention.`);
- `convert --layout diffusers` loaded strictly by `from_pretrained` (config values the model's own),
  `--layout original` back to the same bytes;
- merge-lora of a diffusers/PEFT LoRA and of an ai-toolkit/ComfyUI (`diffusion_model.`) LoRA onto the single
  file and the folder against ErnieImageLoraLoaderMixin + `load_lora_adapter` + `fuse_lora`;
- `convert --to int8`: the family's high-precision layers stay as they are;
- refusal: a head size whose rope axes no release has (no config.json derivable) without `--config`.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from families_util import assert_needs_config, merge_onto, shapes, state_dict, tiny_z_image
from helpers.layout_round_trips import diffusers_folder_to_original_and_round_trip, original_file_to_diffusers_folder
from helpers.tiny_ernie_image import tiny_ernie_image as tiny
from ckpt import families
from ckpt.families import DIFFUSERS, ORIGINAL

diffusers = pytest.importorskip("diffusers")
pytest.importorskip("peft")
from diffusers.loaders.lora_pipeline import ErnieImageLoraLoaderMixin as ERNIE  # noqa: E402

from helpers.merge_compare import compare, diffusers_fused, peft_lora_file  # noqa: E402

PRE = "model.diffusion_model."


def convert(sd):
    from diffusers.loaders.single_file_utils import convert_ernie_image_transformer_checkpoint_to_diffusers as fn

    return fn({(k if k.startswith(PRE) else PRE + k): v for k, v in sd.items()})


def _randomized(model):
    """The model with every tensor random (final_linear and adaLN_modulation start at zero)."""
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return model


def test_names_are_diffusers_and_the_converter_only_strips_the_prefix():
    sd = state_dict(tiny())
    back = convert({PRE + k: v.clone() for k, v in sd.items()})
    assert set(back) == set(sd) and all(torch.equal(back[k], sd[k]) for k in sd)
    fam = families.get("ernie_image")
    assert fam.pairs is None and set(fam.layouts) == {DIFFUSERS}


def test_detection_kohya_names_config_class_and_look_alikes():
    sd = shapes(state_dict(tiny()))
    m = families.detect(sd, sd)
    assert (m.family_id, m.layout) == ("ernie_image", DIFFUSERS), m
    flat = [k.rsplit(".", 1)[0].replace(".", "_") for k in sd if k.endswith(".weight") and len(sd[k]) == 2]
    assert families.detect(flat).family_id == "ernie_image"
    peft = [f"layers.{i}.{m}" for i in range(2) for m in ("self_attention.to_q", "self_attention.to_v", "mlp.up_proj")]
    assert families.detect(peft).family_id == "ernie_image"
    assert families.from_config({"_class_name": "ErnieImageTransformer2DModel"}) is families.get("ernie_image")
    llm = [f"model.layers.{i}.{m}.weight" for i in range(2) for m in
           ("self_attn.q_proj", "self_attn.k_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")]
    assert families.detect(llm).family_id == "hf_causal_lm"
    z = shapes(state_dict(tiny_z_image()))
    assert families.detect(z, z).family_id == "z_image"


@pytest.fixture(scope="module")
def case():
    torch.manual_seed(0)
    model = _randomized(tiny(head=128, hidden=128))
    sd = state_dict(model)
    return model, sd, dict(sd), convert


@pytest.mark.parametrize("prefix", ["", PRE])
def test_single_file_to_diffusers_folder(tmp_path, run_ckpt, case, prefix):
    original_file_to_diffusers_folder(tmp_path, run_ckpt, case, prefix)


def test_diffusers_folder_to_single_file_and_round_trip(tmp_path, run_ckpt, case):
    diffusers_folder_to_original_and_round_trip(tmp_path, run_ckpt, case)


def test_head_size_without_release_rope_needs_config(tmp_path, run_ckpt):
    model = tiny()
    save_file({PRE + k: v for k, v in state_dict(model).items()}, tmp_path / "e.safetensors")
    assert_needs_config(run_ckpt, tmp_path, model, tmp_path / "e.safetensors",
                        "rope axes are known for an attention head size of 128, not 16); pass --config REF")


# ------------------------------------------------------------------------------------------ merge-lora

@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ernie")
    model = _randomized(tiny())
    sd = state_dict(model)
    save_file({PRE + k: v for k, v in sd.items()}, tmp / "single.safetensors")
    return model, sd, tmp


def _merge_both(tmp_path, run_ckpt, bases, lora_file, ratio, changed):
    model, sd, _ = bases
    want = diffusers_fused(tiny, sd, lora_file, ERNIE, ratio)
    for layout in (DIFFUSERS, ORIGINAL):  # the single file holds the diffusers names under PRE
        got = merge_onto(run_ckpt, tmp_path, model, sd, layout, lora_file, convert, "--ratio", ratio)
        assert compare(got, want, sd) == changed


def test_diffusers_peft_lora_onto_both(tmp_path, run_ckpt, bases):
    targets = ["to_q", "to_k", "to_v", "to_out.0", "gate_proj", "up_proj", "linear_fc2", "text_proj",
               "adaLN_modulation.1"]
    lora_file = peft_lora_file(tiny(), targets, tmp_path / "peft", ERNIE)
    _merge_both(tmp_path, run_ckpt, bases, lora_file, 0.8, 2 * 7 + 2)


def test_ai_toolkit_comfy_lora_onto_both(tmp_path, run_ckpt, bases):
    _, sd, _ = bases
    g = torch.Generator().manual_seed(4)
    lora = {}
    for mod in [f"layers.{i}.{m}" for i in range(2) for m in ("self_attention.to_q", "self_attention.to_out.0",
                                                              "mlp.gate_proj", "mlp.linear_fc2")] + ["final_linear"]:
        rows, cols = sd[f"{mod}.weight"].shape
        lora[f"diffusion_model.{mod}.lora_A.weight"] = torch.randn(4, cols, generator=g) * 0.1
        lora[f"diffusion_model.{mod}.lora_B.weight"] = torch.randn(rows, 4, generator=g) * 0.1
    save_file(lora, tmp_path / "l.safetensors")
    _merge_both(tmp_path, run_ckpt, bases, tmp_path / "l.safetensors", 1.0, 2 * 4 + 1)


# --------------------------------------------------------------------------------- high precision

def test_int8_keeps_the_family_high_precision_layers(tmp_path, run_ckpt, bases):
    _, _, tmp = bases
    code, _, err = run_ckpt("convert", tmp / "single.safetensors", "--to", "int8", "-o", tmp_path / "q.safetensors")
    assert code == 0, err
    assert "ERNIE-Image, diffusers layout: the family's high-precision layers kept" in err
    q, plain = load_file(tmp_path / "q.safetensors"), load_file(tmp / "single.safetensors")
    quantized = {k[: -len(".comfy_quant")] for k in q if k.endswith(".comfy_quant")}
    assert quantized == {k[: -len(".weight")] for k, v in plain.items()
                         if v.dim() == 2 and k.startswith(PRE + "layers.")}
    for k in ("text_proj", "adaLN_modulation.1", "final_norm.linear", "final_linear", "time_embedding.linear_1"):
        assert torch.equal(q[f"{PRE}{k}.weight"], plain[f"{PRE}{k}.weight"]), k
