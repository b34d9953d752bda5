"""`ckpt lora resize|merge --format F`: inputs converted to naming F first, then resized or merged.

Oracles: `ckpt merge-lora` of the inputs themselves (itself checked against diffusers and PEFT), and
Eckart-Young for the cut: a kohya `img_attn.qkv` made of diffusers to_q/k/v is resized as one module
(rank <= R), to the best rank-R approximation of its block-diagonally fused delta.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from lora_helpers import close, kohya_modules, rnd, truncated

pytest.importorskip("diffusers")
pytest.importorskip("peft")

from helpers.lora_flux import TOL, flux_with_lora, merge_with_ckpt  # noqa: E402


def test_resize_to_kohya_cuts_the_fused_modules(tmp_path, run_ckpt):
    base, want, want_bfl = flux_with_lora(tmp_path, targets=("to_q", "to_k", "to_v", "proj_out"))
    src = tmp_path / "dlora" / "pytorch_lora_weights.safetensors"
    bfl = tmp_path / "bfl.safetensors"
    full = tmp_path / "full.safetensors"
    code, stdout, err = run_ckpt("lora", "resize", src, "--rank", 64, "--format", "kohya", "--base", bfl, "-o", full)
    assert code == 0, err
    assert "converted to the kohya naming" in stdout
    got = merge_with_ckpt(run_ckpt, bfl, full, tmp_path / "m.safetensors")  # rank cap above every rank: exact
    for k, v in want_bfl.items():
        torch.testing.assert_close(got[k], v, **TOL, msg=k)
    fused = kohya_modules(full)
    cut = tmp_path / "cut.safetensors"
    code, _, err = run_ckpt("lora", "resize", src, "--rank", 2, "--format", "kohya", "--base", bfl, "-o", cut, "-q")
    assert code == 0, err
    mods = kohya_modules(cut)
    assert set(mods) == set(fused) and all(d.shape[0] <= 2 for _, d, _ in mods.values())
    name = "lora_unet_double_blocks_0_img_attn_qkv"
    assert fused[name][1].shape[0] == 9  # q, k, v at rank 3, block-diagonal
    up, down, scale = fused[name]
    cu, cd, cs = mods[name]
    assert close(cu @ cd * cs, truncated(up @ down * scale, 2))


def test_merge_of_two_namings_equals_applying_both(tmp_path, run_ckpt):
    base, want, want_bfl = flux_with_lora(tmp_path, targets=("to_q", "to_k", "to_v", "proj_out"))
    src = tmp_path / "dlora" / "pytorch_lora_weights.safetensors"
    bfl = tmp_path / "bfl.safetensors"
    H = 16
    kohya = {"lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight": rnd(2, H),
             "lora_unet_double_blocks_0_img_attn_qkv.lora_up.weight": rnd(3 * H, 2, scale=0.1),
             "lora_unet_double_blocks_0_img_attn_qkv.alpha": torch.tensor(1.0),
             "lora_unet_single_blocks_1_linear2.lora_down.weight": rnd(2, load_file(bfl)["single_blocks.1.linear2.weight"].shape[1]),
             "lora_unet_single_blocks_1_linear2.lora_up.weight": rnd(H, 2, scale=0.1)}
    save_file(kohya, tmp_path / "k.safetensors")
    code, _, err = run_ckpt("lora", "merge", src, tmp_path / "k.safetensors", "-o", tmp_path / "x.safetensors")
    assert code == 2 and "--format" in err and not (tmp_path / "x.safetensors").exists()
    for fmt, out in (("kohya", tmp_path / "both.safetensors"), ("peft", tmp_path / "both")):
        code, stdout, err = run_ckpt("lora", "merge", src, tmp_path / "k.safetensors", "--ratio", 0.5, "--ratio", 2,
                                     "--format", fmt, "--base", bfl, "-o", out)
        assert code == 0, err
        assert not [p for p in tmp_path.iterdir() if ".ckpt-tmp-" in p.name]  # scratch folder gone
        got = merge_with_ckpt(run_ckpt, bfl, out, tmp_path / f"m-{fmt}.safetensors")
        code, _, err = run_ckpt("merge-lora", bfl, src, tmp_path / "k.safetensors", "--ratio", 0.5, "--ratio", 2,
                                "-o", tmp_path / f"ref-{fmt}.safetensors", "-q")
        assert code == 0, err
        ref = load_file(tmp_path / f"ref-{fmt}.safetensors")
        for k, v in ref.items():
            torch.testing.assert_close(got[k], v, **TOL, msg=k)


def test_dry_run_and_bad_format_write_nothing(tmp_path, run_ckpt):
    flux_with_lora(tmp_path)
    src = tmp_path / "dlora" / "pytorch_lora_weights.safetensors"
    before = sorted(p.name for p in tmp_path.iterdir())
    code, stdout, err = run_ckpt("lora", "resize", src, "--rank", 1, "--format", "kohya", "--base",
                                 tmp_path / "bfl.safetensors", "-o", tmp_path / "o.safetensors", "--dry-run")
    assert code == 0, err
    assert "would convert 1 input" in stdout
    # add_k_proj alone: the fused txt_attn.qkv's size needs the base: the conversion's own message
    code, _, err = run_ckpt("lora", "resize", src, "--rank", 1, "--format", "kohya", "-o", tmp_path / "o.safetensors")
    assert code == 2 and err.startswith("error: ") and "--base" in err and len(err.strip().splitlines()) == 1
    code, _, err = run_ckpt("lora", "merge", src, src, "--format", "onnx", "-o", tmp_path / "o.safetensors")
    assert code == 2 and "--format" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == before
