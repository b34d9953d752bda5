"""`gemma3` (Gemma3Model): Gemma 2's norms + 1, q/k norms, the vocabulary trimmed to the tokenizer, TextModel's
parameters and then its own. The same class converts a Gemma 3 vision-language folder
(`Gemma3ForConditionalGeneration`) without `--mmproj`: its language model (under `language_model.`), the SigLIP
vision tower and the projector left out (`ckpt.families.llm.multimodal`), the text config merged over it.
Read back as `Gemma3ForCausalLM` (the norms' shift taken off by the reader, `LLMArch.norm_shift`) with the attention
llama.cpp computes: its sliding-window pattern, RoPE bases and query scale."""

from __future__ import annotations

from ckpt.errors import CkptError
from ckpt.families.llm.arch import Export, LLMArch, Readback
from ckpt.families.llm.archs.gemma2 import GEMMA2_LAYER
from ckpt.families.llm.multimodal import text_model_name


class Gemma3(LLMArch):
    def source_name(self, name: str) -> str | None:
        """TextModel.filter_tensors, which Gemma3Model keeps (a causal LM's names pass unchanged)."""
        return text_model_name(name)

    def parameters(self, w, x: Export, ftype: int) -> list[str]:
        """Gemma3Model.set_gguf_parameters: TextModel's, then its own (a key set again keeps its place)."""
        notes = super().parameters(w, x, ftype)
        hparams, rope = x.hparams, x.rope
        w.add_context_length(hparams.get("max_position_embeddings", 131072))
        w.add_head_count(hparams.get("num_attention_heads", 8))
        w.add_layer_norm_rms_eps(hparams.get("rms_norm_eps", 1e-6))
        w.add_key_length(hparams.get("head_dim", 256))
        w.add_value_length(hparams.get("head_dim", 256))
        w.add_rope_freq_base(rope.get("full_attention", rope).get("rope_theta", 1_000_000.0))
        if hparams.get("attn_logit_softcapping") is not None:
            raise CkptError("config.json sets attn_logit_softcapping, which Gemma 3 does not have (llama.cpp's "
                            "converter refuses it)")
        if final := hparams.get("final_logit_softcapping"):
            w.add_final_logit_softcapping(final)
        if hparams.get("sliding_window_pattern") != 1:
            w.add_sliding_window(hparams["sliding_window"])
        w.add_head_count_kv(hparams.get("num_key_value_heads", 4))
        return notes

    def read_config(self, r: Readback) -> None:
        """Gemma3TextConfig as llama.cpp's gemma3 reads the metadata: sliding-window layers by its pattern (every
        6th layer global unless the file says otherwise; none without a window), the global layers' RoPE base and
        scaling, the local ones' base, the query scale of `f_attention_scale` (head_dim; hidden / heads for the
        62-layer 27B), the final softcapping, GELU-tanh; the head size checked against `attention.key_length`."""
        from ckpt.families.llm.readback_keys import check_head_dim
        from ckpt.quant.gguf_llm import Meta

        import gguf

        K = gguf.Keys
        m = Meta(r.header, self.arch)
        check_head_dim(m, r)
        cfg = r.cfg
        n = cfg["num_hidden_layers"]
        full = {"rope_type": "default", "rope_theta": cfg.pop("rope_theta")}
        if (scaling := cfg.pop("rope_scaling", None)) is not None:  # the global layers' (llama.cpp's freq_scale)
            full.update(scaling)
            r.notes[:] = [note for note in r.notes if not note.startswith("config.json rope_scaling")]
            r.notes.append(f"config.json rope_parameters.full_attention {full} from the GGUF metadata; check it "
                           "against the original model")
        window = m.integer(K.Attention.SLIDING_WINDOW, None, lo=0)
        if window:
            pattern = r.header.value(m.key(K.Attention.SLIDING_WINDOW_PATTERN))
            if isinstance(pattern, list):
                if len(pattern) != n or not all(isinstance(b, bool) for b in pattern):
                    raise m.bad(m.key(K.Attention.SLIDING_WINDOW_PATTERN), pattern[:8],
                                f"not one true/false per block ({n})")
                swa = pattern
            else:
                step = m.integer(K.Attention.SLIDING_WINDOW_PATTERN, 6, lo=0)
                swa = [step == 0 or i % step < step - 1 for i in range(n)]  # llama_hparams::set_swa_pattern
        else:
            swa = [False] * n
        local = m.number(K.Rope.FREQ_BASE_SWA, 10000.0)
        cfg.pop("hidden_act", None)
        cfg.update(hidden_activation="gelu_pytorch_tanh", sliding_window=window or None,
                   layer_types=["sliding_attention" if s else "full_attention" for s in swa],
                   rope_parameters={"full_attention": full,
                                    "sliding_attention": {"rope_type": "default", "rope_theta": local}},
                   query_pre_attn_scalar=cfg["hidden_size"] // cfg["num_attention_heads"] if n == 62 else
                   cfg["head_dim"],
                   attn_logit_softcapping=None,
                   final_logit_softcapping=m.number(K.LLM.FINAL_LOGIT_SOFTCAPPING, None))
        if (pad := m.integer(K.Tokenizer.PAD_ID, None, lo=0)) is not None:
            cfg["pad_token_id"] = pad


ARCH = Gemma3("gemma3", "Gemma3ForCausalLM", "gemma3_text", GEMMA2_LAYER + ("self_attn.q_norm", "self_attn.k_norm"),
              hf_classes=("Gemma3ForCausalLM", "Gemma3ForConditionalGeneration"), params="gemma3", vocab="gemma3",
              norm_shift=1.0, trim_vocab=True)
