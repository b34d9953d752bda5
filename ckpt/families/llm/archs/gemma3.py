"""`gemma3` (Gemma3Model): Gemma 2's norms + 1, q/k norms, the vocabulary trimmed to the tokenizer, TextModel's
parameters and then its own."""

from __future__ import annotations

from ckpt.errors import CkptError
from ckpt.families.llm.arch import Export, LLMArch
from ckpt.families.llm.archs.gemma2 import GEMMA2_LAYER


class Gemma3(LLMArch):
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


ARCH = Gemma3("gemma3", "Gemma3ForCausalLM", "gemma3_text", GEMMA2_LAYER + ("self_attn.q_norm", "self_attn.k_norm"),
              hf_classes=("Gemma3ForCausalLM",), params="gemma3", vocab="gemma3", norm_shift=1.0, trim_vocab=True,
              readable=False)
