"""merge-lora on the new families, both layouts, against diffusers' own LoRA loading.

Bases: a tiny diffusers model saved with `save_pretrained` (diffusers layout), or its original layout
made from the family's pairs and checked by diffusers' converter (`convert_*_to_diffusers` gives the
model's state dict back bit for bit). LoRAs: PEFT adapters saved by the pipeline's `save_lora_weights`
(diffusers naming, alpha in `lora_adapter_metadata`), or original-named files (musubi-tuner kohya,
ComfyUI/ai-toolkit `diffusion_model.` lora_A/B) written here. Oracle: a fresh model, the pipeline's
`lora_state_dict` (which converts original namings itself), `load_lora_adapter` and
`fuse_lora(lora_scale=ratio)`; merged original-layout outputs are compared after diffusers' converter.
fp32 throughout: rtol 1e-5, atol 1e-6 (only the summation order differs). Diffusers-format LoRAs onto each
family's original-layout base are one table: tests/test_merge_diffusers_loras.py.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from families_util import original_from_pairs, state_dict, tiny_flux2, tiny_wan
from ckpt import families

diffusers = pytest.importorskip("diffusers")
peft = pytest.importorskip("peft")
from helpers.merge_compare import compare, diffusers_fused  # noqa: E402


def _sfu():
    from diffusers.loaders import single_file_utils

    return single_file_utils


# ---------------------------------------------------------------------------------------- Wan

def test_musubi_wan_lora_onto_diffusers_folder(tmp_path, run_ckpt):
    """A musubi-tuner (kohya) Wan LoRA, original module names, on a diffusers `save_pretrained` folder."""
    torch.manual_seed(1)
    model = tiny_wan("t2v")
    base_sd = state_dict(model)
    model.save_pretrained(tmp_path / "wan")
    original = original_from_pairs(families.get("wan"), base_sd)
    r, alpha = 4, 2.0
    lora = {}
    for i in range(2):
        mods = [f"blocks.{i}.{a}.{p}" for a in ("self_attn", "cross_attn") for p in "qkvo"]
        for mod in mods + [f"blocks.{i}.ffn.0", f"blocks.{i}.ffn.2"]:
            w = original[f"{mod}.weight"]
            name = "lora_unet_" + mod.replace(".", "_")
            lora[f"{name}.lora_down.weight"] = torch.randn(r, w.shape[1]) * 0.1
            lora[f"{name}.lora_up.weight"] = torch.randn(w.shape[0], r) * 0.1
            lora[f"{name}.alpha"] = torch.tensor(alpha)
    save_file(lora, tmp_path / "musubi.safetensors")
    want = diffusers_fused(lambda: tiny_wan("t2v"), base_sd, tmp_path / "musubi.safetensors", diffusers.WanPipeline, 1.0)

    code, stdout, err = run_ckpt("merge-lora", tmp_path / "wan", tmp_path / "musubi.safetensors", "-o",
                                 tmp_path / "out", "-q")
    assert code == 0, err
    got = load_file(tmp_path / "out" / "diffusion_pytorch_model.safetensors")
    assert compare(got, want, base_sd) == 2 * 10
    assert "20 LoRA modules matched" in stdout


# -------------------------------------------------------------------------------------- Flux.2

def test_bfl_named_flux2_lora_onto_diffusers_folder(tmp_path, run_ckpt):
    """An ai-toolkit/ComfyUI Flux.2 LoRA (`diffusion_model.double_blocks.0.img_attn.qkv.lora_A`, fused qkv)
    on a diffusers folder: the fused delta lands on to_q/to_k/to_v row by row."""
    torch.manual_seed(4)
    model = tiny_flux2()
    base_sd = state_dict(model)
    model.save_pretrained(tmp_path / "flux2")
    original = original_from_pairs(families.get("flux2"), base_sd)
    r = 4
    lora = {}
    for mod in ("double_blocks.0.img_attn.qkv", "double_blocks.0.txt_attn.qkv", "double_blocks.0.img_mlp.0",
                "double_blocks.0.txt_attn.proj", "single_blocks.1.linear1", "single_blocks.0.linear2", "img_in"):
        w = original[f"{mod}.weight"]
        lora[f"diffusion_model.{mod}.lora_A.weight"] = torch.randn(r, w.shape[1]) * 0.1
        lora[f"diffusion_model.{mod}.lora_B.weight"] = torch.randn(w.shape[0], r) * 0.1
    save_file(lora, tmp_path / "l.safetensors")
    want = diffusers_fused(tiny_flux2, base_sd, tmp_path / "l.safetensors", diffusers.Flux2Pipeline, 1.0)

    code, stdout, err = run_ckpt("merge-lora", tmp_path / "flux2", tmp_path / "l.safetensors", "-o",
                                 tmp_path / "out", "-q")
    assert code == 0, err
    got = load_file(tmp_path / "out" / "diffusion_pytorch_model.safetensors")
    assert compare(got, want, base_sd) == 6 + 5
    assert "7 LoRA modules matched" in stdout


def test_unmatched_error_names_both_families(tmp_path, run_ckpt):
    """A Wan LoRA on a Flux.2 base: refused, saying what each side is."""
    model = tiny_flux2()
    model.save_pretrained(tmp_path / "flux2")
    lora = {"lora_unet_blocks_0_self_attn_q.lora_down.weight": torch.zeros(2, 16),
            "lora_unet_blocks_0_self_attn_q.lora_up.weight": torch.zeros(16, 2),
            "lora_unet_blocks_0_cross_attn_k.lora_down.weight": torch.zeros(2, 16),
            "lora_unet_blocks_0_cross_attn_k.lora_up.weight": torch.zeros(16, 2)}
    save_file(lora, tmp_path / "wan_lora.safetensors")
    code, _, err = run_ckpt("merge-lora", tmp_path / "flux2", tmp_path / "wan_lora.safetensors", "-o", tmp_path / "o")
    assert code == 2 and "Traceback" not in err
    assert "kohya LoRA for wan (original names); base is flux2 (diffusers layout)" in err, err
    assert not (tmp_path / "o").exists()


def test_inspect_reports_family_id_and_layout(tmp_path, run_ckpt):
    import json

    model = tiny_wan("t2v")
    model.save_pretrained(tmp_path / "wan")
    original = original_from_pairs(families.get("wan"), state_dict(model))
    save_file({"model.diffusion_model." + k: v for k, v in original.items()}, tmp_path / "wan.safetensors")
    save_file({"lora_unet_blocks_0_self_attn_q.lora_down.weight": torch.zeros(2, 16),
               "lora_unet_blocks_0_self_attn_q.lora_up.weight": torch.zeros(16, 2)}, tmp_path / "l.safetensors")
    seen = {}
    for name in ("wan", "wan.safetensors", "l.safetensors"):
        code, out, err = run_ckpt("inspect", "--json", tmp_path / name)
        assert code == 0, err
        (c,) = json.loads(out)["components"]
        seen[name] = (c["family_id"], c["layout"], c["family"])
    assert seen["wan"][:2] == ("wan", "diffusers") and "WanTransformer3DModel" in seen["wan"][2]
    assert seen["wan.safetensors"][:2] == ("wan", "original") and "(original)" in seen["wan.safetensors"][2]
    assert seen["l.safetensors"][:2] == ("wan", "original") and seen["l.safetensors"][2].startswith("LoRA for Wan")
