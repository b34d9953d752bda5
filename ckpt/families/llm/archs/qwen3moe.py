"""`qwen3moe` (Qwen3MoeModel, a Qwen2MoeModel): experts stacked per layer, the expert feed-forward sizes, and
TextModel's BPE vocabulary (Qwen2MoeModel is no Qwen2Model: a SentencePiece-only folder is not converted).

Read back (GGUF -> HF) as `Qwen3MoeForCausalLM`: one `mlp.experts.X.*_proj` per expert again
(`ckpt.families.llm.moe_readback`), the expert keys from the metadata (checked against the tensors), every layer a
mixture of experts (llama.cpp's qwen3moe has no dense layers) whose top-k weights are renormalized, as llama.cpp
computes it (norm_topk_prob; the GGUF does not record it, the released Qwen3-MoE models set it)."""

from __future__ import annotations

from ckpt.families.llm.arch import Export, LLMArch, Readback
from ckpt.families.llm.moe_readback import MLP_PROJ, is_stacked, moe_config, unstacked
from ckpt.families.llm.readback_keys import check_head_dim
from ckpt.io.tensors import Tensor


class Qwen3Moe(LLMArch):
    def parameters(self, w, x: Export, ftype: int) -> list[str]:
        """Qwen2MoeModel.set_gguf_parameters: TextModel's, then the expert feed-forward lengths."""
        notes = super().parameters(w, x, ftype)
        if (n := x.hparams.get("moe_intermediate_size")) is not None:
            w.add_expert_feed_forward_length(n)
        if (n := x.hparams.get("shared_expert_intermediate_size")) is not None:
            w.add_expert_shared_feed_forward_length(n)
        return notes

    # ------------------------------------------------------------------ reading back (GGUF -> HF)

    def read_config(self, r: Readback) -> None:
        """Qwen3MoeConfig: the expert keys (checked against the stacked experts and the router), the head size of
        `attention.key_length` (checked against the q rows it splits and the q/k norms), every layer sparse, top-k
        renormalized and no sliding window, as llama.cpp's qwen3moe runs it."""
        import gguf

        from ckpt.quant.gguf_llm import Meta

        m, cfg = Meta(r.header, self.arch), r.cfg
        n_expert, used, _ = moe_config(m, r)
        check_head_dim(m, r)
        cfg.update(num_experts=n_expert, num_experts_per_tok=used,
                   moe_intermediate_size=m.integer(gguf.Keys.LLM.EXPERT_FEED_FORWARD_LENGTH), norm_topk_prob=True,
                   decoder_sparse_step=1, mlp_only_layers=[], use_sliding_window=False, sliding_window=None)
        r.notes.append("config.json norm_topk_prob: true, as llama.cpp's qwen3moe computes it (it always "
                       "renormalizes the chosen experts' weights; the GGUF does not record the original's), and "
                       "Qwen3MoeConfig's defaults use_sliding_window false, decoder_sparse_step 1, no mlp_only_layers")

    def in_place(self, gname: str) -> bool:
        return not is_stacked(gname)

    def read_tensor(self, r: Readback, gname: str) -> list[tuple[str, Tensor]]:
        """A stacked `ffn_*_exps` back to one `mlp.experts.X.*_proj` per expert; the rest (the router
        `mlp.gate` included) by the table."""
        parts = gname.split(".")
        if is_stacked(gname):
            return unstacked(r, gname, f"model.layers.{parts[1]}.mlp.experts.{{x}}.{MLP_PROJ[parts[2]]}.weight")
        return super().read_tensor(r, gname)


ARCH = Qwen3Moe("qwen3moe", "Qwen3MoeForCausalLM", "qwen3_moe", ("input_layernorm", "self_attn.q_proj",
                "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "self_attn.q_norm", "self_attn.k_norm",
                "post_attention_layernorm", "mlp.gate"), hf_classes=("Qwen3MoeForCausalLM",), params="qwen2moe",
                vocab="text",
                bias_flags={"attention_bias": ("attn_q.bias", "attn_k.bias", "attn_v.bias", "attn_output.bias")},
                experts=("experts", "model.layers.{bid}.mlp.experts.{x}.{w}.weight",
                         ("down_proj", "gate_proj", "up_proj"), "model.layers.{bid}.mlp.experts.{w}.weight"))
