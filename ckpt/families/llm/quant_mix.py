"""llama.cpp's per-tensor quantization mix: which GGML type `llama-quantize MODEL.gguf OUT.gguf Q4_K_M` gives
each tensor of an LLM GGUF, so a GGUF written here carries the types a user would get from llama.cpp.

"Q4_K_M" is no single type: llama.cpp's `src/llama-quant.cpp` (llama-cpp-python 0.3.36's vendored copy) picks
each tensor's type from its name, its layer, its row length and a few model facts (layer count, GQA ratio,
expert count, whether output.weight exists). This module is that choice transcribed, function by function
(`tensor_allows_quantization`, `tensor_get_category`, `init_quantize_state_counters`, `llama_tensor_get_type`,
`llama_tensor_get_type_impl`, `tensor_type_fallback`, `llama_ftype_get_default_type`; the impl's per-category
ftype chains as rule tables, one small function per branch), for the file types whose types ckpt can encode,
without an importance matrix and without `--tensor-type` / `--output-tensor-type` / `--token-embedding-type`
overrides. It is data and a pure function (no torch, no gguf) so a planner can show the
mix before any tensor is read; tests/test_gguf_llm_mix.py checks it against llama.cpp's own quantizer.

Left out, because the supported ftypes never reach them: the IQ1/IQ2/IQ3/TQ/MXFP4/Q2_K_S branches, the imatrix
branches (`has_imatrix` is false), GLM5-next's Q8_0 floor and its extra keep-list. `model.type == LLM_TYPE_70B`
(attn_v Q3_K/Q4_K -> Q5_K) is derived as each arch's `load_arch_hparams` does for llama, qwen2, deci, olmo and
jais2 (`TYPE_70B`); other archs never are 70B here.

The counters (i_attention_wv, i_ffn_down, ...) advance in the order llama.cpp visits tensors: its loader's
`weights_map`, sorted by block number (non-block tensors first) and then by name, not the file order.
"""

from __future__ import annotations

import re
from typing import NamedTuple

from ckpt.errors import CkptError

# llama.h `enum llama_ftype`: the value llama-quantize writes as general.file_type (= gguf.LlamaFileType)
FILE_TYPE = {
    "ALL_F32": 0, "MOSTLY_F16": 1, "MOSTLY_Q4_0": 2, "MOSTLY_Q4_1": 3, "MOSTLY_Q8_0": 7, "MOSTLY_Q5_0": 8,
    "MOSTLY_Q5_1": 9, "MOSTLY_Q2_K": 10, "MOSTLY_Q3_K_S": 11, "MOSTLY_Q3_K_M": 12, "MOSTLY_Q3_K_L": 13,
    "MOSTLY_Q4_K_S": 14, "MOSTLY_Q4_K_M": 15, "MOSTLY_Q5_K_S": 16, "MOSTLY_Q5_K_M": 17, "MOSTLY_Q6_K": 18,
    "MOSTLY_IQ4_NL": 25, "MOSTLY_IQ4_XS": 30, "MOSTLY_BF16": 32,
}

# llama_ftype_get_default_type: the type every quantizable tensor starts from
DEFAULT_TYPE = {
    "ALL_F32": "F32", "MOSTLY_F16": "F16", "MOSTLY_BF16": "BF16",
    "MOSTLY_Q4_0": "Q4_0", "MOSTLY_Q4_1": "Q4_1", "MOSTLY_Q5_0": "Q5_0", "MOSTLY_Q5_1": "Q5_1",
    "MOSTLY_Q8_0": "Q8_0", "MOSTLY_Q2_K": "Q2_K",
    "MOSTLY_Q3_K_S": "Q3_K", "MOSTLY_Q3_K_M": "Q3_K", "MOSTLY_Q3_K_L": "Q3_K",
    "MOSTLY_Q4_K_S": "Q4_K", "MOSTLY_Q4_K_M": "Q4_K", "MOSTLY_Q5_K_S": "Q5_K", "MOSTLY_Q5_K_M": "Q5_K",
    "MOSTLY_Q6_K": "Q6_K", "MOSTLY_IQ4_NL": "IQ4_NL", "MOSTLY_IQ4_XS": "IQ4_XS",
}

# ggml_blck_size of every type this module can choose (values per block; 1 for the plain types)
BLOCK = {"F32": 1, "F16": 1, "BF16": 1, "Q4_0": 32, "Q4_1": 32, "Q5_0": 32, "Q5_1": 32, "Q8_0": 32,
         "IQ4_NL": 32, "Q2_K": 256, "Q3_K": 256, "Q4_K": 256, "Q5_K": 256, "Q6_K": 256, "IQ4_XS": 256}
PLAIN = ("F32", "F16", "BF16")  # !ggml_is_quantized

# tensor_type_fallback: a type whose block does not divide the row -> this one (F16 if that does not either);
# 32-block types have no smaller block and go to F16 directly
FALLBACK = {"IQ4_XS": "IQ4_NL", "Q2_K": "Q4_0", "Q3_K": "Q4_0", "Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}

# tensor_get_category: exact names first, then the first name fragment found, in this order
EXACT_CATEGORY = {"output.weight": "OUTPUT", "token_embd.weight": "TOKEN_EMBD",
                  "per_layer_token_embd.weight": "TOKEN_EMBD"}
FRAGMENT_CATEGORY = (
    ("attn_qkv.weight", "ATTENTION_QKV"), ("attn_kv_b.weight", "ATTENTION_KV_B"), ("attn_v.weight", "ATTENTION_V"),
    ("attn_k.weight", "ATTENTION_K"), ("attn_q.weight", "ATTENTION_Q"), ("attn_output.weight", "ATTENTION_OUTPUT"),
    ("ffn_up", "FFN_UP"), ("ffn_gate", "FFN_GATE"), ("ffn_down", "FFN_DOWN"),
)
ATTN_V_LIKE = ("ATTENTION_V", "ATTENTION_QKV", "ATTENTION_KV_B")  # category_is_attn_v

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


def category(name: str) -> str:
    """tensor_get_category."""
    if name in EXACT_CATEGORY:
        return EXACT_CATEGORY[name]
    return next((cat for frag, cat in FRAGMENT_CATEGORY if frag in name), "OTHER")


def allows_quantization(name: str, shape: tuple[int, ...]) -> bool:
    """tensor_allows_quantization with the default params (quantize_output_tensor, no only_copy): a tensor of
    at least 2 dims as ggml counts them (size-1 dims at the torch shape's front do not count) whose name ends
    in `weight` and is on no keep-list."""
    n_dims = len(shape)
    while n_dims > 1 and shape[len(shape) - n_dims] == 1:  # ggml_n_dims: trailing ne of 1 do not count
        n_dims -= 1
    if n_dims < 2 or not name.endswith("weight"):
        return False
    return name not in KEEP_NAMES and not any(frag in name for frag in KEEP_FRAGMENTS)


def _use_more_bits(i_layer: int, n_layers: int) -> bool:
    """llama_tensor_get_type_impl's use_more_bits: the first and last eighth, and every third layer between."""
    return i_layer < n_layers // 8 or i_layer >= 7 * n_layers // 8 or _c_mod(i_layer - n_layers // 8, 3) == 2


def _c_mod(a: int, b: int) -> int:
    """C's `%` (truncates toward zero), for negative left operands."""
    return a - b * int(a / b)


class _State:
    """quantize_state_impl: the model facts and the counters, as init_quantize_state_counters sets them."""

    def __init__(self, names, *, arch, n_layer, n_head, n_head_kv, n_expert):
        cats = [category(n) for n in names]
        self.arch, self.n_expert = arch, n_expert
        self.falcon = arch == "falcon"  # LLM_ARCH_FALCON, the one arch the rules name
        self.n_gqa = n_head // n_head_kv if n_head_kv else 0  # llama_hparams::n_gqa
        self.type_70b = arch in TYPE_70B and TYPE_70B[arch](n_layer, n_head, n_head_kv, n_expert)
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
# stays. A C ternary is consecutive rows of one file type, the last with no condition; a branch the C enters on its
# file type alone but may leave unchanged ends with a `None` row, so later rows never see that file type. A new
# llama.cpp file type or an imatrix condition is rows here (and a WHEN entry), not another branch in code.


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
    "falcon": lambda qs, i, n: qs.falcon,
    "!falcon": lambda qs, i, n: not qs.falcon,
    "i < 2": lambda qs, i, n: i < 2,
    "i < 4": lambda qs, i, n: i < 4,
    "i < n/8": lambda qs, i, n: i < n // 8,
    "i < n/16": lambda qs, i, n: i < n // 16,
    "use_more_bits": lambda qs, i, n: _use_more_bits(i, n),
}

# `category_is_attn_v` branch (i = qs.i_attention_wv, n = qs.n_attention_wv); the 70B and 8-expert bumps that
# follow the chain are in _attn_v. Left out: Q2_K_S, IQ3_XXS, IQ3_XS/IQ3_S, IQ3_M (between Q2_K and Q3_K_M).
ATTN_V_RULES = (
    Rule(("MOSTLY_Q2_K",), ("n_gqa >= 4",), "Q4_K"),
    Rule(("MOSTLY_Q2_K",), (), "Q3_K"),
    Rule(("MOSTLY_Q3_K_M",), ("i < 2",), "Q5_K"),
    Rule(("MOSTLY_Q3_K_M",), (), "Q4_K"),
    Rule(("MOSTLY_Q3_K_L",), (), "Q5_K"),
    Rule(("MOSTLY_IQ4_NL", "MOSTLY_IQ4_XS"), ("n_gqa >= 4",), "Q5_K"),
    Rule(("MOSTLY_Q4_K_M", "MOSTLY_Q5_K_M"), ("use_more_bits",), "Q6_K"),
    Rule(("MOSTLY_Q4_K_S",), ("i < 4",), "Q5_K"),
)

# `category == ATTENTION_K` branch. Left out: IQ3_XS -> IQ3_XXS, IQ3_XXS -> IQ2_S.
ATTN_K_RULES = (
    Rule(None, ("n_expert == 8",), "Q8_0"),
)

# `category == ATTENTION_Q` branch: only IQ3_XS -> IQ3_XXS and IQ3_XXS -> IQ2_S, both left out.
ATTN_Q_RULES: tuple[Rule, ...] = ()

# `category == FFN_DOWN` branch (i, n = layer_info(i_ffn_down, n_ffn_down)). Left out: Q2_K_S, IQ3_XXS without
# imatrix (after Q2_K), IQ3_M (after Q3_K_M), Q4_0/Q5_0 with imatrix (last); IQ4_NL/IQ4_XS also need !has_imatrix.
FFN_DOWN_RULES = (
    Rule(("MOSTLY_Q2_K",), (), "Q3_K"),
    Rule(("MOSTLY_Q3_K_M",), ("i < n/16",), "Q5_K"),
    Rule(("MOSTLY_Q3_K_M",), ("!falcon",), "Q4_K"),
    Rule(("MOSTLY_Q3_K_M",), ("use_more_bits",), "Q4_K"),
    Rule(("MOSTLY_Q3_K_M",), (), "Q3_K"),
    Rule(("MOSTLY_Q3_K_L",), ("falcon",), "Q4_K"),
    Rule(("MOSTLY_Q3_K_L",), (), "Q5_K"),
    Rule(("MOSTLY_Q4_K_M",), ("falcon", "i < n/16"), "Q6_K"),
    Rule(("MOSTLY_Q4_K_M",), ("falcon", "use_more_bits"), "Q5_K"),
    Rule(("MOSTLY_Q4_K_M",), ("falcon",), "Q4_K"),
    Rule(("MOSTLY_Q4_K_M",), ("use_more_bits",), "Q6_K"),
    Rule(("MOSTLY_Q4_K_M",), (), None),
    Rule(("MOSTLY_IQ4_NL", "MOSTLY_IQ4_XS"), ("i < n/8",), "Q5_K"),
    Rule(("MOSTLY_Q5_K_M",), ("use_more_bits",), "Q6_K"),
    Rule(("MOSTLY_Q4_K_S",), ("!falcon", "i < n/8"), "Q5_K"),
)

# `category == ATTENTION_OUTPUT` branch: not falcon with 8 experts, not falcon otherwise, falcon. Left out: the
# IQ3_XS/IQ3_XXS/IQ3_S/IQ3_M file types (in the 8-expert list; IQ3_XXS -> IQ3_S and IQ3_M -> Q4_K otherwise).
ATTN_OUTPUT_RULES = (
    Rule(("MOSTLY_Q2_K", "MOSTLY_Q3_K_S", "MOSTLY_Q3_K_M", "MOSTLY_IQ4_NL", "MOSTLY_Q4_K_S", "MOSTLY_Q4_K_M",
          "MOSTLY_IQ4_XS"), ("!falcon", "n_expert == 8"), "Q5_K"),
    Rule(("MOSTLY_Q2_K",), ("!falcon", "n_expert != 8"), "Q3_K"),
    Rule(("MOSTLY_Q3_K_M",), ("!falcon", "n_expert != 8"), "Q4_K"),
    Rule(("MOSTLY_Q3_K_L",), ("!falcon", "n_expert != 8"), "Q5_K"),
    Rule(("MOSTLY_Q3_K_L",), ("falcon",), "Q4_K"),
)

# `category == TOKEN_EMBD` branch (untied): only the IQ1/IQ2/IQ3_XXS/TQ/Q2_0 file types change it, all left out.
TOKEN_EMBD_RULES: tuple[Rule, ...] = ()

# `category == FFN_GATE` / `FFN_UP` branches (i, n = layer_info(...)): only IQ3_XS changes them (IQ3_XXS where
# n/8 <= i < 7n/8), left out; the layer check and the counter remain.
FFN_GATE_RULES: tuple[Rule, ...] = ()
FFN_UP_RULES: tuple[Rule, ...] = ()


def _first_rule(rules: tuple[Rule, ...], ftype: str, new_type: str, qs: _State, i: int = 0, n: int = 0) -> str:
    """One category's else-if chain: the first row of `rules` for `ftype` whose conditions hold."""
    for rule in rules:
        if (rule.ftypes is None or ftype in rule.ftypes) and all(WHEN[c](qs, i, n) for c in rule.when):
            return new_type if rule.to is None else rule.to
    return new_type


# --- one function per branch of llama_tensor_get_type_impl: (state, type so far, name, ftype) -> (type, reason) ---

def _output(qs: _State, new_type: str, ne0: int, cat: str) -> tuple[str, str]:
    """`category == OUTPUT || (has_tied_embeddings && category == TOKEN_EMBD)` without --output-tensor-type: Q8_0
    for falcon or a row the type's block does not divide, else Q6_K unless already Q8_0. Left out: MXFP4_MOE ->
    Q8_0 (first) and the IQ1/IQ2/IQ3_XXS file types -> Q5_K (before the Q6_K)."""
    rule = "output" if cat == "OUTPUT" else "tied token_embd (output rule)"
    if qs.falcon or ne0 % BLOCK[new_type]:
        return "Q8_0", rule
    return ("Q6_K" if new_type != "Q8_0" else new_type), rule


def _token_embd(qs: _State, new_type: str, name: str, ftype: str) -> tuple[str, str]:
    """`category == TOKEN_EMBD` (untied) without --token-embedding-type: TOKEN_EMBD_RULES."""
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
    """`category == ATTENTION_Q`: ATTN_Q_RULES. Its reason stays "default", what summaries have always said of
    attn_q (no supported file type changes it)."""
    return _first_rule(ATTN_Q_RULES, ftype, new_type, qs), "default"


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


# tensor category -> its branch (the categories left out, OTHER among them, keep the type: reason "default")
CATEGORY_RULES = {
    "TOKEN_EMBD": _token_embd, "ATTENTION_V": _attn_v, "ATTENTION_QKV": _attn_v, "ATTENTION_KV_B": _attn_v,
    "ATTENTION_K": _attn_k, "ATTENTION_Q": _attn_q, "FFN_DOWN": _ffn_down, "ATTENTION_OUTPUT": _attn_output,
    "FFN_GATE": _ffn_gate, "FFN_UP": _ffn_up,
}


def _impl(qs: _State, new_type: str, name: str, ne0: int, ftype: str, cat: str) -> tuple[str, str]:
    """llama_tensor_get_type_impl for the supported ftypes: (type, which rule chose it). The C's order: output
    (and tied token_embd) first, then one branch per category (CATEGORY_RULES). Left out, for the file types that
    reach them: the MXFP4_MOE branch (after output) and the IQ1/IQ2 branch (after token_embd), whose own
    per-category rules would be a second CATEGORY_RULES-like table chosen here by file type."""
    if cat == "OUTPUT" or (qs.has_tied_embeddings and cat == "TOKEN_EMBD"):
        return _output(qs, new_type, ne0, cat)
    branch = CATEGORY_RULES.get(cat)
    return branch(qs, new_type, name, ftype) if branch else (new_type, "default")


def _fallback(new_type: str, ne0: int) -> tuple[str, bool]:
    """tensor_type_fallback: (type, whether the row length forced a change)."""
    if ne0 % BLOCK[new_type] == 0:
        return new_type, False
    ret = FALLBACK.get(new_type, new_type)
    if ne0 % BLOCK[ret]:
        ret = "F16"  # "must use F16 due to unusual shape"
    return ret, True


def llm_types(ftype: str, tensors: list[tuple[str, tuple[int, ...], str]], *, arch: str, n_layer: int,
              n_head: int, n_head_kv: int, n_expert: int = 0, pure: bool = False) -> list[tuple[str, str, bool]]:
    """ftype: a gguf.LlamaFileType member name ("MOSTLY_Q4_K_M", "MOSTLY_Q8_0", "MOSTLY_IQ4_XS", ...).
    tensors: every tensor of the file in file order: (GGUF name e.g. "blk.3.attn_v.weight", torch shape
    (outermost first, so ggml's ne[0] is shape[-1]), the GGML type name it has before quantizing: "F32"/"F16"/"BF16").
    Returns per tensor (GGML type name chosen, a short reason for a summary, True when llama.cpp's
    tensor_type_fallback changed the type because the row length does not divide the block).

    A tensor llama.cpp does not quantize (1-D, norms, biases, ...) keeps its type as it is, F16 included.
    With `pure` (llama-quantize --pure) every quantizable tensor starts from the ftype's type and only the
    row-length fallback applies. For MOSTLY_F16 / MOSTLY_BF16 / ALL_F32 every quantizable tensor becomes that
    type, with no rule and no fallback."""
    if ftype not in DEFAULT_TYPE:
        raise CkptError(f"llama.cpp file type {ftype} is not supported here (supported: {', '.join(DEFAULT_TYPE)})")
    names = [t[0] for t in tensors]
    qs = _State(names, arch=arch, n_layer=n_layer, n_head=n_head, n_head_kv=n_head_kv, n_expert=n_expert)
    default = DEFAULT_TYPE[ftype]
    out: list[tuple[str, str, bool] | None] = [None] * len(tensors)
    # llama_model_quantize_impl visits ml.weights_map: by block number (-1 outside blocks), then by name
    for k in sorted(range(len(tensors)), key=lambda k: (_block_number(names[k]), names[k])):
        name, shape, src = tensors[k]
        if not allows_quantization(name, shape):
            out[k] = (src, "not quantized", False)
            continue
        # llama_tensor_get_type
        if default in PLAIN:
            out[k] = (default, "ftype", False)
            continue
        new_type, reason = (default, "pure") if pure else _impl(qs, default, name, shape[-1], ftype, category(name))
        final, fell_back = _fallback(new_type, shape[-1])
        if fell_back:
            reason = f"{reason}: row of {shape[-1]} fits no {new_type} block -> {final}"
        out[k] = (final, reason, fell_back)
    return out  # type: ignore[return-value]
