"""`ckpt lora resize` against the formulas and PEFT.

Oracles: the best rank-k approximation of each module's scaled delta (fp64 SVD of scale * up @ down
formed here); kohya's rank rules (`lora_helpers.kohya_rank`) on its singular values; the effective
scale kept (alpha' / k == alpha / r); resize to the same rank is the identity (modules pass through
bit for bit); PEFT loads the resized adapter folder (`PeftModel.from_pretrained`, which needs every
rank_pattern entry right to load) and `merge_and_unload` gives base + the truncated deltas.
Tolerances: fp32 factors of O(0.1) deltas against fp64 truncations, atol 1e-5 / rel 1e-4.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from lora_helpers import close, kohya_modules, kohya_rank, rel_error, report_rows, rnd, truncated


def _kohya_lora(path, modules, alpha_of=lambda r: r / 2, dtype=torch.float32):
    sd = {}
    for name, (out, cols, r) in modules.items():
        sd[f"{name}.lora_down.weight"] = (rnd(r, *cols) * 0.3).to(dtype)
        sd[f"{name}.lora_up.weight"] = (rnd(out, r, *([1] * (len(cols) - 1))) * 0.3).to(dtype)
        sd[f"{name}.alpha"] = torch.tensor(alpha_of(r))
    save_file(sd, path, metadata={"ss_network_dim": "8", "ss_network_alpha": "4", "sshs_model_hash": "x"})
    return sd


def _delta(sd, name):
    up, down = sd[name + ".lora_up.weight"].float(), sd[name + ".lora_down.weight"].float()
    r = down.shape[0]
    return float(sd[name + ".alpha"]) / r * (up.reshape(up.shape[0], -1) @ down.reshape(r, -1))


MODULES = {"lora_unet_a": (24, (16,), 8), "lora_unet_b": (12, (20,), 6), "lora_unet_conv": (8, (4, 3, 3), 8)}


def test_lower_rank_is_best_approximation_with_scale_kept(tmp_path, run_ckpt):
    src = _kohya_lora(tmp_path / "l.safetensors", MODULES)
    out = tmp_path / "r.safetensors"
    code, stdout, err = run_ckpt("lora", "resize", tmp_path / "l.safetensors", "--rank", 4, "--conv-rank", 3, "-o", out)
    assert code == 0, err
    got = kohya_modules(out)
    sd = load_file(out)
    rows = report_rows(stdout)
    for name, (_, _, r) in MODULES.items():
        k = 3 if name == "lora_unet_conv" else 4
        up, down, scale = got[name]
        assert up.shape[1] == k and rows[name][0] == k
        assert scale == pytest.approx((r / 2) / r)  # alpha' = scale * k: the effective scale is kept
        d = _delta(src, name)
        best = truncated(d, k)
        assert close(scale * up @ down, best)
        assert rows[name][1] == pytest.approx(rel_error(d, scale * up @ down), rel=1e-3)
    assert sd["lora_unet_conv.lora_down.weight"].shape == (3, 4, 3, 3)
    assert sd["lora_unet_conv.lora_up.weight"].shape == (8, 3, 1, 1)
    from safetensors import safe_open

    with safe_open(out, "pt") as f:
        meta = f.metadata()
    assert meta["ss_network_dim"] == "4" and "sshs_model_hash" not in meta


def test_same_rank_is_identity(tmp_path, run_ckpt):
    src = _kohya_lora(tmp_path / "l.safetensors", MODULES, dtype=torch.float16)
    out = tmp_path / "r.safetensors"
    code, stdout, err = run_ckpt("lora", "resize", tmp_path / "l.safetensors", "--rank", 8, "-o", out)
    assert code == 0, err
    got = load_file(out)
    assert set(got) == set(src)
    for k, v in src.items():
        assert torch.equal(got[k], v) and got[k].dtype == v.dtype, k
    assert "3 modules passed through unchanged" in stdout


@pytest.mark.parametrize("method,threshold", [("sv_fro", 0.8), ("sv_ratio", 3.0), ("sv_cumulative", 0.6)])
def test_dynamic_ranks_follow_kohya(tmp_path, run_ckpt, method, threshold):
    src = _kohya_lora(tmp_path / "l.safetensors", {"lora_unet_a": (40, (30,), 16), "lora_unet_b": (30, (20,), 12)})
    out = tmp_path / "r.safetensors"
    code, _, err = run_ckpt("lora", "resize", tmp_path / "l.safetensors", "--rank", 10, "--dynamic", method,
                            "--threshold", threshold, "-o", out)
    assert code == 0, err
    got = kohya_modules(out)
    for name, r in (("lora_unet_a", 16), ("lora_unet_b", 12)):
        d = _delta(src, name)
        want = kohya_rank(torch.linalg.svdvals(d.double()), method, threshold, 10)
        assert got[name][0].shape[1] == want
        up, down, scale = got[name]
        assert close(scale * up @ down, truncated(d, want))


def test_loha_becomes_lora_and_dora_keeps_its_magnitude(tmp_path, run_ckpt):
    w1a, w1b, w2a, w2b = rnd(12, 4), rnd(4, 10), rnd(12, 4), rnd(4, 10)
    mag = rnd(12).abs()
    down, up = rnd(6, 10), rnd(12, 6)
    save_file({"lora_unet_h.hada_w1_a": w1a, "lora_unet_h.hada_w1_b": w1b, "lora_unet_h.hada_w2_a": w2a,
               "lora_unet_h.hada_w2_b": w2b, "lora_unet_h.alpha": torch.tensor(2.0),
               "lora_unet_d.lora_down.weight": down, "lora_unet_d.lora_up.weight": up,
               "lora_unet_d.alpha": torch.tensor(3.0), "lora_unet_d.dora_scale": mag.reshape(12, 1)},
              tmp_path / "l.safetensors")
    out = tmp_path / "r.safetensors"
    code, stdout, err = run_ckpt("lora", "resize", tmp_path / "l.safetensors", "-r", 3, "-o", out)
    assert code == 0, err
    sd = load_file(out)
    assert not any("hada" in k for k in sd)
    got = kohya_modules(out)
    loha = 2.0 / 4 * (w1a @ w1b) * (w2a @ w2b)
    uh, dh, sh = got["lora_unet_h"]
    assert sh == 1.0
    assert close(sh * uh @ dh, truncated(loha, 3))
    ud, dd, sdora = got["lora_unet_d"]
    assert sdora == pytest.approx(3.0 / 6)
    assert close(sdora * ud @ dd, truncated(3.0 / 6 * up @ down, 3))
    assert torch.equal(sd["lora_unet_d.dora_scale"], mag.reshape(12, 1))
    assert "loha -> lora" in stdout


def test_peft_folder_resized_loads_in_peft(tmp_path, run_ckpt):
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    base = transformers.LlamaForCausalLM(cfg)
    base.save_pretrained(tmp_path / "base")
    conf = peft.LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"],
                           rank_pattern={"down_proj": 6}, init_lora_weights=False)
    pm = peft.get_peft_model(base, conf)
    pm.save_pretrained(tmp_path / "adapter")
    deltas = {}
    for name, mod in pm.named_modules():
        if hasattr(mod, "get_delta_weight") and "default" in getattr(mod, "lora_A", {}):
            deltas[name.replace("base_model.model.", "") + ".weight"] = mod.get_delta_weight("default").detach()
    out = tmp_path / "resized"
    code, stdout, err = run_ckpt("lora", "resize", tmp_path / "adapter", "--rank", 5, "--dynamic", "sv_fro",
                                 "--threshold", 0.9, "-o", out)
    assert code == 0, err
    config = json.loads((out / "adapter_config.json").read_text())
    rows = report_rows(stdout)
    assert config["peft_type"] == "LORA" and config["target_modules"]  # the input's config, updated
    fresh = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "base")
    base_sd = {k: v.clone() for k, v in fresh.state_dict().items()}
    merged = peft.PeftModel.from_pretrained(fresh, out).merge_and_unload().state_dict()
    for key, d in deltas.items():
        name = "base_model.model." + key[: -len(".weight")]
        k = rows[name][0]
        assert k == kohya_rank(torch.linalg.svdvals(d.double()), "sv_fro", 0.9, 5)
        torch.testing.assert_close((merged[key] - base_sd[key]).double(), truncated(d, k), rtol=0, atol=2e-5, msg=key)


def _bad(run_ckpt, tmp_path, *args):
    before = set(p.name for p in tmp_path.iterdir())
    code, out, err = run_ckpt("lora", "resize", *args)
    assert code == 2, (out, err)
    assert err.startswith("error: ") and len(err.strip().splitlines()) == 1, err
    assert set(p.name for p in tmp_path.iterdir()) == before
    return err


def test_bad_inputs(tmp_path, run_ckpt):
    _kohya_lora(tmp_path / "l.safetensors", MODULES)
    lo, o = tmp_path / "l.safetensors", tmp_path / "o.safetensors"
    assert "at least 1" in _bad(run_ckpt, tmp_path, lo, "--rank", 0, "-o", o)
    assert "give --rank" in _bad(run_ckpt, tmp_path, lo, "-o", o)
    assert "no such" in _bad(run_ckpt, tmp_path, tmp_path / "missing.safetensors", "-r", 2)
    save_file({"model.weight": rnd(4, 4)}, tmp_path / "notlora.safetensors")
    assert "no LoRA" in _bad(run_ckpt, tmp_path, tmp_path / "notlora.safetensors", "-r", 2, "-o", o)
    assert "fraction" in _bad(run_ckpt, tmp_path, lo, "-r", 2, "--dynamic", "sv_fro", "--threshold", 2, "-o", o)
    assert "--lowrank" not in _bad(run_ckpt, tmp_path, lo, "-r", 2, "--clamp-quantile", 0.9, "-o", o)
    o.write_bytes(b"keep")
    assert "already exists" in _bad(run_ckpt, tmp_path, lo, "-r", 2, "-o", o)
