"""llama.cpp's per-tensor quantization mix: which GGML type `llama-quantize [flags] MODEL.gguf OUT.gguf Q4_K_M` gives
each tensor of an LLM GGUF, so a GGUF written here carries the types a user would get from llama.cpp.

"Q4_K_M" is no single type: llama.cpp's `src/llama-quant.cpp` (llama-cpp-python 0.3.36's vendored copy) picks
each tensor's type from its name, its layer, its row length, a few model facts (layer count, GQA ratio, expert
count, whether output.weight exists), whether an importance matrix is given, and llama-quantize's per-tensor flags.
This module is that choice transcribed, function by function (`tensor_allows_quantization`, `tensor_get_category`,
`init_quantize_state_counters`, `llama_tensor_get_type`, `llama_tensor_get_type_impl`, `tensor_type_fallback`,
`tensor_requires_imatrix`, `llama_ftype_get_default_type`; the impl's per-category ftype chains as rule tables, one
small function per branch), for every file type llama-quantize lists (tools/quantize/quantize.cpp's QUANT_OPTIONS),
with and without an importance matrix, and with `--pure`, `--tensor-type`, `--output-tensor-type`,
`--token-embedding-type` and `--leave-output-tensor`. It is data and a pure function (no torch, no gguf) so a
planner can show the mix before any tensor is read; tests/test_gguf_llm_mix.py and tests/test_gguf_mix_imatrix.py
check it against llama.cpp's own quantizer.

Where llama.cpp refuses a run, `llm_types` raises the same refusal as one CkptError line: a file type that needs an
importance matrix without one ("this quantization requires an imatrix"), a tensor such a type needs an entry for
that the imatrix lacks ("Missing importance matrix for tensor ..."), a row length with no fallback type ("no tensor
type fallback is defined for type q1_0"), a layer it cannot tell. Where llama.cpp would abort or write a broken
file instead (ggml's IQ2_XXS/IQ2_XS/IQ1_S quantizers without an importance for the token embedding or output that
`tensor_requires_imatrix` exempts; an --output-tensor-type / --token-embedding-type whose blocks do not divide the
rows, which llama.cpp applies without its fallback), ckpt refuses too.

Left out: GLM5-next's Q8_0 floor and its extra keep-list, `--prune-layers`. `model.type == LLM_TYPE_70B` (attn_v
Q3_K/Q4_K -> Q5_K) is derived as each arch's `load_arch_hparams` does for llama, qwen2, deci, olmo and jais2
(`TYPE_70B`); other archs never are 70B here.

The counters (i_attention_wv, i_ffn_down, ...) advance in the order llama.cpp visits tensors: its loader's
`weights_map`, sorted by block number (non-block tensors first) and then by name, not the file order.
"""

from __future__ import annotations

import re
from typing import NamedTuple

from ckpt.errors import CkptError
from ckpt.families.llm.tensor_type_option import QUANT_TARGETS, compile_pattern, ggml_type, parse_tensor_type

__all__ = ["llm_types", "parse_tensor_type", "requires_imatrix", "unused_tensor_types", "category",
           "allows_quantization"]

# llama.h `enum llama_ftype`: the value llama-quantize writes as general.file_type (= gguf.LlamaFileType; gguf 0.19
# lacks MOSTLY_Q2_0, which ckpt.io.ggml_types adds to it)
FILE_TYPE = {
    "ALL_F32": 0, "MOSTLY_F16": 1, "MOSTLY_Q4_0": 2, "MOSTLY_Q4_1": 3, "MOSTLY_Q8_0": 7, "MOSTLY_Q5_0": 8,
    "MOSTLY_Q5_1": 9, "MOSTLY_Q2_K": 10, "MOSTLY_Q3_K_S": 11, "MOSTLY_Q3_K_M": 12, "MOSTLY_Q3_K_L": 13,
    "MOSTLY_Q4_K_S": 14, "MOSTLY_Q4_K_M": 15, "MOSTLY_Q5_K_S": 16, "MOSTLY_Q5_K_M": 17, "MOSTLY_Q6_K": 18,
    "MOSTLY_IQ2_XXS": 19, "MOSTLY_IQ2_XS": 20, "MOSTLY_Q2_K_S": 21, "MOSTLY_IQ3_XS": 22, "MOSTLY_IQ3_XXS": 23,
    "MOSTLY_IQ1_S": 24, "MOSTLY_IQ4_NL": 25, "MOSTLY_IQ3_S": 26, "MOSTLY_IQ3_M": 27, "MOSTLY_IQ2_S": 28,
    "MOSTLY_IQ2_M": 29, "MOSTLY_IQ4_XS": 30, "MOSTLY_IQ1_M": 31, "MOSTLY_BF16": 32, "MOSTLY_TQ1_0": 36,
    "MOSTLY_TQ2_0": 37, "MOSTLY_MXFP4_MOE": 38, "MOSTLY_Q1_0": 40, "MOSTLY_Q2_0": 41,
}

# llama_ftype_get_default_type: the type every quantizable tensor starts from (IQ2_S starts from IQ2_XS, IQ2_M from
# IQ2_S, IQ3_XS and IQ3_M from IQ3_S: the mix rules make the difference)
DEFAULT_TYPE = {
    "ALL_F32": "F32", "MOSTLY_F16": "F16", "MOSTLY_BF16": "BF16",
    "MOSTLY_Q4_0": "Q4_0", "MOSTLY_Q4_1": "Q4_1", "MOSTLY_Q5_0": "Q5_0", "MOSTLY_Q5_1": "Q5_1",
    "MOSTLY_Q8_0": "Q8_0", "MOSTLY_Q1_0": "Q1_0", "MOSTLY_Q2_0": "Q2_0", "MOSTLY_MXFP4_MOE": "MXFP4",
    "MOSTLY_Q2_K_S": "Q2_K", "MOSTLY_Q2_K": "Q2_K", "MOSTLY_IQ3_XS": "IQ3_S",
    "MOSTLY_Q3_K_S": "Q3_K", "MOSTLY_Q3_K_M": "Q3_K", "MOSTLY_Q3_K_L": "Q3_K",
    "MOSTLY_Q4_K_S": "Q4_K", "MOSTLY_Q4_K_M": "Q4_K", "MOSTLY_Q5_K_S": "Q5_K", "MOSTLY_Q5_K_M": "Q5_K",
    "MOSTLY_Q6_K": "Q6_K", "MOSTLY_TQ1_0": "TQ1_0", "MOSTLY_TQ2_0": "TQ2_0",
    "MOSTLY_IQ2_XXS": "IQ2_XXS", "MOSTLY_IQ2_XS": "IQ2_XS", "MOSTLY_IQ2_S": "IQ2_XS", "MOSTLY_IQ2_M": "IQ2_S",
    "MOSTLY_IQ3_XXS": "IQ3_XXS", "MOSTLY_IQ1_S": "IQ1_S", "MOSTLY_IQ1_M": "IQ1_M",
    "MOSTLY_IQ4_NL": "IQ4_NL", "MOSTLY_IQ4_XS": "IQ4_XS", "MOSTLY_IQ3_S": "IQ3_S", "MOSTLY_IQ3_M": "IQ3_S",
}

# ggml_blck_size of every type llama-quantize can give a tensor (values per block; 1 for the plain types)
BLOCK = {"F32": 1, "F16": 1, "BF16": 1, "Q4_0": 32, "Q4_1": 32, "Q5_0": 32, "Q5_1": 32, "Q8_0": 32,
         "IQ4_NL": 32, "MXFP4": 32, "Q2_0": 64, "NVFP4": 64, "Q1_0": 128,
         "Q2_K": 256, "Q3_K": 256, "Q4_K": 256, "Q5_K": 256, "Q6_K": 256, "IQ4_XS": 256, "TQ1_0": 256,
         "TQ2_0": 256, "IQ2_XXS": 256, "IQ2_XS": 256, "IQ2_S": 256, "IQ3_XXS": 256, "IQ3_S": 256, "IQ1_S": 256,
         "IQ1_M": 256}
assert set(BLOCK) == set(QUANT_TARGETS)
PLAIN = ("F32", "F16", "BF16")  # !ggml_is_quantized

# tensor_type_fallback: a type whose block does not divide the row -> this one (F16 if that does not either);
# 32-block types have no smaller block and go to F16 directly; a larger block not listed (Q1_0, NVFP4) has no
# fallback: llama.cpp refuses the run
FALLBACK = {"IQ1_S": "IQ4_NL", "IQ1_M": "IQ4_NL", "IQ2_XXS": "IQ4_NL", "IQ2_XS": "IQ4_NL", "IQ2_S": "IQ4_NL",
            "IQ3_XXS": "IQ4_NL", "IQ3_S": "IQ4_NL", "IQ4_XS": "IQ4_NL", "Q2_0": "Q4_0", "Q2_K": "Q4_0",
            "Q3_K": "Q4_0", "TQ1_0": "Q4_0", "TQ2_0": "Q4_0", "Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}

# tensor_requires_imatrix: the types llama-quantize quantizes only with an importance matrix (and Q2_K within a
# Q2_K_S file), except for the token embedding and the output tensor
REQUIRES_IMATRIX = ("IQ3_XXS", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ1_M", "IQ1_S")
# ggml_quantize_requires_imatrix: ggml's quantizer asserts an importance is given (the exempt tensors included)
GGML_REQUIRES_IMATRIX = ("IQ2_XXS", "IQ2_XS", "IQ1_S")

# tensor_get_category: exact names first, then the first name fragment found, in this order
EXACT_CATEGORY = {"output.weight": "OUTPUT", "token_embd.weight": "TOKEN_EMBD",
                  "per_layer_token_embd.weight": "TOKEN_EMBD"}
FRAGMENT_CATEGORY = (
    ("attn_qkv.weight", "ATTENTION_QKV"), ("attn_kv_b.weight", "ATTENTION_KV_B"), ("attn_v.weight", "ATTENTION_V"),
    ("attn_k.weight", "ATTENTION_K"), ("attn_q.weight", "ATTENTION_Q"), ("attn_output.weight", "ATTENTION_OUTPUT"),
    ("ffn_up", "FFN_UP"), ("ffn_gate", "FFN_GATE"), ("ffn_down", "FFN_DOWN"),
)
ATTN_V_LIKE = ("ATTENTION_V", "ATTENTION_QKV", "ATTENTION_KV_B")  # category_is_attn_v
TOKEN_EMBD_NAMES = ("token_embd.weight", "per_layer_token_embd.weight")  # tensor_name_match_token_embd

# tensor_allows_quantization: name fragments never quantized (GLM5-next's own list left out)
KEEP_FRAGMENTS = (
    "_norm.weight", "ffn_gate_inp.weight", "ffn_gate_tid2eid.weight", "altup", "laurel", "per_layer_model_proj",
    "ssm_conv1d", "shortconv.conv.weight", "indexer.k_proj.weight", "indexer.q_proj.weight",
    "time_mix_first.weight", "time_mix_w0.weight", "time_mix_w1.weight", "time_mix_w2.weight",
    "time_mix_v0.weight", "time_mix_v1.weight", "time_mix_v2.weight", "time_mix_a0.weight",
    "time_mix_a1.weight", "time_mix_a2.weight", "time_mix_g1.weight", "time_mix_g2.weight",
    "time_mix_decay_w1.weight", "time_mix_decay_w2.weight", "time_mix_lerp_fused.weight", "attn_rel_b.weight",
    ".position_embd", "sam.pos_embd", "sam.neck.", "sam.net_", ".rel_pos", ".patch_embd", ".patch_merger",
    "a.rvq.codebook", "mm.a.code_embd",
)
KEEP_NAMES = ("position_embd.weight", "token_types.weight")  # LLM_TN(arch)(POS_EMBD / TOKEN_TYPES, "weight")

# models/<arch>.cpp load_arch_hparams: when model.type is LLM_TYPE_70B (n_layer, n_head, n_head_kv, n_expert)
TYPE_70B = {
    "llama": lambda n_layer, n_head, n_head_kv, n_expert: n_expert != 8 and n_layer == 80 and n_head != n_head_kv,
    "qwen2": lambda n_layer, *_: n_layer == 80,
    "deci": lambda n_layer, *_: n_layer == 80,
    "olmo": lambda n_layer, *_: n_layer == 80,
    "jais2": lambda n_layer, *_: n_layer == 68,
}

_BLOCK_NUMBER = re.compile(r"blk\.\s*([+-]?\d+)")


def _block_number(name: str) -> int:
    """sscanf(name, "blk.%d.", &layer), -1 where it does not match (llama_model_loader's weight_name_comparer)."""
    m = _BLOCK_NUMBER.match(name)
    return int(m.group(1)) if m else -1


def _label(ftype: str) -> str:
    """llama-quantize's name of a file type (QUANT_OPTIONS): MOSTLY_IQ2_XXS -> IQ2_XXS."""
    return ftype[len("MOSTLY_"):] if ftype.startswith("MOSTLY_") else ftype


def category(name: str) -> str:
    """tensor_get_category."""
    if name in EXACT_CATEGORY:
        return EXACT_CATEGORY[name]
    return next((cat for frag, cat in FRAGMENT_CATEGORY if frag in name), "OTHER")


def allows_quantization(name: str, shape: tuple[int, ...], quantize_output_tensor: bool = True) -> bool:
    """tensor_allows_quantization (no only_copy): a tensor of at least 2 dims as ggml counts them (size-1 dims at
    the torch shape's front do not count) whose name ends in `weight` and is on no keep-list; output.weight only
    with `quantize_output_tensor` (llama-quantize --leave-output-tensor clears it)."""
    n_dims = len(shape)
    while n_dims > 1 and shape[len(shape) - n_dims] == 1:  # ggml_n_dims: trailing ne of 1 do not count
        n_dims -= 1
    if n_dims < 2 or not name.endswith("weight"):
        return False
    if not quantize_output_tensor and name == "output.weight":
        return False
    return name not in KEEP_NAMES and not any(frag in name for frag in KEEP_FRAGMENTS)


def requires_imatrix(name: str, ggml_type_name: str, ftype: str) -> bool:
    """tensor_requires_imatrix: whether llama-quantize refuses to give `name` this type without an importance
    matrix (the token embedding and the output tensor never; Q2_K only in a Q2_K_S file)."""
    if name in TOKEN_EMBD_NAMES or name == "output.weight":
        return False
    return ggml_type_name in REQUIRES_IMATRIX or (ggml_type_name == "Q2_K" and ftype == "MOSTLY_Q2_K_S")


def _use_more_bits(i_layer: int, n_layers: int) -> bool:
    """llama_tensor_get_type_impl's use_more_bits: the first and last eighth, and every third layer between."""
    return i_layer < n_layers // 8 or i_layer >= 7 * n_layers // 8 or _c_mod(i_layer - n_layers // 8, 3) == 2


def _c_mod(a: int, b: int) -> int:
    """C's `%` (truncates toward zero), for negative left operands."""
    return a - b * int(a / b)


class _State:
    """quantize_state_impl: the model facts, the flags and the counters, as init_quantize_state_counters sets
    them."""

    def __init__(self, names, *, arch, n_layer, n_head, n_head_kv, n_expert, has_imatrix, output_tensor_type):
        cats = [category(n) for n in names]
        self.arch, self.n_expert = arch, n_expert
        self.falcon = arch == "falcon"  # LLM_ARCH_FALCON, the one arch the rules name (and BAILINGMOE3's experts)
        self.n_gqa = n_head // n_head_kv if n_head_kv else 0  # llama_hparams::n_gqa
        self.type_70b = arch in TYPE_70B and TYPE_70B[arch](n_layer, n_head, n_head_kv, n_expert)
        self.has_imatrix = has_imatrix
        self.output_tensor_type = output_tensor_type
        self.n_attention_wv = sum(c in ATTN_V_LIKE for c in cats)
        self.has_tied_embeddings = "OUTPUT" not in cats
        self.n_ffn_down = self.n_ffn_gate = self.n_ffn_up = n_layer  # hparams.n_layer_all
        self.i_attention_wv = self.i_ffn_down = self.i_ffn_gate = self.i_ffn_up = 0

    def layer_info(self, i_layer: int, n_layer: int, name: str) -> tuple[int, int]:
        """llama_tensor_get_type_impl's layer_info: with experts, the layer is read from the name."""
        if max(1, self.n_expert) > 1:
            m = _BLOCK_NUMBER.match(name)
            if m is None:
                raise CkptError(f"llama.cpp's quantizer cannot tell the layer of tensor {name}")
            i_layer = int(m.group(1))
            if not 0 <= i_layer < n_layer:
                raise CkptError(f"tensor {name} is in layer {i_layer}, outside the model's {n_layer} layers")
        return i_layer, n_layer


# --- llama_tensor_get_type_impl's per-category ftype chains, as data ---------------------------------------------
#
# Each category's `if (ftype == A) ... else if (ftype == B && cond) ...` chain is a tuple of rows in the C's order;
# the first row whose file type and conditions all hold gives the type (`to`; None: the type stays), no row: it
# stays. A C ternary is consecutive rows of one file type, the last with no condition; a C `||` of conditions is
# consecutive rows with the same result; a branch the C enters on its file type alone but may leave unchanged ends
# with a `None` row, so later rows never see that file type. A new llama.cpp file type or condition is rows here
# (and a WHEN entry), not another branch in code.


class Rule(NamedTuple):
    ftypes: tuple[str, ...] | None  # llama_ftype names (FILE_TYPE keys); None: every file type reaching the branch
    when: tuple[str, ...]  # WHEN keys, all must hold; () always
    to: str | None  # the GGML type; None: keep the type the tensor has so far


# the conditions the rows name, as the C writes them: (state, i, n) -> bool, i/n the branch's layer (or counter)
# and layer count (or tensor count)
WHEN = {
    "n_gqa >= 4": lambda qs, i, n: qs.n_gqa >= 4,
    "n_expert == 8": lambda qs, i, n: qs.n_expert == 8,
    "n_expert != 8": lambda qs, i, n: qs.n_expert != 8,
    "n_expert >= 4": lambda qs, i, n: qs.n_expert >= 4,
    "falcon": lambda qs, i, n: qs.falcon,
    "!falcon": lambda qs, i, n: not qs.falcon,
    "has_imatrix": lambda qs, i, n: qs.has_imatrix,
    "!has_imatrix": lambda qs, i, n: not qs.has_imatrix,
    "i < 2": lambda qs, i, n: i < 2,
    "i < 4": lambda qs, i, n: i < 4,
    "i < n/8": lambda qs, i, n: i < n // 8,
    "i < n/16": lambda qs, i, n: i < n // 16,
    "n/8 <= i < 7n/8": lambda qs, i, n: n // 8 <= i < 7 * n // 8,
    "use_more_bits": lambda qs, i, n: _use_more_bits(i, n),
}

IQ2_S_M = ("MOSTLY_IQ2_S", "MOSTLY_IQ2_M")
IQ4 = ("MOSTLY_IQ4_NL", "MOSTLY_IQ4_XS")

# the output rule (and a tied token_embd's) after MXFP4_MOE's Q8_0 and the falcon / row-length Q8_0: these file
# types take Q5_K, the rest Q6_K (unless already Q8_0)
OUTPUT_Q5_K_FTYPES = ("MOSTLY_IQ2_XXS", "MOSTLY_IQ2_XS", "MOSTLY_IQ3_XXS", "MOSTLY_IQ1_S", "MOSTLY_IQ2_S",
                      "MOSTLY_IQ2_M", "MOSTLY_IQ1_M")

# `category == TOKEN_EMBD` branch (untied, no --token-embedding-type)
TOKEN_EMBD_RULES = (
    Rule(("MOSTLY_IQ2_XXS", "MOSTLY_IQ2_XS", "MOSTLY_IQ1_S", "MOSTLY_IQ1_M"), (), "Q2_K"),
    Rule(IQ2_S_M, (), "IQ3_S"),
    Rule(("MOSTLY_IQ3_XXS",), (), "IQ3_S"),
    Rule(("MOSTLY_TQ1_0", "MOSTLY_TQ2_0", "MOSTLY_Q2_0"), (), "Q4_K"),
)

# `category_is_attn_v` branch (i = qs.i_attention_wv, n = qs.n_attention_wv); the 70B and 8-expert bumps that
# follow the chain are in _attn_v
ATTN_V_RULES = (
    Rule(("MOSTLY_Q2_K",), ("n_gqa >= 4",), "Q4_K"),
    Rule(("MOSTLY_Q2_K",), (), "Q3_K"),
    Rule(("MOSTLY_Q2_K_S",), ("n_gqa >= 4",), "Q4_K"),
    Rule(("MOSTLY_IQ3_XXS",), ("n_gqa >= 4",), "Q4_K"),
    Rule(("MOSTLY_IQ3_XXS",), ("!has_imatrix",), "IQ3_S"),
    Rule(("MOSTLY_IQ3_XXS",), (), "IQ3_XXS"),
    Rule(("MOSTLY_IQ3_XS", "MOSTLY_IQ3_S"), ("n_gqa >= 4",), "Q4_K"),
    Rule(("MOSTLY_IQ3_M",), (), "Q4_K"),
    Rule(("MOSTLY_Q3_K_M",), ("i < 2",), "Q5_K"),
    Rule(("MOSTLY_Q3_K_M",), (), "Q4_K"),
    Rule(("MOSTLY_Q3_K_L",), (), "Q5_K"),
    Rule(IQ4, ("n_gqa >= 4",), "Q5_K"),
    Rule(("MOSTLY_Q4_K_M", "MOSTLY_Q5_K_M"), ("use_more_bits",), "Q6_K"),
    Rule(("MOSTLY_Q4_K_S",), ("i < 4",), "Q5_K"),
)

# `category == ATTENTION_K` branch
ATTN_K_RULES = (
    Rule(None, ("n_expert == 8",), "Q8_0"),
    Rule(("MOSTLY_IQ3_XS",), (), "IQ3_XXS"),
    Rule(("MOSTLY_IQ3_XXS",), (), "IQ2_S"),
)

# `category == ATTENTION_Q` branch
ATTN_Q_RULES = (
    Rule(("MOSTLY_IQ3_XS",), (), "IQ3_XXS"),
    Rule(("MOSTLY_IQ3_XXS",), (), "IQ2_S"),
)

# `category == FFN_DOWN` branch (i, n = layer_info(i_ffn_down, n_ffn_down))
FFN_DOWN_RULES = (
    Rule(("MOSTLY_Q2_K",), (), "Q3_K"),
    Rule(("MOSTLY_Q2_K_S",), ("i < n/8",), "Q4_K"),
    Rule(("MOSTLY_Q2_K_S",), (), None),
    Rule(("MOSTLY_IQ3_XXS",), ("!has_imatrix", "i < n/8"), "Q4_K"),
    Rule(("MOSTLY_IQ3_XXS",), ("!has_imatrix",), "Q3_K"),
    Rule(("MOSTLY_Q3_K_M",), ("i < n/16",), "Q5_K"),
    Rule(("MOSTLY_Q3_K_M",), ("!falcon",), "Q4_K"),
    Rule(("MOSTLY_Q3_K_M",), ("use_more_bits",), "Q4_K"),
    Rule(("MOSTLY_Q3_K_M",), (), "Q3_K"),
    Rule(("MOSTLY_IQ3_M",), ("i < n/8",), "Q4_K"),
    Rule(("MOSTLY_IQ3_M",), ("n_expert == 8", "use_more_bits"), "Q4_K"),
    Rule(("MOSTLY_Q3_K_L",), ("falcon",), "Q4_K"),
    Rule(("MOSTLY_Q3_K_L",), (), "Q5_K"),
    Rule(("MOSTLY_Q4_K_M",), ("falcon", "i < n/16"), "Q6_K"),
    Rule(("MOSTLY_Q4_K_M",), ("falcon", "use_more_bits"), "Q5_K"),
    Rule(("MOSTLY_Q4_K_M",), ("falcon",), "Q4_K"),
    Rule(("MOSTLY_Q4_K_M",), ("use_more_bits",), "Q6_K"),
    Rule(("MOSTLY_Q4_K_M",), (), None),
    Rule(IQ4, ("i < n/8", "!has_imatrix"), "Q5_K"),
    Rule(("MOSTLY_Q5_K_M",), ("use_more_bits",), "Q6_K"),
    Rule(("MOSTLY_Q4_K_S",), ("!falcon", "i < n/8"), "Q5_K"),
    Rule(("MOSTLY_Q4_0",), ("has_imatrix", "i < n/8"), "Q4_1"),
    Rule(("MOSTLY_Q5_0",), ("has_imatrix", "i < n/8"), "Q5_1"),
)

# `category == ATTENTION_OUTPUT` branch: not falcon with 8 experts, not falcon otherwise, falcon
ATTN_OUTPUT_RULES = (
    Rule(("MOSTLY_Q2_K", "MOSTLY_IQ3_XS", "MOSTLY_IQ3_XXS", "MOSTLY_Q3_K_S", "MOSTLY_Q3_K_M", "MOSTLY_IQ4_NL",
          "MOSTLY_Q4_K_S", "MOSTLY_Q4_K_M", "MOSTLY_IQ3_S", "MOSTLY_IQ3_M", "MOSTLY_IQ4_XS"),
         ("!falcon", "n_expert == 8"), "Q5_K"),
    Rule(("MOSTLY_Q2_K",), ("!falcon", "n_expert != 8"), "Q3_K"),
    Rule(("MOSTLY_IQ3_XXS",), ("!falcon", "n_expert != 8"), "IQ3_S"),
    Rule(("MOSTLY_Q3_K_M",), ("!falcon", "n_expert != 8"), "Q4_K"),
    Rule(("MOSTLY_Q3_K_L",), ("!falcon", "n_expert != 8"), "Q5_K"),
    Rule(("MOSTLY_IQ3_M",), ("!falcon", "n_expert != 8"), "Q4_K"),
    Rule(("MOSTLY_Q3_K_L",), ("falcon",), "Q4_K"),
)

# `category == FFN_GATE` / `FFN_UP` branches (i, n = layer_info(...))
FFN_GATE_RULES = (
    Rule(("MOSTLY_IQ3_XS",), ("n/8 <= i < 7n/8",), "IQ3_XXS"),
)
FFN_UP_RULES = FFN_GATE_RULES

# the IQ1/IQ2 file types have a branch of their own (after output and token_embd): its per-category rules
LOW_BIT_FTYPES = ("MOSTLY_IQ2_XXS", "MOSTLY_IQ2_XS", "MOSTLY_IQ1_S", "MOSTLY_IQ2_S", "MOSTLY_IQ2_M", "MOSTLY_IQ1_M")
LOW_BIT_ATTN_V_RULES = (  # i_attention_wv counted, no 70B or 8-expert bump
    Rule(None, ("n_gqa >= 4",), "Q4_K"),
    Rule(None, ("n_expert >= 4",), "Q4_K"),
    Rule(IQ2_S_M, (), "IQ3_S"),
    Rule(None, (), "Q2_K"),
)
LOW_BIT_ATTN_K_RULES = (Rule(None, ("n_expert == 8",), "Q4_K"),)
LOW_BIT_FFN_DOWN_RULES = (  # i = the ffn_down counter, n = n_ffn_down (not layer_info)
    Rule(IQ2_S_M, ("i < n/8",), "IQ3_S"),
    Rule(None, ("i < n/8",), "Q2_K"),
)
LOW_BIT_ATTN_OUTPUT_RULES = (
    Rule(None, ("n_expert == 8",), "Q5_K"),
    Rule(("MOSTLY_IQ1_S", "MOSTLY_IQ1_M"), (), "IQ2_XXS"),
    Rule(IQ2_S_M, (), "IQ3_S"),
)


def _first_rule(rules: tuple[Rule, ...], ftype: str, new_type: str, qs: _State, i: int = 0, n: int = 0) -> str:
    """One category's else-if chain: the first row of `rules` for `ftype` whose conditions hold."""
    for rule in rules:
        if (rule.ftypes is None or ftype in rule.ftypes) and all(WHEN[c](qs, i, n) for c in rule.when):
            return new_type if rule.to is None else rule.to
    return new_type


# --- one function per branch of llama_tensor_get_type_impl: (state, type so far, name, ftype) -> (type, reason) ---

def _output(qs: _State, new_type: str, ne0: int, cat: str, ftype: str) -> tuple[str, str]:
    """`category == OUTPUT || (has_tied_embeddings && category == TOKEN_EMBD)`: --output-tensor-type where given
    (only a tied token_embd reaches here with it: llama_tensor_get_type gives output.weight its type first); else
    Q8_0 for MXFP4_MOE, for falcon or for a row the type's block does not divide, Q5_K for the IQ1/IQ2/IQ3_XXS file
    types, else Q6_K unless already Q8_0."""
    rule = "output" if cat == "OUTPUT" else "tied token_embd (output rule)"
    if qs.output_tensor_type is not None:
        return qs.output_tensor_type, f"{rule}: --output-tensor-type"
    if ftype == "MOSTLY_MXFP4_MOE" or qs.falcon or ne0 % BLOCK[new_type]:
        return "Q8_0", rule
    if ftype in OUTPUT_Q5_K_FTYPES:
        return "Q5_K", rule
    return ("Q6_K" if new_type != "Q8_0" else new_type), rule


def _mxfp4_moe(qs: _State, shape: tuple[int, ...], cat: str) -> tuple[str, str]:
    """The MXFP4_MOE branch (after output): MXFP4 for a tensor of several experts (ne[2] > 1; for bailingmoe3 only
    its FFN experts, its MLA projections are 3-D too), Q8_0 for every other."""
    ne2 = shape[-3] if len(shape) >= 3 else 1
    if ne2 > 1 and (qs.arch != "bailingmoe3" or cat in ("FFN_UP", "FFN_GATE", "FFN_DOWN")):
        return "MXFP4", "MXFP4_MOE experts"
    return "Q8_0", "MXFP4_MOE non-expert"


def _token_embd(qs: _State, new_type: str, name: str, ftype: str) -> tuple[str, str]:
    """`category == TOKEN_EMBD` (untied; --token-embedding-type was applied before the mix): TOKEN_EMBD_RULES."""
    return _first_rule(TOKEN_EMBD_RULES, ftype, new_type, qs), "token_embd"


def _attn_v(qs: _State, new_type: str, name: str, ftype: str) -> tuple[str, str]:
    """`category_is_attn_v(category)` (attn_v, attn_qkv, attn_kv_b): ATTN_V_RULES by attn_v count, then
    `model.type == LLM_TYPE_70B` lifts Q3_K/Q4_K to Q5_K and `n_expert == 8` makes it Q8_0; counts
    i_attention_wv. (The C's later `category == ATTENTION_QKV` branch is unreachable: this one takes QKV.)"""
    new_type = _first_rule(ATTN_V_RULES, ftype, new_type, qs, qs.i_attention_wv, qs.n_attention_wv)
    if qs.type_70b and new_type in ("Q3_K", "Q4_K"):
        new_type = "Q5_K"
    if qs.n_expert == 8:
        new_type = "Q8_0"
    qs.i_attention_wv += 1
    return new_type, "attn_v"


def _attn_k(qs: _State, new_type: str, name: str, ftype: str) -> tuple[str, str]:
    """`category == ATTENTION_K`: ATTN_K_RULES."""
    return _first_rule(ATTN_K_RULES, ftype, new_type, qs), "attn_k"


def _attn_q(qs: _State, new_type: str, name: str, ftype: str) -> tuple[str, str]:
    """`category == ATTENTION_Q`: ATTN_Q_RULES. Its reason is "attn_q" where a rule changed the type, "default"
    otherwise (what summaries have always said of attn_q)."""
    t = _first_rule(ATTN_Q_RULES, ftype, new_type, qs)
    return t, ("attn_q" if t != new_type else "default")


def _ffn_down(qs: _State, new_type: str, name: str, ftype: str) -> tuple[str, str]:
    """`category == FFN_DOWN`: FFN_DOWN_RULES by layer_info(i_ffn_down, n_ffn_down); counts i_ffn_down."""
    i_layer, n_layer = qs.layer_info(qs.i_ffn_down, qs.n_ffn_down, name)
    qs.i_ffn_down += 1
    return _first_rule(FFN_DOWN_RULES, ftype, new_type, qs, i_layer, n_layer), "ffn_down"


def _attn_output(qs: _State, new_type: str, name: str, ftype: str) -> tuple[str, str]:
    """`category == ATTENTION_OUTPUT`: ATTN_OUTPUT_RULES."""
    return _first_rule(ATTN_OUTPUT_RULES, ftype, new_type, qs), "attn_output"


def _ffn_gate(qs: _State, new_type: str, name: str, ftype: str) -> tuple[str, str]:
    """`category == FFN_GATE`: FFN_GATE_RULES by layer_info(i_ffn_gate, n_ffn_gate); counts i_ffn_gate."""
    i_layer, n_layer = qs.layer_info(qs.i_ffn_gate, qs.n_ffn_gate, name)
    qs.i_ffn_gate += 1
    return _first_rule(FFN_GATE_RULES, ftype, new_type, qs, i_layer, n_layer), "ffn_gate"


def _ffn_up(qs: _State, new_type: str, name: str, ftype: str) -> tuple[str, str]:
    """`category == FFN_UP`: FFN_UP_RULES by layer_info(i_ffn_up, n_ffn_up); counts i_ffn_up."""
    i_layer, n_layer = qs.layer_info(qs.i_ffn_up, qs.n_ffn_up, name)
    qs.i_ffn_up += 1
    return _first_rule(FFN_UP_RULES, ftype, new_type, qs, i_layer, n_layer), "ffn_up"


def _low_bit_attn_v(qs: _State, new_type: str, name: str, ftype: str) -> tuple[str, str]:
    """The IQ1/IQ2 branch's attn_v-like tensors: LOW_BIT_ATTN_V_RULES; counts i_attention_wv."""
    qs.i_attention_wv += 1
    return _first_rule(LOW_BIT_ATTN_V_RULES, ftype, new_type, qs), "attn_v"


def _low_bit_attn_k(qs: _State, new_type: str, name: str, ftype: str) -> tuple[str, str]:
    """The IQ1/IQ2 branch's attn_k: Q4_K with 8 experts."""
    return _first_rule(LOW_BIT_ATTN_K_RULES, ftype, new_type, qs), "attn_k"


def _low_bit_ffn_down(qs: _State, new_type: str, name: str, ftype: str) -> tuple[str, str]:
    """The IQ1/IQ2 branch's ffn_down: the first eighth by the tensor counter (`qs.i_ffn_down < qs.n_ffn_down/8`:
    tensors, not layers, so an MoE's shared-expert ffn_down counts too); counts i_ffn_down."""
    i = qs.i_ffn_down
    qs.i_ffn_down += 1
    return _first_rule(LOW_BIT_FFN_DOWN_RULES, ftype, new_type, qs, i, qs.n_ffn_down), "ffn_down"


def _low_bit_attn_output(qs: _State, new_type: str, name: str, ftype: str) -> tuple[str, str]:
    """The IQ1/IQ2 branch's attn_output: LOW_BIT_ATTN_OUTPUT_RULES."""
    return _first_rule(LOW_BIT_ATTN_OUTPUT_RULES, ftype, new_type, qs), "attn_output"


# tensor category -> its branch (the categories left out, OTHER among them, keep the type: reason "default")
CATEGORY_RULES = {
    "TOKEN_EMBD": _token_embd, "ATTENTION_V": _attn_v, "ATTENTION_QKV": _attn_v, "ATTENTION_KV_B": _attn_v,
    "ATTENTION_K": _attn_k, "ATTENTION_Q": _attn_q, "FFN_DOWN": _ffn_down, "ATTENTION_OUTPUT": _attn_output,
    "FFN_GATE": _ffn_gate, "FFN_UP": _ffn_up,
}
# the same for the IQ1/IQ2 file types (their token_embd rule is the shared one: the C's TOKEN_EMBD branch comes
# first)
LOW_BIT_CATEGORY_RULES = {
    "TOKEN_EMBD": _token_embd, "ATTENTION_V": _low_bit_attn_v, "ATTENTION_QKV": _low_bit_attn_v,
    "ATTENTION_KV_B": _low_bit_attn_v, "ATTENTION_K": _low_bit_attn_k, "FFN_DOWN": _low_bit_ffn_down,
    "ATTENTION_OUTPUT": _low_bit_attn_output,
}


def _impl(qs: _State, new_type: str, name: str, shape: tuple[int, ...], ftype: str, cat: str) -> tuple[str, str]:
    """llama_tensor_get_type_impl: (type, which rule chose it). The C's order: output (and tied token_embd) first,
    then MXFP4_MOE's own rule, then one branch per category (CATEGORY_RULES; LOW_BIT_CATEGORY_RULES for the IQ1/IQ2
    file types)."""
    if cat == "OUTPUT" or (qs.has_tied_embeddings and cat == "TOKEN_EMBD"):
        return _output(qs, new_type, shape[-1], cat, ftype)
    if ftype == "MOSTLY_MXFP4_MOE":
        return _mxfp4_moe(qs, shape, cat)
    branch = (LOW_BIT_CATEGORY_RULES if ftype in LOW_BIT_FTYPES else CATEGORY_RULES).get(cat)
    return branch(qs, new_type, name, ftype) if branch else (new_type, "default")


def _fallback(new_type: str, ne0: int, name: str) -> tuple[str, bool]:
    """tensor_type_fallback: (type, whether the row length forced a change); llama.cpp's refusal where the type
    has no fallback."""
    if ne0 % BLOCK[new_type] == 0:
        return new_type, False
    if new_type in FALLBACK:
        ret = FALLBACK[new_type]
    elif BLOCK[new_type] <= 32:
        ret = new_type
    else:
        raise CkptError(f"tensor {name} has rows of {ne0} values, not whole {new_type} blocks of {BLOCK[new_type]}, "
                        f"and llama.cpp has no fallback type for {new_type} (llama-quantize refuses it too)")
    if ne0 % BLOCK[ret]:
        ret = "F16"  # "must use F16 due to unusual shape"
    return ret, True


def _flag_type(text: str | None, flag: str) -> str | None:
    return None if text is None else ggml_type(text, flag)


def _direct(name: str, ne0: int, t: str, flag: str) -> tuple[str, str, bool]:
    """A type llama_tensor_get_type returns as the flag gives it, before the mix and without its fallback: rows
    its blocks do not divide would make ggml assert (or write a broken tensor), so they are refused here."""
    if ne0 % BLOCK[t]:
        raise CkptError(f"{flag} {t}: tensor {name} has rows of {ne0} values, not whole {t} blocks of {BLOCK[t]} "
                        "(llama-quantize applies this flag without a fallback type)")
    return t, flag, False


def _tensor_type(qs: _State, ftype: str, name: str, shape: tuple[int, ...], cat: str, *, pure: bool,
                 patterns, token_embedding_type: str | None) -> tuple[str, str, bool]:
    """llama_tensor_get_type for a tensor that allows quantization: --token-embedding-type, --output-tensor-type,
    then (for a quantized file type) the first --tensor-type pattern found in the name, else the mix's rules
    (unless --pure), then the row-length fallback."""
    ne0 = shape[-1]
    if token_embedding_type is not None and cat == "TOKEN_EMBD":
        # per_layer_token_embd follows --token-embedding-type unless a --tensor-type pattern names it
        if name != "per_layer_token_embd.weight" or not any(rx.search(name) for _, rx, _ in patterns):
            return _direct(name, ne0, token_embedding_type, "--token-embedding-type")
    if qs.output_tensor_type is not None and cat == "OUTPUT":
        return _direct(name, ne0, qs.output_tensor_type, "--output-tensor-type")
    default = DEFAULT_TYPE[ftype]
    if default in PLAIN:
        return default, "ftype", False
    manual = next(((p, t) for p, rx, t in patterns if rx.search(name)), None)
    if manual is not None:
        new_type, reason = manual[1], f"--tensor-type {manual[0]}={manual[1]}"
    elif pure:
        new_type, reason = default, "pure"
    else:
        new_type, reason = _impl(qs, default, name, shape, ftype, cat)
    final, fell_back = _fallback(new_type, ne0, name)
    if fell_back:
        reason = f"{reason}: row of {ne0} fits no {new_type} block -> {final}"
    return final, reason, fell_back


def llm_types(ftype: str, tensors: list[tuple[str, tuple[int, ...], str]], *, arch: str, n_layer: int,
              n_head: int, n_head_kv: int, n_expert: int = 0, pure: bool = False, has_imatrix: bool = False,
              imatrix_names=None, tensor_types=(), output_tensor_type: str | None = None,
              token_embedding_type: str | None = None,
              quantize_output_tensor: bool = True) -> list[tuple[str, str, bool]]:
    """ftype: a llama_ftype name (FILE_TYPE: "MOSTLY_Q4_K_M", "MOSTLY_Q8_0", "MOSTLY_IQ2_XXS", ...).
    tensors: every tensor of the file in file order: (GGUF name e.g. "blk.3.attn_v.weight", torch shape
    (outermost first, so ggml's ne[0] is shape[-1]), the GGML type name it has before quantizing: "F32"/"F16"/"BF16").
    Returns per tensor (GGML type name chosen, a short reason for a summary, True when llama.cpp's
    tensor_type_fallback changed the type because the row length does not divide the block).

    A tensor llama.cpp does not quantize (1-D, norms, biases, ..., output.weight with --leave-output-tensor) keeps
    its type as it is, F16 included. With `pure` (llama-quantize --pure) every quantizable tensor starts from the
    ftype's type and only the row-length fallback applies. For MOSTLY_F16 / MOSTLY_BF16 / ALL_F32 every
    quantizable tensor becomes that type, with no rule and no fallback (only the two type flags apply).

    The flags, as llama-quantize takes them: `has_imatrix` (--imatrix with at least one entry left after
    --include/--exclude-weights; llama-quantize passes none otherwise, so an empty `imatrix_names` is no imatrix),
    `imatrix_names` (the tensor names it has entries for, or None when unknown), `tensor_types` ((pattern, type)
    as `parse_tensor_type` gives them; the first pattern found in a name wins and replaces the mix's rules, the
    fallback still applies; the reason says which), `output_tensor_type` / `token_embedding_type` (GGML type names:
    output.weight / token_embd.weight take them as they are, before every other rule), `quantize_output_tensor`
    (False: --leave-output-tensor). Refusals (CkptError): module docstring."""
    if ftype not in DEFAULT_TYPE:
        shown = ftype if len(ftype) <= 40 else ftype[:37] + "..."
        raise CkptError(f"llama.cpp file type {shown} is not supported here (llama-quantize's: "
                        f"{', '.join(_label(f) for f in DEFAULT_TYPE)})")
    output_tensor_type = _flag_type(output_tensor_type, "--output-tensor-type")
    token_embedding_type = _flag_type(token_embedding_type, "--token-embedding-type")
    patterns = [(p, compile_pattern(p), ggml_type(t, "--tensor-type")) for p, t in tensor_types]
    if imatrix_names is not None and not imatrix_names:
        has_imatrix = False
    names = [t[0] for t in tensors]
    qs = _State(names, arch=arch, n_layer=n_layer, n_head=n_head, n_head_kv=n_head_kv, n_expert=n_expert,
                has_imatrix=has_imatrix, output_tensor_type=output_tensor_type)
    out: list[tuple[str, str, bool] | None] = [None] * len(tensors)
    # llama_model_quantize_impl visits ml.weights_map: by block number (-1 outside blocks), then by name
    order = sorted(range(len(tensors)), key=lambda k: (_block_number(names[k]), names[k]))
    for k in order:  # its preliminary loop: every type, and the refusal of a type that needs an imatrix
        name, shape, src = tensors[k]
        if not allows_quantization(name, shape, quantize_output_tensor):
            left = not quantize_output_tensor and name == "output.weight" and allows_quantization(name, shape)
            out[k] = (src, "--leave-output-tensor" if left else "not quantized", False)
            continue
        out[k] = _tensor_type(qs, ftype, name, shape, category(name), pure=pure, patterns=patterns,
                              token_embedding_type=token_embedding_type)
        if not has_imatrix and requires_imatrix(name, out[k][0], ftype):
            raise CkptError(f"{_label(ftype)} needs an importance matrix: tensor {name} would be {out[k][0]}, "
                            f"which llama-quantize makes only with one; give --imatrix FILE")
    for k in order:  # its main loop: the importance of each tensor it quantizes
        name, shape, src = tensors[k]
        final = out[k][0]
        missing = not has_imatrix or (imatrix_names is not None and name not in imatrix_names)
        if final == src or not missing:
            continue
        if requires_imatrix(name, final, ftype):  # (only with an imatrix: the loop above refused it without)
            raise CkptError(f"the importance matrix has no entry for tensor {name}, which would be {final}: "
                            f"llama-quantize makes {final} only with one (give an imatrix computed for this model, "
                            "or another type for the tensor with --tensor-type)")
        if final in GGML_REQUIRES_IMATRIX:  # a tensor the check above exempts: ggml asserts instead
            why = "the importance matrix has no entry for it" if has_imatrix else "there is no --imatrix"
            raise CkptError(f"tensor {name} would be {final}, which ggml quantizes only with an importance matrix, "
                            f"and {why}: give --imatrix FILE with an entry for it, or another type")
    return out  # type: ignore[return-value]


def unused_tensor_types(tensor_types, types: list[tuple[str, str, bool]]) -> list[str]:
    """The `--tensor-type` entries (as "--tensor-type PATTERN=TYPE") that decided no tensor's type in `types`
    (llm_types' result): a pattern that matches no quantizable tensor, or only tensors an earlier pattern took,
    changes nothing, as in llama.cpp (which says nothing of it); a planner says it in its summary."""
    out = []
    for p, t in tensor_types:
        key = f"--tensor-type {p}={ggml_type(t, '--tensor-type')}"
        if not any(reason == key or reason.startswith(key + ": ") for _, reason, _ in types):
            out.append(key)
    return out
