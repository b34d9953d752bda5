"""`ckpt lora extract` against the formulas and against PEFT / diffusers loaders.

Oracles: (1) Eckart-Young: a delta of exact rank r comes back to fp32 precision at any rank >= r, and
at a lower rank k the LoRA's delta is the best rank-k approximation (fp64 SVD in the test); (2) the
reported relative error equals ||dW - scale * up @ down||_F / ||dW||_F recomputed here from the written
factors; (3) kohya's dynamic-rank rules (`lora_helpers.kohya_rank`, from resize_lora.py) and kohya's
quantile clamp (torch.quantile); (4) `ckpt merge-lora` of the extracted LoRA into BASE gives TUNED, and
PEFT (`PeftModel.from_pretrained` + `merge_and_unload`) / diffusers (`load_lora_adapter` + `fuse_lora`)
load the peft / diffusers outputs into the base and give TUNED.

Tolerances: exact-rank reconstructions are fp32 SVDs of O(0.1) deltas: relative error below 1e-5;
merged weights within atol 1e-5. Reported errors print 4 significant digits: rtol 1e-3.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from lora_helpers import kohya_modules, kohya_rank, low_rank, rel_error, report_rows, rnd, truncated


def _pair(tmp_path, rank=3, conv=True):
    base = {"blocks.0.attn.qkv.weight": rnd(24, 8), "blocks.0.attn.qkv.bias": rnd(24),
            "blocks.0.mlp.fc1.weight": rnd(32, 8), "blocks.0.mlp.fc2.weight": rnd(8, 32),
            "blocks.0.norm.weight": rnd(8), "blocks.0.frozen.weight": rnd(8, 8)}
    if conv:
        base["conv_in.weight"] = rnd(8, 4, 3, 3)
        base["skip.weight"] = rnd(8, 4, 1, 1)
    tuned = {k: v.clone() for k, v in base.items()}
    deltas = {}
    for k in base:
        if k.endswith(".weight") and base[k].dim() >= 2 and "frozen" not in k:
            deltas[k] = low_rank(base[k].shape, rank)
            tuned[k] += deltas[k]
    tuned["blocks.0.attn.qkv.bias"] += 0.01
    save_file(base, tmp_path / "base.safetensors")
    save_file(tuned, tmp_path / "tuned.safetensors")
    return base, tuned, deltas


def _kohya(key):
    return "lora_unet_" + key[: -len(".weight")].replace(".", "_")


def test_exact_rank_comes_back_and_merges_to_tuned(tmp_path, run_ckpt):
    base, tuned, deltas = _pair(tmp_path, rank=3)
    out = tmp_path / "lora.safetensors"
    code, stdout, err = run_ckpt("lora", "extract", tmp_path / "base.safetensors", tmp_path / "tuned.safetensors",
                                 "--rank", 5, "-o", out)
    assert code == 0, err
    mods = kohya_modules(out)
    assert set(mods) == {_kohya(k) for k in deltas}
    rows = report_rows(stdout)
    for k, d in deltas.items():
        up, down, scale = mods[_kohya(k)]
        assert up.shape[1] == min(5, *d.reshape(d.shape[0], -1).shape) and scale == 1.0
        assert rel_error(d, scale * up @ down) < 1e-5
        assert rows[_kohya(k)][1] < 1e-5
    sd = load_file(out)
    assert sd["lora_unet_conv_in.lora_down.weight"].shape == (5, 4, 3, 3)
    assert sd["lora_unet_conv_in.lora_up.weight"].shape == (8, 5, 1, 1)
    assert sd["lora_unet_skip.lora_down.weight"].shape == (4, 4, 1, 1)  # capped at in = 4
    assert "1 module capped" in stdout and "lora_unet_skip (4)" in stdout
    assert all(v.dtype == torch.float32 for v in sd.values())
    # unchanged weight skipped and listed; the changed bias is listed as having no LoRA form
    assert "blocks.0.frozen.weight" in stdout and "skipped" in stdout
    assert "no LoRA form" in stdout and "blocks.0.attn.qkv.bias" in stdout
    merged = tmp_path / "merged.safetensors"
    code, _, err = run_ckpt("merge-lora", tmp_path / "base.safetensors", out, "-o", merged, "-q")
    assert code == 0, err
    got = load_file(merged)
    for k in deltas:
        torch.testing.assert_close(got[k], tuned[k], rtol=0, atol=1e-5)
    assert torch.equal(got["blocks.0.frozen.weight"], base["blocks.0.frozen.weight"])


@pytest.mark.parametrize("save_dtype", ["fp32", "fp16"])
def test_truncation_is_best_rank_k_and_reported_error_is_measured(tmp_path, run_ckpt, save_dtype):
    base, tuned, deltas = _pair(tmp_path, rank=6)
    out = tmp_path / "lora.safetensors"
    code, stdout, err = run_ckpt("lora", "extract", tmp_path / "base.safetensors", tmp_path / "tuned.safetensors",
                                 "--rank", 2, "--conv-rank", 3, "--save-dtype", save_dtype, "-o", out)
    assert code == 0, err
    rows = report_rows(stdout)
    mods = kohya_modules(out)
    sd = load_file(out)
    for k, d in deltas.items():
        name = _kohya(k)
        up, down, scale = mods[name]
        want_rank = 3 if k == "conv_in.weight" else 2
        assert up.shape[1] == want_rank and rows[name][0] == want_rank
        assert sd[name + ".lora_up.weight"].dtype == {"fp32": torch.float32, "fp16": torch.float16}[save_dtype]
        measured = rel_error(d, scale * up @ down)
        assert rows[name][1] == pytest.approx(measured, rel=1e-3)
        best = rel_error(d, truncated(d, want_rank))
        assert measured == pytest.approx(best, rel=1e-4 if save_dtype == "fp32" else 1e-2)


@pytest.mark.parametrize("method,threshold", [("sv_fro", 0.9), ("sv_ratio", 4.0), ("sv_cumulative", 0.7)])
def test_dynamic_ranks_follow_kohya(tmp_path, run_ckpt, method, threshold):
    base = {"a.weight": rnd(40, 30), "b.weight": rnd(30, 20)}
    tuned = {k: v + rnd(*v.shape, scale=0.05) @ torch.diag(torch.linspace(1, 0.01, v.shape[1])) for k, v in base.items()}
    save_file(base, tmp_path / "base.safetensors")
    save_file(tuned, tmp_path / "tuned.safetensors")
    out = tmp_path / "lora.safetensors"
    code, stdout, err = run_ckpt("lora", "extract", tmp_path / "base.safetensors", tmp_path / "tuned.safetensors",
                                 "--rank", 25, "--dynamic", method, "--threshold", threshold, "-o", out)
    assert code == 0, err
    mods = kohya_modules(out)
    for k in base:
        d = (tuned[k] - base[k]).double()
        S = torch.linalg.svdvals(d)
        want = kohya_rank(S, method, threshold, 25)
        up, down, scale = mods[_kohya(k)]
        assert up.shape[1] == want
        assert rel_error(d, scale * up @ down) == pytest.approx(rel_error(d, truncated(d, want)), rel=1e-4)
    assert load_file(out)["lora_unet_a.alpha"].item() == mods["lora_unet_a"][0].shape[1]


def test_clamp_quantile_is_kohyas(tmp_path, run_ckpt):
    base = {"a.weight": rnd(16, 12)}
    tuned = {"a.weight": base["a.weight"] + rnd(16, 12, scale=0.1)}
    save_file(base, tmp_path / "base.safetensors")
    save_file(tuned, tmp_path / "tuned.safetensors")
    out = tmp_path / "lora.safetensors"
    code, _, err = run_ckpt("lora", "extract", tmp_path / "base.safetensors", tmp_path / "tuned.safetensors",
                            "--rank", 4, "--clamp-quantile", 0.9, "-o", out)
    assert code == 0, err
    d = tuned["a.weight"] - base["a.weight"]
    U, S, Vh = torch.linalg.svd(d)
    U, Vh = U[:, :4] @ torch.diag(S[:4]), Vh[:4]
    sd = load_file(out)
    up, down = sd["lora_unet_a.lora_up.weight"], sd["lora_unet_a.lora_down.weight"]
    # singular vectors have no preferred sign, and the quantile of their values depends on it: align the
    # oracle's signs with ours (by the down rows, which the clamp at 0.9 barely touches) before clamping
    sign = torch.sign((Vh * down).sum(1))
    U, Vh = U * sign, Vh * sign.unsqueeze(1)
    hi = torch.quantile(torch.cat([U.flatten(), Vh.flatten()]), 0.9)
    assert float(up.abs().max()) == pytest.approx(float(hi), rel=1e-4)
    torch.testing.assert_close(up, U.clamp(-hi, hi), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(down, Vh.clamp(-hi, hi), rtol=1e-4, atol=1e-5)


def test_lowrank_reports_its_measured_error(tmp_path, run_ckpt):
    base = {"a.weight": rnd(96, 80)}
    tuned = {"a.weight": base["a.weight"] + low_rank((96, 80), 20) + rnd(96, 80, scale=1e-3)}
    save_file(base, tmp_path / "base.safetensors")
    save_file(tuned, tmp_path / "tuned.safetensors")
    out = tmp_path / "lora.safetensors"
    code, stdout, err = run_ckpt("lora", "extract", tmp_path / "base.safetensors", tmp_path / "tuned.safetensors",
                                 "--rank", 8, "--lowrank", "--niter", 4, "-o", out)
    assert code == 0, err
    up, down, scale = kohya_modules(out)["lora_unet_a"]
    d = tuned["a.weight"] - base["a.weight"]
    measured = rel_error(d, up @ down)
    assert report_rows(stdout)["lora_unet_a"][1] == pytest.approx(measured, rel=1e-3)
    assert measured <= rel_error(d, truncated(d, 8)) * 1.05  # randomized, close to the best rank-8


def test_min_diff_skips_small_deltas(tmp_path, run_ckpt):
    base = {"a.weight": rnd(8, 8), "b.weight": rnd(8, 8)}
    tuned = {"a.weight": base["a.weight"] + 1e-4 * rnd(8, 8), "b.weight": base["b.weight"] + low_rank((8, 8), 2)}
    save_file(base, tmp_path / "base.safetensors")
    save_file(tuned, tmp_path / "tuned.safetensors")
    out = tmp_path / "lora.safetensors"
    code, stdout, err = run_ckpt("lora", "extract", tmp_path / "base.safetensors", tmp_path / "tuned.safetensors",
                                 "--rank", 2, "--min-diff", 0.01, "-o", out)
    assert code == 0, err
    assert set(kohya_modules(out)) == {"lora_unet_b"}
    assert "1 module skipped" in stdout and "a.weight" in stdout


def test_flux_bfl_base_kohya_names_merge_back(tmp_path, run_ckpt):
    H, M = 8, 16
    base = {"double_blocks.0.img_attn.qkv.weight": rnd(3 * H, H), "double_blocks.0.img_attn.proj.weight": rnd(H, H),
            "single_blocks.0.linear1.weight": rnd(3 * H + M, H), "single_blocks.0.linear2.weight": rnd(H, H + M),
            "final_layer.adaLN_modulation.1.weight": rnd(2 * H, H)}
    tuned = {k: v + low_rank(v.shape, 2) for k, v in base.items()}
    prefixed = {"model.diffusion_model." + k: v for k, v in base.items()}
    save_file(prefixed, tmp_path / "base.safetensors")
    save_file({"model.diffusion_model." + k: v for k, v in tuned.items()}, tmp_path / "tuned.safetensors")
    out = tmp_path / "lora.safetensors"
    code, stdout, err = run_ckpt("lora", "extract", tmp_path / "base.safetensors", tmp_path / "tuned.safetensors",
                                 "-r", 2, "-o", out, "-q")
    assert code == 0, err
    assert set(kohya_modules(out)) == {"lora_unet_double_blocks_0_img_attn_qkv", "lora_unet_double_blocks_0_img_attn_proj",
                                       "lora_unet_single_blocks_0_linear1", "lora_unet_single_blocks_0_linear2",
                                       "lora_unet_final_layer_adaLN_modulation_1"}
    merged = tmp_path / "merged.safetensors"
    assert run_ckpt("merge-lora", tmp_path / "base.safetensors", out, "-o", merged, "-q")[0] == 0
    got = load_file(merged)
    for k, v in tuned.items():
        torch.testing.assert_close(got["model.diffusion_model." + k], v, rtol=0, atol=1e-5)


def test_peft_folder_loads_in_peft_and_merges_to_tuned(tmp_path, run_ckpt):
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    model.save_pretrained(tmp_path / "base")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("q_proj.weight", "v_proj.weight", "down_proj.weight")):
                p.add_(low_rank(p.shape, 3 if "layers.0" in name else 5))
    model.save_pretrained(tmp_path / "tuned")
    want = {k: v.clone() for k, v in model.state_dict().items()}
    out = tmp_path / "adapter"
    code, stdout, err = run_ckpt("lora", "extract", tmp_path / "base", tmp_path / "tuned", "--rank", 8,
                                 "--dynamic", "sv_fro", "--threshold", 0.999999, "-o", out)
    assert code == 0, err
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and len(config["target_modules"]) == 6
    assert set(config["rank_pattern"].values()) | {config["r"]} == {3, 5}
    fresh = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "base")
    merged = peft.PeftModel.from_pretrained(fresh, out).merge_and_unload()
    for k, v in merged.state_dict().items():
        torch.testing.assert_close(v, want[k], rtol=0, atol=2e-5, msg=k)


def test_diffusers_file_loads_with_load_lora_adapter_and_fuses_to_tuned(tmp_path, run_ckpt):
    diffusers = pytest.importorskip("diffusers")
    pytest.importorskip("peft")

    def make():
        torch.manual_seed(0)
        return diffusers.FluxTransformer2DModel(patch_size=1, in_channels=4, num_layers=1, num_single_layers=1,
                                                attention_head_dim=8, num_attention_heads=2, joint_attention_dim=16,
                                                pooled_projection_dim=16, axes_dims_rope=(2, 2, 4))

    model = make()
    model.save_pretrained(tmp_path / "base")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("attn.to_q.weight", "attn.add_k_proj.weight", "proj_mlp.weight", "ff.net.2.weight")):
                p.add_(low_rank(p.shape, 2 if "to_q" in name else 4))
    model.save_pretrained(tmp_path / "tuned")
    want = {k: v.clone() for k, v in model.state_dict().items()}
    out = tmp_path / "lora.safetensors"
    code, stdout, err = run_ckpt("lora", "extract", tmp_path / "base", tmp_path / "tuned", "--rank", 6,
                                 "--dynamic", "sv_ratio", "--threshold", 1e4, "--format", "diffusers", "-o", out, "-q")
    assert code == 0, err
    sd = load_file(out)
    assert not any(k.endswith(".alpha") for k in sd) and all(k.startswith("transformer.") for k in sd)
    from safetensors import safe_open

    with safe_open(out, "pt") as f:
        meta = json.loads(f.metadata()["lora_adapter_metadata"])
    ranks = {meta["transformer.r"], *meta["transformer.rank_pattern"].values()}
    assert ranks == {2, 4} and meta["transformer.lora_alpha"] == meta["transformer.r"]
    fresh = make()
    fresh.load_state_dict(load_file(tmp_path / "base" / "diffusion_pytorch_model.safetensors"))
    lora_sd, metadata = diffusers.FluxPipeline.lora_state_dict(str(out), return_lora_metadata=True)
    fresh.load_lora_adapter(lora_sd, prefix="transformer", metadata=metadata)
    fresh.fuse_lora()
    got = {k.replace(".base_layer.", "."): v for k, v in fresh.state_dict().items() if "lora_" not in k}
    for k, v in want.items():
        torch.testing.assert_close(got[k], v, rtol=0, atol=2e-5, msg=k)


def _bad(run_ckpt, tmp_path, *args):
    before = set(p.name for p in tmp_path.iterdir())
    code, out, err = run_ckpt("lora", "extract", *args)
    assert code == 2, (out, err)
    assert err.startswith("error: ") and len(err.strip().splitlines()) == 1, err
    assert set(p.name for p in tmp_path.iterdir()) == before
    return err


def test_bad_inputs_one_line_exit_2_nothing_written(tmp_path, run_ckpt):
    _pair(tmp_path, conv=False)
    b, t, o = tmp_path / "base.safetensors", tmp_path / "tuned.safetensors", tmp_path / "o.safetensors"
    assert "at least 1" in _bad(run_ckpt, tmp_path, b, t, "--rank", 0, "-o", o)
    assert "larger than any layer" in _bad(run_ckpt, tmp_path, b, t, "--rank", 33, "-o", o)
    assert "--threshold" in _bad(run_ckpt, tmp_path, b, t, "--rank", 4, "--dynamic", "sv_fro", "-o", o)
    assert "Missing argument" in _bad(run_ckpt, tmp_path, b)
    assert "No such option" in _bad(run_ckpt, tmp_path, b, t, "--rnak", 4)
    assert "no such" in _bad(run_ckpt, tmp_path, b, tmp_path / "missing.safetensors", "-r", 2, "-o", o)
    # mismatched shapes, and another family (other keys)
    other = {k: v for k, v in load_file(t).items()}
    other["blocks.0.mlp.fc1.weight"] = rnd(16, 8)
    save_file(other, tmp_path / "shape.safetensors")
    assert "not the same model" in _bad(run_ckpt, tmp_path, b, tmp_path / "shape.safetensors", "-r", 2, "-o", o)
    save_file({"x.weight": rnd(4, 4)}, tmp_path / "family.safetensors")
    assert "no counterpart" in _bad(run_ckpt, tmp_path, b, tmp_path / "family.safetensors", "-r", 2, "-o", o)
    # a text encoder in a PEFT folder, a VAE-free original-layout base for diffusers naming
    assert "diffusers" in _bad(run_ckpt, tmp_path, b, t, "-r", 2, "--format", "diffusers", "-o", o)
    o.write_bytes(b"keep")
    assert "already exists" in _bad(run_ckpt, tmp_path, b, t, "-r", 2, "-o", o)
    assert o.read_bytes() == b"keep"


def test_dry_run_writes_nothing(tmp_path, run_ckpt):
    _pair(tmp_path)
    o = tmp_path / "o.safetensors"
    code, stdout, err = run_ckpt("lora", "extract", tmp_path / "base.safetensors", tmp_path / "tuned.safetensors",
                                 "-r", 4, "-o", o, "--dry-run")
    assert code == 0, err
    assert "would extract up to 6 modules from 6 weights" in stdout and not o.exists()
    assert not [p for p in tmp_path.iterdir() if "ckpt-tmp" in p.name]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_cpu(tmp_path, run_ckpt):
    _, _, deltas = _pair(tmp_path, rank=6)
    for dev in ("cpu", "cuda"):
        code, _, err = run_ckpt("lora", "extract", tmp_path / "base.safetensors", tmp_path / "tuned.safetensors",
                                "-r", 3, "--device", dev, "-o", tmp_path / f"{dev}.safetensors")
        assert code == 0, err
    a, b = kohya_modules(tmp_path / "cpu.safetensors"), kohya_modules(tmp_path / "cuda.safetensors")
    for name in a:
        torch.testing.assert_close(a[name][0] @ a[name][1], b[name][0] @ b[name][1], rtol=1e-4, atol=1e-5)


def test_fp8_scaled_base_is_decoded(tmp_path, run_ckpt):
    """A ComfyUI scaled-fp8 base (weight codes x scale_weight) against a bf16-free fp32 fine-tune."""
    codes = (rnd(16, 12) * 50).clamp(-448, 448).to(torch.float8_e4m3fn)
    scale = torch.tensor(0.004)
    base = {"scaled_fp8": torch.empty(0, dtype=torch.float8_e4m3fn), "a.weight": codes, "a.scale_weight": scale}
    logical = codes.float() * scale
    delta = low_rank((16, 12), 2)
    save_file(base, tmp_path / "base.safetensors")
    save_file({"a.weight": logical + delta}, tmp_path / "tuned.safetensors")
    out = tmp_path / "lora.safetensors"
    code, stdout, err = run_ckpt("lora", "extract", tmp_path / "base.safetensors", tmp_path / "tuned.safetensors",
                                 "-r", 2, "-o", out, "-q")
    assert code == 0, err
    up, down, scale_ = kohya_modules(out)["lora_unet_a"]
    assert rel_error(delta, scale_ * up @ down) < 1e-5


def test_failure_after_decomposing_leaves_nothing(tmp_path, run_ckpt):
    """The scratch store is removed when a later module fails (a changed text encoder in a PEFT folder)."""
    te = "cond_stage_model.transformer.text_model.encoder.layers.0.self_attn.q_proj.weight"
    base = {"model.diffusion_model.a.weight": rnd(8, 8), te: rnd(8, 8)}
    tuned = {k: v + low_rank(v.shape, 2) for k, v in base.items()}
    save_file(base, tmp_path / "base.safetensors")
    save_file(tuned, tmp_path / "tuned.safetensors")
    before = set(p.name for p in tmp_path.iterdir())
    code, out, err = run_ckpt("lora", "extract", tmp_path / "base.safetensors", tmp_path / "tuned.safetensors",
                              "-r", 2, "--format", "peft", "-o", tmp_path / "new" / "adapter")
    assert code == 2 and "PEFT adapter folder holds one model" in err, err
    assert set(p.name for p in tmp_path.iterdir()) == before


def test_output_in_new_folder(tmp_path, run_ckpt):
    _pair(tmp_path, conv=False)
    o = tmp_path / "loras" / "x" / "lora.safetensors"
    code, _, err = run_ckpt("lora", "extract", tmp_path / "base.safetensors", tmp_path / "tuned.safetensors",
                            "-r", 2, "-o", o, "-q")
    assert code == 0, err
    assert o.is_file() and [p.name for p in o.parent.iterdir()] == ["lora.safetensors"]
    assert not [p for p in tmp_path.iterdir() if "ckpt-tmp" in p.name]


def test_frobenius_norm_of_a_large_delta_is_summed_in_fp64():
    """The reported relative error divides by ||dW||: torch's fp32 vector_norm is 8e-4 low on 16 M
    elements (0.36% on a Flux 18432 x 3072 delta), so ckpt sums in fp64; fp64 torch is the oracle."""
    from ckpt.lora.svd import error_of_whole, fro_norm

    g = torch.Generator().manual_seed(0)
    d = torch.randn(8192, 2048, generator=g) + 0.5
    exact = d.double().norm().item()
    assert abs(fro_norm(d) - exact) <= 1e-9 * exact
    up, down = torch.randn(8192, 4, generator=g), torch.randn(4, 2048, generator=g)
    err, norm = error_of_whole(d, up, down)
    assert abs(norm - exact) <= 1e-9 * exact
    want = (d.double() - up.double() @ down.double()).norm().item()
    assert abs(err - want) <= 1e-6 * want


@pytest.mark.parametrize("shape", [(300, 70), (1, 70), (300, 2000), (12, 5, 3, 3), (70,)])
def test_norms_walk_row_bands_summing_each_in_fp64(monkeypatch, shape):
    """fro_norm and error_of_whole walk the same row bands (ERROR_BAND elements or fewer, one row at least, a
    short last band): each band's sum of squares in fp64, the bands' sums added in order. Pinned bit for bit
    against that walk written out here, with a small ERROR_BAND so that there are many bands."""
    import math

    from ckpt.lora import svd

    monkeypatch.setattr(svd, "ERROR_BAND", 1000)
    g = torch.Generator().manual_seed(3)
    t = torch.randn(*shape, generator=g) * 3 + 0.5
    flat = t.reshape(t.shape[0], -1) if t.dim() > 1 else t.reshape(1, -1)
    rows = max(1, 1000 // flat.shape[1])

    def walked(band):
        n = flat.shape[0]
        return math.sqrt(sum(float(band(a, min(a + rows, n)).double().pow(2).sum()) for a in range(0, n, rows)))

    assert svd.fro_norm(t) == walked(lambda a, b: flat[a:b])
    up, down = torch.randn(flat.shape[0], 3, generator=g), torch.randn(3, flat.shape[1], generator=g)
    err, norm = svd.error_of_whole(flat, up, down)
    assert norm == walked(lambda a, b: flat[a:b])
    assert err == walked(lambda a, b: torch.addmm(flat[a:b], up[a:b], down, alpha=-1))
