"""`gemma2` (Gemma2Model): every norm + 1, lm_head left out (llama.cpp ties it), its own parameters (softcapping,
sliding window) and SentencePiece vocabulary."""

from __future__ import annotations

from ckpt.families.llm.arch import Export, LLMArch

GEMMA2_LAYER = ("input_layernorm", "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                "post_attention_layernorm", "pre_feedforward_layernorm", "mlp.gate_proj", "mlp.up_proj",
                "mlp.down_proj", "post_feedforward_layernorm")


class Gemma2(LLMArch):
    def parameters(self, w, x: Export, ftype: int) -> list[str]:
        """Gemma2Model.set_gguf_parameters (its own, not TextModel's)."""
        hparams, n_block = x.hparams, x.n_block
        w.add_context_length(hparams["max_position_embeddings"])
        w.add_embedding_length(hparams["hidden_size"])
        w.add_block_count(n_block)
        w.add_feed_forward_length(hparams["intermediate_size"])
        w.add_head_count(hparams["num_attention_heads"])
        w.add_head_count_kv(hparams.get("num_key_value_heads", hparams["num_attention_heads"]))
        w.add_layer_norm_rms_eps(hparams["rms_norm_eps"])
        w.add_key_length(hparams["head_dim"])
        w.add_value_length(hparams["head_dim"])
        w.add_file_type(ftype)
        w.add_attn_logit_softcapping(hparams["attn_logit_softcapping"])
        w.add_final_logit_softcapping(hparams["final_logit_softcapping"])
        w.add_sliding_window(hparams["sliding_window"])
        return []


ARCH = Gemma2("gemma2", "Gemma2ForCausalLM", "gemma2", GEMMA2_LAYER, hf_classes=("Gemma2ForCausalLM",),
              params="gemma2", vocab="gemma2", norm_shift=1.0, drop=("lm_head.weight",), readable=False)
