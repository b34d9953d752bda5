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

import gguf
import numpy as np
import pytest
from helpers import llama_ref
from helpers.llm_mix_models import FALLBACK_WARNING, LLAMA_70B, MODELS, N_VOCAB, Model, tensors, write_model  # noqa: F401

from ckpt.errors import CkptError
from ckpt.families.llm.quant_mix import llm_types

# the static file types (every other one, and the flags, in tests/test_gguf_mix_imatrix.py)
FTYPES = ["ALL_F32", "MOSTLY_F16", "MOSTLY_BF16", "MOSTLY_Q4_0", "MOSTLY_Q4_1", "MOSTLY_Q5_0", "MOSTLY_Q5_1",
          "MOSTLY_Q8_0", "MOSTLY_Q2_K", "MOSTLY_Q3_K_S", "MOSTLY_Q3_K_M", "MOSTLY_Q3_K_L", "MOSTLY_Q4_K_S",
          "MOSTLY_Q4_K_M", "MOSTLY_Q5_K_S", "MOSTLY_Q5_K_M", "MOSTLY_Q6_K", "MOSTLY_IQ4_NL", "MOSTLY_IQ4_XS"]

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
