"""`ckpt lora merge` against `ckpt merge-lora` of the separate LoRAs and PEFT's add_weighted_adapter.

Oracles: --concat equals applying the LoRAs one after the other (merge-lora with the same ratios, fp32,
atol 1e-5); PEFT's `add_weighted_adapter(combination_type="cat")` and `"svd"` (merged with
`merge_and_unload`) give the same weights as the folder ckpt writes (svd: the same rank; the truncated
SVD is unique for distinct singular values, so only fp32 rounding differs, atol 2e-5); --svd of a LoRA
plus a LoHa equals the best rank-k approximation of the summed delta (fp64 SVD in the test).
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from lora_helpers import close, kohya_modules, report_rows, rnd, truncated


def _lora(path, names, r, alpha, seed_scale=0.3, conv=False):
    sd = {}
    for n, (out, cols) in names.items():
        sd[f"{n}.lora_down.weight"] = rnd(r, *cols) * seed_scale
        sd[f"{n}.lora_up.weight"] = rnd(out, r, *([1] * (len(cols) - 1))) * seed_scale
        sd[f"{n}.alpha"] = torch.tensor(float(alpha))
    save_file(sd, path)
    return sd


BASE = {"a.weight": (16, (12,)), "b.weight": (10, (16,)), "c.weight": (8, (4, 3, 3))}


def _base(tmp_path):
    sd = {k: rnd(o, *cols) for k, (o, cols) in BASE.items()}
    save_file(sd, tmp_path / "base.safetensors")
    return sd


def test_concat_equals_applying_both(tmp_path, run_ckpt):
    _base(tmp_path)
    mods = {"lora_unet_" + k[:-7]: v for k, v in BASE.items()}
    _lora(tmp_path / "A.safetensors", mods, 4, 2)
    _lora(tmp_path / "B.safetensors", {k: v for k, v in mods.items() if k != "lora_unet_b"}, 2, 8)
    out = tmp_path / "AB.safetensors"
    code, stdout, err = run_ckpt("lora", "merge", tmp_path / "A.safetensors", tmp_path / "B.safetensors",
                                 "--ratio", 0.7, "--ratio", -0.4, "-o", out)
    assert code == 0, err
    got = kohya_modules(out)
    assert got["lora_unet_a"][0].shape[1] == 6 and got["lora_unet_a"][2] == 1.0
    assert got["lora_unet_b"][0].shape[1] == 4  # only in A: rank 4, ratio folded in
    for name, (two, one) in (("sep", (tmp_path / "A.safetensors", tmp_path / "B.safetensors")),):
        code, _, err = run_ckpt("merge-lora", tmp_path / "base.safetensors", two, one, "--ratio", 0.7, "--ratio", -0.4,
                                "-o", tmp_path / "sep.safetensors", "-q")
        assert code == 0, err
    code, _, err = run_ckpt("merge-lora", tmp_path / "base.safetensors", out, "-o", tmp_path / "one.safetensors", "-q")
    assert code == 0, err
    sep, one = load_file(tmp_path / "sep.safetensors"), load_file(tmp_path / "one.safetensors")
    for k in sep:
        torch.testing.assert_close(one[k], sep[k], rtol=0, atol=1e-5, msg=k)


def test_single_input_module_with_ratio_one_passes_through(tmp_path, run_ckpt):
    a = _lora(tmp_path / "A.safetensors", {"lora_unet_a": (16, (12,))}, 4, 2)
    _lora(tmp_path / "B.safetensors", {"lora_unet_b": (10, (16,))}, 2, 8)
    out = tmp_path / "AB.safetensors"
    code, stdout, err = run_ckpt("lora", "merge", tmp_path / "A.safetensors", tmp_path / "B.safetensors", "-o", out)
    assert code == 0, err
    got = load_file(out)
    for k, v in a.items():
        assert torch.equal(got[k], v)
    assert "2 modules passed through unchanged" in stdout


def test_svd_of_lora_plus_loha_is_best_rank_k(tmp_path, run_ckpt):
    down, up = rnd(4, 12), rnd(16, 4)
    save_file({"lora_unet_a.lora_down.weight": down, "lora_unet_a.lora_up.weight": up,
               "lora_unet_a.alpha": torch.tensor(2.0)}, tmp_path / "A.safetensors")
    w1a, w1b, w2a, w2b = rnd(16, 3), rnd(3, 12), rnd(16, 3), rnd(3, 12)
    save_file({"lora_unet_a.hada_w1_a": w1a, "lora_unet_a.hada_w1_b": w1b, "lora_unet_a.hada_w2_a": w2a,
               "lora_unet_a.hada_w2_b": w2b, "lora_unet_a.alpha": torch.tensor(1.5)}, tmp_path / "B.safetensors")
    out = tmp_path / "AB.safetensors"
    code, stdout, err = run_ckpt("lora", "merge", tmp_path / "A.safetensors", tmp_path / "B.safetensors", "--svd",
                                 "--rank", 5, "--ratio", 0.5, "--ratio", 2, "-o", out)
    assert code == 0, err
    d = 0.5 * (2.0 / 4) * up @ down + 2 * (1.5 / 3) * (w1a @ w1b) * (w2a @ w2b)
    u, dn, s = kohya_modules(out)["lora_unet_a"]
    assert u.shape[1] == 5
    assert close(s * u @ dn, truncated(d, 5))
    err_reported = report_rows(stdout)["lora_unet_a"][1]
    measured = float((d.double() - (s * u @ dn).double()).norm() / d.double().norm())
    assert err_reported == pytest.approx(measured, rel=1e-3)
    # --concat refuses the LoHa by name
    code, _, err = run_ckpt("lora", "merge", tmp_path / "A.safetensors", tmp_path / "B.safetensors", "-o",
                            tmp_path / "c.safetensors")
    assert code == 2 and "lora_unet_a" in err and "--svd" in err


@pytest.mark.parametrize("kind", ["cat", "svd"])
def test_peft_add_weighted_adapter(tmp_path, run_ckpt, kind):
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)

    def fresh():
        torch.manual_seed(0)
        return transformers.LlamaForCausalLM(cfg)

    fresh().save_pretrained(tmp_path / "base")
    targets = ["q_proj", "v_proj", "o_proj"]
    pm = peft.get_peft_model(fresh(), peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets,
                                                     init_lora_weights=False))
    pm.save_pretrained(tmp_path / "A")
    torch.manual_seed(1)
    pm2 = peft.get_peft_model(fresh(), peft.LoraConfig(r=2, lora_alpha=1, target_modules=targets,
                                                      init_lora_weights=False))
    pm2.save_pretrained(tmp_path / "B")
    # PEFT's own combination, on one model holding both adapters
    model = peft.PeftModel.from_pretrained(fresh(), tmp_path / "A", adapter_name="A")
    model.load_adapter(tmp_path / "B", adapter_name="B")
    extra = {"svd_rank": 3} if kind == "svd" else {}
    model.add_weighted_adapter(["A", "B"], [0.6, -1.3], "AB", combination_type=kind, **extra)
    model.set_adapter("AB")
    want = model.merge_and_unload(adapter_names=["AB"]).state_dict()
    out = tmp_path / "AB"
    args = ["--svd", "--rank", 3] if kind == "svd" else ["--concat"]
    code, stdout, err = run_ckpt("lora", "merge", tmp_path / "A", tmp_path / "B", "--ratio", 0.6, "--ratio", -1.3,
                                 *args, "-o", out)
    assert code == 0, err
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["r"] == (3 if kind == "svd" else 6)
    got = peft.PeftModel.from_pretrained(fresh(), out).merge_and_unload().state_dict()
    for k, v in want.items():
        torch.testing.assert_close(got[k], v, rtol=0, atol=2e-5, msg=k)


def _bad(run_ckpt, tmp_path, *args):
    before = set(p.name for p in tmp_path.iterdir())
    code, out, err = run_ckpt("lora", "merge", *args)
    assert code == 2, (out, err)
    assert err.startswith("error: ") and len(err.strip().splitlines()) == 1, err
    assert set(p.name for p in tmp_path.iterdir()) == before
    return err


def test_bad_inputs(tmp_path, run_ckpt):
    _lora(tmp_path / "A.safetensors", {"lora_unet_a": (16, (12,))}, 4, 2)
    _lora(tmp_path / "B.safetensors", {"lora_unet_a": (12, (16,))}, 2, 2)
    save_file({"lora_unet_a.lora_down.weight": rnd(2, 12), "lora_unet_a.lora_up.weight": rnd(16, 2),
               "lora_unet_a.dora_scale": rnd(16, 1)}, tmp_path / "D.safetensors")
    save_file({"x.lora_A.weight": rnd(2, 12), "x.lora_B.weight": rnd(16, 2)}, tmp_path / "P.safetensors")
    A, B, D, P, o = (tmp_path / n for n in ("A.safetensors", "B.safetensors", "D.safetensors", "P.safetensors",
                                             "o.safetensors"))
    assert "not the same model" in _bad(run_ckpt, tmp_path, A, B, "-o", o)
    assert "DoRA" in _bad(run_ckpt, tmp_path, A, D, "-o", o)
    assert "--ratio given 1 time for" in _bad(run_ckpt, tmp_path, A, D, "--ratio", 1, "-o", o)
    assert "another naming" in _bad(run_ckpt, tmp_path, A, P, "-o", o)
    assert "at least two" in _bad(run_ckpt, tmp_path, A, "-o", o)
    assert "go with --svd" in _bad(run_ckpt, tmp_path, A, A, "--rank", 2, "-o", o)
    assert "at least 1" in _bad(run_ckpt, tmp_path, A, A, "--svd", "--rank", 0, "-o", o)
