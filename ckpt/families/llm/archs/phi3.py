"""`phi3` (Phi3MiniModel): fused qkv and gate_up kept fused (llama.cpp splits them), its own parameters and
vocabulary, a long-context model's `rope_factors_long/short.weight` and attention factor."""

from __future__ import annotations

import math

from ckpt.lazy import torch

from ckpt.errors import CkptError
from ckpt.families.llm import config_keys
from ckpt.families.llm.arch import Export, LLMArch
from ckpt.families.llm.text import find
from ckpt.io.tensors import ComputedTensor, Tensor

PHI3_LAYER = ("input_layernorm", "self_attn.qkv_proj", "self_attn.o_proj", "post_attention_layernorm",
              "mlp.gate_up_proj", "mlp.down_proj")


class Phi3(LLMArch):
    def extra_tensors(self, x: Export) -> list[tuple[str, Tensor]]:
        factors = phi3_rope_factors(x.hparams, x.rope, x.config_path)
        if factors is None:
            return []
        return [(g, ComputedTensor(g, lambda f=f: f, torch.float32, tuple(f.shape)))
                for g, f in (("rope_factors_long.weight", factors[1]), ("rope_factors_short.weight", factors[2]))]

    def early_parameters(self, w, x: Export) -> None:
        factors = phi3_rope_factors(x.hparams, x.rope, x.config_path)
        if factors is not None:  # set while the reference prepares its tensors, before its metadata
            w.add_rope_scaling_attn_factors(factors[0])

    def parameters(self, w, x: Export, ftype: int) -> list[str]:
        """Phi3MiniModel.set_gguf_parameters (its own)."""
        hparams, rope, n_block = x.hparams, x.rope, x.n_block
        n_embd, n_head, rope_dims = _phi3_rope(hparams, rope)
        w.add_context_length(find(hparams, ["n_positions", "max_position_embeddings"], optional=False))
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        w.add_embedding_length(n_embd)
        w.add_feed_forward_length(find(hparams, ["intermediate_size"], optional=False))
        w.add_block_count(n_block)
        w.add_head_count(n_head)
        w.add_head_count_kv(find(hparams, ["num_key_value_heads", "n_head_kv"], optional=False))
        w.add_layer_norm_rms_eps(find(hparams, ["rms_norm_eps"], optional=False))
        w.add_rope_dimension_count(rope_dims)
        w.add_rope_freq_base(rope.get("full_attention", rope)["rope_theta"])
        w.add_file_type(ftype)
        w.add_sliding_window(hparams.get("sliding_window") or 0)
        return []


def _phi3_rope(hparams: dict, rope: dict, where="config.json") -> tuple[int, int, int]:
    n_embd = find(hparams, ["hidden_size", "n_embd"], optional=False)
    n_head = find(hparams, ["num_attention_heads", "n_head"], optional=False)
    if rope.get("original_max_position_embeddings") is None:
        raise CkptError(f"{where}: has no original_max_position_embeddings, which llama.cpp's Phi-3 converter needs")
    return n_embd, n_head, int(rope.get("partial_rotary_factor", 1.0) * n_embd) // n_head


def phi3_rope_factors(hparams: dict, rope: dict, where="config.json"):
    """Phi3MiniModel.generate_extra_tensors: (attention factor, long factors, short factors) of a long-context
    model, None without long factors."""
    n_embd, n_head, rope_dims = _phi3_rope(hparams, rope, where)
    long, short = rope.get("long_factor"), rope.get("short_factor")
    if not long:
        return None
    orig = rope["original_max_position_embeddings"]
    scale = find(hparams, ["n_positions", "max_position_embeddings"], optional=False) / orig
    kind = str(rope.get("rope_type", "")).lower()
    if scale > 1.0 and orig < 2 and kind in ("su", "longrope"):
        raise CkptError(f"{where}: original_max_position_embeddings is {orig}; Phi-3's long-context attention factor "
                        "divides by its logarithm")
    if kind in ("su", "longrope"):
        attn = math.sqrt(1 + math.log(scale) / math.log(orig)) if scale > 1.0 else 1.0
    elif kind == "yarn":
        attn = 0.1 * math.log(scale) + 1.0 if scale > 1.0 else 1.0
    else:
        raise CkptError(f"{where}: rope type {config_keys.show(kind)} with long_factor: llama.cpp's Phi-3 converter "
                        "supports longrope, su and yarn")
    if short is None or len(long) != len(short) or len(long) != rope_dims / 2:
        raise CkptError(f"{where}: long_factor has {len(long)} values and short_factor "
                        f"{len(short) if short is not None else 'none'}; each must have {rope_dims // 2} (half of "
                        "the rotary dimensions)")
    return attn, torch.tensor(long, dtype=torch.float32), torch.tensor(short, dtype=torch.float32)


ARCH = Phi3("phi3", "Phi3ForCausalLM", "phi3", PHI3_LAYER, hf_classes=("Phi3ForCausalLM",), params="phi3", vocab="phi3",
            readable=False)
