"""Tiny transformers causal LMs (llama, qwen2, qwen3) with norms away from 1, the models the GGUF LLM tests
convert and compare against transformers' own GGUF loader."""

from __future__ import annotations

import torch


def tiny(kind, **kw):
    import transformers

    common = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-5)
    common.update(kw)
    cfg_cls, model_cls = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
                          "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
                          "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM)}[kind]
    torch.manual_seed(0)
    model = model_cls(cfg_cls(**common)).eval()
    with torch.no_grad():  # norms away from 1, so a dropped +1 or a swapped norm shows
        for n, p in model.named_parameters():
            if "norm" in n:
                p.add_(torch.randn(p.shape) * 0.1)
    return model


def load_strict(folder, cls, **kwargs):
    """`cls.from_pretrained(folder, **kwargs)` that loaded every weight: no missing, unexpected or mismatched
    key and no error message."""
    model, info = cls.from_pretrained(folder, output_loading_info=True, **kwargs)
    assert not any(info.values()), info
    return model
