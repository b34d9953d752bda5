"""`ckpt merge-lora` as a command: reports, unmatched/ambiguous keys, ratios, dtypes, FP8 bases,
layouts, dry runs and bad adapters. Expected values are the LoRA formula computed here in fp32 and
rounded once with torch's own cast."""

from __future__ import annotations

import json

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file


def rnd(*shape, seed=[100]):
    seed[0] += 1
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed[0]))


def write(path, tensors, metadata=None):
    save_file(tensors, path, metadata=metadata)
    return path


def simple(tmp_path, dtype=torch.float16):
    W = rnd(8, 6)
    base = write(tmp_path / "base.safetensors", {"a.weight": W.to(dtype), "a.bias": rnd(8).to(dtype),
                                                  "norm.weight": torch.ones(6)}, {"title": "tiny"})
    d, u = rnd(2, 6), rnd(8, 2)
    lora = write(tmp_path / "l.safetensors", {"a.lora_down.weight": d, "a.lora_up.weight": u, "a.alpha": torch.tensor(1.0)})
    return base, lora, W.to(dtype), d, u


def test_keeps_dtypes_metadata_and_rounds_once(tmp_path, run_ckpt):
    base, lora, W, d, u = simple(tmp_path)
    code, out, err = run_ckpt("merge-lora", base, lora, "-q")
    assert code == 0, err
    dst = tmp_path / "base-merged.safetensors"
    got = load_file(dst)
    assert {k: v.dtype for k, v in got.items()} == {"a.weight": torch.float16, "a.bias": torch.float16,
                                                    "norm.weight": torch.float32}
    assert torch.equal(got["a.weight"], (W.float() + 0.5 * u @ d).half())
    assert torch.equal(got["a.bias"], load_file(base)["a.bias"])
    with safe_open(dst, "pt") as f:
        meta = f.metadata()
    assert meta["title"] == "tiny" and meta["ckpt_operation"].startswith("merge-lora")
    assert "1 LoRA module matched" in out and "base tensors changed: 1" in out


def test_several_loras_with_ratios_and_to(tmp_path, run_ckpt):
    base, lora, W, d, u = simple(tmp_path)
    d2, u2 = rnd(3, 6), rnd(8, 3)
    lora2 = write(tmp_path / "l2.safetensors", {"a.lora_A.weight": d2, "a.lora_B.weight": u2})  # no alpha: scale 1
    out = tmp_path / "o.safetensors"
    code, _, err = run_ckpt("merge-lora", base, lora, lora2, "--ratio", "0.5", "--ratio", "-1.5", "--to", "bf16", "-o", out)
    assert code == 0, err
    got = load_file(out)
    assert all(v.dtype == torch.bfloat16 for v in got.values())
    want = (W.float() + 0.5 * 0.5 * (u @ d) - 1.5 * (u2 @ d2)).bfloat16()
    torch.testing.assert_close(got["a.weight"].float(), want.float(), rtol=0, atol=0)


def test_ratio_count_must_match(tmp_path, run_ckpt):
    base, lora, *_ = simple(tmp_path)
    code, _, err = run_ckpt("merge-lora", base, lora, lora, "--ratio", "0.5")
    assert code == 2 and "--ratio" in err and len(err.strip().splitlines()) == 1


def test_unmatched_is_an_error_unless_allowed(tmp_path, run_ckpt):
    base, _, W, d, u = simple(tmp_path)
    lora = write(tmp_path / "l.safetensors", {"a.lora_down.weight": d, "a.lora_up.weight": u,
                                              "missing.lora_down.weight": d.clone(), "missing.lora_up.weight": u.clone(),
                                              "junk": torch.zeros(1)})
    out = tmp_path / "o.safetensors"
    code, stdout, err = run_ckpt("merge-lora", base, lora, "-o", out)
    assert code == 2 and not out.exists()
    assert "3 LoRA keys match no base tensor" in err and "--allow-unmatched" in err
    assert "missing.lora_down.weight" in stdout and "junk" in stdout
    assert not list(tmp_path.glob(".*ckpt-tmp*"))
    code, stdout, err = run_ckpt("merge-lora", base, lora, "-o", out, "--allow-unmatched")
    assert code == 0, err
    assert "3 unmatched LoRA keys" in stdout and "missing.lora_up.weight" in stdout
    assert torch.equal(load_file(out)["a.weight"], (W.float() + u @ d).half())


def test_dry_run_writes_nothing(tmp_path, run_ckpt):
    base, lora, *_ = simple(tmp_path)
    code, out, err = run_ckpt("merge-lora", base, lora, "--dry-run")
    assert code == 0, err
    assert "would write" in out and "1 LoRA module matched" in out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["base.safetensors", "l.safetensors"]


def test_fp8_bases_are_decoded_merged_in_fp32_and_written_bf16(tmp_path, run_ckpt):
    W1, W2 = rnd(8, 6), rnd(8, 6)
    w1 = W1.to(torch.float8_e4m3fn)
    w2 = (W2 / 4).to(torch.float8_e4m3fn)
    scale = torch.tensor(4.0)
    base = write(tmp_path / "b.safetensors", {"p.weight": w1, "s.weight": w2, "s.scale_weight": scale,
                                              "scaled_fp8": torch.zeros(0, dtype=torch.float8_e4m3fn),
                                              "s.bias": rnd(8)})
    d, u = rnd(2, 6), rnd(8, 2)
    lora = write(tmp_path / "l.safetensors", {"p.lora_down.weight": d, "p.lora_up.weight": u,
                                              "s.lora_down.weight": d.clone(), "s.lora_up.weight": u.clone()})
    out = tmp_path / "o.safetensors"
    code, stdout, err = run_ckpt("merge-lora", base, lora, "-o", out)
    assert code == 0, err
    got = load_file(out)
    assert set(got) == {"p.weight", "s.weight", "s.bias"}
    assert got["p.weight"].dtype == torch.bfloat16 and got["s.bias"].dtype == torch.float32
    assert torch.equal(got["p.weight"], (w1.float() + u @ d).bfloat16())
    assert torch.equal(got["s.weight"], (w2.float() * scale + u @ d).bfloat16())
    assert "written as bf16" in err
    code, _, err = run_ckpt("merge-lora", base, lora, "-o", tmp_path / "o16.safetensors", "--to", "fp16", "-q")
    assert code == 0, err
    assert torch.equal(load_file(tmp_path / "o16.safetensors")["p.weight"], (w1.float() + u @ d).half())


def test_sharded_folder_keeps_layout_and_config(tmp_path, run_ckpt):
    from huggingface_hub import save_torch_state_dict

    sd = {f"layers.{i}.weight": rnd(16, 16) for i in range(4)}
    folder = tmp_path / "model"
    folder.mkdir()
    save_torch_state_dict(sd, folder, max_shard_size=2500)
    (folder / "config.json").write_text(json.dumps({"architectures": ["X"], "torch_dtype": "float32"}))
    d, u = rnd(2, 16), rnd(16, 2)
    lora = write(tmp_path / "l.safetensors", {"base_model.model.layers.3.lora_A.weight": d,
                                              "base_model.model.layers.3.lora_B.weight": u})
    code, _, err = run_ckpt("merge-lora", folder, lora, "-q")
    assert code == 0, err
    out = tmp_path / "model-merged"
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in folder.iterdir())
    idx = json.loads((out / "model.safetensors.index.json").read_text())
    assert idx["weight_map"] == json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    shard = idx["weight_map"]["layers.3.weight"]
    torch.testing.assert_close(load_file(out / shard)["layers.3.weight"], sd["layers.3.weight"] + u @ d,
                               rtol=1e-6, atol=1e-6)


def test_peft_alpha_from_diffusers_metadata(tmp_path, run_ckpt):
    W = rnd(8, 6)
    base = write(tmp_path / "b.safetensors", {"blocks.0.q.weight": W, "blocks.1.q.weight": W.clone()})
    d, u = rnd(4, 6), rnd(8, 4)
    meta = {"lora_adapter_metadata": json.dumps({"transformer.lora_alpha": 2, "transformer.r": 4,
                                                 "transformer.alpha_pattern": {"blocks.1.q": 8}})}
    lora = write(tmp_path / "l.safetensors", {"transformer.blocks.0.q.lora_A.weight": d.clone(),
                                              "transformer.blocks.0.q.lora_B.weight": u.clone(),
                                              "transformer.blocks.1.q.lora_A.weight": d,
                                              "transformer.blocks.1.q.lora_B.weight": u}, meta)
    out = tmp_path / "o.safetensors"
    code, _, err = run_ckpt("merge-lora", base, lora, "-o", out, "-q")
    assert code == 0, err
    got = load_file(out)
    torch.testing.assert_close(got["blocks.0.q.weight"], W + 0.5 * u @ d, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got["blocks.1.q.weight"], W + 2.0 * u @ d, rtol=1e-6, atol=1e-6)


def test_ambiguous_spelling_is_an_error_naming_candidates(tmp_path, run_ckpt):
    base = write(tmp_path / "b.safetensors", {"a.b.weight": rnd(4, 4), "a_b.weight": rnd(4, 4)})
    lora = write(tmp_path / "l.safetensors", {"lora_unet_a_b.lora_down.weight": rnd(2, 4),
                                              "lora_unet_a_b.lora_up.weight": rnd(4, 2)})
    out = tmp_path / "o.safetensors"
    code, _, err = run_ckpt("merge-lora", base, lora, "-o", out)
    assert code == 2 and not out.exists()
    assert "several base tensors" in err and "a.b.weight" in err and "a_b.weight" in err


def test_bad_lora_files(tmp_path, run_ckpt):
    base, _, W, d, u = simple(tmp_path)
    out = tmp_path / "o.safetensors"
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all")
    wrong = write(tmp_path / "wrong.safetensors", {"a.lora_down.weight": rnd(2, 5), "a.lora_up.weight": u})
    half = write(tmp_path / "half.safetensors", {"a.lora_up.weight": u})
    empty_dir = tmp_path / "folder"
    empty_dir.mkdir()
    for bad, words in [(garbage, "garbage.safetensors"), (wrong, "does not fit"), (half, "no down weight"),
                       (empty_dir, "not a PEFT adapter"), (tmp_path / "nope.safetensors", "no such LoRA")]:
        code, _, err = run_ckpt("merge-lora", base, bad, "-o", out)
        assert code == 2, (bad, err)
        assert words in err and err.startswith("error:") and len(err.strip().splitlines()) == 1, err
        assert not out.exists()


def test_peft_folder_with_bad_config(tmp_path, run_ckpt):
    base, _, W, d, u = simple(tmp_path)
    ad = tmp_path / "ad"
    ad.mkdir()
    write(ad / "adapter_model.safetensors", {"base_model.model.a.lora_A.weight": d, "base_model.model.a.lora_B.weight": u})
    (ad / "adapter_config.json").write_text("{broken")
    code, _, err = run_ckpt("merge-lora", base, ad, "-o", tmp_path / "o.safetensors")
    assert code == 2 and "adapter_config.json" in err
    (ad / "adapter_config.json").write_text(json.dumps({"peft_type": "IA3"}))
    code, _, err = run_ckpt("merge-lora", base, ad, "-o", tmp_path / "o.safetensors")
    assert code == 2 and "IA3" in err
    (ad / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "lora_alpha": 4, "r": 2}))
    code, _, err = run_ckpt("merge-lora", base, ad, "-o", tmp_path / "o.safetensors", "-q")
    assert code == 0, err
    assert torch.equal(load_file(tmp_path / "o.safetensors")["a.weight"], (W.float() + 2 * u @ d).half())


def test_pipeline_folder_routes_modules_to_their_component(tmp_path, run_ckpt):
    pipe = tmp_path / "pipe"
    (pipe / "unet").mkdir(parents=True)
    (pipe / "text_encoder").mkdir()
    P, C, Q = rnd(4, 4), rnd(4, 4, 3, 3), rnd(4, 4)
    write(pipe / "unet" / "diffusion_pytorch_model.safetensors",
          {"down_blocks.0.attentions.0.proj_in.weight": P, "conv_in.weight": C})
    write(pipe / "text_encoder" / "model.safetensors", {"text_model.encoder.layers.0.self_attn.q_proj.weight": Q})
    (pipe / "unet" / "config.json").write_text(json.dumps({"_class_name": "UNet2DConditionModel"}))
    (pipe / "model_index.json").write_text(json.dumps({"_class_name": "StableDiffusionPipeline"}))
    pd, pu, qd, qu, cd, cu = rnd(2, 4), rnd(4, 2), rnd(2, 4), rnd(4, 2), rnd(2, 4, 3, 3), rnd(4, 2, 1, 1)
    lora = write(tmp_path / "l.safetensors", {
        "lora_unet_down_blocks_0_attentions_0_proj_in.lora_down.weight": pd,
        "lora_unet_down_blocks_0_attentions_0_proj_in.lora_up.weight": pu,
        "lora_te_text_model_encoder_layers_0_self_attn_q_proj.lora_down.weight": qd,
        "lora_te_text_model_encoder_layers_0_self_attn_q_proj.lora_up.weight": qu,
        "unet.conv_in.lora_A.weight": cd, "unet.conv_in.lora_B.weight": cu})
    code, out, err = run_ckpt("merge-lora", pipe, lora, "-q")
    assert code == 0, err
    dst = tmp_path / "pipe-merged"
    assert (dst / "model_index.json").is_file() and (dst / "unet" / "config.json").is_file()
    unet = load_file(dst / "unet" / "diffusion_pytorch_model.safetensors")
    te = load_file(dst / "text_encoder" / "model.safetensors")
    tol = dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(unet["down_blocks.0.attentions.0.proj_in.weight"], P + pu @ pd, **tol)
    torch.testing.assert_close(unet["conv_in.weight"], C + (cu.flatten(1) @ cd.flatten(1)).reshape(C.shape), **tol)
    torch.testing.assert_close(te["text_model.encoder.layers.0.self_attn.q_proj.weight"], Q + qu @ qd, **tol)
    assert "3 LoRA modules matched" in out


def test_multi_band_streaming_matches_whole_tensor(tmp_path, run_ckpt, monkeypatch):
    """Force many small bands through the real writer: same bits as the formula on the whole tensor."""
    import ckpt.io.output

    monkeypatch.setattr(ckpt.io.output, "BAND_ELEMS", 64)
    W, m = rnd(40, 16), rnd(40, 1).abs()
    d, u = rnd(3, 16), rnd(40, 3)
    base = write(tmp_path / "b.safetensors", {"w.weight": W})
    lora = write(tmp_path / "l.safetensors", {"w.lora_down.weight": d, "w.lora_up.weight": u, "w.dora_scale": m})
    out = tmp_path / "o.safetensors"
    code, _, err = run_ckpt("merge-lora", base, lora, "-o", out, "-q", "--ratio", "0.5")
    assert code == 0, err
    V = W + u @ d
    want = W + 0.5 * (m * V / V.norm(dim=1, keepdim=True) - W)
    torch.testing.assert_close(load_file(out)["w.weight"], want, rtol=1e-5, atol=1e-5)
