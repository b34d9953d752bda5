"""`ckpt.families.llm.quant_mix.llm_types` against llama.cpp's own quantizer (llama-cpp-python 0.3.36's
`llama_model_quantize`, i.e. `llama-quantize`): tiny LLM GGUFs are quantized by llama.cpp to every supported
file type, and each tensor's type in its output must be the one `llm_types` predicts, the row-length fallbacks
exactly the tensors llama.cpp warns about.

The models are small but shaped to reach the rules: GQA ratios 1, 2, 4 and 8 (n_gqa >= 4 rules), 8, 10 and 12
layers (use_more_bits spreads), tied and untied embeddings, rows not a multiple of 256 (K-quant fallbacks) and
of 32 (the F16 last resort), F32 / F16 / BF16 sources, F16 norms and tensors with leading size-1 dims, a file
written in lexicographic order (blk.10 before blk.2: llama.cpp counts in layer order), an 8-expert MoE and an
80-layer GQA llama (LLM_TYPE_70B). Values are random: types do not depend on them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from helpers import llama_ref

from ckpt.errors import CkptError
from ckpt.families.llm.quant_mix import FILE_TYPE, llm_types

# the static file types (every other one, and the flags, in tests/test_gguf_mix_imatrix.py)
FTYPES = ["ALL_F32", "MOSTLY_F16", "MOSTLY_BF16", "MOSTLY_Q4_0", "MOSTLY_Q4_1", "MOSTLY_Q5_0", "MOSTLY_Q5_1",
          "MOSTLY_Q8_0", "MOSTLY_Q2_K", "MOSTLY_Q3_K_S", "MOSTLY_Q3_K_M", "MOSTLY_Q3_K_L", "MOSTLY_Q4_K_S",
          "MOSTLY_Q4_K_M", "MOSTLY_Q5_K_S", "MOSTLY_Q5_K_M", "MOSTLY_Q6_K", "MOSTLY_IQ4_NL", "MOSTLY_IQ4_XS"]
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


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """name -> the model's F16/F32 GGUF, written once per module on first use."""
    folder = tmp_path_factory.mktemp("llm_mix")
    built = {}

    def get(name: str, m: Model):
        if name not in built:
            write_model(folder / f"{name}.gguf", m)
            built[name] = folder / f"{name}.gguf"
        return built[name]

    return get


def predicted(m: Model, ftype: str, pure: bool = False):
    ts = tensors(m)
    got = llm_types(ftype, [(n, s, t.name) for n, s, t in ts], arch=m.arch, n_layer=m.n_layer, n_head=m.n_head,
                    n_head_kv=m.n_head_kv, n_expert=m.n_expert, pure=pure)
    return {n: g for (n, _, _), g in zip(ts, got)}


def check_against_llama_cpp(src, dst, m: Model, ftype: str, pure: bool = False):
    llama_ref.llama_cpp()  # skip here, with the reason, when llama.cpp is not there
    log = llama_ref.quantize_gguf(src, dst, ftype, pure=pure)
    out = {t.name: t.tensor_type.name for t in gguf.GGUFReader(dst).tensors}
    want = predicted(m, ftype, pure)
    assert set(out) == set(want)
    wrong = {n: (out[n], want[n][0], want[n][1]) for n in want if out[n] != want[n][0]}
    assert not wrong, f"{ftype}{' --pure' if pure else ''}: llama.cpp type, predicted type, rule: {wrong}"
    assert set(FALLBACK_WARNING.findall(log)) == {n for n, (_, _, fb) in want.items() if fb}
    return want


CASES = [(name, f, False) for name in MODELS for f in FTYPES]
CASES += [(name, f, True) for name in MODELS for f in ("MOSTLY_Q4_K_M", "MOSTLY_Q3_K_S", "MOSTLY_IQ4_XS")]


@pytest.mark.parametrize("name, ftype, pure", CASES, ids=[f"{n}-{f[7:] if f.startswith('MOSTLY_') else f}"
                                                          f"{'-pure' if p else ''}" for n, f, p in CASES])
def test_llm_types_match_llama_quantize(source, tmp_path, name, ftype, pure):
    m = MODELS[name]
    check_against_llama_cpp(source(name, m), tmp_path / "out.gguf", m, ftype, pure)


@pytest.mark.parametrize("ftype", ["MOSTLY_Q3_K_S", "MOSTLY_Q4_K_S", "MOSTLY_Q3_K_M"])
def test_llama_70b_attn_v_takes_q5_k(source, tmp_path, ftype):
    want = check_against_llama_cpp(source("llama70b", LLAMA_70B), tmp_path / "out.gguf", LLAMA_70B, ftype)
    assert {want[f"blk.{i}.attn_v.weight"][0] for i in range(80)} == {"Q5_K"}  # all Q3_K/Q4_K lifted


def test_the_models_reach_the_rules():
    """What the oracle tests above cover, spelled out on the predictions they checked."""
    q4km = predicted(MODELS["llama8"], "MOSTLY_Q4_K_M")
    assert q4km["output.weight"][0] == "Q6_K" and q4km["token_embd.weight"][0] == "Q4_K"
    assert [q4km[f"blk.{i}.ffn_down.weight"][0] for i in range(8)] == \
           ["Q6_K", "Q4_K", "Q4_K", "Q6_K", "Q4_K", "Q4_K", "Q6_K", "Q6_K"]  # use_more_bits over 8 layers
    tied = predicted(MODELS["llama10_tied_f32"], "MOSTLY_Q4_0")
    assert tied["token_embd.weight"] == ("Q6_K", "tied token_embd (output rule)", False)
    assert tied["blk.0.attn_norm.weight"][0] == "F16"  # a norm is copied as it is, F16 included
    assert tied["blk.0.extra_gain.weight"][0] == "F32" and tied["blk.2.extra_scale.weight"][0] == "F16"  # 1-D to ggml
    assert tied["blk.1.extra_proj.weight"][0] == "Q4_0"  # (1, 64, 256) is 2-D to ggml
    t10 = predicted(MODELS["llama10_tied_f32"], "MOSTLY_Q4_K_S")
    assert t10["blk.5.ffn_down.weight"] == ("Q5_0", "ffn_down: row of 320 fits no Q4_K block -> Q5_0", True)
    assert t10["blk.0.ffn_down.weight"][0] == "Q5_1"  # first eighth: Q5_K, which falls back to Q5_1
    odd = predicted(MODELS["qwen2_odd_rows"], "MOSTLY_Q4_K_M")
    assert odd["output.weight"] == ("Q8_0", "output", False)  # 288 % 256: the output rule's own Q8_0
    assert odd["blk.0.ffn_down.weight"][::2] == ("F16", True)  # 336 % 32: the F16 last resort
    assert odd["blk.0.attn_v.weight"] == ("Q8_0", "attn_v: row of 288 fits no Q6_K block -> Q8_0", True)
    moe = predicted(MODELS["moe8"], "MOSTLY_Q4_K_M")
    assert moe["blk.0.attn_v.weight"][0] == moe["blk.0.attn_k.weight"][0] == "Q8_0"
    assert moe["blk.0.attn_output.weight"][0] == "Q5_K" and moe["blk.0.ffn_gate_inp.weight"][0] == "F32"
    lex = predicted(MODELS["qwen3_lex_bf16"], "MOSTLY_Q4_K_M")  # counted by layer, not in file order
    assert "".join("6" if lex[f"blk.{i}.attn_v.weight"][0] == "Q6_K" else "4" for i in range(12)) == "644644644666"


@pytest.mark.parametrize("ftype", ["MOSTLY_NVFP4", "Q4_K_M", "GUESSED", ""])  # NVFP4: no llama-quantize type
def test_unsupported_file_types_are_refused_by_name(ftype):
    with pytest.raises(CkptError, match=f"file type {ftype} is not supported"):
        llm_types(ftype, [("output.weight", (256, 256), "F16")], arch="llama", n_layer=1, n_head=8, n_head_kv=8)


def test_logits_helper_reads_llama_cpp_outputs(source, tmp_path):
    """tests/helpers/llama_ref.logits runs llama.cpp on the F16 model and on its Q8_0 quantization."""
    m = MODELS["llama8"]
    src = source("llama8", m)
    llama_ref.llama_cpp()
    llama_ref.quantize_gguf(src, tmp_path / "q8.gguf", "MOSTLY_Q8_0")
    ids = [1, 5, 70, 300, 9]
    a, b = llama_ref.logits(src, ids), llama_ref.logits(tmp_path / "q8.gguf", ids)
    assert a.shape == b.shape == (len(ids), N_VOCAB) and np.isfinite(a).all()
    assert np.abs(a - b).max() < 0.05 * np.abs(a).max()
