"""`gemma2` (Gemma2Model): every norm + 1, lm_head left out (llama.cpp ties it), its own parameters (softcapping,
sliding window) and SentencePiece vocabulary.

Read back as `Gemma2ForCausalLM` (the norms' shift taken off by the reader, `LLMArch.norm_shift`; lm_head tied to the
embeddings, as llama.cpp runs it) with the attention llama.cpp computes: every other layer on the sliding window,
the softcappings, the query scale of its `f_attention_scale`."""

from __future__ import annotations

from ckpt.families.llm.arch import Export, LLMArch, Readback
from ckpt.families.llm.readback_keys import check_head_dim, layer_types, pad_token, swa_layers

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

    # ------------------------------------------------------------------ reading back (GGUF -> HF)

    def read_config(self, r: Readback) -> None:
        """Gemma2Config as llama.cpp's gemma2 reads the metadata: the sliding window (4096 where the file has none)
        on every other layer (its pattern of 2 unless the file says otherwise), one RoPE base for all layers, the
        attention and final softcappings (50 and 30 where the file has none), the query scale of
        `f_attention_scale` (head_dim; hidden / heads for the 46-layer 27B), GELU-tanh, the head size checked against
        `attention.key_length`."""
        import gguf

        from ckpt.quant.gguf_llm import Meta

        K = gguf.Keys
        m, cfg = Meta(r.header, self.arch), r.cfg
        check_head_dim(m, r)
        n = cfg["num_hidden_layers"]
        theta = cfg["rope_theta"]
        if (local := m.number(K.Rope.FREQ_BASE_SWA, None)) is not None and local != theta:
            raise m.bad(m.key(K.Rope.FREQ_BASE_SWA), local, f"not the global layers' {theta} (Gemma2ForCausalLM has "
                                                            "one RoPE base)")
        notes = []  # keys the file may lack: llama.cpp's defaults for gemma2 (llama_hparams, its loader)
        for key, default, what in ((K.Attention.SLIDING_WINDOW, 4096, "sliding_window"),
                                   (K.LLM.ATTN_LOGIT_SOFTCAPPING, 50.0, "attn_logit_softcapping"),
                                   (K.LLM.FINAL_LOGIT_SOFTCAPPING, 30.0, "final_logit_softcapping")):
            if r.header.value(m.key(key)) is None:
                notes.append(f"{what} {default}")
        if m.number(K.Rope.FREQ_BASE, None) is None:
            notes.append(f"rope_theta {theta}")
        cfg.pop("hidden_act", None)
        cfg.update(hidden_activation="gelu_pytorch_tanh", sliding_window=m.integer(K.Attention.SLIDING_WINDOW, 4096),
                   layer_types=layer_types(swa_layers(m, n, 2)),
                   query_pre_attn_scalar=cfg["hidden_size"] // cfg["num_attention_heads"] if n == 46 else
                   cfg["head_dim"],
                   attn_logit_softcapping=m.number(K.LLM.ATTN_LOGIT_SOFTCAPPING, 50.0),
                   final_logit_softcapping=m.number(K.LLM.FINAL_LOGIT_SOFTCAPPING, 30.0))
        pad_token(m, cfg)
        if notes:
            r.notes.append(f"config.json {', '.join(notes)}: not recorded in the GGUF; the values llama.cpp's gemma2 "
                           "takes without them (Gemma 2's own)")


ARCH = Gemma2("gemma2", "Gemma2ForCausalLM", "gemma2", GEMMA2_LAYER, hf_classes=("Gemma2ForCausalLM",),
              params="gemma2", vocab="gemma2", norm_shift=1.0, drop=("lm_head.weight",))
