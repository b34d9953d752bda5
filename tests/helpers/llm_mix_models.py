"""The tiny LLM GGUFs the mix tests quantize with llama.cpp (tests/test_gguf_llm_mix.py, test_gguf_mix_imatrix.py,
test_gguf_dequant_types.py): models shaped to reach llama_tensor_get_type's rules, and their writer."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import gguf
import numpy as np
from gguf import GGMLQuantizationType as T

from ckpt.families.llm.quant_mix import FILE_TYPE

FALLBACK_WARNING = re.compile(r"warning: (\S+)\s+- ncols\s+\d+ not divisible by")
N_VOCAB = 320


@dataclass(frozen=True)
class Model:
    arch: str
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    n_ff: int
    tied: bool = False
    matrix: T = T.F16  # type of the 2-D/3-D weights
    norm: T = T.F32
    n_expert: int = 0
    lexicographic: bool = False  # write blk.10 before blk.2, as a sorted-keys converter would
    extra: dict = field(default_factory=dict)  # more tensors: name -> (torch shape, type)


MODELS = {
    "llama8": Model("llama", 8, 256, 8, 2, 512),
    "llama10_tied_f32": Model("llama", 10, 256, 8, 8, 320, tied=True, matrix=T.F32, norm=T.F16,
                              extra={"blk.0.extra_gain.weight": ((1, 256), T.F32),
                                     "blk.1.extra_proj.weight": ((1, 64, 256), T.F16),
                                     "blk.2.extra_scale.weight": ((1, 1, 256), T.F16)}),
    "qwen2_odd_rows": Model("qwen2", 8, 288, 8, 1, 336),
    "qwen3_lex_bf16": Model("qwen3", 12, 256, 8, 4, 512, tied=True, matrix=T.BF16, lexicographic=True),
    "moe8": Model("llama", 4, 256, 8, 4, 128, n_expert=8),
}
LLAMA_70B = Model("llama", 80, 256, 8, 2, 32)


def tensors(m: Model) -> list[tuple[str, tuple[int, ...], T]]:
    """The model's tensors (GGUF name, torch shape, type) in the order they are written."""
    head = m.n_embd // m.n_head
    kv = head * m.n_head_kv
    top = [("token_embd.weight", (N_VOCAB, m.n_embd), m.matrix), ("output_norm.weight", (m.n_embd,), m.norm)]
    if not m.tied:
        top.append(("output.weight", (N_VOCAB, m.n_embd), m.matrix))
    blocks = []
    for i in range(m.n_layer):
        b = [("attn_norm.weight", (m.n_embd,), m.norm), ("attn_q.weight", (m.n_embd, m.n_embd), m.matrix),
             ("attn_k.weight", (kv, m.n_embd), m.matrix), ("attn_v.weight", (kv, m.n_embd), m.matrix),
             ("attn_output.weight", (m.n_embd, m.n_embd), m.matrix), ("ffn_norm.weight", (m.n_embd,), m.norm)]
        if m.arch == "qwen2":
            b += [("attn_q.bias", (m.n_embd,), T.F32), ("attn_k.bias", (kv,), T.F32), ("attn_v.bias", (kv,), T.F32)]
        if m.arch == "qwen3":
            b += [("attn_q_norm.weight", (head,), m.norm), ("attn_k_norm.weight", (head,), m.norm)]
        if m.n_expert:
            e = m.n_expert
            b += [("ffn_gate_inp.weight", (e, m.n_embd), T.F32),
                  ("ffn_gate_exps.weight", (e, m.n_ff, m.n_embd), m.matrix),
                  ("ffn_up_exps.weight", (e, m.n_ff, m.n_embd), m.matrix),
                  ("ffn_down_exps.weight", (e, m.n_embd, m.n_ff), m.matrix)]
        else:
            b += [("ffn_gate.weight", (m.n_ff, m.n_embd), m.matrix), ("ffn_up.weight", (m.n_ff, m.n_embd), m.matrix),
                  ("ffn_down.weight", (m.n_embd, m.n_ff), m.matrix)]
        blocks += [(f"blk.{i}.{n}", s, t) for n, s, t in b]
    blocks += [(n, s, t) for n, (s, t) in m.extra.items()]
    if m.lexicographic:
        blocks.sort(key=lambda x: x[0])
    return top + blocks


def write_model(path, m: Model) -> None:
    """A GGUF llama.cpp loads for quantizing (and, for the llama models, for inference): the arch's
    hyperparameters and a minimal SentencePiece-style vocabulary (<unk>, <s>, </s>, the 256 byte tokens)."""
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), arch=m.arch)
    w.add_block_count(m.n_layer)
    w.add_context_length(256)
    w.add_embedding_length(m.n_embd)
    w.add_feed_forward_length(m.n_ff)
    w.add_head_count(m.n_head)
    w.add_head_count_kv(m.n_head_kv)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_dimension_count(m.n_embd // m.n_head)
    w.add_file_type(FILE_TYPE["MOSTLY_F16"] if m.matrix == T.F16 else FILE_TYPE["ALL_F32"])
    if m.n_expert:
        w.add_expert_count(m.n_expert)
        w.add_expert_used_count(2)
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    tokens += [f"\u2581t{i}" for i in range(N_VOCAB - len(tokens))]
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * N_VOCAB)
    w.add_token_types([2, 3, 3] + [6] * 256 + [1] * (N_VOCAB - 259))
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    for name, shape, t in tensors(m):
        x = rng.standard_normal(shape, dtype=np.float32) * (0.02 if len(shape) > 1 else 1.0)
        if name.endswith("norm.weight"):
            x = 1.0 + 0.1 * x
        if t == T.F16:
            w.add_tensor(name, x.astype(np.float16))
        elif t == T.BF16:
            bits = (x.view(np.uint32) >> 16).astype(np.uint16)  # truncation is fine: values do not matter
            w.add_tensor(name, bits, raw_dtype=T.BF16)
        else:
            w.add_tensor(name, x)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
