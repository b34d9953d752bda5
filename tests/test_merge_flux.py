"""Merging through the key map into fused and renamed Flux weights (tiny BFL and diffusers bases).

A diffusers-named PEFT LoRA on a BFL base lands on row slices of fused weights (`img_attn.qkv`,
`single_blocks.N.linear1`), DoRA normalises the slice rows only, and `norm_out.linear` lands on
`final_layer.adaLN_modulation.1` with its halves swapped. A BFL-named kohya LoRA on a diffusers base is
split row-wise over `to_q/to_k/to_v`. Expected values: the LoRA formula applied here to the module's
own rows; fp32 throughout (rtol/atol 1e-5).
"""

from __future__ import annotations

import torch
from safetensors.torch import load_file, save_file

H, M, R = 8, 16, 2
TOL = dict(rtol=1e-5, atol=1e-5)


def rnd(*shape, seed=[500]):
    seed[0] += 1
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed[0]))


def swap(t):
    h = t.shape[0] // 2
    return torch.cat([t[h:], t[:h]])


def test_diffusers_peft_lora_on_bfl_base(tmp_path, run_ckpt):
    base = {"double_blocks.0.img_attn.qkv.weight": rnd(3 * H, H), "double_blocks.0.img_attn.qkv.bias": rnd(3 * H),
            "double_blocks.0.img_attn.proj.weight": rnd(H, H),
            "single_blocks.0.linear1.weight": rnd(3 * H + M, H), "single_blocks.0.linear2.weight": rnd(H, H + M),
            "final_layer.adaLN_modulation.1.weight": rnd(2 * H, H), "final_layer.adaLN_modulation.1.bias": rnd(2 * H)}
    save_file(base, tmp_path / "flux.safetensors")
    kA, kB, mA, mB, mag, nA, nB, nb = rnd(R, H), rnd(H, R), rnd(R, H), rnd(M, R), rnd(M).abs(), rnd(R, H), rnd(2 * H, R), rnd(2 * H)
    lora = {"transformer.transformer_blocks.0.attn.to_k.lora_A.weight": kA,
            "transformer.transformer_blocks.0.attn.to_k.lora_B.weight": kB,
            "transformer.single_transformer_blocks.0.proj_mlp.lora_A.weight": mA,
            "transformer.single_transformer_blocks.0.proj_mlp.lora_B.weight": mB,
            "transformer.single_transformer_blocks.0.proj_mlp.lora_magnitude_vector": mag,
            "transformer.norm_out.linear.lora_A.weight": nA, "transformer.norm_out.linear.lora_B.weight": nB,
            "transformer.norm_out.linear.lora_B.bias": nb}
    import json

    save_file(lora, tmp_path / "l.safetensors",
              metadata={"lora_adapter_metadata": json.dumps({"transformer.lora_alpha": 4, "transformer.r": R})})
    out = tmp_path / "out.safetensors"
    code, stdout, err = run_ckpt("merge-lora", tmp_path / "flux.safetensors", tmp_path / "l.safetensors", "-o", out)
    assert code == 0, err
    assert "3 LoRA modules matched" in stdout and "base tensors changed: 4" in stdout
    got = load_file(out)
    s = 4 / R
    qkv = base["double_blocks.0.img_attn.qkv.weight"].clone()
    qkv[H:2 * H] += s * kB @ kA
    torch.testing.assert_close(got["double_blocks.0.img_attn.qkv.weight"], qkv, **TOL)
    assert torch.equal(got["double_blocks.0.img_attn.qkv.bias"], base["double_blocks.0.img_attn.qkv.bias"])
    lin1 = base["single_blocks.0.linear1.weight"].clone()
    V = lin1[3 * H:] + s * mB @ mA
    lin1[3 * H:] = mag[:, None] * V / V.norm(dim=1, keepdim=True)
    torch.testing.assert_close(got["single_blocks.0.linear1.weight"], lin1, **TOL)
    ada_w = swap(swap(base["final_layer.adaLN_modulation.1.weight"]) + s * nB @ nA)
    ada_b = swap(swap(base["final_layer.adaLN_modulation.1.bias"]) + s * nb)
    torch.testing.assert_close(got["final_layer.adaLN_modulation.1.weight"], ada_w, **TOL)
    torch.testing.assert_close(got["final_layer.adaLN_modulation.1.bias"], ada_b, **TOL)


def test_bfl_kohya_lora_on_diffusers_base_splits_rows(tmp_path, run_ckpt):
    base = {f"transformer_blocks.0.attn.{n}.weight": rnd(H, H) for n in ("to_q", "to_k", "to_v")}
    base.update({f"single_transformer_blocks.0.attn.{n}.weight": rnd(H, H) for n in ("to_q", "to_k", "to_v")})
    base["single_transformer_blocks.0.proj_mlp.weight"] = rnd(M, H)
    base["single_transformer_blocks.0.proj_out.weight"] = rnd(H, H + M)
    save_file(base, tmp_path / "dif.safetensors")
    down, up = rnd(R, H), rnd(3 * H, R)
    save_file({"lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight": down,
               "lora_unet_double_blocks_0_img_attn_qkv.lora_up.weight": up,
               "lora_unet_double_blocks_0_img_attn_qkv.alpha": torch.tensor(1.0)}, tmp_path / "l.safetensors")
    out = tmp_path / "out.safetensors"
    code, stdout, err = run_ckpt("merge-lora", tmp_path / "dif.safetensors", tmp_path / "l.safetensors", "-o", out)
    assert code == 0, err
    got = load_file(out)
    dW = 0.5 * up @ down
    for i, n in enumerate(("to_q", "to_k", "to_v")):
        k = f"transformer_blocks.0.attn.{n}.weight"
        torch.testing.assert_close(got[k], base[k] + dW[i * H:(i + 1) * H], **TOL)
    assert "base tensors changed: 3" in stdout
