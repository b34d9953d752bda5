"""`ckpt merge-lora` against PEFT's own `merge_and_unload()` on tiny transformers models.

Bases and adapters are made and saved with `save_pretrained`; the oracle is the state dict of the
PEFT model after `merge_and_unload()`. Both sides merge in fp32 from fp32 weights; the only difference
is floating-point summation order (PEFT forms B @ A * s then adds, ckpt uses addmm), so the
tolerance is a few fp32 ulps (rtol 1e-5, atol 1e-6).
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

TOL = dict(rtol=1e-5, atol=1e-6)


def tiny_llama(attention_bias=False):
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   attention_bias=attention_bias, tie_word_embeddings=False)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg)


def randomize_adapter(model):
    """Non-zero B (and embedding A), magnitudes and modules_to_save, so every part matters."""
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name or "modules_to_save" in name:
                p.add_(torch.randn(p.shape, generator=g) * 0.2)


def check_against_peft(tmp_path, run_ckpt, base_model, config, *extra):
    base_dir, ad_dir, out = tmp_path / "base", tmp_path / "adapter", tmp_path / "merged"
    base_model.save_pretrained(base_dir)
    pm = peft.get_peft_model(base_model, config)
    randomize_adapter(pm)
    pm.save_pretrained(ad_dir)
    want = {k: v.detach().clone() for k, v in pm.merge_and_unload().state_dict().items()}
    code, stdout, err = run_ckpt("merge-lora", base_dir, ad_dir, "-o", out, "-q", *extra)
    assert code == 0, err
    got = load_file(out / "model.safetensors")
    stored = load_file(base_dir / "model.safetensors")
    assert set(got) == set(stored)
    changed = 0
    for k in got:
        torch.testing.assert_close(got[k], want[k].to(got[k].dtype), **TOL, msg=k)
        changed += not torch.equal(got[k], stored[k])
    assert changed and f"base tensors changed: {changed}" in stdout
    assert json.loads((out / "config.json").read_text()) == json.loads((base_dir / "config.json").read_text())
    return stdout


def test_peft_lora_patterns_bias_modules_to_save(tmp_path, run_ckpt):
    # lora_bias needs biases on the targets: attention_bias gives q/v/o biases
    cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "o_proj"],
                          rank_pattern={"layers.1.self_attn.q_proj": 2}, alpha_pattern={"v_proj": 3},
                          modules_to_save=["lm_head"], lora_bias=True)
    out = check_against_peft(tmp_path, run_ckpt, tiny_llama(attention_bias=True), cfg)
    assert "LoRA modules matched" in out


def test_peft_dora(tmp_path, run_ckpt):
    cfg = peft.LoraConfig(r=4, lora_alpha=6, target_modules=["q_proj", "v_proj", "down_proj", "embed_tokens"],
                          use_dora=True)
    check_against_peft(tmp_path, run_ckpt, tiny_llama(), cfg)


def test_peft_rslora(tmp_path, run_ckpt):
    cfg = peft.LoraConfig(r=8, lora_alpha=4, target_modules=["k_proj", "o_proj", "gate_proj", "embed_tokens"],
                          use_rslora=True)
    check_against_peft(tmp_path, run_ckpt, tiny_llama(), cfg)


def test_peft_fan_in_fan_out_conv1d(tmp_path, run_ckpt):
    """GPT-2 stores Conv1D weights [in, out]: the delta is (B @ A)^T."""
    gcfg = transformers.GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=50, n_positions=32,
                                   bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(gcfg)
    cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn", "c_proj"], fan_in_fan_out=True, lora_bias=True)
    check_against_peft(tmp_path, run_ckpt, model, cfg)


def test_peft_dora_fan_in_fan_out(tmp_path, run_ckpt):
    """DoRA on a transposed layer normalises the stored columns (whole-tensor path)."""
    gcfg = transformers.GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=50, n_positions=32,
                                   bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(gcfg)
    cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"], fan_in_fan_out=True, use_dora=True)
    check_against_peft(tmp_path, run_ckpt, model, cfg)
