"""`ckpt lora convert` on every diffusion family of the registry that has both layouts.

For each family a tiny diffusers model gets a PEFT LoRA on every Linear layer (`save_lora_adapter`:
diffusers' own file), fused by diffusers itself (`fuse_lora`): that is the oracle. The LoRA is then
converted and each output checked against it:

- `--format kohya` (with the original-layout base: fused q/k/v, swapped adaLN halves...) and
  `--format comfy` (no base): `ckpt merge-lora` onto the original-layout base gives the fused model
  in the original layout (the family's pairs, themselves checked against diffusers' converters in
  tests/test_families*.py);
- the kohya file back to `--format diffusers`: diffusers' `load_lora_adapter` (with the
  `lora_adapter_metadata` the file carries) + `fuse_lora` gives the fused model again;
- `--format peft`: an adapter folder that `ckpt merge-lora` merges onto the diffusers base.

SD1/SDXL UNets need `--base` wherever the names cross layouts (LDM `input_blocks.4.0` <->
`down_blocks.1.resnets.0`) or are kohya-flattened: the block numbering follows from the UNet's whole
structure, which the LoRA's modules alone do not show; without it the command refuses (checked).
HiDream and Qwen-Image have one naming (no original <-> diffusers pairs), so kohya's flattened names
cannot be dotted again from the registry: `--base` there too (refusal checked).

fp32 throughout: atol 2e-5 on O(1) weights (summation order only).
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

diffusers = pytest.importorskip("diffusers")
peft = pytest.importorskip("peft")

from families_util import (original_from_pairs, state_dict, tiny_chroma, tiny_flux2, tiny_hidream,  # noqa: E402
                           tiny_hunyuan_video, tiny_hunyuan_video15, tiny_ltx2, tiny_ltx_video, tiny_lumina2,
                           tiny_qwen_image, tiny_sd3, tiny_unet, tiny_wan, tiny_z_image)

from ckpt.families import get  # noqa: E402

TOL = dict(rtol=0, atol=2e-5)

# families whose original layout fuses q/k/v (kohya: rank 3r there, 4r for HunyuanVideo's q/k/v/mlp linear1)
FUSED = ("flux2", "sd3", "hunyuan_video", "hunyuan_video15", "chroma", "lumina2")

CASES = {
    "flux2": tiny_flux2,
    "sd3": tiny_sd3,
    "wan": lambda: tiny_wan("i2v"),
    "hunyuan_video": tiny_hunyuan_video,
    "hunyuan_video15": tiny_hunyuan_video15,
    "ltx_video": tiny_ltx_video,
    "ltx2": tiny_ltx2,
    "chroma": tiny_chroma,
    "z_image": tiny_z_image,
    "lumina2": tiny_lumina2,
    "hidream": tiny_hidream,
    "qwen_image": tiny_qwen_image,
    "sd1": tiny_unet,
    "sdxl": lambda: tiny_unet("sdxl"),
}


def _linears(model) -> list[str]:
    return [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]


def _plain(model) -> dict:
    return {k.replace(".base_layer.", "."): v.detach().clone() for k, v in model.state_dict().items()
            if "lora_" not in k}


def _diffusers_fused(make, base, path, prefix) -> dict:
    """diffusers' answer for a converted diffusers file: its tensors and lora_adapter_metadata loaded
    by `load_lora_adapter` into a fresh model, then fused."""
    with safe_open(str(path), "pt") as f:
        metadata = json.loads(f.metadata()["lora_adapter_metadata"])
    model = make()
    model.load_state_dict(base)
    model.load_lora_adapter(load_file(path), prefix=prefix, metadata=metadata)
    model.fuse_lora()
    return _plain(model)


def _merged(run_ckpt, base, lora, out) -> dict:
    code, _, err = run_ckpt("merge-lora", base, lora, "-o", out, "-q")
    assert code == 0, err
    return load_file(out)


def _same(got: dict, want: dict) -> None:
    assert set(got) == set(want)
    for k, v in want.items():
        torch.testing.assert_close(got[k], v, **TOL, msg=k)


@pytest.mark.parametrize("family_id", list(CASES))
def test_every_format_merges_like_diffusers_fuses(tmp_path, run_ckpt, family_id):
    make = CASES[family_id]
    fam = get("sd1" if family_id == "sdxl" else family_id)
    torch.manual_seed(0)
    model = make()
    base = state_dict(model)
    model.add_adapter(peft.LoraConfig(r=2, lora_alpha=3, init_lora_weights=False, target_modules=_linears(model)))
    model.save_lora_adapter(tmp_path / "dlora")
    src = tmp_path / "dlora" / "pytorch_lora_weights.safetensors"
    model.fuse_lora()
    want = _plain(model)
    def original(sd):  # HiDream, Qwen-Image: one naming, the diffusers one
        return original_from_pairs(fam, sd) if "original" in fam.layouts else sd

    want_original = original(want)
    save_file(original(base), tmp_path / "original.safetensors")
    save_file(base, tmp_path / "diffusers.safetensors")

    kohya = tmp_path / "kohya.safetensors"
    code, _, err = run_ckpt("lora", "convert", src, "--format", "kohya", "--base", tmp_path / "original.safetensors",
                            "-o", kohya, "-q")
    assert code == 0, err
    sd = load_file(kohya)
    assert all(k.startswith("lora_unet_") for k in sd)
    ranks = {v.shape[0] for k, v in sd.items() if k.endswith(".lora_down.weight")}
    assert 2 in ranks and (max(ranks) > 2) == (family_id in FUSED)  # pieces re-fused block-diagonally
    _same(_merged(run_ckpt, tmp_path / "original.safetensors", kohya, tmp_path / "m1.safetensors"), want_original)

    comfy = tmp_path / "comfy.safetensors"
    unet = family_id in ("sd1", "sdxl")
    if unet:  # a UNet's LDM block numbers follow from its whole structure, which its LoRA alone lacks
        code, _, err = run_ckpt("lora", "convert", src, "--format", "comfy", "-o", comfy)
        assert code == 2 and "--base" in err and not comfy.exists()
    code, _, err = run_ckpt("lora", "convert", src, "--format", "comfy", "-o", comfy, "-q",
                            *(("--base", tmp_path / "original.safetensors") if unet else ()))
    assert code == 0, err
    assert all(k.startswith("diffusion_model.") for k in load_file(comfy))
    _same(_merged(run_ckpt, tmp_path / "original.safetensors", comfy, tmp_path / "m2.safetensors"), want_original)

    back = tmp_path / "back.safetensors"
    flat_needs_base = unet or "original" not in fam.layouts
    if flat_needs_base:  # kohya's flattened names: a UNet's blocks, a one-naming family's paths: only a base tells
        code, _, err = run_ckpt("lora", "convert", kohya, "--format", "diffusers", "-o", back)
        assert code == 2 and "--base" in err and not back.exists()
    code, _, err = run_ckpt("lora", "convert", kohya, "--format", "diffusers", "-o", back, "-q",  # else keys alone
                            *(("--base", tmp_path / "original.safetensors") if flat_needs_base else ()))
    assert code == 0, err
    assert not any(k.endswith(".alpha") for k in load_file(back))
    prefix = "unet" if unet else "transformer"
    assert all(k.startswith(prefix + ".") for k in load_file(back))
    _same(_diffusers_fused(make, base, back, prefix), want)

    folder = tmp_path / "peft"
    code, _, err = run_ckpt("lora", "convert", src, "--format", "peft", "-o", folder, "-q")
    assert code == 0, err
    assert (folder / "adapter_config.json").is_file()
    _same(_merged(run_ckpt, tmp_path / "diffusers.safetensors", folder, tmp_path / "m3.safetensors"), want)
