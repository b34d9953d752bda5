"""`glm4moe` (Glm4MoeModel in the reference's conversion/glm.py): GLM-4.5 / 4.6 / 4.7, GLM-4.5-Air.

What the reference does, and so ckpt:
- the first `first_k_dense_replace` layers have a dense MLP, the others routed experts (stacked per layer as
  `ffn_{down,gate,up}_exps`, in that order), one shared expert (`ffn_*_shexp`), a sigmoid router (`ffn_gate_inp`,
  F32) and its score correction (`e_score_correction_bias`, written as the bias `exp_probs_b.bias`, F32);
- partial rotary in NeoX order: q/k rows are not permuted (llama.cpp's GLM-4.5 graph rotates NeoX-style), and
  `rope.dimension_count` is head_dim x partial_rotary_factor (0.5 by default);
- q/k norms and q/k/v biases where the checkpoint has them (GLM-4.5 has biases, no norms; other releases norms);
- the NextN/MTP layers "its own way": without `--no-mtp` (the default, which ckpt follows) the block count is
  num_hidden_layers + num_nextn_predict_layers and `nextn_predict_layers` is written, whether or not the folder
  holds those layers' tensors. A folder that holds them (`model.layers.{num_hidden_layers}.*`: a whole decoder
  layer plus `eh_proj`, `enorm`, `hnorm`, `embed_tokens`, `shared_head.{head,norm}`) gets them as
  `blk.{n}.*` / `blk.{n}.nextn.*`; one without them gets the extra block count alone (llama.cpp then loads the
  trunk without its MTP layer: `trunk_only` in its loader);
- the vocabulary as `_set_vocab_glm`: BPE, with bos `[gMASK]`, eot `<|user|>`, unk `<|endoftext|>`, eom
  `<|observation|>`.

Checked before anything is written, where the reference takes the config on trust and llama.cpp would refuse or
misread the file: the leading dense layers against the layers that hold a dense MLP, the layer count against the
NextN layers' tensors, experts present (llama.cpp's loader asserts them), the NextN layers within llama.cpp's 512
blocks.

Read back (GGUF -> HF): the stacked experts one tensor per expert again (`ckpt.families.llm.moe_readback`), the
score correction under its HF name, the config's MoE keys from the metadata (each checked against the tensors), the
trunk's layer count (block_count less the NextN layers) and the NextN layer, where the file has one, as the release
stores it (transformers' Glm4MoeForCausalLM has no module for it and leaves it unread, as for the release).
"""

from __future__ import annotations

import re

from ckpt.errors import CkptError
from ckpt.families.llm import config_keys
from ckpt.families.llm.arch import Export, LLMArch, Readback
from ckpt.families.llm.multimodal import text_model_name
from ckpt.families.llm.moe_readback import is_stacked, moe_config, rope_config, unstacked
from ckpt.io.tensors import Tensor

GLM4MOE_LAYER = ("input_layernorm", "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                 "self_attn.q_norm", "self_attn.k_norm", "post_attention_layernorm", "mlp.gate_proj", "mlp.up_proj",
                 "mlp.down_proj", "mlp.gate", "mlp.shared_experts.gate_proj", "mlp.shared_experts.up_proj",
                 "mlp.shared_experts.down_proj", "mlp.gate.e_score_correction",
                 # the NextN/MTP layer's own (gguf's table names them in every block)
                 "eh_proj", "enorm", "hnorm", "embed_tokens", "shared_head.head", "shared_head.norm")
NEXTN_ONLY = ("eh_proj", "enorm", "hnorm", "shared_head", "embed_tokens")  # a NextN/MTP layer's own tensors
_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")


def _nextn(values: dict) -> int:
    """num_nextn_predict_layers (transformers' alias num_mtp_layers); transformers' default of 1 where config.json
    has neither (the reference reads the config as transformers fills it in)."""
    v = values.get("num_nextn_predict_layers", values.get("num_mtp_layers", 1))
    return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else 0


class Glm4Moe(LLMArch):
    def source_name(self, name: str) -> str | None:
        """TextModel.filter_tensors (ModelBase's `e_score_correction_bias` -> `.bias`); the MTP layers are kept, as
        the reference keeps them without --no-mtp."""
        return text_model_name(name)

    def trailing_blocks(self, values: dict) -> int:
        return _nextn(values)

    def check(self, x: Export, hf_arch: str) -> None:
        """Glm4MoeModel.__init__: the block count grows by the NextN layers and gguf's name table is built for
        them; the config's dense layers and experts checked against the tensors."""
        super().check(x, hf_arch)
        hp = x.hparams
        if not x.n_expert:
            raise CkptError(f"{x.config_path}: n_routed_experts is {hp.get('n_routed_experts')!r}; llama.cpp's "
                            "glm4moe loader needs experts (it asserts n_expert > 0)")
        n_main = x.n_block
        dense = hp.get("first_k_dense_replace", 0) or 0
        for name in x.tensor_shapes:
            m = _LAYER.fullmatch(name)
            if m is None or int(m.group(1)) >= n_main:
                continue
            i, rest = int(m.group(1)), m.group(2)
            if rest.split(".")[0] in NEXTN_ONLY:
                raise CkptError(f"{x.config_path}: num_hidden_layers is {n_main} but {name} is a NextN/MTP layer's "
                                "(those follow the last decoder layer)")
            if rest.startswith("mlp.gate_proj.") and i >= dense:
                raise CkptError(f"{x.config_path}: first_k_dense_replace is {dense} but {name} is a dense MLP's "
                                f"(layer {i} would hold experts)")
            if rest.startswith("mlp.experts.") and i < dense:
                raise CkptError(f"{x.config_path}: first_k_dense_replace is {dense} but {name} is an expert's "
                                f"(layer {i} would be dense)")
        nextn = hp.get("num_nextn_predict_layers", 0)
        if nextn:
            if n_main + nextn > config_keys.MAX_LAYERS:
                raise CkptError(f"{x.config_path}: num_hidden_layers {n_main} + num_nextn_predict_layers {nextn} "
                                f"blocks; llama.cpp loads at most {config_keys.MAX_LAYERS}")
            import gguf

            x.n_block = n_main + nextn
            enum = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == self.arch)
            x.table = gguf.get_tensor_name_map(enum, x.n_block)
            if not any(n.startswith(f"model.layers.{n_main}.") for n in x.tensor_shapes):
                x.notes.append(f"num_nextn_predict_layers {nextn}: block_count {x.n_block} with no tensors for the "
                               f"NextN layer{'s' if nextn > 1 else ''} (the folder has none), as llama.cpp's "
                               "converter writes it; llama.cpp runs the model without them")

    def parameters(self, w, x: Export, ftype: int) -> list[str]:
        """Glm4MoeModel.set_gguf_parameters: TextModel's, then the rotary dimensions and the MoE keys."""
        notes = super().parameters(w, x, ftype)
        hp = x.hparams
        if (rope_dim := hp.get("head_dim")) is None:
            rope_dim = hp["hidden_size"] // hp["num_attention_heads"]
        w.add_rope_dimension_count(int(rope_dim * x.rope.get("partial_rotary_factor", 0.5)))
        if (v := hp.get("n_routed_experts")) is not None:
            w.add_expert_count(v)
        if (v := hp.get("moe_intermediate_size")) is not None:
            w.add_expert_feed_forward_length(v)
        if (v := hp.get("n_shared_experts")) is not None:
            w.add_expert_shared_count(v)
        if (v := hp.get("first_k_dense_replace")) is not None:
            w.add_leading_dense_block_count(v)
        import gguf

        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
        if (v := hp.get("routed_scaling_factor")) is not None:
            w.add_expert_weights_scale(v)
        if (v := hp.get("norm_topk_prob")) is not None:
            w.add_expert_weights_norm(v)
        if (v := hp.get("num_nextn_predict_layers")) is not None:
            w.add_nextn_predict_layers(v)
        return notes

    # ------------------------------------------------------------------ reading back (GGUF -> HF)

    def read_config(self, r: Readback) -> None:
        """Glm4MoeConfig from the metadata: the trunk's layers (block_count less the NextN layers), the MoE keys
        (each checked against the tensors that show it), q/k norms where the file has them, the partial rotary
        factor from rope.dimension_count."""
        import gguf

        from ckpt.quant.gguf_llm import Meta

        K = gguf.Keys.LLM
        m, cfg = Meta(r.header, self.arch), r.cfg
        n_blocks, head_dim = cfg["num_hidden_layers"], cfg["head_dim"]
        nextn = m.integer(K.NEXTN_PREDICT_LAYERS, 0, lo=0)
        if nextn >= n_blocks:
            raise m.bad(m.key(K.NEXTN_PREDICT_LAYERS), nextn, f"not fewer than the {n_blocks} blocks")
        n_main = n_blocks - nextn
        dense = m.integer(K.LEADING_DENSE_BLOCK_COUNT, 0, lo=0)
        if dense > n_main:
            raise m.bad(m.key(K.LEADING_DENSE_BLOCK_COUNT), dense, f"more than the model's {n_main} layers")
        for i in range(n_main):
            need, kind = ("ffn_gate", "dense") if i < dense else ("ffn_gate_inp", "MoE")
            if f"blk.{i}.{need}.weight" not in r.stored:
                raise m.bad(m.key(K.LEADING_DENSE_BLOCK_COUNT), dense,
                            f"but the file has no blk.{i}.{need}.weight (block {i} would be {kind})")
        n_expert, used, shared = moe_config(m, r)
        if m.integer(K.EXPERT_GATING_FUNC, 2) != 2:
            raise m.bad(m.key(K.EXPERT_GATING_FUNC), m.integer(K.EXPERT_GATING_FUNC),
                        "not 2 (sigmoid), the only router Glm4MoeForCausalLM has")
        norm = r.header.value(m.key(K.EXPERT_WEIGHTS_NORM), False)
        if not isinstance(norm, bool):
            raise m.bad(m.key(K.EXPERT_WEIGHTS_NORM), norm, "not true or false")
        n_group, topk_group = m.integer(K.EXPERT_GROUP_COUNT, 1), m.integer(K.EXPERT_GROUP_USED_COUNT, 1)
        if n_expert % n_group or topk_group > n_group:
            raise m.bad(m.key(K.EXPERT_GROUP_COUNT), n_group, f"not groups of the {n_expert} experts of which "
                                                              f"{topk_group} are used")
        cfg.update(num_hidden_layers=n_main, num_nextn_predict_layers=nextn, first_k_dense_replace=dense,
                   n_routed_experts=n_expert, num_experts_per_tok=used, moe_intermediate_size=m.integer(
                       K.EXPERT_FEED_FORWARD_LENGTH), n_shared_experts=shared,
                   routed_scaling_factor=m.number(K.EXPERT_WEIGHTS_SCALE, 1.0), norm_topk_prob=norm,
                   n_group=n_group, topk_group=topk_group,
                   use_qk_norm=any(n.endswith(".attn_q_norm.weight") for n in r.stored),
                   rope_parameters=rope_config(m, cfg, head_dim))

    def blocks_with(self, r: Readback, suffix: str) -> set[int] | None:
        """The dense MLP in the leading dense layers, the experts in the others and in the NextN layers (where the
        file has them), a NextN layer's own tensors there only, the attention and norms everywhere."""
        n_main, nextn, dense = (r.cfg[k] for k in ("num_hidden_layers", "num_nextn_predict_layers",
                                                   "first_k_dense_replace"))
        mtp = set(range(n_main, n_main + nextn)) if any(n.startswith(f"blk.{n_main}.") for n in r.stored) else set()
        kind = suffix.split(".")[0]
        if kind == "nextn":
            return mtp
        if kind in ("ffn_gate", "ffn_up", "ffn_down"):
            return set(range(dense))
        if kind in MOE_TENSORS:
            return set(range(dense, n_main)) | mtp
        return set(range(n_main)) | mtp

    def in_place(self, gname: str) -> bool:
        return not is_stacked(gname)

    def read_tensor(self, r: Readback, gname: str) -> list[tuple[str, Tensor]]:
        """A stacked `ffn_*_exps` back to one `mlp.experts.X.*_proj` per expert, the score correction under its
        HF name; the NextN layer as the release stores it (`model.layers.{num_hidden_layers}.*`); the rest by the
        table."""
        parts = gname.split(".")
        if is_stacked(gname):
            return unstacked(r, gname, f"model.layers.{parts[1]}.mlp.experts.{{x}}.{EXPS[parts[2]]}.weight")
        if gname.endswith(".exp_probs_b.bias"):
            hf = f"model.layers.{parts[1]}.mlp.gate.e_score_correction_bias"
            return [(hf, r.value(gname, hf))]
        return super().read_tensor(r, gname)


# the stacked experts (llama.cpp's names) and the HF projection each holds; the other MoE-only tensors
EXPS = {"ffn_down_exps": "down_proj", "ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj"}
MOE_TENSORS = (*EXPS, "ffn_gate_inp", "exp_probs_b", "ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp")


ARCH = Glm4Moe("glm4moe", "Glm4MoeForCausalLM", "glm4_moe", GLM4MOE_LAYER, hf_classes=("Glm4MoeForCausalLM",),
               params="glm4moe", vocab="glm",
               bias_flags={"attention_bias": ("attn_q.bias", "attn_k.bias", "attn_v.bias")},
               experts=("mlp.experts", "model.layers.{bid}.mlp.experts.{x}.{w}.weight",
                        ("down_proj", "gate_proj", "up_proj"), "model.layers.{bid}.mlp.experts.{w}.weight"))
