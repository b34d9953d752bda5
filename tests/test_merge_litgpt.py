"""LitGPT inputs that must be refused by name, with nothing written (the merges themselves are checked
against litgpt in tests/litgpt, which runs in its own venv)."""

from __future__ import annotations

import torch
import yaml

HP = dict(checkpoint_dir="", precision="32-true", lora_r=2, lora_alpha=4, lora_query=True, lora_key=False,
          lora_value=True, lora_projection=False, lora_mlp=False, lora_head=False)
CFG = dict(name="tiny", n_embd=8, n_head=2, n_query_groups=1, head_size=4, n_layer=1)


def write_litgpt(tmp_path, lora: dict, hp=None, cfg=None, base_keys=None):
    base, ft = tmp_path / "base", tmp_path / "ft"
    base.mkdir()
    ft.mkdir()
    qkv_rows = (2 + 2 * 1) * 4
    sd = base_keys or {"transformer.h.0.attn.qkv.weight": torch.randn(qkv_rows, 8),
                       "transformer.h.0.attn.proj.weight": torch.randn(8, 8)}
    torch.save(sd, base / "lit_model.pth")
    (base / "model_config.yaml").write_text(yaml.safe_dump(cfg or CFG))
    torch.save({"model": lora}, ft / "lit_model.pth.lora")
    hp = dict(HP, checkpoint_dir=str(base)) if hp is None else hp
    if hp:
        (ft / "hyperparameters.yaml").write_text(yaml.safe_dump(hp))
    (ft / "model_config.yaml").write_text(yaml.safe_dump(cfg or CFG))
    return base, ft


def qkv_lora(rows_b=8 + 4):  # q (2 heads * 4) and v (1 group * 4) enabled, rank 2
    return {"transformer.h.0.attn.qkv.lora_A": torch.randn(4, 8),
            "transformer.h.0.attn.qkv.lora_B": torch.randn(rows_b, 2)}


def test_old_attn_attn_lora_names_are_refused(tmp_path, run_ckpt):
    base, ft = write_litgpt(tmp_path, {"transformer.h.0.attn.attn.lora_A": torch.randn(4, 8),
                                       "transformer.h.0.attn.attn.lora_B": torch.randn(12, 2)})
    code, out, err = run_ckpt("merge-lora", ft)
    assert code == 2
    assert "older LitGPT key names" in err and "attn.attn" in err
    assert not (tmp_path / "ft-merged").exists()


def test_flags_that_do_not_fit_the_factors_are_named(tmp_path, run_ckpt):
    base, ft = write_litgpt(tmp_path, qkv_lora(rows_b=16))
    code, out, err = run_ckpt("merge-lora", ft)
    assert code == 2
    assert "lora_query=True, lora_key=False, lora_value=True" in err and "n_query_groups=1" in err
    assert not (tmp_path / "ft-merged").exists()


def test_missing_hyperparameters_and_missing_base(tmp_path, run_ckpt):
    base, ft = write_litgpt(tmp_path, qkv_lora(), hp={})
    code, out, err = run_ckpt("merge-lora", base / "lit_model.pth", ft / "lit_model.pth.lora")
    assert code == 2 and "hyperparameters.yaml" in err
    (ft / "hyperparameters.yaml").write_text(yaml.safe_dump(dict(HP, checkpoint_dir=str(tmp_path / "gone"))))
    code, out, err = run_ckpt("merge-lora", ft)
    assert code == 2 and "was not found" in err and "ckpt merge-lora BASE/lit_model.pth" in err


def test_a_base_that_does_not_fit_the_config_is_refused(tmp_path, run_ckpt):
    base, ft = write_litgpt(tmp_path, qkv_lora(), base_keys={"transformer.h.0.attn.qkv.weight": torch.randn(20, 8)})
    code, out, err = run_ckpt("merge-lora", ft)
    assert code == 2 and "fused weight of 16 rows" in err and "[20, 8]" in err


def test_inspect_names_litgpt_files(tmp_path, run_ckpt):
    import json

    base, ft = write_litgpt(tmp_path, qkv_lora())
    code, out, err = run_ckpt("inspect", ft / "lit_model.pth.lora", "--json")
    comp = json.loads(out)["components"][0]
    assert code == 0 and comp["kind"] == "lora" and comp["lora"]["types"] == ["LitGPT LoRA"]
    assert comp["family"] == "LoRA for LitGPT GPT"
    code, out, err = run_ckpt("inspect", base / "lit_model.pth", "--json")
    assert json.loads(out)["components"][0]["family"] == "LitGPT GPT"
