"""`llama` (LlamaModel in the reference's conversion/llama.py): Llama, Mistral and Mixtral checkpoints. q/k rows
permuted for llama.cpp's RoPE, `{arch}.vocab_size` and `.rope.dimension_count` (LlamaModel.set_gguf_parameters),
Llama 3 RoPE scaling factors as `rope_freqs.weight` (generate_extra_tensors), Mixtral's experts stacked."""

from __future__ import annotations

import math

from ckpt.lazy import torch

from ckpt.families.llm.arch import LLAMA_LAYER, Export, LLMArch
from ckpt.io.tensors import ComputedTensor, Tensor


class Llama(LLMArch):
    def extra_tensors(self, x: Export) -> list[tuple[str, Tensor]]:
        factors = llama3_rope_factors(x.rope, x.hparams)
        if factors is None:
            return []
        x.notes.append("rope_freqs.weight: Llama 3 RoPE scaling factors computed from config.json, as llama.cpp's "
                       "converter adds them")
        return [("rope_freqs.weight", ComputedTensor("rope_freqs.weight", lambda f=factors: f, torch.float32,
                                                     tuple(factors.shape)))]


def llama3_rope_factors(rope: dict, hparams: dict) -> torch.Tensor | None:
    """LlamaModel.generate_extra_tensors: `rope_freqs.weight` for rope type llama3, computed as the reference does."""
    params = rope.get("full_attention", rope)
    if not params or str(params.get("rope_type", "")).lower() != "llama3":
        return None
    # (floats: config_keys lets an integer 1e30 through as a number, and torch.pow takes no int past int64)
    base = float(params.get("rope_theta", 10000.0))
    dim = hparams.get("head_dim") or hparams["hidden_size"] // hparams["num_attention_heads"]
    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factor = float(params.get("factor", 8.0))
    low, high = float(params.get("low_freq_factor", 1.0)), float(params.get("high_freq_factor", 4.0))
    old = params.get("original_max_position_embeddings", 8192)
    low_wavelen, high_wavelen = old / low, old / high
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            out.append(1)
        elif wavelen > low_wavelen:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(out, dtype=torch.float32)


ARCH = Llama("llama", "LlamaForCausalLM", "llama", LLAMA_LAYER, rope_permute=True,
             bias_flags={"attention_bias": ("attn_q.bias", "attn_k.bias", "attn_v.bias", "attn_output.bias"),
                         "mlp_bias": ("ffn_gate.bias", "ffn_up.bias", "ffn_down.bias")},
             hf_classes=("LlamaForCausalLM", "LLaMAForCausalLM", "MistralForCausalLM", "MixtralForCausalLM"),
             llama_params=True, vocab="llama",
             experts=("block_sparse_moe.experts", "model.layers.{bid}.block_sparse_moe.experts.{x}.{w}.weight",
                      ("w1", "w2", "w3"), "layers.{bid}.feed_forward.experts.{w}.weight"))
