"""What config.json must hold before a Hugging Face LLM folder is written as a llama.cpp GGUF: per key, the
type and range of its value and the tensor shapes it must agree with. One table for every architecture of
`ckpt.families.llm`: a rule applies where the config has the key or the model has the tensor.

Why: llama.cpp's converter takes config.json on trust. A head count of 0 is a ZeroDivisionError there, a
context length of 2^40 a struct.error, a string epsilon a TypeError; worse, a config that disagrees with the
weights (3 blocks for 2, 100 tokens for 320 embedding rows, head counts that do not divide q's rows) is
written without complaint into a GGUF llama.cpp refuses to load, and values it asserts on (more experts used
than there are) abort the program that loads it. A block count or vocabulary size of 10^9 makes the
converter, and transformers' config classes, build lists that long. So each value is checked here first, as
the GGUF reader checks GGUF metadata (`ckpt.quant.gguf_llm.Meta`): its type and range (what the GGUF field it
becomes holds: uint32 counts, float32 numbers; what llama.cpp accepts), then against the tensors that show
it. A refusal is one line naming config.json, the key and both values.

`check(values, shapes, ...)` runs twice in the exporter: on config.json as written (before transformers'
config class sees it) and on the values as transformers fills them in (defaults, derived head_dim), which are
the ones the reference writes. A value that comes from transformers and not from the file says so.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Callable

from ckpt.errors import CkptError
from ckpt.families.llm.text import GATING_FUNCS

U32 = 2**32 - 1  # GGUF uint32: block count, lengths, head counts, vocabulary size
I32 = 2**31 - 1  # llama_token: token ids
F32_MAX = 3.4028234663852886e38  # GGUF float32: epsilons, RoPE bases and factors
MAX_LAYERS = 512  # llama.cpp's LLAMA_MAX_LAYERS: load_hparams asserts block_count <= it
MAX_EXPERTS = 1024  # LLAMA_MAX_EXPERTS: asserted likewise


@dataclass(frozen=True)
class Kind:
    """What a key's value must be: `ok(value)`, else the refusal says the value is `want`."""

    want: str
    ok: Callable[[object], bool]


def _int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _num(v) -> bool:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return False
    return abs(v) <= F32_MAX if isinstance(v, int) else math.isfinite(v) and abs(v) <= F32_MAX


def integer(lo: int, hi: int, why: str = "") -> Kind:
    top = {U32: "2^32 - 1", I32: "2^31 - 1"}.get(hi, str(hi))
    return Kind(f"not an integer from {lo} to {top}{why}", lambda v: _int(v) and lo <= v <= hi)


COUNT = integer(1, U32)
COUNT0 = integer(0, U32)
BLOCKS = integer(1, MAX_LAYERS, " (llama.cpp loads at most 512 blocks)")
EXPERTS = integer(0, MAX_EXPERTS, " (llama.cpp's most experts)")
POSITIVE = Kind("not a finite number above 0 (a float32)", lambda v: _num(v) and v > 0)
FINITE = Kind("not a finite number (a float32)", _num)
FRACTION = Kind("not a number above 0 and at most 1", lambda v: _num(v) and 0 < v <= 1)
TEXT = Kind("not a string", lambda v: isinstance(v, str))
FLAG = Kind("not true or false", lambda v: isinstance(v, bool))
OBJECT = Kind("not a JSON object", lambda v: isinstance(v, dict))
NUMBERS = Kind("not a list of finite numbers", lambda v: isinstance(v, list) and all(_num(x) for x in v))
COUNTS0 = Kind("not a list of integers from 0 to 2^32 - 1",
               lambda v: isinstance(v, list) and all(_int(x) and 0 <= x <= U32 for x in v))
INT32 = Kind("not an integer from -2^31 to 2^31 - 1 (a GGUF int32)", lambda v: _int(v) and -I32 - 1 <= v <= I32)
PER_LAYER = Kind("not an integer from 1 to 2^32 - 1, or a list of them (one per layer)",
                 lambda v: COUNT.ok(v) or (isinstance(v, list) and v != [] and all(COUNT.ok(x) for x in v)))
PER_LAYER_FF = ("gemma3n",)  # the architectures whose intermediate_size may be per layer (an array in the GGUF)
TOKEN_IDS = Kind("not a token id (an integer from 0 to 2^31 - 1) or a list of them",
                 lambda v: (_int(v) and 0 <= v <= I32) or (isinstance(v, list) and v != [] and
                                                            all(_int(x) and 0 <= x <= I32 for x in v)))

# config.json's keys the reference reads (TextModel / LlamaModel / Gemma2Model / Gemma3Model / Phi3MiniModel /
# Qwen2MoeModel .set_gguf_parameters, their `_find` lists, SpecialVocab's token ids) and what each must hold
KEYS: dict[str, Kind] = {
    **dict.fromkeys(("num_hidden_layers", "n_layers", "n_layer", "num_layers"), BLOCKS),
    **dict.fromkeys(("max_position_embeddings", "n_ctx", "n_positions", "max_length", "max_sequence_length",
                     "model_max_length", "original_max_position_embeddings"), COUNT),
    **dict.fromkeys(("hidden_size", "n_embd", "dim"), COUNT),
    **dict.fromkeys(("prefix_dense_intermediate_size", "dense_intermediate_size", "n_inner",
                     "hidden_dim", "moe_intermediate_size", "shared_expert_intermediate_size"), COUNT),
    "intermediate_size": PER_LAYER,  # a list for Gemma 3n (its MatFormer layers), written as llama.cpp's array
    **dict.fromkeys(("intermediate_size_mlp", "interleave_moe_layer_step"), COUNT),  # Llama 4
    **dict.fromkeys(("num_attention_heads", "n_head", "n_heads", "num_key_value_heads", "n_kv_heads", "n_head_kv",
                     "head_dim", "vocab_size", "vocab_size_per_layer_input"), COUNT),
    **dict.fromkeys(("num_local_experts", "num_experts", "n_routed_experts"), EXPERTS),
    **dict.fromkeys(("num_experts_per_tok", "num_experts_per_token", "top_k_experts"), COUNT0),
    "sliding_window": COUNT0,
    # GLM-4.5 (Glm4MoeModel) and MiniMax-M2 (MiniMaxM2Model): the expert and NextN/MTP keys they write
    **dict.fromkeys(("num_nextn_predict_layers", "num_mtp_layers"), integer(0, MAX_LAYERS, " (llama.cpp loads at "
                                                                            "most 512 blocks)")),
    **dict.fromkeys(("n_shared_experts", "first_k_dense_replace", "n_group", "topk_group"), COUNT0),
    "rotary_dim": COUNT, "routed_scaling_factor": FINITE, "norm_topk_prob": FLAG,
    # TextModel.set_gguf_parameters' expert score function (it raises on any other)
    **dict.fromkeys(("score_function", "scoring_func", "score_func", "moe_router_activation",
                     "moe_router_activation_func", "expert_selection_fn"),
                    Kind(f"not one of {', '.join(GATING_FUNCS)} (the experts' score functions llama.cpp's converter "
                         "writes)", lambda v: isinstance(v, str) and v in GATING_FUNCS)),
    **dict.fromkeys(("rms_norm_eps", "norm_eps", "layer_norm_eps", "layer_norm_epsilon", "norm_epsilon",
                     "attn_logit_softcapping", "final_logit_softcapping"), POSITIVE),
    **dict.fromkeys(("global_rope_theta", "rope_global_theta", "rope_theta_global", "rope_theta", "rotary_emb_base",
                     "local_rope_theta", "rope_local_theta", "rope_theta_local", "swa_rope_theta",
                     "rope_local_base_freq"), POSITIVE),
    **dict.fromkeys(("partial_rotary_factor", "rope_pct", "rope_percent"), FRACTION),
    "is_causal": FLAG,
    **dict.fromkeys(("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id", "sep_token_id", "cls_token_id",
                     "mask_token_id"), TOKEN_IDS),
    **dict.fromkeys(("rope_parameters", "rope_scaling", "text_config"), OBJECT),
    "_name_or_path": TEXT,  # gguf's Metadata heuristics read the model's name from it
    # Qwen3-Next / Qwen3.5 gated DeltaNet layers (Qwen3NextModel.set_gguf_parameters: the ssm.* keys)
    **dict.fromkeys(("linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim",
                     "linear_num_key_heads", "linear_num_value_heads", "full_attention_interval"), COUNT),
    "mtp_num_hidden_layers": COUNT0,
    # DeepSeek-V2/V3 / Kimi K2 (DeepseekV2Model.set_gguf_parameters): the MLA sizes
    **dict.fromkeys(("q_lora_rank", "kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim"), COUNT),
}
# generation_config.json's sampling defaults, which gguf's Metadata writes as `general.sampling.*`
GENERATION_KEYS: dict[str, Kind] = {
    "sequence": TEXT, "top_k": INT32, "penalty_last_n": INT32, "mirostat": INT32,
    **dict.fromkeys(("top_p", "min_p", "xtc_probability", "xtc_threshold", "temperature", "penalty_repeat",
                     "mirostat_tau", "mirostat_eta"), FINITE),
}
# inside rope_parameters / rope_scaling (and their per-attention-kind `full_attention` / `sliding_attention`)
ROPE_KEYS: dict[str, Kind] = {
    "rope_type": TEXT, "type": TEXT, "rope_theta": POSITIVE, "factor": POSITIVE,
    "original_max_position_embeddings": COUNT, "low_freq_factor": POSITIVE, "high_freq_factor": POSITIVE,
    "extrapolation_factor": FINITE, "attention_factor": FINITE, "attn_factor": FINITE, "beta_fast": FINITE,
    "beta_slow": FINITE, "partial_rotary_factor": FRACTION, "long_factor": NUMBERS, "short_factor": NUMBERS,
    "mrope_section": COUNTS0, "mscale": FINITE, "mscale_all_dim": FINITE,
}
ROPE_KINDS = ("full_attention", "sliding_attention")

# a quantity the tensors show -> the config keys that state it; every one of them present must agree
QUANTITIES: dict[str, tuple[str, ...]] = {
    "blocks": ("num_hidden_layers", "n_layers", "n_layer", "num_layers"),
    "ctx": ("max_position_embeddings", "n_ctx", "n_positions", "max_length", "max_sequence_length",
            "model_max_length"),
    "embd": ("hidden_size", "n_embd", "dim"),
    "ff": ("intermediate_size", "n_inner", "hidden_dim", "dense_intermediate_size", "prefix_dense_intermediate_size"),
    "expert_ff": ("moe_intermediate_size",),
    "ff_mlp": ("intermediate_size_mlp",),  # Llama 4's dense layers (its intermediate_size is the experts')
    "heads": ("num_attention_heads", "n_head", "n_heads"),
    "kv_heads": ("num_key_value_heads", "n_kv_heads", "n_head_kv"),
    "head_dim": ("head_dim",),
    "vocab": ("vocab_size",),
    "experts": ("num_local_experts", "num_experts", "n_routed_experts"),
    "experts_used": ("num_experts_per_tok", "num_experts_per_token", "top_k_experts"),
    "shared_experts": ("n_shared_experts",),
    "rms_eps": ("rms_norm_eps", "norm_eps"),
    "softcap_attn": ("attn_logit_softcapping",),
    "softcap_final": ("final_logit_softcapping",),
    "sliding_window": ("sliding_window",),
    "shared_ff": ("shared_expert_intermediate_size",),
    "linear_k_heads": ("linear_num_key_heads",),
    "linear_v_heads": ("linear_num_value_heads",),
    "linear_k_dim": ("linear_key_head_dim",),
    "linear_v_dim": ("linear_value_head_dim",),
    "conv_kernel": ("linear_conv_kernel_dim",),
    "q_lora_rank": ("q_lora_rank",),  # MLA (deepseek2)
    "kv_lora_rank": ("kv_lora_rank",),
    "rope_dim": ("qk_rope_head_dim",),
    "nope_dim": ("qk_nope_head_dim",),
    "v_head_dim": ("v_head_dim",),
}
# what each architecture's parameters (`LLMArch.params`) cannot be written without (the reference indexes them,
# or llama.cpp requires the GGUF key they become); LlamaModel's own (`LLMArch.llama_params`) also the vocabulary
REQUIRED: dict[str, tuple[str, ...]] = {
    "text": ("blocks", "ctx", "embd", "ff", "heads", "kv_heads", "rms_eps"),
    "gemma2": ("blocks", "ctx", "embd", "ff", "heads", "kv_heads", "rms_eps", "head_dim", "softcap_attn",
               "softcap_final", "sliding_window"),
    "gemma3": ("blocks", "ctx", "embd", "ff", "heads", "kv_heads", "rms_eps"),
    "phi3": ("blocks", "ctx", "embd", "ff", "heads", "kv_heads", "rms_eps"),
    "qwen2moe": ("blocks", "ctx", "embd", "heads", "kv_heads", "rms_eps", "experts", "experts_used", "expert_ff"),
    # Qwen3NextModel (a Qwen2MoeModel) and Qwen3.5 dense: the gated DeltaNet sizes it indexes
    "qwen3next": ("blocks", "ctx", "embd", "heads", "kv_heads", "rms_eps", "experts", "experts_used", "expert_ff",
                  "linear_k_heads", "linear_v_heads", "linear_k_dim", "linear_v_dim", "conv_kernel"),
    "qwen35": ("blocks", "ctx", "embd", "ff", "heads", "kv_heads", "rms_eps", "linear_k_heads", "linear_v_heads",
               "linear_k_dim", "linear_v_dim", "conv_kernel"),
    "glm4moe": ("blocks", "ctx", "embd", "ff", "heads", "kv_heads", "rms_eps", "experts", "experts_used", "expert_ff"),
    "minimax-m2": ("blocks", "ctx", "embd", "ff", "heads", "kv_heads", "rms_eps", "experts", "experts_used"),
    "llama4": ("blocks", "ctx", "embd", "ff", "ff_mlp", "heads", "kv_heads", "rms_eps", "experts", "experts_used"),
    # DeepseekV2Model: the MLA sizes it indexes (kv_heads: its kv_b_proj split), the vocabulary it writes
    "deepseek2": ("blocks", "ctx", "embd", "heads", "kv_heads", "vocab", "rope_dim", "nope_dim", "v_head_dim"),
    # GptOssModel: its experts' feed-forward length is intermediate_size; it indexes sliding_window
    "gpt_oss": ("blocks", "ctx", "embd", "ff", "heads", "kv_heads", "rms_eps", "experts", "experts_used",
                "sliding_window"),
}


@dataclass(frozen=True)
class Shape:
    """`tensor` (a name under `model.layers.N.`, `{x}` for every expert; or a top-level name without its
    `model.` prefix) has, along `dim`, the sum of `terms`: each a coefficient times a product of quantities."""

    tensor: str
    dim: int
    terms: tuple[tuple[int, tuple[str, ...]], ...]


def size(*quantities: str, times: int = 1) -> tuple:
    return ((times, quantities),)


QKV = size("heads", "head_dim") + size("kv_heads", "head_dim", times=2)  # Phi-3's fused q, k, v rows
SHAPES: tuple[Shape, ...] = (
    Shape("embed_tokens.weight", 0, size("vocab")), Shape("embed_tokens.weight", 1, size("embd")),
    Shape("lm_head.weight", 0, size("vocab")), Shape("lm_head.weight", 1, size("embd")),
    Shape("norm.weight", 0, size("embd")),
    *(Shape(f"{n}.weight", 0, size("embd")) for n in ("input_layernorm", "post_attention_layernorm",
                                                      "pre_feedforward_layernorm", "post_feedforward_layernorm")),
    Shape("self_attn.q_proj.weight", 0, size("heads", "head_dim")), Shape("self_attn.q_proj.weight", 1, size("embd")),
    Shape("self_attn.q_proj.bias", 0, size("heads", "head_dim")),
    Shape("self_attn.k_proj.weight", 0, size("kv_heads", "head_dim")),
    Shape("self_attn.k_proj.weight", 1, size("embd")),
    Shape("self_attn.k_proj.bias", 0, size("kv_heads", "head_dim")),
    Shape("self_attn.v_proj.weight", 0, size("kv_heads", "head_dim")),
    Shape("self_attn.v_proj.weight", 1, size("embd")),
    Shape("self_attn.v_proj.bias", 0, size("kv_heads", "head_dim")),
    Shape("self_attn.o_proj.weight", 0, size("embd")), Shape("self_attn.o_proj.weight", 1, size("heads", "head_dim")),
    Shape("self_attn.qkv_proj.weight", 0, QKV), Shape("self_attn.qkv_proj.weight", 1, size("embd")),
    Shape("self_attn.q_norm.weight", 0, size("head_dim")), Shape("self_attn.k_norm.weight", 0, size("head_dim")),
    Shape("mlp.gate_proj.weight", 0, size("ff")), Shape("mlp.up_proj.weight", 0, size("ff")),
    Shape("mlp.gate_proj.weight", 1, size("embd")), Shape("mlp.up_proj.weight", 1, size("embd")),
    Shape("mlp.down_proj.weight", 0, size("embd")), Shape("mlp.down_proj.weight", 1, size("ff")),
    Shape("mlp.gate_up_proj.weight", 0, size("ff", times=2)), Shape("mlp.gate_up_proj.weight", 1, size("embd")),
    # Mixtral (llama): the router and each expert's w1 / w3 (gate, up) and w2 (down)
    Shape("block_sparse_moe.gate.weight", 0, size("experts")),
    Shape("block_sparse_moe.experts.{x}.w1.weight", 0, size("ff")),
    Shape("block_sparse_moe.experts.{x}.w3.weight", 0, size("ff")),
    Shape("block_sparse_moe.experts.{x}.w2.weight", 1, size("ff")),
    # Qwen3-MoE: the router (mlp.gate) and the experts' projections
    Shape("mlp.gate.weight", 0, size("experts")),
    Shape("mlp.experts.{x}.gate_proj.weight", 0, size("expert_ff")),
    Shape("mlp.experts.{x}.up_proj.weight", 0, size("expert_ff")),
    Shape("mlp.experts.{x}.down_proj.weight", 1, size("expert_ff")),
    # the routers' score corrections (DeepSeek-V3 / GLM-4.5's mlp.gate, MiniMax-M2's block_sparse_moe; named as
    # ModelBase.filter_tensors renames them) and GLM-4.5 / DeepSeek's shared experts
    Shape("mlp.gate.e_score_correction.bias", 0, size("experts")),
    Shape("block_sparse_moe.e_score_correction.bias", 0, size("experts")),
    *(Shape(f"mlp.shared_experts.{w}_proj.weight", d, size(*q)) for w in ("gate", "up")
      for d, q in ((0, ("expert_ff", "shared_experts")), (1, ("embd",)))),
    Shape("mlp.shared_experts.down_proj.weight", 0, size("embd")),
    Shape("mlp.shared_experts.down_proj.weight", 1, size("expert_ff", "shared_experts")),
)
_BY_TENSOR: dict[str, list[Shape]] = {}
for _s in SHAPES:
    _BY_TENSOR.setdefault(_s.tensor, []).append(_s)

# names as the quantities see them: a block's tensors under `model.layers.N.`, an expert's index as {x}
_BLOCK = re.compile(r"(?:.*\.)?layers\.(\d+)\.(.+)")
_EXPERT = re.compile(r"(\.experts\.)\d+\.")


@dataclass
class Sizes:
    """The checked quantities the exporter plans with (the reference's values for them)."""

    blocks: int
    heads: int
    kv_heads: int
    experts: int


def show(v) -> str:
    """A value as one short part of a line (a long list or string cut)."""
    s = repr(v)
    return s if len(s) <= 40 else s[:37] + "..."


class _Config:
    """The values being checked, with the wording of a refusal: `where` (config.json's path) and, for a value
    transformers filled in rather than the file (`stated` given and without the key), that it is transformers'."""

    def __init__(self, values: dict, where: str, stated: dict | None):
        self.values, self.where, self.stated = values, where, stated

    def label(self, key: str) -> str:
        if self.stated is not None and key not in self.stated:
            return f"{key} (transformers' value, not in config.json)"
        return key

    def bad(self, key: str, v, problem: str) -> CkptError:
        return CkptError(f"{self.where}: {self.label(key)} is {show(v)}, {problem}")


def _check_kinds(c: _Config) -> None:
    for key, kind in KEYS.items():
        v = c.values.get(key)
        if v is not None and not kind.ok(v):
            raise c.bad(key, v, kind.want)
    for container in ("rope_parameters", "rope_scaling"):
        rope = c.values.get(container)
        if not rope:
            continue
        parts = [(container, rope)] + [(f"{container}.{k}", rope[k]) for k in ROPE_KINDS if rope.get(k) is not None]
        for prefix, part in parts:
            if not isinstance(part, dict):
                raise c.bad(prefix, part, OBJECT.want)
            for key, kind in ROPE_KEYS.items():
                v = part.get(key)
                if v is not None and not kind.ok(v):
                    raise c.bad(f"{prefix}.{key}", v, kind.want)
            _check_rope(c, prefix, part)


def _check_rope(c: _Config, prefix: str, rope: dict) -> None:
    """What one RoPE scaling type needs of its parameters, as the reference computes with them."""
    kind = str(rope.get("rope_type", rope.get("type", ""))).lower()
    if kind == "llama3":  # LlamaModel.generate_extra_tensors computes with these (a default only where absent)
        for key in ("rope_theta", "factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
            if key in rope and rope[key] is None:
                raise c.bad(f"{prefix}.{key}", None, f"{ROPE_KEYS[key].want}, which llama3 RoPE scaling computes with")
        low, high = rope.get("low_freq_factor", 1.0), rope.get("high_freq_factor", 4.0)
        if not low <= high:  # (equal leaves no band to smooth: Llama 4 Scout's 1.0 and 1.0)
            raise c.bad(f"{prefix}.high_freq_factor", high, f"below low_freq_factor ({show(low)}), which llama3 "
                                                             "RoPE scaling cannot have")
    if kind == "yarn" and rope.get("factor") is not None and rope.get("original_max_position_embeddings") is None:
        raise CkptError(f"{c.where}: {prefix} is yarn RoPE scaling without original_max_position_embeddings, which "
                        "llama.cpp's converter writes with it")


def _quantities(c: _Config) -> dict[str, tuple[str, int]]:
    """quantity -> (the key stating it, its value); the keys of one quantity must agree."""
    out = {}
    for q, keys in QUANTITIES.items():
        present = [(k, c.values[k]) for k in keys if c.values.get(k) is not None]
        for k, v in present[1:]:
            if v != present[0][1]:
                raise c.bad(k, v, f"but {c.label(present[0][0])} is {show(present[0][1])}; llama.cpp's converter "
                                  "reads one or the other")
        if present:
            out[q] = present[0]
    return out


def _check_blocks(c: _Config, q: dict, names, extra: int = 0) -> None:
    """The block count against the blocks the weights hold (exactly 0..n-1, each present; or 0..n+extra-1 where
    the architecture converts `extra` blocks after them: `LLMArch.trailing_blocks`)."""
    if "blocks" not in q:
        return
    key, n = q["blocks"]
    present = {int(m.group(1)) for name in names if (m := _BLOCK.fullmatch(name))}
    if any(len(present) == k and max(present) == k - 1 for k in {n, n + extra} if k):
        return
    if not present:
        raise c.bad(key, n, "but the weights hold no blocks (no model.layers.N tensors)")
    have = f"{len(present)} block{'s' if len(present) != 1 else ''} (model.layers.{min(present)}-{max(present)})"
    gap = next(i for i in range(len(present) + 1) if i not in present)
    more = f", none for block {gap}" if gap < max(present) else ""
    raise CkptError(f"{c.where}: {c.label(key)} is {n} but the weights hold {have}{more}")


def _head_dim(c: _Config, q: dict):
    """head_dim as stated, else hidden_size / num_attention_heads as llama.cpp derives it where the GGUF has no
    key length; (label, value). Derived from the values transformers filled in only: on config.json as written,
    the config class may still supply a head_dim of its own (Gemma's 256)."""
    if "head_dim" in q:
        return c.label(q["head_dim"][0]), q["head_dim"][1]
    if c.stated is not None and "embd" in q and "heads" in q:
        return f"head_dim ({q['embd'][0]} / {q['heads'][0]})", q["embd"][1] // q["heads"][1]
    return None


def _check_relations(c: _Config, q: dict, complete: bool) -> None:
    """The quantities against each other: what llama.cpp asserts or computes with. (`complete`: the values
    transformers filled in, where a missing expert count means none.)"""
    if "heads" in q and "kv_heads" in q:
        (hk, h), (kk, kv) = q["heads"], q["kv_heads"]
        if kv > h or h % kv:
            raise c.bad(kk, kv, f"which does not divide {c.label(hk)} ({h}) into groups (grouped-query attention)")
    if "ff" in q and isinstance(q["ff"][1], list) and "blocks" in q and len(q["ff"][1]) != q["blocks"][1]:
        raise c.bad(q["ff"][0], q["ff"][1], f"{len(q['ff'][1])} values for the {q['blocks'][1]} layers of "
                                            f"{c.label(q['blocks'][0])}")
    hd = _head_dim(c, q)
    if hd is not None and hd[1] % 2:
        raise CkptError(f"{c.where}: {hd[0]} is {hd[1]}, odd; RoPE rotates a head's values in pairs")
    if "experts_used" in q and ("experts" in q or complete):
        key, used = q["experts_used"]
        n_exp = q["experts"][1] if "experts" in q else 0
        if n_exp and not 1 <= used <= n_exp:
            raise c.bad(key, used, f"not from 1 to the {n_exp} experts (llama.cpp asserts it)")
        if not n_exp and used:
            raise c.bad(key, used, "but the model has no experts (llama.cpp asserts that none are used then)")


def _rules(arch) -> dict[str, list[Shape]]:
    """The shape rules by tensor: the generic ones, those of a tensor the architecture has its own rules for
    (`LLMArch.shape_rules`) replaced by them."""
    own = getattr(arch, "shape_rules", ())
    if not own:
        return _BY_TENSOR
    out = dict(_BY_TENSOR)
    for tensor in {s.tensor for s in own}:
        out[tensor] = [s for s in own if s.tensor == tensor]
    return out


def _of_block(values: dict, name: str, used) -> dict | None:
    """The quantities `used` as they apply to tensor `name`: a per-layer list's value for its block (None for a
    tensor outside the blocks, which such a quantity does not describe)."""
    lists = [k for k in used if isinstance(values[k], list)]
    if not lists:
        return values
    m = _BLOCK.fullmatch(name)
    if m is None:
        return None
    i = int(m.group(1))
    if any(i >= len(values[k]) for k in lists):
        return None
    return {**values, **{k: values[k][i] for k in lists}}


def _check_shapes(c: _Config, q: dict, shapes: dict[str, tuple[int, ...]], rules=None) -> None:
    """Every tensor a rule names against the quantities; the first disagreement is refused, naming the keys with
    their values, the tensor and its size. Rules of one quantity go first, so that a wrong hidden_size is named
    alone, not in a product with the head count."""
    values = {k: v for k, (_, v) in q.items()}
    labels = {k: c.label(key) for k, (key, _) in q.items()}
    hd = _head_dim(c, q)
    if hd is not None:
        labels["head_dim"], values["head_dim"] = hd
    found = []
    for name, shape in shapes.items():
        m = _BLOCK.fullmatch(name)
        rel = _EXPERT.sub(r"\1{x}.", m.group(2)) if m else name.removeprefix("model.")
        found += [(rule, name, shape) for rule in (rules or _BY_TENSOR).get(rel, ())]
    found.sort(key=lambda x: sum(len(qs) for _, qs in x[0].terms) + len(x[0].terms))  # stable: file order within
    all_values = values
    for rule, name, shape in found:
        used = {x for _, qs in rule.terms for x in qs}
        if not used <= all_values.keys():
            continue
        values = _of_block(all_values, name, used)  # a per-layer list (Gemma 3n's intermediate_size): the block's
        if values is None:
            continue
        want = sum(k * math.prod(values[x] for x in qs) for k, qs in rule.terms)
        have = shape[rule.dim] if len(shape) > rule.dim else None
        if have == want:
            continue
        what = ("rows", "columns")[rule.dim] if rule.dim < 2 else f"values along dim {rule.dim}"
        has = f"has {have} {what}" if have is not None else f"has shape {list(shape)}"
        first = rule.terms[0][1][0]
        if rule.terms == size(first):
            msg = f"{c.where}: {labels[first]} is {values[first]} but {name} {has}"
        else:  # a product of several keys: each named with its value, none blamed alone
            formula = " + ".join((f"{k} x " if k != 1 else "") + " x ".join(labels[x] for x in qs)
                                 for k, qs in rule.terms)
            numbers = " + ".join((f"{k} x " if k != 1 else "") + " x ".join(str(values[x]) for x in qs)
                                 for k, qs in rule.terms)
            msg = f"{c.where}: {formula} is {numbers} = {want} but {name} {has}"
        raise CkptError(msg)


def check(values: dict, shapes: dict[str, tuple[int, ...]], arch, where: str,
          stated: dict | None = None) -> Sizes | None:
    """Refuse, in one line, a config whose values are of the wrong type or range, disagree with each other or
    with the tensors (`shapes`: HF name -> shape). `stated` is config.json as written when `values` are the
    values transformers filled in: then the keys the architecture's parameters need must be there, and the
    planner's sizes are returned."""
    c = _Config(values, where, stated)
    _check_kinds(c)
    q = _quantities(c)
    _check_blocks(c, q, shapes, arch.trailing_blocks(c.values) if hasattr(arch, "trailing_blocks") else 0)
    if "ff" in q and isinstance(q["ff"][1], list) and getattr(arch, "arch", None) not in PER_LAYER_FF:
        raise c.bad(q["ff"][0], q["ff"][1], f"{COUNT.want} (a list is per-layer sizes, which a "
                                            f"{getattr(arch, 'arch', '')} GGUF does not have)")
    _check_relations(c, q, complete=stated is not None)
    _check_shapes(c, q, shapes, _rules(arch))
    if stated is None:
        return None
    need = REQUIRED.get(arch.params, REQUIRED["text"]) + (("vocab",) if arch.llama_params else ())
    if q.get("experts", (None, 0))[1]:
        need += ("experts_used",)
    for name in need:
        if name not in q:
            keys = QUANTITIES[name]
            also = f" (nor {', '.join(keys[1:])})" if len(keys) > 1 else ""
            raise CkptError(f"{where}: has no {keys[0]}{also}, which llama.cpp's converter needs for a {arch.arch} "
                            "GGUF")
    return Sizes(blocks=q["blocks"][1], heads=q["heads"][1], kv_heads=q["kv_heads"][1],
                 experts=q.get("experts", (None, 0))[1])


def check_generation(values: dict, where: str) -> None:
    """generation_config.json's sampling defaults, each of the type its GGUF key has."""
    for key, kind in GENERATION_KEYS.items():
        v = values.get(key)
        if v is not None and not kind.ok(v):
            raise CkptError(f"{where}: {key} is {show(v)}, {kind.want}")


def token_id_warnings(values: dict, n_vocab: int, where: str) -> list[str]:
    """config.json's special token ids that are no token of the vocabulary: the reference leaves them out, or
    writes them and llama.cpp disables them on load, which the user should hear about."""
    out = []
    for key in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id", "sep_token_id", "cls_token_id",
                "mask_token_id"):
        v = values.get(key)
        if _int(v) and v >= n_vocab:
            out.append(f"{where}: {key} {v} is not a token of the {n_vocab}-token vocabulary; llama.cpp ignores it "
                       f"(its own default {key.removesuffix('_token_id')} token applies)")
    return out


__all__ = ["GENERATION_KEYS", "KEYS", "QUANTITIES", "REQUIRED", "ROPE_KEYS", "SHAPES", "Kind", "Shape", "Sizes",
           "check", "check_generation", "show", "token_id_warnings"]
