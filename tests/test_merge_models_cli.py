"""`ckpt merge`: the config schema (every key used or refused by name), the flags, --print-config, the output
(dtype, model card, recipe in the metadata, tokenizer) and the one-line refusals of bad input."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from helpers.merge_oracle import mergekit_yaml, max_diff, tensors, tiny_llama, variants
from helpers.refusals import assert_refused


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return variants(root, 3)


def _config(tmp_path, text):
    p = tmp_path / "c.yaml"
    p.write_text(text)
    return p


@pytest.mark.parametrize("text, culprit, problem", [
    ("merge_method: linear\nmodels: [{{model: {m0}}}]\nfoo: 1\n", "", "unknown key 'foo'"),
    ("merge_method: linear\nmodules: {{}}\n", "", "'modules' (per-module configs"),
    ("merge_method: linear\nmodels: [{{model: {m0}}}]\ntokenizer_source: union\n", "", "tokenizer_source: union"),
    ("merge_method: frobnicate\nmodels: [{{model: {m0}}}]\n", "merge_method: 'frobnicate'", "is not a method ckpt has"),
    ("merge_method: linear\nmodels: [{{model: {m0}, parameters: {{wieght: 1}}}}]\n", "", "has no parameter 'wieght'"),
    ("merge_method: linear\nmodels: [{{model: {m0}}}]\nslices: []\n", "", "exactly one of models: or slices:"),
    ("models: [{{model: {m0}}}]\n", "", "merge_method is missing"),
    ("merge_method: linear\nmodels: [{{model: {m0}}}\n", "", "not valid YAML"),
    ("merge_method: linear\nmodels: [{{model: {m0}, parameters: {{weight: abc}}}}]\n", "", "weight is a number"),
    ("merge_method: linear\nmodels: [{{model: {m0}, parameters: {{weight: [{{filter: mlp}}]}}}}]\n", "",
     "value is missing"),
    ("merge_method: linear\nmodels: [{{model: {m0}}}]\ndtype: int8\n", "dtype: 'int8'", "choose one of"),
    ("merge_method: passthrough\nslices: [{{sources: [{{model: {m0}, layer_range: [3, 1]}}]}}]\n", "",
     "layer_range is [START, END]"),
    ("merge_method: linear\nmodels: [{{model: {m0}, parameters: {{weight: 1}}}}]\nresidual_weight: 1\n", "",
     "unknown key 'residual_weight'"),
])
def test_config_errors_are_one_line(run_ckpt, tmp_path, models, text, culprit, problem):
    cfg = _config(tmp_path, text.format(m0=models[0]))
    assert_refused(run_ckpt, tmp_path, ["merge", cfg], f"{cfg}: {culprit}".rstrip(), problem) if not culprit.startswith(
        ("merge_method", "dtype")) else assert_refused(run_ckpt, tmp_path, ["merge", cfg], culprit, problem)


def test_missing_config_and_missing_model(run_ckpt, tmp_path, models):
    assert_refused(run_ckpt, tmp_path, ["merge", tmp_path / "nope.yaml"], str(tmp_path / "nope.yaml"), "no such file")
    cfg = _config(tmp_path, f"merge_method: linear\nmodels:\n  - model: {tmp_path}/missing\n    parameters: {{weight: 1}}\n")
    code, out, err = run_ckpt("merge", cfg, "-o", tmp_path / "o")
    assert code == 2 and err.count("\n") == 1 and "missing" in err and not (tmp_path / "o").exists()


def test_an_input_that_fails_to_decode_is_one_line(run_ckpt, tmp_path, models):
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all}")
    cfg = _config(tmp_path, f"merge_method: linear\nmodels:\n  - model: {models[0]}/model.safetensors\n"
                            f"    parameters: {{weight: 1}}\n  - model: {bad}\n    parameters: {{weight: 1}}\n")
    code, out, err = run_ckpt("merge", cfg, "-o", tmp_path / "o.safetensors")
    assert code == 2 and err.count("\n") == 1 and err.startswith(f"error: model {bad}"), err
    assert not (tmp_path / "o.safetensors").exists()


def test_flags_with_a_config_are_refused(run_ckpt, tmp_path, models):
    cfg = _config(tmp_path, f"merge_method: linear\nmodels: [{{model: {models[0]}, parameters: {{weight: 1}}}}]\n")
    assert_refused(run_ckpt, tmp_path, ["merge", cfg, "--alpha", "0.3"], "--alpha with a config", "whole recipe")


def test_shapes_that_differ_are_named(run_ckpt, tmp_path):
    a = tiny_llama(tmp_path / "a", 1)
    sd = load_file(a / "model.safetensors")
    sd["model.embed_tokens.weight"] = torch.zeros(65, 32)
    (tmp_path / "b").mkdir()
    save_file(sd, tmp_path / "b" / "model.safetensors")
    shutil.copy(a / "config.json", tmp_path / "b")
    assert_refused(run_ckpt, tmp_path, ["merge", a, tmp_path / "b", "--alpha", "0.5", "-o", tmp_path / "o"],
                   "1 tensor has different shapes", "model.embed_tokens.weight")


def test_missing_tensors_are_refused_or_taken_from_the_reference(run_ckpt, tmp_path, models):
    sd = load_file(models[1] / "model.safetensors")
    gone = "model.layers.1.mlp.up_proj.weight"
    del sd[gone]
    sd["extra.weight"] = torch.ones(2)
    (tmp_path / "b").mkdir()
    save_file(sd, tmp_path / "b" / "model.safetensors")
    shutil.copy(models[1] / "config.json", tmp_path / "b")
    args = ["merge", models[0], tmp_path / "b", "--alpha", "0.5", "-o", tmp_path / "o"]
    assert_refused(run_ckpt, tmp_path, args, f"{tmp_path / 'b'} lacks 1 tensor", gone)
    code, out, err = run_ckpt(*args, "--allow-missing", "-q")
    assert code == 0, err
    got, base = tensors(tmp_path / "o"), tensors(models[0])
    assert torch.equal(got[gone], base[gone]) and "extra.weight" not in got
    assert "1 tensor some input lacks taken from" in out and "1 tensor the reference lacks left out" in out


def test_print_config_runs_the_same_merge(run_ckpt, tmp_path, models):
    code, text, err = run_ckpt("merge", models[0], models[1], "models_unused_placeholder"[:0] or "--alpha", "0.3",
                               "--print-config")
    assert code == 0 and "merge_method: weighted_sum" in text and "alpha: 0.3" in text, (text, err)
    code, out, err = run_ckpt("merge", models[0], models[1], "--alpha", "0.3", "-o", tmp_path / "a", "-q")
    assert code == 0, err
    cfg = _config(tmp_path, text)
    code, out, err = run_ckpt("merge", cfg, "-o", tmp_path / "b", "-q")
    assert code == 0, err
    assert max_diff(tensors(tmp_path / "a"), tensors(tmp_path / "b")) == 0


def test_flag_built_linear_equals_mergekit(run_ckpt, tmp_path, models):
    code, text, err = run_ckpt("merge", "--method", "linear", models[0], models[1], models[2], "--weight",
                               "0.2,0.3,0.5", "--param", "normalize=false", "--print-config")
    assert code == 0, err
    assert "normalize: false" in text
    cfg = _config(tmp_path, text + "dtype: float32\n")
    ref = mergekit_yaml(cfg.read_text(), tmp_path / "mk")
    code, out, err = run_ckpt("merge", "--method", "linear", models[0], models[1], models[2], "--weight",
                              "0.2,0.3,0.5", "--param", "normalize=false", "-o", tmp_path / "ck", "-q")
    assert code == 0, err
    assert max_diff(tensors(ref), tensors(tmp_path / "ck")) == 0


def test_output_dtype_model_card_recipe_and_report(run_ckpt, tmp_path, models):
    rep = tmp_path / "r.json"
    code, out, err = run_ckpt("merge", models[0], models[1], "--alpha", "0.25", "--to", "bf16", "-o", tmp_path / "o",
                              "--report", rep, "-q")
    assert code == 0, err
    o = tmp_path / "o"
    with safe_open(str(o / "model.safetensors"), "pt") as f:
        meta = f.metadata()
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}
    assert "merge_method: weighted_sum" in meta["ckpt_merge_recipe"]
    cfg = json.loads((o / "config.json").read_text())
    assert cfg.get("dtype", cfg.get("torch_dtype")) == "bfloat16"
    card = (o / "README.md").read_text()
    assert "weighted_sum" in card and "```yaml" in card and "mergekit_config.yml" not in card
    assert (o / "mergekit_config.yml").read_text() == meta["ckpt_merge_recipe"]
    facts = json.loads(rep.read_text())
    assert "merge_method: weighted_sum" in json.dumps(facts)


def test_tokenizer_source_takes_that_models_files(run_ckpt, tmp_path, models):
    a, b = tmp_path / "a", tmp_path / "b"
    shutil.copytree(models[0], a)
    shutil.copytree(models[1], b)
    (a / "tokenizer_config.json").write_text('{"from": "a"}')
    (b / "tokenizer_config.json").write_text('{"from": "b"}')
    (b / "special_tokens_map.json").write_text('{}')
    cfg = _config(tmp_path, f"merge_method: linear\nbase_model: {a}\nmodels:\n  - model: {a}\n    parameters: "
                            f"{{weight: 1}}\n  - model: {b}\n    parameters: {{weight: 1}}\ntokenizer_source: {b}\n")
    code, out, err = run_ckpt("merge", cfg, "-o", tmp_path / "o")
    assert code == 0, err
    assert json.loads((tmp_path / "o" / "tokenizer_config.json").read_text()) == {"from": "b"}
    assert (tmp_path / "o" / "special_tokens_map.json").exists()
    code, out, err = run_ckpt("merge", cfg, "-o", tmp_path / "o2", "--dry-run")
    assert code == 0 and not (tmp_path / "o2").exists()


def test_dry_run_and_seed_note(run_ckpt, tmp_path, models):
    code, out, err = run_ckpt("merge", models[0], models[1], "--alpha", "0.5", "--seed", "3", "--dry-run",
                              "-o", tmp_path / "o")
    assert code == 0 and "would write" in out and not (tmp_path / "o").exists()
    assert "not randomized" in out + err


@pytest.mark.parametrize("args, culprit, problem", [
    (["{m0}", "{m1}", "--weight", "0.1,0.2,0.3", "--method", "linear"], "--weight 0.1,0.2,0.3", "one per model"),
    (["{m0}", "{m1}", "--param", "alpha"], "--param alpha", "NAME=VALUE"),
    (["{m0}", "{m1}", "{m2}"], "merge: --method is needed", "weighted_sum"),
    (["{m0}", "{m1}", "--alpha", "0.5", "--keep-format", "--to", "bf16"], "--to bf16 and --keep-format", "choose one"),
    (["{m0}", "{m1}", "--alpha", "0.5", "--keep-format", "--layout", "original"], "--layout and --keep-format",
     "choose one"),
    (["{m0}", "{m1}", "--alpha", "0.5", "--tokenizer-source", "{m2}"], "tokenizer_source", "not one of the merged"),
    ([], "merge: give a config", "models to merge"),
])
def test_flag_errors_are_one_line(run_ckpt, tmp_path, models, args, culprit, problem):
    fill = {f"m{i}": str(m) for i, m in enumerate(models)}
    args = [a.format(**fill) for a in args]
    assert_refused(run_ckpt, tmp_path, ["merge", *args, "-o", tmp_path / "o"], culprit.format(**fill), problem)


def test_slices_of_a_model_without_layers_and_other_families_are_refused(run_ckpt, tmp_path, models):
    flux = tmp_path / "flux.safetensors"
    save_file({"double_blocks.0.img_attn.qkv.weight": torch.zeros(24, 8), "img_in.weight": torch.zeros(8, 4),
               "single_blocks.0.linear1.weight": torch.zeros(40, 8)}, flux)
    cfg = _config(tmp_path, f"merge_method: passthrough\nslices:\n  - sources:\n      - model: {flux}\n"
                            "        layer_range: [0, 1]\n")
    assert_refused(run_ckpt, tmp_path, ["merge", cfg, "-o", tmp_path / "o"], str(flux), "no `layers.N.` tensors")
    assert_refused(run_ckpt, tmp_path, ["merge", models[0], flux, "--alpha", "0.5", "-o", tmp_path / "o"],
                   f"{flux} is Flux", "models of one family")


def test_a_lora_that_matches_nothing_is_named(run_ckpt, tmp_path, models):
    lora = tmp_path / "lora.safetensors"
    save_file({"lora_unet_foo.lora_down.weight": torch.zeros(2, 8), "lora_unet_foo.lora_up.weight": torch.zeros(8, 2)},
              lora)
    cfg = _config(tmp_path, f"merge_method: linear\nmodels:\n  - model: {models[0]}\n    parameters: {{weight: 1}}\n"
                            f"  - model: {models[1]}+{lora}\n    parameters: {{weight: 1}}\n")
    assert_refused(run_ckpt, tmp_path, ["merge", cfg, "-o", tmp_path / "o"], f"model {models[1]}+{lora}",
                   "match")


def test_a_parameter_only_some_filters_give_is_named_per_tensor(run_ckpt, tmp_path, models):
    cfg = _config(tmp_path, f"merge_method: linear\nmodels:\n  - model: {models[0]}\n    parameters: {{weight: 1}}\n"
                            f"  - model: {models[1]}\n    parameters:\n      weight: [{{filter: mlp, value: 1}}]\n")
    assert_refused(run_ckpt, tmp_path, ["merge", cfg, "-o", tmp_path / "o"], f"{cfg}: parameters ({models[1]})",
                   "parameter weight is missing for")
    cfg.write_text(f"merge_method: linear\nmodels:\n  - model: {models[0]}\n    parameters: {{weight: 1}}\n"
                   f"  - model: {models[1]}\n")
    assert_refused(run_ckpt, tmp_path, ["merge", cfg, "-o", tmp_path / "o"], f"{cfg}: linear needs parameter weight",
                   f"for {models[1]}")


def test_max_shard_size_and_torch_format(run_ckpt, tmp_path, models):
    code, out, err = run_ckpt("merge", models[0], models[1], "--alpha", "0.5", "--max-shard-size", "20KB", "-o",
                              tmp_path / "s", "-q")
    assert code == 0, err
    shards = sorted(p.name for p in (tmp_path / "s").glob("*.safetensors"))
    assert len(shards) > 1 and (tmp_path / "s" / "model.safetensors.index.json").exists()
    want = tensors(tmp_path / "s")
    code, out, err = run_ckpt("merge", models[0], models[1], "--alpha", "0.5", "--format", "torch", "-o",
                              tmp_path / "t", "-q")
    assert code == 0, err
    got = {}
    for p in (tmp_path / "t").glob("*.bin"):
        got.update(torch.load(p, weights_only=True))
    for p in (tmp_path / "t").glob("*.pth"):
        got.update(torch.load(p, weights_only=True))
    assert max_diff(want, got) == 0


def test_the_lora_of_base_plus_lora_is_an_input(run_ckpt, tmp_path, models, capsys):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = get_peft_model(AutoModelForCausalLM.from_pretrained(models[1]), LoraConfig(r=2, target_modules=["q_proj"]))
    model.save_pretrained(tmp_path / "lora")
    capsys.readouterr()  # transformers' loading bars
    target = tmp_path / "lora" / "adapter_model.safetensors"
    before = target.read_bytes()
    cfg = _config(tmp_path, f"merge_method: linear\nmodels:\n  - model: {models[0]}\n    parameters: {{weight: 1}}\n"
                            f"  - model: {models[1]}+{tmp_path / 'lora'}\n    parameters: {{weight: 1}}\n")
    code, out, err = run_ckpt("merge", cfg, "-o", target, "--overwrite")
    assert code == 2 and err.count("\n") == 1 and "input" in err, err
    assert target.read_bytes() == before
