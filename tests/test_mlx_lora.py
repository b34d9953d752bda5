"""mlx-lm LoRA adapter folders (adapters.safetensors + adapter_config.json) in the main suite, which has no mlx
(tests/serve/test_mlx_lora.py holds ckpt's merges to `mlx_lm fuse` itself, byte for byte):

- the same adapter restated in PEFT's terms (lora_A = lora_a.T, lora_B = lora_b.T, lora_alpha = scale * rank) and
  merged by PEFT's `merge_and_unload` gives ckpt's merge of the mlx-lm folder (fp32, a few ulps: summation order),
  and the merged folder loads strictly in transformers;
- `ckpt lora convert --format peft` of the folder is an adapter PEFT loads and merges to the same values;
- `ckpt inspect` names it and its settings;
- every bad folder is refused in one line, nothing written.
"""

from __future__ import annotations

import json

import pytest
import torch
from helpers.llm import load_strict, tiny
from helpers.refusals import assert_refused
from safetensors.torch import load_file, save_file

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

TOL = dict(rtol=1e-5, atol=1e-6)
TARGETS = ("self_attn.q_proj", "self_attn.v_proj", "mlp.down_proj")


def _base(tmp_path):
    model = tiny("llama", tie_word_embeddings=False)
    model.save_pretrained(tmp_path / "base")
    return model


def _adapter(folder, model, rank=4, scale=20.0, layers=(1,), config=None, tensors=None, drop=()):
    """An adapter folder as `mlx_lm lora` saves it: lora_a [in, r], lora_b [r, out] (fp32) under each module path."""
    g = torch.Generator().manual_seed(3)
    sd = {}
    for i in layers:
        for t in TARGETS:
            w = model.get_submodule(f"model.layers.{i}.{t}").weight
            sd[f"model.layers.{i}.{t}.lora_a"] = torch.randn(w.shape[1], rank, generator=g) * 0.1
            sd[f"model.layers.{i}.{t}.lora_b"] = torch.randn(rank, w.shape[0], generator=g) * 0.1
    for k in drop:
        del sd[k]
    sd.update(tensors or {})
    folder.mkdir(parents=True, exist_ok=True)
    save_file(sd, folder / "adapters.safetensors", metadata={"format": "mlx"})
    cfg = {"fine_tune_type": "lora", "num_layers": len(layers),
           "lora_parameters": {"rank": rank, "scale": scale, "dropout": 0.0}}
    for k, v in (config or {}).items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    (folder / "adapter_config.json").write_text(json.dumps(cfg, indent=4))
    return sd


def _peft_merged(model, sd, rank, scale):
    """PEFT's merge of the same factors: its LoRA layers given lora_A = lora_a.T, lora_B = lora_b.T."""
    cfg = peft.LoraConfig(r=rank, lora_alpha=scale * rank, target_modules=[t.split(".")[-1] for t in TARGETS])
    pm = peft.get_peft_model(model, cfg)
    with torch.no_grad():
        for name, mod in pm.named_modules():
            key = name.removeprefix("base_model.model.")
            if f"{key}.lora_a" in sd:
                mod.lora_A["default"].weight.copy_(sd[f"{key}.lora_a"].T)
                mod.lora_B["default"].weight.copy_(sd[f"{key}.lora_b"].T)
            elif hasattr(mod, "lora_B"):
                mod.lora_B["default"].weight.zero_()
    return {k: v.detach().clone() for k, v in pm.merge_and_unload().state_dict().items()}


def test_merge_is_peft_merge_of_the_same_factors(tmp_path, run_ckpt):
    model = _base(tmp_path)
    sd = _adapter(tmp_path / "adapters", model, rank=4, scale=20.0, layers=(0, 1))
    want = _peft_merged(model, sd, 4, 20.0)
    code, out, err = run_ckpt("merge-lora", tmp_path / "base", tmp_path / "adapters", "-o", tmp_path / "m")
    assert code == 0, err
    got = load_file(tmp_path / "m" / "model.safetensors")
    stored = load_file(tmp_path / "base" / "model.safetensors")
    changed = [k for k in got if not torch.equal(got[k], stored[k])]
    assert len(changed) == 6
    for k in got:
        torch.testing.assert_close(got[k], want[k], **TOL, msg=k)
    load_strict(tmp_path / "m", transformers.LlamaForCausalLM)


def test_lora_convert_to_peft_is_loaded_by_peft(tmp_path, run_ckpt):
    model = _base(tmp_path)
    _adapter(tmp_path / "adapters", model, rank=8, scale=2.0)
    code, _, err = run_ckpt("lora", "convert", tmp_path / "adapters", "--format", "peft", "-o", tmp_path / "peft")
    assert code == 0, err
    assert json.loads((tmp_path / "peft" / "adapter_config.json").read_text())["lora_alpha"] == 16
    pm = peft.PeftModel.from_pretrained(model, tmp_path / "peft")
    want = pm.merge_and_unload().state_dict()
    code, _, err = run_ckpt("merge-lora", tmp_path / "base", tmp_path / "adapters", "-o", tmp_path / "m")
    assert code == 0, err
    got = load_file(tmp_path / "m" / "model.safetensors")
    for k in got:
        torch.testing.assert_close(got[k], want[k], **TOL, msg=k)


def test_inspect_names_an_mlx_lm_adapter(tmp_path, run_ckpt):
    _adapter(tmp_path / "adapters", tiny("llama"), rank=4, scale=20.0)
    code, out, err = run_ckpt("inspect", tmp_path / "adapters")
    assert code == 0, err
    assert "mlx-lm LoRA; 3 modules, rank 4" in out
    assert "fine_tune_type=lora, rank=4, scale=20.0, num_layers=1" in out


L1 = "model.layers.1.self_attn.q_proj"


@pytest.mark.parametrize("case,culprit,problem", [
    ("no_config", "adapters", "needs adapter_config.json beside adapters.safetensors"),
    ("type", "adapters/adapter_config.json", "fine_tune_type 'qlora' is not one mlx-lm writes"),
    ("dora", "adapters/adapter_config.json", "fine_tune_type 'dora' is not merged"),
    ("full", "adapters/adapter_config.json", "fine_tune_type 'full'"),
    ("alpha", "adapters/adapter_config.json", "scale, not alpha"),
    ("rank", "adapters/adapters.safetensors", "/ lora_b [4, 64] do not have rank 8 (adapter_config.json"),
    ("half", "adapters/adapters.safetensors", f"module '{L1}' has lora_a only"),
    ("switch", "adapters/adapters.safetensors", "stacked experts (LoRASwitchLinear) are not merged"),
    ("keys", "adapters/adapters.safetensors", "is not one of adapter_config.json lora_parameters keys"),
    ("no_module", "adapters", "match no base tensor (e.g. 'model.layers.7.self_attn.q_proj.lora_a'"),
    ("bad_json", "adapters/adapter_config.json", "is not valid JSON"),
])
def test_refuses_a_bad_adapter_folder(tmp_path, run_ckpt, capsys, case, culprit, problem):
    model = _base(tmp_path)
    capsys.readouterr()  # transformers' save progress
    rank, config, tensors, drop = 4, {}, {}, ()
    if case == "type":
        config = {"fine_tune_type": "qlora"}
    elif case in ("dora", "full"):
        config = {"fine_tune_type": case}
    elif case == "alpha":
        config = {"lora_parameters": {"rank": 4, "alpha": 16, "dropout": 0.0}}
    elif case == "rank":
        config = {"lora_parameters": {"rank": 8, "scale": 1.0}}
    elif case == "half":
        drop = (f"{L1}.lora_b",)
    elif case == "switch":
        tensors = {"model.layers.1.mlp.switch_mlp.up_proj.lora_a": torch.zeros(2, 4, 64),
                   "model.layers.1.mlp.switch_mlp.up_proj.lora_b": torch.zeros(2, 96, 4)}
    elif case == "keys":
        config = {"lora_parameters": {"rank": 4, "scale": 1.0, "keys": ["self_attn.q_proj", "self_attn.v_proj"]}}
    elif case == "no_module":
        tensors = {"model.layers.7.self_attn.q_proj.lora_a": torch.zeros(64, 4),
                   "model.layers.7.self_attn.q_proj.lora_b": torch.zeros(4, 64)}
    _adapter(tmp_path / "adapters", model, rank=rank, config=config, tensors=tensors, drop=drop)
    if case == "no_config":
        (tmp_path / "adapters" / "adapter_config.json").unlink()
    elif case == "bad_json":
        (tmp_path / "adapters" / "adapter_config.json").write_text("{")
    culprit = str(tmp_path / culprit)
    assert_refused(run_ckpt, tmp_path, ["merge-lora", tmp_path / "base", tmp_path / "adapters", "-o",
                                        tmp_path / "out"], culprit, problem)
