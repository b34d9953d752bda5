"""`ckpt convert ./deepseek-v3 --to gguf-<type>`: DeepSeek-V3 / Kimi K2 (`DeepseekV3ForCausalLM`) as llama.cpp's
`deepseek2` (`ckpt.families.llm.archs.deepseek2`), held to llama.cpp's own converter.

Oracles: llama.cpp's `convert_hf_to_gguf.py` (its DeepseekV2Model, llama-cpp-python 0.3.36's vendored tree, run in
a subprocess with its own gguf-py: `helpers.hf_llm.reference`), `llama-quantize` and llama.cpp's logits through
llama-cpp-python (`helpers.llama_ref`), and the original model's own weights (the MLA split checked against
`kv_b_proj`).

The models are tiny random ones built here (`helpers.deepseek`): DeepSeek-V3's shape (low-rank queries, a dense
layer first, routed + shared experts, sigmoid router with its score correction, expert groups, yarn RoPE), Kimi K2's
config.json (its legacy rope_scaling spelling, one expert group, BF16), DeepSeek-V2-Lite's
attention (one q_proj) with tied embeddings, and DeepSeek's FP8 release format of the first (128x128
`weight_scale_inv` blocks, `quantization_config.quant_method: fp8`, its MTP layer after the model's). The reference
dequantizes `weight_scale_inv` FP8 itself (`ModelBase.dequant_model`), so the FP8 folder is compared with the
reference run on that same FP8 folder, directly.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from helpers.deepseek import deepseek_folder, fp8_copy
from helpers.hf_llm import bpe_hash, read_gguf, reference
from helpers.refusals import assert_refused

CKPT_ONLY = {"ckpt.version", "ckpt.operation"}
# name -> (variant, source dtype, outtypes compared with the reference)
MODELS = {
    "v3": ("v3", torch.float32, ("f16", "bf16", "f32", "q8_0")),
    "kimi": ("kimi", torch.bfloat16, ("bf16", "f16", "q8_0")),
    "lite": ("lite", torch.float32, ("f16",)),
    "fp8": ("v3", None, ("f16", "bf16")),  # the FP8 release format of v3, with its MTP layer
}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("deepseek")
    out = {}
    for name, (variant, dtype, _) in MODELS.items():
        if dtype is not None:
            out[name] = deepseek_folder(root / name, variant, dtype)
    out["fp8"] = (fp8_copy(out["v3"][0], root / "fp8", mtp=True), None)
    return out


@pytest.fixture(scope="module")
def pre(built):
    """The test tokenizer's pre-tokenizer hash (one trained tokenizer: one hash), registered as qwen2's split."""
    return bpe_hash(built["v3"][0]), "qwen2"


@pytest.fixture(scope="module")
def refs(built, pre, tmp_path_factory):
    """The reference's file of every model and outtype, one converter run per folder."""
    root = tmp_path_factory.mktemp("ref")
    out = {}
    for name, (_, _, outtypes) in MODELS.items():
        files = {t: root / f"{name}-{t}.gguf" for t in outtypes}
        reference(built[name][0], files, pre=pre)
        out.update({(name, t): p for t, p in files.items()})
    return out


@pytest.fixture
def registered(pre, monkeypatch):
    from ckpt.targets.planners import gguf_vocab

    monkeypatch.setitem(gguf_vocab.PRE_TOKENIZERS, *pre)


def ckpt_gguf(run_ckpt, folder, outtype, out, *args):
    code, _, err = run_ckpt("convert", folder, "--to", f"gguf-{outtype}", "-o", out, "-q", *args)
    assert code == 0, err
    return out


def same_file(ours_path, theirs_path, what):
    """Same metadata (keys, order, value types, values) but ckpt's provenance keys; same tensors (names, order,
    types, shapes, bytes)."""
    ours, ours_t = read_gguf(ours_path)
    theirs, theirs_t = read_gguf(theirs_path)
    assert set(ours) - set(theirs) == CKPT_ONLY and set(theirs) <= set(ours), (what, set(ours) ^ set(theirs))
    assert [k for k in ours if k not in CKPT_ONLY] == list(theirs), what
    for k in theirs:
        assert ours[k] == theirs[k], (what, k, str(ours[k])[:200], str(theirs[k])[:200])
    assert [x[:3] for x in ours_t] == [x[:3] for x in theirs_t], what
    for a, b in zip(ours_t, theirs_t):
        assert a[3] == b[3], (what, a[0])


# ---- 1. the reference's file, key for key and byte for byte


@pytest.mark.parametrize("name", list(MODELS))
def test_same_file_as_convert_hf_to_gguf(name, built, refs, registered, run_ckpt, tmp_path):
    """Every outtype of the reference for this model, FP8 source included (decoded as it streams)."""
    for t in MODELS[name][2]:
        same_file(ckpt_gguf(run_ckpt, built[name][0], t, tmp_path / f"ckpt-{t}.gguf"), refs[(name, t)], (name, t))


def test_what_the_file_holds(built, refs, registered):
    """Without ckpt: the reference's file is what the model says (so the comparisons above compare something):
    kv_b_proj split per head into k_b (transposed) and v_b, the experts stacked, the router's score correction as
    exp_probs_b.bias, the MLA lengths and the expert keys; the FP8 copy's MTP layer left out, its values those of
    its codes times their block scales."""
    from safetensors.torch import load_file

    folder, model = built["v3"]
    sd = load_file(folder / "model.safetensors")
    meta, tensors = read_gguf(refs[("v3", "f32")])
    got = {n: torch.from_numpy(np.frombuffer(b, dtype=np.float32).copy()).reshape(tuple(reversed(s)))
           for n, t, s, b in tensors if t == "F32"}
    kv_b = sd["model.layers.1.self_attn.kv_b_proj.weight"].view(4, 64, 64)
    assert torch.equal(got["blk.1.attn_k_b.weight"], kv_b[:, :32].transpose(1, 2))
    assert torch.equal(got["blk.1.attn_v_b.weight"], kv_b[:, 32:])
    assert torch.equal(got["blk.2.ffn_up_exps.weight"],
                       torch.stack([sd[f"model.layers.2.mlp.experts.{x}.up_proj.weight"] for x in range(4)]))
    assert torch.equal(got["blk.1.exp_probs_b.bias"], sd["model.layers.1.mlp.gate.e_score_correction_bias"])
    assert "blk.0.ffn_gate_exps.weight" not in got and "blk.0.ffn_gate.weight" in got
    for key, want in (("deepseek2.attention.head_count_kv", 1), ("deepseek2.attention.key_length", 96),
                      ("deepseek2.attention.value_length", 64), ("deepseek2.attention.key_length_mla", 64),
                      ("deepseek2.attention.value_length_mla", 32), ("deepseek2.leading_dense_block_count", 1),
                      ("deepseek2.expert_shared_count", 1), ("deepseek2.expert_group_count", 2),
                      ("deepseek2.expert_gating_func", 2), ("deepseek2.rope.dimension_count", 32)):
        assert meta[key][0] == want, key
    fp8_meta, fp8_tensors = read_gguf(refs[("fp8", "bf16")])
    assert [n for n, *_ in fp8_tensors] == [n for n, *_ in tensors]  # no MTP block
    fsd = load_file(built["fp8"][0] / "model.safetensors")
    assert fsd["model.layers.1.self_attn.q_b_proj.weight"].dtype == torch.float8_e4m3fn
    assert "model.layers.3.eh_proj.weight_scale_inv" in fsd
    codes, scale = fsd["model.layers.1.mlp.shared_experts.down_proj.weight"], \
        fsd["model.layers.1.mlp.shared_experts.down_proj.weight_scale_inv"]
    want = (codes.float() * scale.repeat_interleave(128, 0).repeat_interleave(128, 1)[:256, :192]).to(torch.bfloat16)
    raw = next(b for n, t, s, b in fp8_tensors if n == "blk.1.ffn_down_shexp.weight")
    assert torch.equal(torch.frombuffer(bytearray(raw), dtype=torch.bfloat16).reshape(256, 192), want)


# ---- 2. K-quant mix: the reference's file through llama-quantize


def test_mix_is_llama_quantize_of_the_reference_file(built, refs, registered, run_ckpt, tmp_path):
    """`--to gguf-q4_k_m` of the BF16 Kimi-shaped model is `convert_hf_to_gguf.py --outtype bf16` then
    `llama-quantize Q4_K_M`: same tensors in its order, types and bytes; same metadata."""
    from helpers import llama_ref

    llama_ref.llama_cpp()
    llama_ref.quantize_gguf(refs[("kimi", "bf16")], tmp_path / "ref.gguf", "MOSTLY_Q4_K_M")
    same_file(ckpt_gguf(run_ckpt, built["kimi"][0], "q4_k_m", tmp_path / "ckpt.gguf"), tmp_path / "ref.gguf",
              "q4_k_m")


# ---- 3. llama.cpp runs it as it runs the reference's file


@pytest.mark.parametrize("name,outtype", [("v3", "f16"), ("fp8", "bf16")])
def test_llama_cpp_logits_match_the_reference_file(name, outtype, built, refs, registered, run_ckpt, tmp_path):
    from helpers import llama_ref

    llama_ref.llama_cpp()
    ckpt_gguf(run_ckpt, built[name][0], outtype, tmp_path / "ckpt.gguf")
    ids = [1, 5, 17, 42, 99, 3, 250, 7]
    a = llama_ref.logits(tmp_path / "ckpt.gguf", ids)
    b = llama_ref.logits(refs[(name, outtype)], ids)
    assert np.isfinite(a).all() and np.array_equal(a, b)


# ---- 4. read back: GGUF -> Hugging Face DeepseekV3ForCausalLM


@pytest.mark.parametrize("name,outtype,to", [("v3", "f32", "fp32"), ("kimi", "bf16", "bf16"), ("lite", "f32", "fp32")])
def test_read_back_loads_in_transformers_with_the_original_logits(name, outtype, to, built, registered, run_ckpt,
                                                                  tmp_path):
    """`convert X.gguf --to fp32|bf16` gives a folder transformers loads strictly (no missing, unexpected or
    mismatched key) with every original tensor exact (kv_b_proj joined again, the experts unstacked: an F32 file of
    an F32 model, a BF16 file of a BF16 one, so no rounding anywhere) and so the original's logits, bit for bit
    (tolerance 0), and the original's config where it decides the computation."""
    from transformers import AutoModelForCausalLM

    folder = built[name][0]
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)  # the original, as saved
    gguf_file = ckpt_gguf(run_ckpt, folder, outtype, tmp_path / "m.gguf")
    code, _, err = run_ckpt("convert", gguf_file, "--to", to, "-o", tmp_path / "back", "-q")
    assert code == 0, err
    back, info = AutoModelForCausalLM.from_pretrained(tmp_path / "back", dtype=torch.float32,
                                                      output_loading_info=True)
    assert not any(info.values()), info
    want, got = model.state_dict(), back.state_dict()
    assert set(got) == set(want)
    for k, v in want.items():
        assert torch.equal(got[k], v), k
    a, b = model.config, back.config
    for key in ("q_lora_rank", "kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim", "n_group",
                "topk_group", "n_routed_experts", "n_shared_experts", "num_experts_per_tok", "first_k_dense_replace",
                "norm_topk_prob", "routed_scaling_factor", "tie_word_embeddings", "rope_interleave", "rms_norm_eps"):
        assert getattr(b, key) == getattr(a, key), key
    def rope(c):  # (Kimi's legacy `type` kept beside transformers' `rope_type`)
        return {k: v for k, v in c.rope_parameters.items() if v is not None and k != "type"}
    assert rope(b) == rope(a)
    ids = torch.tensor([[1, 5, 17, 42, 99, 3, 250, 7]])
    with torch.no_grad():
        assert torch.equal(back(ids).logits, model(ids).logits)


@pytest.mark.parametrize("mix", ["q4_k_m", "q8_0"])
def test_gguf_source_is_llama_quantize(mix, built, registered, run_ckpt, tmp_path):
    """`convert model-F16.gguf --to gguf-<mix>` of a deepseek2 GGUF is `llama-quantize model-F16.gguf <MIX>`: the
    read-back view (kv_b_proj joined, experts unstacked) maps back onto the stored tensors, copied or requantized
    as llama-quantize does."""
    from helpers import llama_ref

    from ckpt.targets.planners.gguf_mixes import mix as mix_of

    llama_ref.llama_cpp()
    src = ckpt_gguf(run_ckpt, built["v3"][0], "f16", tmp_path / "m-F16.gguf")
    llama_ref.quantize_gguf(src, tmp_path / "ref.gguf", mix_of(mix).ftype)
    code, _, err = run_ckpt("convert", src, "--to", f"gguf-{mix}", "-o", tmp_path / "ckpt.gguf", "-q")
    assert code == 0, err
    ours, ours_t = read_gguf(tmp_path / "ckpt.gguf")
    theirs, theirs_t = read_gguf(tmp_path / "ref.gguf")
    assert [x[:3] for x in ours_t] == [x[:3] for x in theirs_t]
    for a, b in zip(ours_t, theirs_t):
        assert a[3] == b[3], a[0]
    assert [k for k in ours if k not in CKPT_ONLY] == [k for k in theirs if k not in CKPT_ONLY]
    for k in theirs:
        if k not in CKPT_ONLY:
            assert ours[k] == theirs[k], (k, str(ours[k])[:200], str(theirs[k])[:200])


def _patched(src, dst, key, value):
    """A copy of a GGUF with one uint32 metadata value changed in place."""
    import gguf

    shutil.copy(src, dst)
    r = gguf.GGUFReader(str(dst), "r+")
    f = r.fields[key]
    f.parts[f.data[0]][0] = value
    del r
    return dst


def test_read_back_refuses_metadata_that_disagrees_with_the_tensors(built, registered, run_ckpt, tmp_path):
    ckpt_gguf(run_ckpt, built["v3"][0], "f16", tmp_path / "v3.gguf")
    cases = [
        ("deepseek2.attention.kv_lora_rank", 32, "tensor blk.0.attn_kv_a_mqa.weight is [96, 256], not [64, 256]"),
        ("deepseek2.attention.key_length_mla", 48, "tensor blk.0.attn_k_b.weight is [4, 64, 32], not [4, 64, 16]"),
        ("deepseek2.expert_count", 8, "metadata 'deepseek2.expert_count' is 8, but blk.1."),
        ("deepseek2.leading_dense_block_count", 2, "metadata 'deepseek2.leading_dense_block_count' is 2, but the "
                                                   "file has no blk.1.ffn_gate.weight"),
        ("deepseek2.expert_gating_func", 1, "metadata 'deepseek2.expert_gating_func' is 1, not 2 (sigmoid)"),
        ("deepseek2.block_count", 4, "metadata 'deepseek2.block_count' is 4, but the file has tensors for 3 blocks"),
    ]
    for i, (key, value, problem) in enumerate(cases):
        bad = _patched(tmp_path / "v3.gguf", tmp_path / f"bad{i}.gguf", key, value)
        assert_refused(run_ckpt, tmp_path, ("convert", bad, "--to", "fp32", "-o", tmp_path / f"out{i}"), str(bad),
                       problem)


# ---- 5. refusals: one line, exit 2, nothing written, inputs unchanged


def _variant(src, dst, config=None, tensors=None):
    """A copy of `src` with config.json keys set (None: removed) and tensors changed (`tensors(state_dict)`)."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    if config:
        cfg = json.loads((dst / "config.json").read_text())
        for k, v in config.items():
            if v is None:
                cfg.pop(k, None)
            else:
                cfg[k] = v
        (dst / "config.json").write_text(json.dumps(cfg))
    if tensors:
        sd = load_file(dst / "model.safetensors")
        tensors(sd)
        save_file(sd, dst / "model.safetensors")
    return dst


def test_refusals(built, registered, run_ckpt, tmp_path):
    """A config that disagrees with the tensors (experts, heads, layers, the dense lead, the query's form, the
    key/value heads kv_b_proj is split by) is one line naming both; so is a Kimi K2 folder with its tiktoken
    tokenizer only."""
    v3, kimi, lite = built["v3"][0], built["kimi"][0], built["lite"][0]
    cases = [
        (v3, {"n_routed_experts": 8}, None, "config.json", "n_routed_experts is 8 but "
                                                             "model.layers.1.mlp.gate.e_score_correction.bias has 4 "
                                                             "rows"),
        (kimi, {"num_attention_heads": 8}, None, "config.json", "num_attention_heads x v_head_dim is 8 x 32 = "
                                                                 "256 but model.layers.0.self_attn.o_proj.weight has "
                                                                 "128 columns"),
        (v3, {"num_hidden_layers": 2}, None, "config.json", "num_hidden_layers is 2 but the weights hold 3 blocks"),
        (v3, {"first_k_dense_replace": 2}, None, "config.json", "first_k_dense_replace is 2 but model.layers.1 has "
                                                                 "routed experts"),
        (lite, {"q_lora_rank": 64}, None, "config.json", "q_lora_rank is 64 but model.layers.0 has one q_proj"),
        (kimi, {"num_key_value_heads": 1}, None, "config.json", "num_key_value_heads x qk_nope_head_dim + "
                                                                 "num_key_value_heads x v_head_dim is 1 x 32 + 1 x 32"),
        (v3, {"scoring_func": "relu"}, None, "config.json", "scoring_func is 'relu', not one of softmax"),
    ]
    for i, (src, config, tensors, culprit, problem) in enumerate(cases):
        bad = _variant(src, tmp_path / f"bad{i}", config, tensors)
        assert_refused(run_ckpt, tmp_path, ("convert", bad, "--to", "gguf-f16"), str(bad / culprit), problem)

    def tiktoken(folder):
        for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            (folder / f).unlink(missing_ok=True)
        (folder / "tiktoken.model").write_text("IQ== 0\n")
    k2 = _variant(kimi, tmp_path / "k2")
    tiktoken(k2)
    assert_refused(run_ckpt, tmp_path, ("convert", k2, "--to", "gguf-f16"), str(k2),
                   "no tokenizer (tokenizer.model or tokenizer.json)")


def test_merge_lora_into_a_deepseek_gguf(built, registered, run_ckpt, tmp_path, capsys):
    """merge-lora into a DeepSeek GGUF: a LoRA on tensors the GGUF stores as they are (q_a_proj, o_proj) is merged and
    reads back as PEFT's merge_and_unload; one on kv_b_proj (stored split per head into k_b and v_b) is refused in
    one line naming the way that works, nothing written."""
    from peft import LoraConfig, get_peft_model
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    folder = built["v3"][0]
    base = ckpt_gguf(run_ckpt, folder, "f32", tmp_path / "base-F32.gguf")
    for targets in (["q_a_proj", "o_proj"], ["kv_b_proj"]):
        torch.manual_seed(3)
        peft = get_peft_model(AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32),
                              LoraConfig(r=2, lora_alpha=4, target_modules=targets, init_lora_weights=False))
        lora = tmp_path / f"lora-{targets[0]}"
        peft.save_pretrained(lora)
        capsys.readouterr()  # transformers' progress bars
        out = tmp_path / f"merged-{targets[0]}.gguf"
        if targets == ["kv_b_proj"]:
            assert_refused(run_ckpt, tmp_path, ("merge-lora", base, lora, "--to", "gguf-f32", "-o", out), str(base),
                           "merge into the Hugging Face folder instead (merge-lora HF_FOLDER LORA --to gguf-f32)")
            continue
        merged = {k: v.detach().clone() for k, v in peft.merge_and_unload().state_dict().items()}
        capsys.readouterr()
        code, _, err = run_ckpt("merge-lora", base, lora, "--to", "gguf-f32", "-o", out, "-q")
        assert code == 0, err
        code, _, err = run_ckpt("convert", out, "--to", "fp32", "-o", tmp_path / "back", "-q")
        assert code == 0, err
        back = load_file(tmp_path / "back" / "model.safetensors")
        changed = [k for k in merged if any(t in k for t in targets)]
        assert changed
        for k in changed:
            torch.testing.assert_close(back[k], merged[k], rtol=0, atol=1e-6)
