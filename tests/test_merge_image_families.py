"""merge-lora on Chroma, Z-Image, Lumina 2, HiDream and Qwen-Image, both layouts, against diffusers' own
LoRA loading (the helpers and the method of tests/test_merge_families.py).

Bases: a tiny diffusers model saved with `save_pretrained` (diffusers layout), or its original layout made
from the family's pairs and checked by diffusers' converter. LoRAs: PEFT adapters saved by the pipeline's
`save_lora_weights`, or original-named files (kohya `lora_unet_`, ComfyUI `diffusion_model.`) written here.
Oracle: the pipeline's `lora_state_dict` (which converts non-diffusers namings itself), `load_lora_adapter`,
`fuse_lora`. Where diffusers' LoRA converter hard-codes a release's width (Chroma's 3072 for kohya
`linear1`, Lumina 2's 2304/768 qkv split), it runs with the tiny model's width (`with_constants`).
fp32: rtol 1e-5, atol 1e-6.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from families_util import original_from_pairs, state_dict, tiny_chroma, with_constants
from test_merge_families import _compare, _fused, _peft_lora
from ckpt import families

diffusers = pytest.importorskip("diffusers")
PREFIX = "model.diffusion_model."


def _sfu():
    from diffusers.loaders import single_file_utils

    return single_file_utils


def _original_base(family_id, base_sd, convert, path, prefix=PREFIX):
    """The original layout of a diffusers state dict from the family's pairs, checked by diffusers'
    converter, saved at `path` (ComfyUI's prefix by default)."""
    original = original_from_pairs(families.get(family_id), base_sd)
    back = convert({k: v.clone() for k, v in original.items()})
    assert set(back) == set(base_sd) and all(torch.equal(back[k], base_sd[k]) for k in base_sd)
    save_file({prefix + k: v for k, v in original.items()}, path)
    return original


def _merged_original(out, convert, original, stdout, prefix=PREFIX):
    """The merged original-layout file through diffusers' converter; checks the count merge-lora reports
    (original tensors changed)."""
    merged = {k[len(prefix):]: v for k, v in load_file(out).items()}
    assert set(merged) == set(original)
    changed = sum(not torch.equal(merged[k], original[k]) for k in original)
    assert f"base tensors changed: {changed}" in stdout, stdout
    return convert(merged)


def _lora_pair(name, w, r=4, kohya=True, alpha=None):
    """Random LoRA factors for base weight `w` under module name `name` (kohya down/up or A/B)."""
    down, up = (".lora_down.weight", ".lora_up.weight") if kohya else (".lora_A.weight", ".lora_B.weight")
    out = {name + down: torch.randn(r, w.shape[1]) * 0.1, name + up: torch.randn(w.shape[0], r) * 0.1}
    if alpha is not None:
        out[name + ".alpha"] = torch.tensor(float(alpha))
    return out


# ------------------------------------------------------------------------------------------ Chroma

def _chroma_convert():
    return with_constants(_sfu().convert_chroma_transformer_checkpoint_to_diffusers, {3072: 16})


def test_diffusers_chroma_lora_onto_original_base(tmp_path, run_ckpt):
    """to_q/k/v, add_*_proj, proj_mlp: rows of the fused `qkv` and `linear1`; the approximator's
    `linear_1` is `in_layer`; x/context embedders, proj_out renamed."""
    torch.manual_seed(0)
    model = tiny_chroma()
    base_sd = state_dict(model)
    original = _original_base("chroma", base_sd, _chroma_convert(), tmp_path / "chroma.safetensors")
    targets = ["to_q", "to_k", "to_v", "add_q_proj", "add_v_proj", "proj_mlp", "proj_out", "ff.net.0.proj",
               "linear_1", "x_embedder", "context_embedder", "to_add_out"]
    lora = _peft_lora(model, targets, tmp_path / "lora", diffusers.ChromaPipeline)
    want = _fused(tiny_chroma, base_sd, lora, diffusers.ChromaPipeline, 0.7)

    out = tmp_path / "out.safetensors"
    code, stdout, err = run_ckpt("merge-lora", tmp_path / "chroma.safetensors", lora, "--ratio", "0.7", "-o", out)
    assert code == 0, err
    got = _merged_original(out, _chroma_convert(), original, stdout)
    assert _compare(got, want, base_sd) == 22  # every target module of every block


def test_kohya_chroma_lora_onto_diffusers_folder(tmp_path, run_ckpt, monkeypatch):
    """A kohya/ai-toolkit Chroma LoRA (original names: fused qkv and linear1) on a diffusers folder; oracle:
    diffusers' kohya Flux converter, which ChromaPipeline uses (its linear1 split set to the tiny width).
    Not `img_in`/`txt_in`: that converter names them without `transformer.`, so diffusers drops them."""
    from diffusers.loaders import lora_conversion_utils, lora_pipeline

    monkeypatch.setattr(lora_pipeline, "_convert_kohya_flux_lora_to_diffusers", with_constants(
        lora_conversion_utils._convert_kohya_flux_lora_to_diffusers, {3072: 16, 12288: 64}))
    torch.manual_seed(1)
    model = tiny_chroma()
    base_sd = state_dict(model)
    model.save_pretrained(tmp_path / "chroma")
    original = original_from_pairs(families.get("chroma"), base_sd)
    lora = {}
    for mod in ("double_blocks.0.img_attn.qkv", "double_blocks.0.txt_attn.qkv", "double_blocks.0.img_mlp.0",
                "double_blocks.0.txt_attn.proj", "single_blocks.0.linear1", "single_blocks.1.linear2"):
        lora.update(_lora_pair("lora_unet_" + mod.replace(".", "_"), original[f"{mod}.weight"], alpha=2))
    save_file(lora, tmp_path / "kohya.safetensors")
    want = _fused(tiny_chroma, base_sd, tmp_path / "kohya.safetensors", diffusers.ChromaPipeline, 1.0)

    code, stdout, err = run_ckpt("merge-lora", tmp_path / "chroma", tmp_path / "kohya.safetensors", "-o",
                                 tmp_path / "out", "-q")
    assert code == 0, err
    got = load_file(tmp_path / "out" / "diffusion_pytorch_model.safetensors")
    assert _compare(got, want, base_sd) == 3 + 3 + 1 + 1 + 4 + 1
    assert "6 LoRA modules matched" in stdout


# ----------------------------------------------------------------------------------------- inspect

@pytest.mark.parametrize("family_id", ["chroma", "z_image", "lumina2", "hidream", "qwen_image"])
def test_inspect_reports_family_id_and_layout(tmp_path, run_ckpt, family_id):
    """A diffusers folder is the diffusers layout; a ComfyUI single file is the original layout where the
    family has one, else the diffusers layout (HiDream, Qwen-Image files use diffusers' names)."""
    import families_util

    model = getattr(families_util, f"tiny_{family_id}")()
    model.save_pretrained(tmp_path / "folder")
    sd = state_dict(model)
    fam = families.get(family_id)
    single = original_from_pairs(fam, sd) if fam.pairs else sd
    save_file({PREFIX + k: v for k, v in single.items()}, tmp_path / "single.safetensors")
    seen = {}
    for name in ("folder", "single.safetensors"):
        code, out, err = run_ckpt("inspect", "--json", tmp_path / name)
        assert code == 0, err
        (c,) = json.loads(out)["components"]
        seen[name] = (c["family_id"], c["layout"])
    assert seen["folder"] == (family_id, "diffusers")
    assert seen["single.safetensors"] == (family_id, "original" if fam.pairs else "diffusers")
