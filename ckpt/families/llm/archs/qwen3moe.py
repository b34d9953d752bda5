"""`qwen3moe` (Qwen3MoeModel, a Qwen2MoeModel): experts stacked per layer, the expert feed-forward sizes, and
TextModel's BPE vocabulary (Qwen2MoeModel is no Qwen2Model: a SentencePiece-only folder is not converted)."""

from __future__ import annotations

from ckpt.families.llm.arch import Export, LLMArch


class Qwen3Moe(LLMArch):
    def parameters(self, w, x: Export, ftype: int) -> list[str]:
        """Qwen2MoeModel.set_gguf_parameters: TextModel's, then the expert feed-forward lengths."""
        notes = super().parameters(w, x, ftype)
        if (n := x.hparams.get("moe_intermediate_size")) is not None:
            w.add_expert_feed_forward_length(n)
        if (n := x.hparams.get("shared_expert_intermediate_size")) is not None:
            w.add_expert_shared_feed_forward_length(n)
        return notes


ARCH = Qwen3Moe("qwen3moe", "Qwen3MoeForCausalLM", "qwen3_moe", ("input_layernorm", "self_attn.q_proj",
                "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "self_attn.q_norm", "self_attn.k_norm",
                "post_attention_layernorm", "mlp.gate"), hf_classes=("Qwen3MoeForCausalLM",), params="qwen2moe",
                vocab="text",
                readable=False,
                experts=("experts", "model.layers.{bid}.mlp.experts.{x}.{w}.weight",
                         ("down_proj", "gate_proj", "up_proj"), "model.layers.{bid}.mlp.experts.{w}.weight"))
