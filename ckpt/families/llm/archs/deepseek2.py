"""`deepseek2` (DeepseekV2Model in the reference's conversion/deepseek.py): DeepSeek-V3 / R1 and Kimi K2
(`DeepseekV3ForCausalLM`), multi-head latent attention (MLA) with routed and shared experts.

What the reference does, and so ckpt:
- attention: the low-rank query (`q_a_proj`, `q_a_layernorm`, `q_b_proj`; or one `q_proj` where `q_lora_rank` is
  unset), the compressed key/value (`kv_a_proj_with_mqa`, `kv_a_layernorm`) kept as they are; `kv_b_proj` split
  per head into `attn_k_b` (its first `qk_nope_head_dim` rows, each head transposed: [heads, kv_lora_rank, nope])
  and `attn_v_b` ([heads, v_head_dim, kv_lora_rank]) for llama.cpp's absorbed MLA (`KvbPart`, read head by head).
  No RoPE row permutation. The metadata says MQA: one kv head, key length `kv_lora_rank + qk_rope_head_dim`, value
  length `kv_lora_rank`, and the per-head MLA lengths in `.attention.key_length_mla` / `.value_length_mla`.
- experts: the routed experts stacked per layer (`ffn_{down,gate,up}_exps`), the shared experts (`*_shexp`) and the
  router with its score correction (`e_score_correction_bias` -> `exp_probs_b.bias`, as ModelBase.filter_tensors
  renames it); the first `first_k_dense_replace` layers dense. The expert keys: count, shared count, feed-forward
  length, weights scale (`routed_scaling_factor`), weights norm (`norm_topk_prob`), and TextModel's group counts
  and gating function (`n_group`, `topk_group`, `scoring_func`).
- RoPE: `.rope.dimension_count` is `qk_rope_head_dim`; yarn scaling as TextModel writes it, plus the log multiplier
  `0.1 * mscale_all_dim` (the reference's legacy spelling).
- DeepSeek-V3's MTP layers (`model.layers.{num_hidden_layers}...`, `num_nextn_predict_layers` of them) are left out,
  and a tied `lm_head.weight` too, as the reference skips them. The vocabulary is tokenizer.json's BPE
  (`_set_vocab_gpt2`); Kimi K2's tiktoken tokenizer needs its remote code, which ckpt does not run.
- FP8 block-quantized releases (`weight_scale_inv`) reach this module already decoded (`ckpt.quant.fp8`), as the
  reference's `dequant_model` decodes them.

Checked before anything is written, where the reference takes the config on trust and llama.cpp would refuse or
misrun the file: the MLA sizes against the tensors (`SHAPES`, with kv_b_proj split by the key/value head count as
the reference asserts), the query's form against `q_lora_rank`, the dense lead against the layers holding experts,
and blocks past `num_hidden_layers` being MTP layers (the reference would drop any block past the count).

Read back (GGUF -> HF `DeepseekV3ForCausalLM`): `attn_k_b` and `attn_v_b` joined into `kv_b_proj` again
(`KvbJoined`), the experts one tensor per expert (`ckpt.families.llm.moe_readback`), the score correction under its
HF name; the config's MLA sizes, MoE keys and yarn parameters from the metadata, each checked against the tensors
that show it (a softmax router, which DeepseekV3ForCausalLM does not have, is refused).
"""

from __future__ import annotations

import math
import re

from ckpt.errors import CkptError, file_error
from ckpt.families.llm.arch import Export, LLMArch, Readback
from ckpt.families.llm.config_keys import Shape, size
from ckpt.families.llm.moe_readback import is_stacked, unstacked
from ckpt.families.llm.multimodal import text_model_name
from ckpt.families.llm.text import find
from ckpt.io.tensors import Tensor, read_rows
from ckpt.io.wrapper import Wrapper
from ckpt.lazy import numpy as np

ATTN = ("self_attn.q_a_proj", "self_attn.q_a_layernorm", "self_attn.q_b_proj", "self_attn.q_proj",
        "self_attn.kv_a_proj_with_mqa", "self_attn.kv_a_layernorm", "self_attn.kv_b_proj", "self_attn.o_proj")
DEEPSEEK2_LAYER = ("input_layernorm", *ATTN, "post_attention_layernorm", "mlp.gate_proj", "mlp.up_proj",
                   "mlp.down_proj", "mlp.gate", "mlp.shared_experts.gate_proj", "mlp.shared_experts.up_proj",
                   "mlp.shared_experts.down_proj")
QK = size("heads", "nope_dim") + size("heads", "rope_dim")  # a query's rows: each head's non-RoPE and RoPE parts
# config_keys' rules for the MLA tensors (they replace the generic q_proj / o_proj rules: MLA heads are not
# head_dim wide)
SHAPES = (
    Shape("self_attn.q_proj.weight", 0, QK), Shape("self_attn.q_proj.weight", 1, size("embd")),
    Shape("self_attn.q_a_proj.weight", 0, size("q_lora_rank")), Shape("self_attn.q_a_proj.weight", 1, size("embd")),
    Shape("self_attn.q_a_layernorm.weight", 0, size("q_lora_rank")),
    Shape("self_attn.q_b_proj.weight", 0, QK), Shape("self_attn.q_b_proj.weight", 1, size("q_lora_rank")),
    Shape("self_attn.kv_a_proj_with_mqa.weight", 0, size("kv_lora_rank") + size("rope_dim")),
    Shape("self_attn.kv_a_proj_with_mqa.weight", 1, size("embd")),
    Shape("self_attn.kv_a_layernorm.weight", 0, size("kv_lora_rank")),
    Shape("self_attn.kv_b_proj.weight", 0, size("kv_heads", "nope_dim") + size("kv_heads", "v_head_dim")),
    Shape("self_attn.kv_b_proj.weight", 1, size("kv_lora_rank")),
    Shape("self_attn.o_proj.weight", 0, size("embd")), Shape("self_attn.o_proj.weight", 1, size("heads", "v_head_dim")),
)
_LAYER = re.compile(r"model.layers.(\d+)")  # the reference's MTP test (re.match, dots unescaped)


class KvbPart(Wrapper):
    """One part of `kv_b_proj` [heads x (nope + v), kv_lora_rank] per head: rows [lo, lo + n) of each head's block,
    as [heads, n, kv_lora_rank], or each head's part transposed, [heads, kv_lora_rank, n] (DeepseekV2Model's
    `kv_b.view(...)`, `torch.split`, `k_b.transpose(1, 2)`). A band is whole heads: their rows of the base."""

    def __init__(self, base: Tensor, heads: int, lo: int, n: int, transpose: bool, name: str):
        self.base, self.heads, self.lo, self.n, self.transpose = base, heads, lo, n, transpose
        self.per = base.shape[0] // heads
        self.name, self.home = name, base.home
        cols = base.shape[1]
        self.shape = (heads, cols, n) if transpose else (heads, n, cols)
        self.row_align = None if base.row_align is None else 1

    dtype = property(lambda self: self.base.dtype)  # the base's, asked when needed (planning needs no torch)
    dtype_name = property(lambda self: self.base.dtype_name)

    @property
    def source_bytes(self):
        return self.base.source_bytes * self.n // self.per

    def read(self, start, stop, device, scratch=None):
        x = read_rows(self.base, start * self.per, stop * self.per, device, scratch)
        x = x.reshape(stop - start, self.per, x.shape[-1])[:, self.lo:self.lo + self.n]
        return (x.transpose(1, 2) if self.transpose else x).contiguous()


def _mla(x: Export) -> tuple[int, int, int]:
    """(kv heads, qk_nope_head_dim, v_head_dim) as DeepseekV2Model.modify_tensors indexes them."""
    hp = x.hparams
    return x.n_head_kv, hp["qk_nope_head_dim"], hp["v_head_dim"]


def _dense_lead(hp: dict) -> int:
    """DeepseekV2Model.set_gguf_parameters' leading dense block count (all blocks without routed experts)."""
    k = hp.get("first_k_dense_replace")
    if k is None:
        k = hp["num_hidden_layers"] if hp.get("n_routed_experts") is None else 0
    return k


class Deepseek2(LLMArch):
    def source_name(self, name: str) -> str | None:
        """TextModel.filter_tensors (a VLM's vision side left out) then ModelBase's (`e_score_correction_bias` as
        `e_score_correction.bias`, gguf's name for the router's score correction)."""
        return text_model_name(name)

    def trailing_blocks(self, values: dict) -> int:
        """DeepSeek-V3's MTP layers follow the model's (`num_nextn_predict_layers` of them); left out below."""
        n = values.get("num_nextn_predict_layers")
        return n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else 0

    def check(self, x: Export, hf_arch: str) -> None:
        """The config against the weights where the reference would write a GGUF llama.cpp cannot load: the query's
        form (`q_lora_rank` or `q_proj`), the dense layers first (`first_k_dense_replace`) and the experts after."""
        super().check(x, hf_arch)
        hp, where, names = x.hparams, x.config_path, x.tensor_shapes
        blocks, mtp = {}, {}
        for n in names:
            m = _LAYER.match(n)
            if m:
                i = int(m.group(1))
                (blocks if i < x.n_block else mtp).setdefault(i, set()).add(n[m.end() + 1:])
        for i, have in sorted(mtp.items()):  # the reference drops any block past the count: only MTP layers go
            if "eh_proj.weight" not in have:
                raise CkptError(f"{where}: num_hidden_layers is {x.n_block} but the weights hold "
                                f"{x.n_block + len(mtp)} blocks, and model.layers.{i} is no multi-token prediction "
                                "layer (no eh_proj)")
        q_lora = hp.get("q_lora_rank")
        for i, have in sorted(blocks.items()):
            low_rank = "self_attn.q_a_proj.weight" in have
            if q_lora is not None and "self_attn.q_proj.weight" in have and not low_rank:
                raise CkptError(f"{where}: q_lora_rank is {q_lora} but model.layers.{i} has one q_proj, not q_a_proj "
                                "and q_b_proj (a query without the low-rank step has no q_lora_rank)")
            if q_lora is None and low_rank:
                raise CkptError(f"{where}: q_lora_rank is not set but model.layers.{i} has q_a_proj (llama.cpp reads "
                                "the low-rank query only with it)")
        lead = _dense_lead(hp)
        for i, have in sorted(blocks.items()):
            moe = "mlp.gate.weight" in have
            if moe and i < lead:
                raise CkptError(f"{where}: first_k_dense_replace is {lead} but model.layers.{i} has routed experts "
                                "(mlp.gate.weight); llama.cpp makes the first first_k_dense_replace blocks dense")
            if not moe and i >= lead and x.n_expert:
                raise CkptError(f"{where}: first_k_dense_replace is {lead} but model.layers.{i} has no routed "
                                "experts (no mlp.gate.weight); llama.cpp gives every later block experts")

    def tensors(self, x: Export, name: str, t: Tensor) -> list[tuple[str, Tensor]]:
        """DeepseekV2Model.modify_tensors: a tied lm_head and the MTP layers left out, the experts stacked,
        `kv_b_proj` split into `k_b_proj` (transposed per head) and `v_b_proj`; the rest as TextModel's."""
        hp = x.hparams
        if hp.get("tie_word_embeddings", False) and name in ("lm_head.weight", "model.lm_head.weight"):
            return []
        m = _LAYER.match(name)
        if m and int(m.group(1)) >= x.n_block:
            note = (f"model.layers.{x.n_block}+ (DeepSeek-V3's multi-token prediction layers): left out, as "
                    "llama.cpp's converter leaves them out")
            if note not in x.notes:
                x.notes.append(note)
            return []
        if name.endswith("kv_b_proj.weight"):
            heads, nope, v = _mla(x)
            if len(t.shape) != 2 or t.shape[0] != heads * (nope + v):
                raise CkptError(f"{x.where}: tensor {name!r} is {list(t.shape)}, not [{heads} heads x ({nope} + {v}), "
                                "kv_lora_rank] as llama.cpp's converter splits it")
            kb, vb = name.replace("kv_b_proj", "k_b_proj"), name.replace("kv_b_proj", "v_b_proj")
            return [(x.gguf_name(self, kb), KvbPart(t, heads, 0, nope, True, kb)),
                    (x.gguf_name(self, vb), KvbPart(t, heads, nope, v, False, vb))]
        return super().tensors(x, name, t)

    def parameters(self, w, x: Export, ftype: int) -> list[str]:
        """DeepseekV2Model.set_gguf_parameters: TextModel's with one kv head (MLA as MQA) and a default RMS epsilon,
        then the MLA lengths, the dense lead, the expert keys and the RoPE dimensions."""
        from ckpt.families.llm.text import text_parameters

        hp = dict(x.hparams)
        hp["num_key_value_heads"] = 1
        hp["rms_norm_eps"] = hp.get("rms_norm_eps", 1e-6)
        notes = text_parameters(w, self, hp, x.rope, x.n_block, ftype)
        w.add_leading_dense_block_count(_dense_lead(hp))
        kv_lora_rank = hp.get("kv_lora_rank", 512)
        w.add_vocab_size(hp["vocab_size"])
        if hp.get("q_lora_rank") is not None:
            w.add_q_lora_rank(hp["q_lora_rank"])
        w.add_kv_lora_rank(kv_lora_rank)
        w.add_key_length(kv_lora_rank + hp["qk_rope_head_dim"])
        w.add_value_length(kv_lora_rank)
        w.add_key_length_mla(hp["qk_nope_head_dim"] + hp["qk_rope_head_dim"])
        w.add_value_length_mla(hp["v_head_dim"])
        ff = find(hp, ["moe_intermediate_size", "intermediate_size"])
        if ff is None:
            raise CkptError(f"{x.config_path}: has no moe_intermediate_size (nor intermediate_size), which llama.cpp's "
                            "converter needs for a deepseek2 GGUF")
        w.add_expert_feed_forward_length(ff)
        if (n := hp.get("n_routed_experts")) is not None:
            w.add_expert_count(n)
        w.add_expert_shared_count(hp.get("n_shared_experts", 0))
        if (v := hp.get("routed_scaling_factor")) is not None:
            w.add_expert_weights_scale(v)
        if (v := hp.get("norm_topk_prob")) is not None and v:
            w.add_expert_weights_norm(v)
        w.add_rope_dimension_count(hp["qk_rope_head_dim"])
        if (v := x.rope.get("mscale_all_dim")) is not None:  # the reference's TAG_DEEPSEEK2_YARN_LOG_MUL_FIX
            w.add_rope_scaling_yarn_log_mul(0.1 * v)
        if x.n_expert and find(hp, GATING_KEYS) is None:
            notes.append("config.json has no scoring_func: the GGUF has no expert gating function, as llama.cpp's "
                         "converter writes it, and llama.cpp routes its experts by softmax (DeepseekV3ForCausalLM "
                         "routes them by sigmoid)")
        return notes

    # ------------------------------------------------------------------ reading back (GGUF -> HF)

    def read_config(self, r: Readback) -> None:
        """DeepseekV3Config from the metadata: the MLA sizes (the per-head lengths of `key_length_mla` /
        `value_length_mla`, the RoPE part of `rope.dimension_count`), the heads kv_b_proj has (the file says one
        MQA head), the dense lead, the MoE keys (each checked against the tensors that show it), the yarn
        parameters (`mscale_all_dim` from the log multiplier, `mscale` equal to it as llama.cpp assumes)."""
        import gguf

        from ckpt.families.llm.moe_readback import moe_config
        from ckpt.quant.gguf_llm import Meta

        K, A = gguf.Keys.LLM, gguf.Keys.Attention
        m, cfg = Meta(r.header, self.arch), r.cfg
        n_blocks, heads = cfg["num_hidden_layers"], cfg["num_attention_heads"]
        kv_lora = m.integer(A.KV_LORA_RANK)
        rope_dim = m.integer(gguf.Keys.Rope.DIMENSION_COUNT)
        k_mla, v_mla = m.integer(A.KEY_LENGTH_MLA), m.integer(A.VALUE_LENGTH_MLA)
        if rope_dim % 2 or rope_dim >= k_mla:
            raise m.bad(m.key(gguf.Keys.Rope.DIMENSION_COUNT), rope_dim, f"not an even part of the {k_mla} values of "
                                                                         "a key head (key_length_mla)")
        nope = k_mla - rope_dim
        q_lora = m.integer(A.Q_LORA_RANK, None)
        dense = m.integer(K.LEADING_DENSE_BLOCK_COUNT, 0, lo=0)
        if dense > n_blocks:
            raise m.bad(m.key(K.LEADING_DENSE_BLOCK_COUNT), dense, f"more than the {n_blocks} blocks")
        want = {"attn_q_a": (q_lora, cfg["hidden_size"]), "attn_q_b": (heads * k_mla, q_lora),
                "attn_q": (heads * k_mla, cfg["hidden_size"]),
                "attn_kv_a_mqa": (kv_lora + rope_dim, cfg["hidden_size"]),
                "attn_k_b": (heads, kv_lora, nope), "attn_v_b": (heads, v_mla, kv_lora),
                "attn_output": (cfg["hidden_size"], heads * v_mla)}
        for name, t in r.stored.items():  # the MLA sizes against the tensors they shape
            kind = name.split(".")[2] if name.count(".") >= 3 else ""
            if kind in ("attn_q_a", "attn_q_b") and q_lora is None:
                raise m.bad(m.key(A.Q_LORA_RANK), None, f"but the file has {name} (a low-rank query)")
            if kind in want and tuple(t.stored_shape) != want[kind]:
                raise file_error(r.path, f"tensor {name} is {list(t.stored_shape)}, not {list(want[kind])} as the "
                                         "metadata's MLA sizes (head_count, kv_lora_rank, q_lora_rank, key/value "
                                         "length_mla, rope.dimension_count) make it")
        moe = {}
        if m.integer(K.EXPERT_COUNT, None) is not None:
            n_expert, used, shared = moe_config(m, r)
            gating = m.integer(K.EXPERT_GATING_FUNC, None)
            if gating not in (None, 2):
                raise m.bad(m.key(K.EXPERT_GATING_FUNC), gating, "not 2 (sigmoid), the only router "
                                                                 "DeepseekV3ForCausalLM has")
            if gating is None:
                r.notes.append(f"{m.key(K.EXPERT_GATING_FUNC)} is not set: llama.cpp routes this file's experts by "
                               "softmax; DeepseekV3ForCausalLM routes them by sigmoid (as the model it was converted "
                               "from did)")
            norm = r.header.value(m.key(K.EXPERT_WEIGHTS_NORM), False)
            if not isinstance(norm, bool):
                raise m.bad(m.key(K.EXPERT_WEIGHTS_NORM), norm, "not true or false")
            n_group, topk_group = m.integer(K.EXPERT_GROUP_COUNT, 1), m.integer(K.EXPERT_GROUP_USED_COUNT, 1)
            if n_expert % n_group or topk_group > n_group:
                raise m.bad(m.key(K.EXPERT_GROUP_COUNT), n_group, f"not groups of the {n_expert} experts of which "
                                                                  f"{topk_group} are used")
            moe = dict(n_routed_experts=n_expert, num_experts_per_tok=used, n_shared_experts=shared,
                       moe_intermediate_size=m.integer(K.EXPERT_FEED_FORWARD_LENGTH),
                       routed_scaling_factor=m.number(K.EXPERT_WEIGHTS_SCALE, 1.0), norm_topk_prob=norm,
                       n_group=n_group, topk_group=topk_group)
        elif dense < n_blocks:
            raise m.bad(m.key(K.LEADING_DENSE_BLOCK_COUNT), dense, f"but the file has no expert_count for blocks "
                                                                   f"{dense}-{n_blocks - 1}")
        for i in range(n_blocks):
            need, what = ("ffn_gate", "dense") if i < dense else ("ffn_gate_inp", "MoE")
            if f"blk.{i}.{need}.weight" not in r.stored:
                raise m.bad(m.key(K.LEADING_DENSE_BLOCK_COUNT), dense,
                            f"but the file has no blk.{i}.{need}.weight (block {i} would be {what})")
        rope = {"rope_type": "default", "rope_theta": cfg.pop("rope_theta")}
        scaling = cfg.pop("rope_scaling", None)
        if scaling:
            rope.update(scaling)
            R = gguf.Keys.Rope
            for key, hf in ((R.SCALING_YARN_BETA_FAST, "beta_fast"), (R.SCALING_YARN_BETA_SLOW, "beta_slow"),
                            (R.SCALING_YARN_EXT_FACTOR, "extrapolation_factor"),
                            (R.SCALING_YARN_ATTN_FACTOR, "attention_factor")):
                if (v := r.header.value(m.key(key), None)) is not None:
                    rope[hf] = _f32(m, key, v)
            if (v := r.header.value(m.key(R.SCALING_YARN_LOG_MUL), None)) is not None:
                log_mul = _f32(m, R.SCALING_YARN_LOG_MUL, v)
                rope["mscale_all_dim"] = rope["mscale"] = float(str(np.float32(log_mul * 10)))
        cfg.update(num_key_value_heads=heads, head_dim=rope_dim, q_lora_rank=q_lora, kv_lora_rank=kv_lora,
                   qk_rope_head_dim=rope_dim, qk_nope_head_dim=nope, v_head_dim=v_mla, first_k_dense_replace=dense,
                   rope_parameters=rope, **moe)

    def blocks_with(self, r: Readback, suffix: str) -> set[int] | None:
        """The dense MLP in the leading dense blocks, the router and experts in the others; the rest everywhere."""
        kind, n, dense = suffix.split(".")[0], r.cfg["num_hidden_layers"], r.cfg["first_k_dense_replace"]
        if kind in ("ffn_gate", "ffn_up", "ffn_down"):
            return set(range(dense))
        if kind in MOE_TENSORS:
            return set(range(dense, n))
        return None

    def in_place(self, gname: str) -> bool:
        return gname.split(".")[2:3] not in (["attn_k_b"], ["attn_v_b"]) and not is_stacked(gname)

    def read_tensor(self, r: Readback, gname: str) -> list[tuple[str, Tensor]]:
        """`attn_k_b` and `attn_v_b` joined into `kv_b_proj` again (read at the first, nothing at the second), the
        stacked experts one tensor per expert, the score correction under its HF name; the rest by the table."""
        parts = gname.split(".")
        if is_stacked(gname):
            return unstacked(r, gname, f"model.layers.{parts[1]}.mlp.experts.{{x}}.{EXPS[parts[2]]}.weight")
        if gname.endswith(".exp_probs_b.bias"):
            hf = f"model.layers.{parts[1]}.mlp.gate.e_score_correction_bias"
            return [(hf, r.value(gname, hf))]
        if gname.endswith(".attn_v_b.weight"):
            return []
        if gname.endswith(".attn_k_b.weight"):
            hf = f"model.layers.{parts[1]}.self_attn.kv_b_proj.weight"
            v_b = f"blk.{parts[1]}.attn_v_b.weight"
            if v_b not in r.stored:
                raise file_error(r.path, f"tensor {v_b} is missing (kv_b_proj is {gname} and it); nothing was "
                                         "written")
            return [(hf, KvbJoined(r.value(gname, hf), r.value(v_b, hf), hf))]
        return super().read_tensor(r, gname)


class KvbJoined(Tensor):
    """`kv_b_proj` again from llama.cpp's `attn_k_b` [heads, kv_lora_rank, nope] and `attn_v_b` [heads, v,
    kv_lora_rank]: each head's k part transposed back, then its v part (`KvbPart`'s inverse). Bands of whole
    heads."""

    def __init__(self, k_b: Tensor, v_b: Tensor, name: str):
        heads, rank, nope = k_b.shape
        if len(v_b.shape) != 3 or v_b.shape[0] != heads or v_b.shape[2] != rank:
            raise CkptError(f"{name}: {k_b.name} {list(k_b.shape)} and {v_b.name} {list(v_b.shape)} are not one "
                            "layer's MLA key/value parts")
        self.k_b, self.v_b, self.name, self.home = k_b, v_b, name, k_b.home
        self.per = nope + v_b.shape[1]
        self.shape = (heads * self.per, rank)
        self.row_align = None if k_b.row_align is None or v_b.row_align is None else self.per

    dtype = property(lambda self: self.k_b.dtype)
    dtype_name = property(lambda self: self.k_b.dtype_name)

    def natural_source(self):
        return self.k_b

    @property
    def source_bytes(self):
        return self.k_b.source_bytes + self.v_b.source_bytes

    def read(self, start, stop, device, scratch=None):
        from ckpt.lazy import torch

        h0, h1 = start // self.per, -(-stop // self.per)
        k = read_rows(self.k_b, h0, h1, device).transpose(1, 2)
        v = read_rows(self.v_b, h0, h1, device)
        rows = torch.cat([k, v.to(k.dtype)], dim=1).reshape((h1 - h0) * self.per, self.shape[1])
        return rows[start - h0 * self.per: stop - h0 * self.per].contiguous()


def _f32(m, key: str, v) -> float:
    """A float32 metadata value as the decimal it was written from, checked finite."""
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise m.bad(m.key(key), v, "not a finite number")
    return float(str(np.float32(v)))


# the stacked experts (llama.cpp's names) and the HF projection each holds; the other MoE-only tensors
EXPS = {"ffn_down_exps": "down_proj", "ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj"}
MOE_TENSORS = (*EXPS, "ffn_gate_inp", "exp_probs_b", "ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp")
GATING_KEYS = ["score_function", "scoring_func", "score_func", "moe_router_activation", "moe_router_activation_func",
               "expert_selection_fn"]


ARCH = Deepseek2("deepseek2", "DeepseekV3ForCausalLM", "deepseek_v3", DEEPSEEK2_LAYER,
                 hf_classes=("DeepseekV3ForCausalLM",), params="deepseek2", vocab="gpt2",
                 experts=("mlp.experts", "model.layers.{bid}.mlp.experts.{x}.{w}.weight",
                          ("down_proj", "gate_proj", "up_proj"), "model.layers.{bid}.mlp.experts.{w}.weight"),
                 shape_rules=SHAPES)
