"""Test-side GGUF makers: what llama.cpp's convert_hf_to_gguf.py and ComfyUI-GGUF's convert.py write,
rebuilt small from gguf's own tables and writer, so the tests have real files to read back."""

from __future__ import annotations

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as T


def quantized(x: np.ndarray, t) -> tuple[np.ndarray, np.ndarray]:
    """(stored data, gguf's own dequantized float32 values) of `x` in GGML type `t`."""
    q = gguf.quants.quantize(x.astype(np.float32), t)
    return q, gguf.quants.dequantize(q, t).reshape(x.shape)


def write_gguf(path, arch: str, tensors: dict, kv=None):
    """tensors: name -> (stored numpy data, ggml type) or a float32 array (written F32)."""
    w = gguf.GGUFWriter(str(path), arch=arch)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    for key, value in (kv or {}).items():
        if isinstance(value, tuple):
            w.add_key_value(key, value[0], value[1], sub_type=value[2] if len(value) > 2 else None)
        elif isinstance(value, str):
            w.add_string(key, value)
        elif isinstance(value, bool):
            w.add_bool(key, value)
        elif isinstance(value, int):
            w.add_uint32(key, value)
        elif isinstance(value, float):
            w.add_float32(key, value)
        else:
            w.add_array(key, value)
    for name, v in tensors.items():
        if isinstance(v, tuple):
            data, t = v
            w.add_tensor(name, data, raw_dtype=t)
        else:
            w.add_tensor(name, v)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def llama_permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp's LlamaModel.permute (rows of each head (2, hd/2) -> (hd/2, 2))."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


ARCH_ENUM = {v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}


def hf_to_gguf(model, arch: str, path, qtype=T.F32, permute: bool = False):
    """An HF causal LM written the way llama.cpp's converter writes it: gguf's tensor names, q/k rows
    permuted for llama, 1-D tensors in F32, matrices in `qtype`, metadata from the config.
    Returns {gguf name: float32 values as stored (after the permute and quantization)}."""
    cfg = model.config
    table = gguf.get_tensor_name_map(ARCH_ENUM[arch], cfg.num_hidden_layers)
    w = gguf.GGUFWriter(str(path), arch=arch)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_vocab_size(cfg.vocab_size)  # real files have tokenizer.ggml.tokens, which transformers counts instead
    if arch == "llama":
        w.add_rope_dimension_count(head_dim)
    if cfg.bos_token_id is not None:
        w.add_bos_token_id(cfg.bos_token_id)
    if cfg.eos_token_id is not None:
        w.add_eos_token_id(cfg.eos_token_id)
    stored = {}
    for hf_name, value in model.state_dict().items():
        if hf_name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        base, suffix = hf_name.rsplit(".", 1)
        name = table.get_name(base) + "." + suffix
        x = value.detach().float()
        if permute and base.endswith("self_attn.q_proj"):
            x = llama_permute(x, cfg.num_attention_heads)
        if permute and base.endswith("self_attn.k_proj"):
            x = llama_permute(x, cfg.num_key_value_heads)
        x = x.numpy()
        t = T.F32 if x.ndim == 1 else qtype
        q, values = quantized(x, t) if t != T.F32 else (x, x)
        w.add_tensor(name, q, raw_dtype=t)
        stored[name] = values
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return stored


LLM_KV = {"attention.head_count": 2, "attention.head_count_kv": 1, "embedding_length": 32, "feed_forward_length": 64,
          "block_count": 1, "attention.layer_norm_rms_epsilon": 1e-6, "context_length": 64,
          "rope.freq_base": 10000.0}


def tiny_llm_gguf(path, arch: str = "qwen2", **kv):
    """A one-block llama.cpp LLM GGUF (2 heads of 16, 1 kv head, hidden 32, ffn 64) with its metadata;
    `kv` overrides or adds keys under `{arch}.` (dots as `__`; None drops a key; a (value, type) tuple
    gives the GGUF type, as write_gguf takes it)."""
    rng = np.random.default_rng(1)
    meta = {f"{arch}.{k}": v for k, v in LLM_KV.items()}
    for k, v in kv.items():
        key = k.replace("__", ".")
        meta[key if key.startswith(("tokenizer.", "general.")) else f"{arch}.{key}"] = v
    tensors = {"token_embd.weight": (8, 32), "blk.0.attn_q.weight": (32, 32), "blk.0.attn_k.weight": (16, 32),
               "blk.0.attn_v.weight": (16, 32), "blk.0.ffn_up.weight": (64, 32), "output_norm.weight": (32,)}
    write_gguf(path, arch, {n: rng.standard_normal(s).astype(np.float32) for n, s in tensors.items()},
               kv={k: v for k, v in meta.items() if v is not None})
    return path
