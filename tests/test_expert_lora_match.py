"""PEFT `target_parameters` LoRAs on gpt-oss expert banks, matched once for every command (`match_loras` gives their
patches the expert adapter, `experts_patches`): `ckpt merge BASE+LORA` equals `ckpt merge-lora`, and a LoRA on
`gate_up_proj` alone (which PEFT saves under the name down_proj's takes when both banks are targeted) lands on
gate_up_proj, equal to PEFT's merge_and_unload on transformers' dequantized model.

The base, the oracle's dequantized banks and the PEFT adapters are made as tests/test_merge_quant_llm.py makes them
(helpers.mxfp4_ref's MXFP4 folder, transformers' `convert_moe_packed_tensors`, PEFT >= 0.17 ParamWrapper LoRAs)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from helpers import quant_llm_merge as qm  # noqa: E402

TOL = dict(rtol=1e-5, atol=1e-6)  # PEFT scales the product before adding it, ckpt adds with the scale as alpha


@pytest.fixture(scope="module")
def gptoss(tmp_path_factory):
    """(root, {bank: transformers' dequantized bank}): a gpt-oss MXFP4 folder `q` and three PEFT LoRAs: `lora` (both
    banks + q_proj), `down` (down_proj alone, rslora), `gate_up` (gate_up_proj alone)."""
    root = tmp_path_factory.mktemp("gptoss")
    return root, qm.gptoss_with_loras(root)


def _merge_lora(run_ckpt, base, lora, out):
    code, text, err = run_ckpt("merge-lora", base, lora, "--to", "fp32", "-o", out)
    assert code == 0, err
    return text, load_file(out / "model.safetensors")


@pytest.mark.parametrize("lora", ["lora", "down", "gate_up"])
def test_model_merge_of_base_plus_lora_equals_merge_lora(gptoss, run_ckpt, tmp_path, lora):
    """mergekit's `model: BASE+LORA` in a linear merge of one model at weight 1 (x * 1 / 1: the model itself),
    in fp32: every tensor equals merge-lora's fp32 output bit for bit, expert banks included."""
    root, dequantized = gptoss
    _, want = _merge_lora(run_ckpt, root / "q", root / lora, tmp_path / "ml")
    cfg = tmp_path / "m.yaml"
    cfg.write_text(f"merge_method: linear\nmodels:\n  - model: {root / 'q'}+{root / lora}\n"
                   "    parameters: {weight: 1.0}\ndtype: float32\n")
    code, out, err = run_ckpt("merge", cfg, "--to", "fp32", "-o", tmp_path / "mm")
    assert code == 0, err
    got = load_file(tmp_path / "mm" / "model.safetensors")
    assert set(got) == set(want)
    for k, v in got.items():
        assert v.dtype == want[k].dtype and torch.equal(v, want[k]), k
    bank = "gate_up_proj" if lora == "gate_up" else "down_proj"  # the LoRA changed its bank
    changed = [k for k in got if k.endswith(f"experts.{bank}")]
    assert len(changed) == 2 and all(not torch.equal(got[k], dequantized[k].float()) for k in changed)


def test_gate_up_alone_lands_on_gate_up_and_equals_peft(gptoss, run_ckpt, tmp_path):
    """A LoRA on gate_up_proj alone is saved as `mlp.experts` (down_proj's name when both banks are targeted); its
    factors [2 * intermediate, hidden] cannot fit down_proj, so they land on gate_up_proj: equal to PEFT's
    merge_and_unload within a few fp32 ulps (PEFT scales the product before adding it, ckpt adds with the scale as
    alpha), down_proj untouched bit for bit."""
    root, dequantized = gptoss
    want = qm.peft_merged(root / "q", dequantized, root / "gate_up", transformers.GptOssForCausalLM,
                          transformers.GptOssConfig)
    text, got = _merge_lora(run_ckpt, root / "q", root / "gate_up", tmp_path / "m")
    assert set(got) == set(want)
    banks = [k for k in got if k.endswith(".mlp.experts.gate_up_proj")]
    assert len(banks) == 2 and "base tensors changed: 2" in text
    for k, v in got.items():
        if k in banks:
            torch.testing.assert_close(v, want[k], **TOL, msg=lambda m: f"{k}: {m}")
            assert not torch.equal(v, dequantized[k].float()), k
        else:
            assert torch.equal(v, want[k]), k


def test_both_banks_keep_down_proj_reading(gptoss, run_ckpt, tmp_path):
    """With both banks targeted, `mlp.experts` stays down_proj's (its `.base_layer` is gate_up_proj's): the
    fallback to gate_up_proj never moves a LoRA that has both."""
    root, _ = gptoss
    text, _ = _merge_lora(run_ckpt, root / "q", root / "lora", tmp_path / "m")
    assert "base tensors changed: 6" in text  # 2 layers x (down_proj, gate_up_proj, q_proj)
