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


def test_finetune_merge_to_a_file_name_writes_that_file(tmp_path, run_ckpt):
    """`-o merged/lit_model.pth` is one file (never a folder named lit_model.pth), with the same tensors
    the folder form writes; a note says which configs the folder form would have copied."""
    base, ft = write_litgpt(tmp_path, qkv_lora())
    code, out, err = run_ckpt("merge-lora", ft, "-o", tmp_path / "folder")
    assert code == 0, err
    assert sorted(p.name for p in (tmp_path / "folder").iterdir()) == [
        "hyperparameters.yaml", "lit_model.pth", "model_config.yaml"]
    code, out, err = run_ckpt("merge-lora", ft, "-o", tmp_path / "merged" / "lit_model.pth")
    assert code == 0, err
    assert (tmp_path / "merged" / "lit_model.pth").is_file()
    assert sorted(p.name for p in (tmp_path / "merged").iterdir()) == ["lit_model.pth"]
    assert "names a file" in err and "hyperparameters.yaml, model_config.yaml" in err
    one = torch.load(tmp_path / "merged" / "lit_model.pth", weights_only=True)
    folder = torch.load(tmp_path / "folder" / "lit_model.pth", weights_only=True)
    assert one.keys() == folder.keys() and all(torch.equal(one[k], folder[k]) for k in one)
    code, out, err = run_ckpt("merge-lora", ft, "-o", tmp_path / "m.safetensors")
    assert code == 0 and (tmp_path / "m.safetensors").is_file(), err


def test_lora_file_alone_finds_its_base(tmp_path, run_ckpt):
    base, ft = write_litgpt(tmp_path, qkv_lora())
    (ft / "prompt_style.yaml").write_text("class_path: litgpt.prompts.Alpaca\n")
    code, out, err = run_ckpt("merge-lora", ft / "lit_model.pth.lora")
    assert code == 0, err
    merged = tmp_path / "ft-merged"
    assert sorted(p.name for p in merged.iterdir()) == [
        "hyperparameters.yaml", "lit_model.pth", "model_config.yaml", "prompt_style.yaml"]
    code, out, err = run_ckpt("merge-lora", ft, "-o", tmp_path / "from-folder")
    assert code == 0, err
    assert (merged / "lit_model.pth").read_bytes() == (tmp_path / "from-folder" / "lit_model.pth").read_bytes()


def test_inspect_a_finetune_folder(tmp_path, run_ckpt):
    import json

    base, ft = write_litgpt(tmp_path, qkv_lora())
    code, out, err = run_ckpt("inspect", ft, "--json")
    assert code == 0, err
    comp = json.loads(out)["components"][0]
    assert comp["files"] == ["lit_model.pth.lora"] and comp["lora"]["types"] == ["LitGPT LoRA"]


def test_convert_a_litgpt_lora_default_names(tmp_path, run_ckpt):
    from safetensors.torch import load_file

    lora = qkv_lora()
    base, ft = write_litgpt(tmp_path, lora)
    code, out, err = run_ckpt("convert", ft / "lit_model.pth.lora", "--to", "bf16", "-q")
    assert code == 0, err
    got = load_file(ft / "lit_model-lora-bf16.safetensors")  # not lit_model.pth-bf16.safetensors
    assert all(torch.equal(got[k], v.bfloat16()) for k, v in lora.items())
    code, out, err = run_ckpt("convert", ft / "lit_model.pth.lora", "--to", "bf16", "--format", "torch", "-q")
    assert code == 0, err
    got = torch.load(ft / "lit_model-bf16.pth.lora", weights_only=True)  # still named as a LitGPT LoRA
    assert all(torch.equal(got[k], v.bfloat16()) for k, v in lora.items())


def test_folder_output_to_a_file_name_is_refused(tmp_path, run_ckpt):
    from safetensors.torch import save_file

    d = tmp_path / "model"
    d.mkdir()
    save_file({"w": torch.ones(2)}, d / "model.safetensors")
    (d / "config.json").write_text("{}")
    (tmp_path / "sub").mkdir()
    code, out, err = run_ckpt("convert", d, "--to", "fp16", "-o", tmp_path / "sub" / "model.safetensors")
    assert code == 2 and err.count("\n") == 1 and "names a file, but the output is a folder" in err, err
    assert list((tmp_path / "sub").iterdir()) == []
