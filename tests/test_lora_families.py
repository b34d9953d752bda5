"""`ckpt lora extract` names through the family registry, checked by the loaders of each naming.

- A BFL-layout Flux.1 base with `--format diffusers`: each fused original weight becomes its diffusers
  modules (row slices of its delta: `to_q/k/v`, `proj_mlp`; `norm_out.linear` with its halves swapped).
  Oracle: diffusers' `load_lora_adapter` + `fuse_lora` on the tiny diffusers model holding the base's
  weights gives the tuned model's weights.
- A diffusers-layout Flux.1 folder with `--format kohya`: the diffusers pieces of a fused original
  module are stacked and decomposed together (`lora_unet_double_blocks_0_img_attn_qkv`). Oracle:
  `ckpt merge-lora` of that kohya LoRA into the original-layout base and into the diffusers folder
  gives the tuned weights in both layouts (both layouts made from diffusers' model via the registry's
  pairs, which tests/test_families.py checks against diffusers' converter).
- SD UNets: kohya names SD1 modules by their diffusers names and SDXL modules by their LDM names.

Deltas have exact rank 2 per diffusers weight, so every module comes back to fp32 precision at the
rank used (fused modules: the stacked rank); tolerance atol 2e-5 on O(1) weights.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from lora_helpers import low_rank

diffusers = pytest.importorskip("diffusers")
pytest.importorskip("peft")

from families_util import original_from_pairs, state_dict, tiny_flux1, tiny_unet  # noqa: E402

from ckpt.families import get  # noqa: E402


def _tuned(sd, r=2, skip=()):
    out = {}
    for k, v in sd.items():
        out[k] = v + low_rank(v.shape, r) if v.dim() >= 2 and k.endswith(".weight") and not any(s in k for s in skip) \
            else v.clone()
    return out


def test_bfl_base_with_diffusers_names_loads_in_diffusers(tmp_path, run_ckpt):
    torch.manual_seed(0)
    model = tiny_flux1()
    base = state_dict(model)
    tuned = _tuned(base)
    fam = get("flux1")
    save_file(original_from_pairs(fam, base), tmp_path / "base.safetensors")
    save_file(original_from_pairs(fam, tuned), tmp_path / "tuned.safetensors")
    out = tmp_path / "lora.safetensors"
    code, stdout, err = run_ckpt("lora", "extract", tmp_path / "base.safetensors", tmp_path / "tuned.safetensors",
                                 "-r", 2, "--format", "diffusers", "-o", out, "-q")
    assert code == 0, err
    keys = load_file(out)
    assert "transformer.transformer_blocks.0.attn.to_k.lora_A.weight" in keys
    assert "transformer.single_transformer_blocks.1.proj_mlp.lora_B.weight" in keys
    assert "transformer.norm_out.linear.lora_A.weight" in keys
    fresh = tiny_flux1()
    fresh.load_state_dict(base)
    lora_sd, metadata = diffusers.FluxPipeline.lora_state_dict(str(out), return_lora_metadata=True)
    fresh.load_lora_adapter(lora_sd, prefix="transformer", metadata=metadata)
    fresh.fuse_lora()
    got = {k.replace(".base_layer.", "."): v for k, v in fresh.state_dict().items() if "lora_" not in k}
    for k, v in tuned.items():
        torch.testing.assert_close(got[k], v, rtol=0, atol=2e-5, msg=k)


def test_diffusers_folder_with_kohya_names_fuses_qkv(tmp_path, run_ckpt):
    torch.manual_seed(0)
    model = tiny_flux1()
    model.save_pretrained(tmp_path / "base")
    base = state_dict(model)
    tuned = _tuned(base)
    model.load_state_dict(tuned)
    model.save_pretrained(tmp_path / "tuned")
    out = tmp_path / "lora.safetensors"
    code, stdout, err = run_ckpt("lora", "extract", tmp_path / "base", tmp_path / "tuned", "-r", 8,
                                 "--format", "kohya", "-o", out)
    assert code == 0, err
    names = {k.rsplit(".", 2)[0] if "lora_" in k.rsplit(".", 2)[-2] else k.rsplit(".", 1)[0] for k in load_file(out)}
    assert "lora_unet_double_blocks_0_img_attn_qkv" in names and "lora_unet_single_blocks_1_linear1" in names
    assert "lora_unet_final_layer_adaLN_modulation_1" in names
    assert not any("transformer_blocks" in n or "to_q" in n for n in names)
    rows = {line.split()[0]: line.split()[1] for line in stdout.splitlines() if line.startswith("lora_unet_")}
    assert rows["lora_unet_double_blocks_0_img_attn_qkv"] == "48x16"  # to_q/k/v stacked: one [3H, H] delta
    fam = get("flux1")
    save_file(original_from_pairs(fam, base), tmp_path / "base-bfl.safetensors")
    want_bfl = original_from_pairs(fam, tuned)
    code, _, err = run_ckpt("merge-lora", tmp_path / "base-bfl.safetensors", out, "-o", tmp_path / "m.safetensors", "-q")
    assert code == 0, err
    got = load_file(tmp_path / "m.safetensors")
    for k, v in want_bfl.items():
        torch.testing.assert_close(got[k], v, rtol=0, atol=2e-5, msg=k)
    code, _, err = run_ckpt("merge-lora", tmp_path / "base", out, "-o", tmp_path / "m", "-q")
    assert code == 0, err
    got = load_file(tmp_path / "m" / "diffusion_pytorch_model.safetensors")
    for k, v in tuned.items():
        torch.testing.assert_close(got[k], v, rtol=0, atol=2e-5, msg=k)


@pytest.mark.parametrize("kind,expect,avoid", [("sd1", "lora_unet_down_blocks_0_attentions_0_proj_in", "input_blocks"),
                                               ("sdxl", "lora_unet_input_blocks_4_1_proj_in", "down_blocks")])
def test_sd_unet_kohya_names(tmp_path, run_ckpt, kind, expect, avoid):
    torch.manual_seed(0)
    base = state_dict(tiny_unet(kind))
    tuned = _tuned(base, skip=("norm",))
    fam = get("sd1")
    pre = "model.diffusion_model."
    save_file({pre + k: v for k, v in original_from_pairs(fam, base).items()}, tmp_path / "base.safetensors")
    want = {pre + k: v for k, v in original_from_pairs(fam, tuned).items()}
    save_file(want, tmp_path / "tuned.safetensors")
    out = tmp_path / "lora.safetensors"
    code, stdout, err = run_ckpt("lora", "extract", tmp_path / "base.safetensors", tmp_path / "tuned.safetensors",
                                 "-r", 2, "-o", out, "-q")
    assert code == 0, err
    keys = list(load_file(out))
    assert expect + ".lora_down.weight" in keys and not any(avoid in k for k in keys)
    code, _, err = run_ckpt("merge-lora", tmp_path / "base.safetensors", out, "-o", tmp_path / "m.safetensors", "-q")
    assert code == 0, err
    got = load_file(tmp_path / "m.safetensors")
    for k, v in want.items():
        torch.testing.assert_close(got[k], v, rtol=0, atol=2e-5, msg=k)
