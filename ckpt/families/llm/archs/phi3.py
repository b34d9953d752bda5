"""`phi3` (Phi3MiniModel): fused qkv and gate_up kept fused (llama.cpp splits them), its own parameters and
vocabulary, a long-context model's `rope_factors_long/short.weight` and attention factor.

Read back as `Phi3ForCausalLM`: `attn_qkv` and `ffn_up` are the HF model's own fused `qkv_proj` and `gate_up_proj`
(checked against the head counts and feed_forward_length), the RoPE factors go back into config.json's
`rope_parameters` (longrope) with the original context and, where it is not the one transformers computes, the
attention factor; the rotary share from `rope.dimension_count`; the sliding window the original had."""

from __future__ import annotations

import math

from ckpt.lazy import numpy as np
from ckpt.lazy import torch

from ckpt.errors import CkptError, file_error
from ckpt.families.llm import config_keys
from ckpt.families.llm.arch import Export, LLMArch, Readback
from ckpt.families.llm.moe_readback import rope_config
from ckpt.families.llm.readback_keys import pad_token
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

    # ------------------------------------------------------------------ reading back (GGUF -> HF)

    def read_config(self, r: Readback) -> None:
        """Phi3Config from the metadata and the fused tensors: `attn_qkv`'s rows are the query heads and twice the
        key/value heads, the rotary share is `rope.dimension_count` of the head, the RoPE factors (both or none, half
        the rotary dimensions each) become a longrope `rope_parameters`, with the attention factor only where it
        differs from the one transformers derives (max_position_embeddings over the original context), so that the
        read-back model computes what the original did; the sliding window the original had (llama.cpp runs Phi-3
        without it) and the tokenizer's padding token (Phi3Config's default 32000 may lie past the vocabulary)."""
        import gguf

        from ckpt.quant.gguf_llm import Meta

        K = gguf.Keys
        m, cfg = Meta(r.header, self.arch), r.cfg
        heads, kv, head = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
        for name, t in r.stored.items():
            if name.endswith(".attn_qkv.weight") and tuple(t.stored_shape[:1]) != ((heads + 2 * kv) * head,):
                raise m.bad(m.key(K.Attention.HEAD_COUNT_KV), kv, f"but {name} is {list(t.stored_shape)}, not "
                                                                  f"{heads} query + 2 x {kv} key/value heads of {head}")
        rope = rope_config(m, cfg, head)
        orig = m.integer(K.Rope.SCALING_ORIG_CTX_LEN, None)
        long, short = (r.stored.get(f"rope_factors_{k}.weight") for k in ("long", "short"))
        attn_key = m.key(K.Rope.SCALING_ATTN_FACTOR)
        attn = m.number(K.Rope.SCALING_ATTN_FACTOR, None)
        if long is None and short is None:
            if attn is not None and attn != 1.0:
                raise m.bad(attn_key, attn, "but the file has no rope_factors_long/short.weight it scales")
        else:
            half = round(rope["partial_rotary_factor"] * head) // 2
            for gname, t in (("rope_factors_long.weight", long), ("rope_factors_short.weight", short)):
                if t is None or tuple(t.stored_shape) != (half,):
                    shape = "missing" if t is None else f"{list(t.stored_shape)}"
                    raise m.bad(m.key(K.Rope.DIMENSION_COUNT), round(rope["partial_rotary_factor"] * head),
                                f"but {gname} is {shape}, not [{half}] (half the rotary dimensions)")
            orig = m.integer(K.Rope.SCALING_ORIG_CTX_LEN, lo=2)  # (longrope divides by its logarithm)
            rope.update(rope_type="longrope", original_max_position_embeddings=orig)
            for k, t in (("long_factor", long), ("short_factor", short)):
                values = r.value(f"rope_factors_{k[:-7]}.weight", k).read_all(torch.device("cpu")).float().numpy()
                if not np.isfinite(values).all() or (values <= 0).any():
                    raise file_error(r.path, f"tensor rope_factors_{k[:-7]}.weight holds a value that is not a "
                                             "finite number above 0")
                rope[k] = [float(str(v)) for v in values.astype(np.float32)]
                r.into_config[f"rope_factors_{k[:-7]}.weight"] = f"config.json rope_parameters {k}"
            scale = cfg["max_position_embeddings"] / orig
            derived = math.sqrt(1 + math.log(scale) / math.log(orig)) if scale > 1.0 else 1.0
            if attn is not None and np.float32(attn) != np.float32(derived):
                rope["attention_factor"] = attn
                r.notes.append(f"config.json rope_parameters attention_factor {attn} from {attn_key} (not the "
                               f"{np.float32(derived)} transformers derives for longrope)")
        window = m.integer(K.Attention.SLIDING_WINDOW, 0, lo=0)
        cfg.update(rope_parameters=rope, sliding_window=window or None, pad_token_id=None)
        if orig is not None:
            cfg["original_max_position_embeddings"] = orig
        if window:
            r.notes.append(f"config.json sliding_window {window} as the original had it (llama.cpp runs Phi-3 "
                           "without a sliding window)")
        pad_token(m, cfg)


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
            ffn_up_rows=2)
