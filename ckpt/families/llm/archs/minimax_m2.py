"""`minimax-m2` (MiniMaxM2Model in the reference's conversion/minimax.py): MiniMax-M2 / M2.1.

What the reference does, and so ckpt: every layer is a mixture of experts (`block_sparse_moe.experts.X.w1/w2/w3`
stacked per layer as `ffn_{gate,down,up}_exps`, in that order), with a router (`ffn_gate_inp`, F32) and its score
correction (`e_score_correction_bias`, written as the bias `exp_probs_b.bias`, F32; config.json's `scoring_func`
"sigmoid" becomes `expert_gating_func` through TextModel's parameters); q/k RMS norms over all heads at once
(`attn_q_norm` has heads x head_dim values, `attn_k_norm` kv_heads x head_dim); no q/k permutation (NeoX RoPE) over
`rotary_dim` of each head's values; `expert_feed_forward_length` is intermediate_size (the experts' size: the model
has no dense MLP); TextModel's BPE vocabulary.

Checked before anything is written: rotary_dim, which the reference requires (a KeyError there) and llama.cpp
rotates with, is an even number of a head's values; experts, which llama.cpp's loader creates for every layer.

Read back (GGUF -> HF): one `w1/w2/w3` per expert again (`ckpt.families.llm.moe_readback`), the score correction
under its HF name, rotary_dim and the expert counts from the metadata (checked against the tensors).
"""

from __future__ import annotations

from ckpt.errors import CkptError
from ckpt.families.llm.arch import Export, LLMArch, Readback
from ckpt.families.llm.config_keys import Shape, size
from ckpt.families.llm.moe_readback import is_stacked, moe_config, rope_config, unstacked
from ckpt.families.llm.multimodal import text_model_name
from ckpt.io.tensors import Tensor

MINIMAX_M2_LAYER = ("input_layernorm", "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                    "self_attn.q_norm", "self_attn.k_norm", "post_attention_layernorm", "block_sparse_moe.gate",
                    "block_sparse_moe.e_score_correction")
W = {"ffn_gate_exps": "w1", "ffn_down_exps": "w2", "ffn_up_exps": "w3"}  # the stacked experts' HF projections


class MiniMaxM2(LLMArch):
    def source_name(self, name: str) -> str | None:
        """TextModel.filter_tensors (ModelBase's `e_score_correction_bias` -> `.bias`)."""
        return text_model_name(name)

    def check(self, x: Export, hf_arch: str) -> None:
        super().check(x, hf_arch)
        hp = x.hparams
        if not x.n_expert:
            raise CkptError(f"{x.config_path}: num_local_experts is {hp.get('num_local_experts')!r}; llama.cpp's "
                            "minimax-m2 loader needs experts in every layer")
        rotary = hp.get("rotary_dim")
        if rotary is None:
            raise CkptError(f"{x.config_path}: has no rotary_dim, which llama.cpp's MiniMax-M2 converter writes as "
                            "rope.dimension_count")
        head_dim = hp.get("head_dim") or hp["hidden_size"] // hp["num_attention_heads"]
        if rotary % 2 or rotary > head_dim:
            raise CkptError(f"{x.config_path}: rotary_dim is {rotary}, not an even number of the head's {head_dim} "
                            "values (RoPE rotates them in pairs)")

    def parameters(self, w, x: Export, ftype: int) -> list[str]:
        """MiniMaxM2Model.set_gguf_parameters: TextModel's, the experts' size and the rotary dimensions."""
        notes = super().parameters(w, x, ftype)
        w.add_expert_feed_forward_length(x.hparams["intermediate_size"])
        w.add_rope_dimension_count(x.hparams["rotary_dim"])
        return notes

    # ------------------------------------------------------------------ reading back (GGUF -> HF)

    def read_config(self, r: Readback) -> None:
        """MiniMaxM2Config from the metadata: the experts (their size is intermediate_size, as written), sigmoid
        routing with its score correction, rotary_dim from rope.dimension_count."""
        import gguf

        from ckpt.quant.gguf_llm import Meta

        K = gguf.Keys.LLM
        m, cfg = Meta(r.header, self.arch), r.cfg
        n_expert, used, _ = moe_config(m, r)
        ff = m.integer(K.EXPERT_FEED_FORWARD_LENGTH)
        if ff != cfg["intermediate_size"]:
            raise m.bad(m.key(K.EXPERT_FEED_FORWARD_LENGTH), ff, f"but {m.key(K.FEED_FORWARD_LENGTH)} is "
                                                                 f"{cfg['intermediate_size']} (MiniMax-M2 has one "
                                                                 "intermediate_size)")
        if m.integer(K.EXPERT_GATING_FUNC, 2) != 2:
            raise m.bad(m.key(K.EXPERT_GATING_FUNC), m.integer(K.EXPERT_GATING_FUNC),
                        "not 2 (sigmoid), the only router MiniMaxM2ForCausalLM has")
        A = gguf.Keys.Attention
        norms = {"attn_q_norm": (A.HEAD_COUNT, cfg["num_attention_heads"]),
                 "attn_k_norm": (A.HEAD_COUNT_KV, cfg["num_key_value_heads"])}
        for name, t in r.stored.items():  # the q/k norms span all heads (the head counts were checked on q/k)
            key, heads = norms.get(name.split(".")[2] if name.count(".") == 3 else "", (None, 0))
            if key is not None and tuple(t.stored_shape) != (heads * cfg["head_dim"],):
                raise m.bad(m.key(key), heads, f"but {name} is {list(t.stored_shape)}, not {heads} heads of "
                                               f"{cfg['head_dim']}")
        rope = rope_config(m, cfg, cfg["head_dim"])
        cfg.update(num_local_experts=n_expert, num_experts_per_tok=used, scoring_func="sigmoid",
                   rotary_dim=round(rope["partial_rotary_factor"] * cfg["head_dim"]), use_qk_norm=True,
                   qk_norm_type="per_layer", use_routing_bias=True, rope_parameters=rope)

    def in_place(self, gname: str) -> bool:
        return not is_stacked(gname)

    def read_tensor(self, r: Readback, gname: str) -> list[tuple[str, Tensor]]:
        """A stacked `ffn_*_exps` back to one `block_sparse_moe.experts.X.w1|w2|w3` per expert, the score
        correction under its HF name; the rest by the table."""
        parts = gname.split(".")
        if is_stacked(gname):
            return unstacked(r, gname, f"model.layers.{parts[1]}.block_sparse_moe.experts.{{x}}.{W[parts[2]]}.weight")
        if gname.endswith(".exp_probs_b.bias"):
            hf = f"model.layers.{parts[1]}.block_sparse_moe.e_score_correction_bias"
            return [(hf, r.value(gname, hf))]
        return super().read_tensor(r, gname)


ARCH = MiniMaxM2("minimax-m2", "MiniMaxM2ForCausalLM", "minimax_m2", MINIMAX_M2_LAYER,
                 hf_classes=("MiniMaxM2ForCausalLM",), params="minimax-m2", vocab="gpt2",
                 experts=("block_sparse_moe.experts", "model.layers.{bid}.block_sparse_moe.experts.{x}.{w}.weight",
                          ("w1", "w2", "w3"), "model.layers.{bid}.block_sparse_moe.experts.{w}.weight"),
                 shape_rules=(Shape("self_attn.q_norm.weight", 0, size("heads", "head_dim")),
                              Shape("self_attn.k_norm.weight", 0, size("kv_heads", "head_dim"))))
