"""`ckpt lora convert` against the loaders of each naming.

Oracles: diffusers (`load_lora_adapter` + `fuse_lora` of a converted diffusers file), PEFT
(`PeftModel.from_pretrained` + `merge_and_unload` of a converted adapter folder), and `ckpt merge-lora`
(itself checked against diffusers and PEFT in tests/test_merge_*.py): merging the converted LoRA gives
the same weights as merging the original. Flux.1 conversions cross layouts without a base: a diffusers
LoRA's to_q/k/v fuse block-diagonally into kohya's `img_attn.qkv` (rank 3r) and split back exactly.
Tolerance atol 2e-5 on O(1) weights (fp32; only summation order differs).
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from lora_helpers import rnd

diffusers = pytest.importorskip("diffusers")
peft = pytest.importorskip("peft")

from families_util import tiny_flux1  # noqa: E402
from helpers.lora_flux import TOL, flux_with_lora, merge_with_ckpt  # noqa: E402


def _fused(base_sd, lora_file):
    """diffusers' answer: the file read by the pipeline's loader (state dict and lora_adapter_metadata),
    loaded into a fresh model and fused."""
    model = tiny_flux1()
    model.load_state_dict(base_sd)
    sd, metadata = diffusers.FluxPipeline.lora_state_dict(str(lora_file), return_lora_metadata=True)
    assert metadata  # the LoraConfig travels in the file
    model.load_lora_adapter(sd, prefix="transformer", metadata=metadata)
    model.fuse_lora()
    return {k.replace(".base_layer.", "."): v for k, v in model.state_dict().items() if "lora_" not in k}


def test_diffusers_to_kohya_fuses_and_back_to_diffusers_splits(tmp_path, run_ckpt):
    base, want, want_bfl = flux_with_lora(tmp_path)
    src = tmp_path / "dlora" / "pytorch_lora_weights.safetensors"
    kohya = tmp_path / "kohya.safetensors"
    # add_k_proj alone: the fused txt_attn.qkv's size is known only from a base
    code, _, err = run_ckpt("lora", "convert", src, "--format", "kohya", "-o", kohya)
    assert code == 2 and "add_k_proj" in err and "--base" in err and not kohya.exists()
    code, stdout, err = run_ckpt("lora", "convert", src, "--format", "kohya", "--base", tmp_path / "bfl.safetensors",
                                 "-o", kohya)
    assert code == 0, err
    sd = load_file(kohya)
    assert sd["lora_unet_double_blocks_0_img_attn_qkv.lora_up.weight"].shape[1] == 9  # q, k, v block-diagonal
    txt = sd["lora_unet_double_blocks_0_txt_attn_qkv.lora_up.weight"]  # only add_k_proj: q and v rows zero
    assert txt.shape == (48, 3) and not txt[:16].any() and not txt[32:].any() and txt[16:32].any()
    assert "lora_unet_final_layer_adaLN_modulation_1.lora_down.weight" in sd
    assert "lora_unet_single_blocks_0_linear2.lora_down.weight" in sd
    assert float(sd["lora_unet_double_blocks_0_img_attn_qkv.alpha"]) == 18.0  # scale 6/3 kept at rank 9
    got = merge_with_ckpt(run_ckpt, tmp_path / "bfl.safetensors", kohya, tmp_path / "m.safetensors")
    for k, v in want_bfl.items():
        torch.testing.assert_close(got[k], v, **TOL, msg=k)
    back = tmp_path / "back.safetensors"
    code, _, err = run_ckpt("lora", "convert", kohya, "--format", "diffusers", "-o", back, "-q")
    assert code == 0, err
    keys = load_file(back)
    assert "transformer.transformer_blocks.0.attn.to_q.lora_A.weight" in keys
    assert not any(k.endswith(".alpha") for k in keys)
    got = _fused(base, back)
    for k, v in want.items():
        torch.testing.assert_close(got[k], v, **TOL, msg=k)


def test_comfy_and_peft_outputs_merge_the_same(tmp_path, run_ckpt):
    base, want, want_bfl = flux_with_lora(tmp_path, targets=("to_q", "to_k", "to_v", "proj_out", "proj_mlp"))
    src = tmp_path / "dlora" / "pytorch_lora_weights.safetensors"
    comfy = tmp_path / "comfy.safetensors"
    assert run_ckpt("lora", "convert", src, "--format", "comfy", "-o", comfy, "-q")[0] == 0
    assert all(k.startswith("diffusion_model.") for k in load_file(comfy))
    got = merge_with_ckpt(run_ckpt, tmp_path / "bfl.safetensors", comfy, tmp_path / "m.safetensors")
    for k, v in want_bfl.items():
        torch.testing.assert_close(got[k], v, **TOL, msg=k)
    folder = tmp_path / "peft"
    assert run_ckpt("lora", "convert", src, "--format", "peft", "-o", folder, "-q")[0] == 0
    cfg = json.loads((folder / "adapter_config.json").read_text())
    assert cfg["r"] == 3 and cfg["lora_alpha"] == 6
    got = merge_with_ckpt(run_ckpt, tmp_path / "bfl.safetensors", folder, tmp_path / "m2.safetensors")
    for k, v in want_bfl.items():
        torch.testing.assert_close(got[k], v, **TOL, msg=k)


def test_peft_llm_adapter_round_trip_through_kohya_with_base(tmp_path, run_ckpt):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)

    def fresh():
        torch.manual_seed(0)
        return transformers.LlamaForCausalLM(cfg)

    fresh().save_pretrained(tmp_path / "base")
    pm = peft.get_peft_model(fresh(), peft.LoraConfig(r=4, lora_alpha=2, target_modules=["q_proj", "down_proj"],
                                                     rank_pattern={"down_proj": 2}, init_lora_weights=False))
    pm.save_pretrained(tmp_path / "adapter")
    want = pm.merge_and_unload().state_dict()
    kohya = tmp_path / "kohya.safetensors"
    assert run_ckpt("lora", "convert", tmp_path / "adapter", "--format", "kohya", "--base", tmp_path / "base",
                    "-o", kohya, "-q")[0] == 0
    back = tmp_path / "back"
    code, _, err = run_ckpt("lora", "convert", kohya, "--format", "peft", "--base", tmp_path / "base", "-o", back, "-q")
    assert code == 0, err
    got = peft.PeftModel.from_pretrained(fresh(), back).merge_and_unload().state_dict()
    for k, v in want.items():
        torch.testing.assert_close(got[k], v, **TOL, msg=k)


def test_lycoris_modules_keep_or_need_to_lora(tmp_path, run_ckpt):
    H = 8
    base = {"double_blocks.0.img_attn.proj.weight": rnd(H, H), "double_blocks.0.img_attn.qkv.weight": rnd(3 * H, H),
            "single_blocks.0.linear2.weight": rnd(H, 3 * H), "single_blocks.0.linear1.weight": rnd(3 * H + 2 * H, H)}
    save_file(base, tmp_path / "bfl.safetensors")
    w = {n: rnd(*s) for n, s in (("w1a", (H, 2)), ("w1b", (2, H)), ("w2a", (H, 2)), ("w2b", (2, H)))}
    loha = {f"lora_unet_double_blocks_0_img_attn_proj.hada_{k[:2]}_{k[2]}": v for k, v in w.items()}
    loha["lora_unet_double_blocks_0_img_attn_proj.alpha"] = torch.tensor(1.0)
    save_file(loha, tmp_path / "loha.safetensors")
    comfy = tmp_path / "comfy.safetensors"
    code, _, err = run_ckpt("lora", "convert", tmp_path / "loha.safetensors", "--format", "comfy",
                            "--base", tmp_path / "bfl.safetensors", "-o", comfy, "-q")
    assert code == 0, err
    assert "diffusion_model.double_blocks.0.img_attn.proj.hada_w1_a" in load_file(comfy)
    code, _, err = run_ckpt("lora", "convert", tmp_path / "loha.safetensors", "--format", "diffusers",
                            "--base", tmp_path / "bfl.safetensors", "-o", tmp_path / "d.safetensors")
    assert code == 2 and "lora_unet_double_blocks_0_img_attn_proj" in err and "--to-lora" in err
    d = tmp_path / "d.safetensors"
    code, stdout, err = run_ckpt("lora", "convert", tmp_path / "loha.safetensors", "--format", "diffusers",
                                 "--base", tmp_path / "bfl.safetensors", "--to-lora", 8, "-o", d)
    assert code == 0, err
    assert "loha -> lora" in stdout
    a = merge_with_ckpt(run_ckpt, tmp_path / "bfl.safetensors", tmp_path / "loha.safetensors", tmp_path / "a.safetensors")
    b = merge_with_ckpt(run_ckpt, tmp_path / "bfl.safetensors", d, tmp_path / "b.safetensors")
    for k in a:
        torch.testing.assert_close(b[k], a[k], **TOL, msg=k)  # rank 8 = full rank here: exact


def _bad(run_ckpt, tmp_path, *args):
    before = set(p.name for p in tmp_path.iterdir())
    code, out, err = run_ckpt("lora", "convert", *args)
    assert code == 2, (out, err)
    assert err.startswith("error: ") and len(err.strip().splitlines()) == 1, err
    assert set(p.name for p in tmp_path.iterdir()) == before
    return err


def test_bad_inputs(tmp_path, run_ckpt):
    save_file({"some_model_thing.lora_down.weight": rnd(2, 8), "some_model_thing.lora_up.weight": rnd(8, 2)},
              tmp_path / "odd.safetensors")
    odd, o = tmp_path / "odd.safetensors", tmp_path / "o.safetensors"
    assert "--base" in _bad(run_ckpt, tmp_path, odd, "--format", "diffusers", "-o", o)
    assert "Invalid value for '--format'" in _bad(run_ckpt, tmp_path, odd, "--format", "onnx", "-o", o)
    assert "Missing option" in _bad(run_ckpt, tmp_path, odd, "-o", o)
    save_file({"x.weight": rnd(8, 8)}, tmp_path / "base.safetensors")
    assert "1 module matches no weight" in _bad(run_ckpt, tmp_path, odd, "--format", "kohya", "--base",
                                     tmp_path / "base.safetensors", "-o", o)
    assert "at least 1" in _bad(run_ckpt, tmp_path, odd, "--format", "kohya", "--to-lora", 0, "-o", o)
