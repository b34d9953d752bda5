"""llama.cpp's per-tensor quantization mix: which GGML type `llama-quantize MODEL.gguf OUT.gguf Q4_K_M` gives
each tensor of an LLM GGUF, so a GGUF written here carries the types a user would get from llama.cpp.

"Q4_K_M" is no single type: llama.cpp's `src/llama-quant.cpp` (llama-cpp-python 0.3.36's vendored copy) picks
each tensor's type from its name, its layer, its row length and a few model facts (layer count, GQA ratio,
expert count, whether output.weight exists). This module is that choice transcribed, function by function
(`tensor_allows_quantization`, `tensor_get_category`, `init_quantize_state_counters`, `llama_tensor_get_type`,
`llama_tensor_get_type_impl`, `tensor_type_fallback`, `llama_ftype_get_default_type`), for the file types whose
types ckpt can encode, without an importance matrix and without `--tensor-type` / `--output-tensor-type` /
`--token-embedding-type` overrides. It is data and a pure function (no torch, no gguf) so a planner can show the
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


def _impl(qs: _State, new_type: str, name: str, ne0: int, ftype: str, cat: str) -> tuple[str, str]:
    """llama_tensor_get_type_impl for the supported ftypes: (type, which rule chose it)."""
    falcon = qs.arch == "falcon"
    if cat == "OUTPUT" or (qs.has_tied_embeddings and cat == "TOKEN_EMBD"):
        rule = "output" if cat == "OUTPUT" else "tied token_embd (output rule)"
        if falcon or ne0 % BLOCK[new_type]:
            return "Q8_0", rule
        return ("Q6_K" if new_type != "Q8_0" else new_type), rule
    if cat == "TOKEN_EMBD":
        return new_type, "token_embd"  # only IQ1/IQ2/IQ3/TQ ftypes change it
    if cat in ATTN_V_LIKE:
        i, n, gqa4 = qs.i_attention_wv, qs.n_attention_wv, qs.n_gqa >= 4
        if ftype == "MOSTLY_Q2_K":
            new_type = "Q4_K" if gqa4 else "Q3_K"
        elif ftype == "MOSTLY_Q3_K_M":
            new_type = "Q5_K" if i < 2 else "Q4_K"
        elif ftype == "MOSTLY_Q3_K_L":
            new_type = "Q5_K"
        elif ftype in ("MOSTLY_IQ4_NL", "MOSTLY_IQ4_XS") and gqa4:
            new_type = "Q5_K"
        elif ftype in ("MOSTLY_Q4_K_M", "MOSTLY_Q5_K_M") and _use_more_bits(i, n):
            new_type = "Q6_K"
        elif ftype == "MOSTLY_Q4_K_S" and i < 4:
            new_type = "Q5_K"
        if qs.type_70b and new_type in ("Q3_K", "Q4_K"):
            new_type = "Q5_K"
        if qs.n_expert == 8:
            new_type = "Q8_0"
        qs.i_attention_wv += 1
        return new_type, "attn_v"
    # (the C's ATTENTION_QKV branch after these is unreachable: category_is_attn_v took QKV above)
    if cat == "ATTENTION_K":
        return ("Q8_0" if qs.n_expert == 8 else new_type), "attn_k"
    if cat == "FFN_DOWN":
        i_layer, n_layer = qs.layer_info(qs.i_ffn_down, qs.n_ffn_down, name)
        more = _use_more_bits(i_layer, n_layer)
        if ftype == "MOSTLY_Q2_K":
            new_type = "Q3_K"
        elif ftype == "MOSTLY_Q3_K_M":
            new_type = "Q5_K" if i_layer < n_layer // 16 else "Q4_K" if not falcon or more else "Q3_K"
        elif ftype == "MOSTLY_Q3_K_L":
            new_type = "Q4_K" if falcon else "Q5_K"
        elif ftype == "MOSTLY_Q4_K_M":
            if falcon:
                new_type = "Q6_K" if i_layer < n_layer // 16 else "Q5_K" if more else "Q4_K"
            elif more:
                new_type = "Q6_K"
        elif i_layer < n_layer // 8 and ftype in ("MOSTLY_IQ4_NL", "MOSTLY_IQ4_XS"):
            new_type = "Q5_K"
        elif ftype == "MOSTLY_Q5_K_M" and more:
            new_type = "Q6_K"
        elif ftype == "MOSTLY_Q4_K_S" and not falcon and i_layer < n_layer // 8:
            new_type = "Q5_K"
        qs.i_ffn_down += 1
        return new_type, "ffn_down"
    if cat == "ATTENTION_OUTPUT":
        if not falcon:
            if qs.n_expert == 8:
                if ftype in ("MOSTLY_Q2_K", "MOSTLY_Q3_K_S", "MOSTLY_Q3_K_M", "MOSTLY_IQ4_NL", "MOSTLY_Q4_K_S",
                             "MOSTLY_Q4_K_M", "MOSTLY_IQ4_XS"):
                    new_type = "Q5_K"
            else:
                new_type = {"MOSTLY_Q2_K": "Q3_K", "MOSTLY_Q3_K_M": "Q4_K",
                            "MOSTLY_Q3_K_L": "Q5_K"}.get(ftype, new_type)
        elif ftype == "MOSTLY_Q3_K_L":
            new_type = "Q4_K"
        return new_type, "attn_output"
    if cat in ("FFN_GATE", "FFN_UP"):  # only IQ3_XS changes them; the layer check and the counter remain
        if cat == "FFN_GATE":
            qs.layer_info(qs.i_ffn_gate, qs.n_ffn_gate, name)
            qs.i_ffn_gate += 1
        else:
            qs.layer_info(qs.i_ffn_up, qs.n_ffn_up, name)
            qs.i_ffn_up += 1
        return new_type, cat.lower()
    return new_type, "default"


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
