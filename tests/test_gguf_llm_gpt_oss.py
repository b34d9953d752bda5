"""`ckpt convert GPT_OSS_FOLDER --to gguf-*` (`ckpt.families.llm.archs.gpt_oss`): OpenAI's gpt-oss as llama.cpp's
`gpt-oss`, from a bf16 folder and from the MXFP4 release as llama.cpp keeps it, and back to Hugging Face.

Oracles: llama.cpp's `convert_hf_to_gguf.py` (llama-cpp-python 0.3.36's vendored tree, `helpers.hf_llm.reference`)
for every key and tensor byte; `llama-quantize` (`helpers.llama_ref.quantize_gguf`) for the Q4_K_M mix of the
reference's file; llama.cpp itself for logits; gguf-py's MXFP4 dequantizer and transformers' own MXFP4 dequantizing
load for what the MXFP4 experts hold; transformers' `from_pretrained` (strict) and logits for the read-back folder.

The folders are tiny random gpt-oss models (`helpers.gpt_oss_llm`: 2 layers, 4 experts, sinks, biases, yarn RoPE,
alternating sliding window) with a byte-level BPE tokenizer trained here with o200k's split and the harmony special
tokens; its check-text hash is registered as llama.cpp's `gpt-4o` for ckpt and for the reference. The MXFP4 folder
is packed by triton_kernels' rule (`helpers.mxfp4_ref`), as the release is.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from helpers.gpt_oss_llm import gpt_oss_folder
from helpers.hf_llm import bpe_hash, read_gguf, reference
from helpers.refusals import assert_refused

CKPT_ONLY = {"ckpt.version", "ckpt.operation"}
# folder -> the outtypes compared with convert_hf_to_gguf.py
OUTTYPES = {"bf16": ("f16", "bf16", "f32", "q8_0"), "mxfp4": ("bf16", "f16", "f32", "q8_0")}
IDS = [1, 5, 17, 42, 99, 3, 250, 7]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpt-oss")
    out = {"bf16": gpt_oss_folder(root / "bf16"), "mxfp4": gpt_oss_folder(root / "mxfp4", mxfp4=True)}
    return out, (bpe_hash(out["bf16"]), "gpt-4o")


@pytest.fixture
def registered(folders, monkeypatch):
    from ckpt.targets.planners import gguf_vocab

    monkeypatch.setitem(gguf_vocab.PRE_TOKENIZERS, *folders[1])


@pytest.fixture(scope="module")
def references(folders, tmp_path_factory):
    """The reference's file of every outtype of both folders (one converter process per folder)."""
    dirs, pre = folders
    root = tmp_path_factory.mktemp("ref")
    out = {}
    for name, types in OUTTYPES.items():
        files = {t: root / f"{name}-{t}.gguf" for t in types}
        reference(dirs[name], files, pre=pre)
        out.update({(name, t): f for t, f in files.items()})
    return out


def ckpt_gguf(run_ckpt, folder, to, out, *args):
    code, _, err = run_ckpt("convert", folder, "--to", f"gguf-{to}", "-o", out, "-q", *args)
    assert code == 0, err
    return out


def same_file(ours_path, theirs_path):
    """Same metadata (keys, order, value types and values) but ckpt's provenance keys; same tensors (names, order,
    types, shapes, bytes)."""
    ours, ours_t = read_gguf(ours_path)
    theirs, theirs_t = read_gguf(theirs_path)
    assert set(ours) - set(theirs) == CKPT_ONLY and set(theirs) <= set(ours), set(ours) ^ set(theirs)
    assert [k for k in ours if k not in CKPT_ONLY] == list(theirs)
    for k in theirs:
        assert ours[k] == theirs[k], (k, str(ours[k])[:200], str(theirs[k])[:200])
    assert [x[:3] for x in ours_t] == [x[:3] for x in theirs_t]
    for a, b in zip(ours_t, theirs_t):
        assert a[3] == b[3], a[0]
    return ours, ours_t


# ---- 1. the reference's file, key for key and byte for byte


@pytest.mark.parametrize("name,outtype", [(n, t) for n, ts in OUTTYPES.items() for t in ts])
def test_same_file_as_convert_hf_to_gguf(name, outtype, folders, references, registered, run_ckpt, tmp_path):
    """bf16: the banks transposed, gate/up split by even and odd rows, their biases likewise, sinks, router bias,
    yarn and sliding window keys. MXFP4: the banks' bytes repacked into GGML's MXFP4 for every outtype, written
    first, general.file_type MOSTLY_MXFP4_MOE for f32/f16/bf16 (Q8_0 for q8_0), as the reference writes them."""
    meta, tensors = same_file(ckpt_gguf(run_ckpt, folders[0][name], outtype, tmp_path / "ckpt.gguf"),
                              references[(name, outtype)])
    types = {n: t for n, t, _, _ in tensors}
    assert meta["general.architecture"][0] == "gpt-oss" and meta["tokenizer.ggml.pre"][0] == "gpt-4o"
    assert meta["gpt-oss.rope.scaling.type"][0] == "yarn" and meta["gpt-oss.attention.sliding_window"][0] == 16
    assert types["blk.1.attn_sinks.weight"] == "F32" and "blk.0.ffn_gate_inp.bias" in types
    if name == "mxfp4":
        assert [t for _, t, _, _ in tensors[:6]] == ["MXFP4"] * 6
        assert meta["general.file_type"][0] == (7 if outtype == "q8_0" else 38)


def test_mxfp4_experts_hold_transformers_dequantized_banks(folders, registered, run_ckpt, tmp_path):
    """Without the reference: gguf-py's MXFP4 dequantizer on the written expert tensors gives the banks transformers
    dequantizes from the MXFP4 folder (gate = even columns of gate_up_proj, up = odd ones, each transposed; down
    transposed), exactly."""
    import gguf
    from transformers import AutoModelForCausalLM

    path = ckpt_gguf(run_ckpt, folders[0]["mxfp4"], "bf16", tmp_path / "m.gguf")
    stored = {t.name: t for t in gguf.GGUFReader(str(path)).tensors}
    model = AutoModelForCausalLM.from_pretrained(folders[0]["mxfp4"])
    for i, layer in enumerate(model.model.layers):
        gate_up, down = layer.mlp.experts.gate_up_proj.detach().float(), layer.mlp.experts.down_proj.detach().float()
        for gname, want in ((f"blk.{i}.ffn_gate_exps.weight", gate_up[..., ::2].transpose(1, 2)),
                            (f"blk.{i}.ffn_up_exps.weight", gate_up[..., 1::2].transpose(1, 2)),
                            (f"blk.{i}.ffn_down_exps.weight", down.transpose(1, 2))):
            t = stored[gname]
            assert t.tensor_type == gguf.GGMLQuantizationType.MXFP4, gname
            assert np.array_equal(gguf.quants.dequantize(t.data, t.tensor_type), want.numpy()), gname


# ---- 2. a llama-quantize mix of the reference's file


@pytest.mark.parametrize("name", ["bf16", "mxfp4"])
def test_q4_k_m_is_llama_quantize_of_the_reference_file(name, folders, references, registered, run_ckpt, tmp_path):
    """`--to gguf-q4_k_m` is `convert_hf_to_gguf.py --outtype bf16` then `llama-quantize Q4_K_M`: tensors in its
    order, types and bytes, and its metadata. From the MXFP4 folder llama-quantize refuses the reference's file
    ("requantizing from type mxfp4 is disabled") unless --allow-requantize, with which it dequantizes the MXFP4
    experts and quantizes them as Q4_K: ckpt's file is that one (ckpt has no gguf-mxfp4_moe mix)."""
    from helpers import llama_ref

    llama_ref.llama_cpp()
    src = references[(name, "bf16")]
    if name == "mxfp4":
        with pytest.raises(AssertionError, match="requantizing from type mxfp4 is disabled"):
            llama_ref.quantize_gguf(src, tmp_path / "refused.gguf", "MOSTLY_Q4_K_M")
    llama_ref.quantize_gguf(src, tmp_path / "ref.gguf", "MOSTLY_Q4_K_M", allow_requantize=name == "mxfp4")
    _, tensors = same_file(ckpt_gguf(run_ckpt, folders[0][name], "q4_k_m", tmp_path / "ckpt.gguf"),
                           tmp_path / "ref.gguf")
    assert {t for n, t, _, _ in tensors if "_exps.weight" in n} <= {"Q4_K", "Q6_K"}


def test_gguf_source_is_llama_quantize(folders, registered, run_ckpt, tmp_path):
    """`convert gpt-oss-F16.gguf --to gguf-q4_k_m` is `llama-quantize` of it (the expert tensors, which the reader
    rebuilds into fused HF banks, are taken as stored, not from those banks); the MXFP4 file is not requantized."""
    from helpers import llama_ref

    llama_ref.llama_cpp()
    src = ckpt_gguf(run_ckpt, folders[0]["bf16"], "f16", tmp_path / "m-F16.gguf")
    llama_ref.quantize_gguf(src, tmp_path / "ref.gguf", "MOSTLY_Q4_K_M")
    code, _, err = run_ckpt("convert", src, "--to", "gguf-q4_k_m", "-o", tmp_path / "ckpt.gguf", "-q")
    assert code == 0, err
    ours, ours_t = read_gguf(tmp_path / "ckpt.gguf")
    theirs, theirs_t = read_gguf(tmp_path / "ref.gguf")
    assert [x[:3] for x in ours_t] == [x[:3] for x in theirs_t]
    for a, b in zip(ours_t, theirs_t):
        assert a[3] == b[3], a[0]
    assert {k: v for k, v in ours.items() if k not in CKPT_ONLY} == {k: v for k, v in theirs.items()
                                                                      if k not in CKPT_ONLY}
    mx = ckpt_gguf(run_ckpt, folders[0]["mxfp4"], "bf16", tmp_path / "mx.gguf")
    assert_refused(run_ckpt, tmp_path, ("convert", mx, "--to", "gguf-q4_k_m"), str(mx),
                   "is MXFP4; requantizing it as Q4_K loses precision twice")


# ---- 3. llama.cpp runs ckpt's file as it runs the reference's


@pytest.mark.parametrize("name,outtype", [("bf16", "f16"), ("mxfp4", "bf16")])
def test_llama_cpp_logits_match_the_reference_file(name, outtype, folders, references, registered, run_ckpt,
                                                   tmp_path):
    from helpers import llama_ref

    llama_ref.llama_cpp()
    ours = llama_ref.logits(ckpt_gguf(run_ckpt, folders[0][name], outtype, tmp_path / "ckpt.gguf"), IDS)
    theirs = llama_ref.logits(references[(name, outtype)], IDS)
    assert np.isfinite(ours).all() and np.array_equal(ours, theirs)


# ---- 4. GGUF -> HF


@pytest.mark.parametrize("name,outtype", [("bf16", "f32"), ("mxfp4", "bf16")])
def test_read_back_is_the_original_model(name, outtype, folders, registered, run_ckpt, tmp_path):
    """`convert X.gguf --to fp32` gives a folder transformers loads strictly (no missing or unexpected key) with
    the original's weights and logits exactly (tolerance 0): the bf16 model through an F32 GGUF, and the MXFP4
    model (as transformers dequantizes it) through its MXFP4 + BF16 GGUF."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    folder = folders[0][name]
    gguf_path = ckpt_gguf(run_ckpt, folder, outtype, tmp_path / "m.gguf")
    code, _, err = run_ckpt("convert", gguf_path, "--to", "fp32", "-o", tmp_path / "back", "-q")
    assert code == 0, err
    cfg = json.loads((tmp_path / "back" / "config.json").read_text())
    assert cfg["layer_types"] == ["sliding_attention", "full_attention"] and cfg["sliding_window"] == 16
    assert cfg["rope_parameters"]["rope_type"] == "yarn" and cfg["rope_parameters"]["truncate"] is False
    back, info = AutoModelForCausalLM.from_pretrained(tmp_path / "back", dtype=torch.float32,
                                                      output_loading_info=True)
    assert not any(info.values()), info
    orig = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    want, got = orig.state_dict(), load_file(tmp_path / "back" / "model.safetensors")
    assert set(got) == set(want)
    for k, v in want.items():
        assert torch.equal(got[k], v), k
    ids = torch.tensor([IDS])
    with torch.no_grad():
        assert torch.equal(back(ids).logits, orig(ids).logits)


# ---- 5. refusals: one line, exit 2, nothing written, inputs unchanged


def _edited(src, dst, **changes):
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(changes)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize("changes,problem", [
    (dict(num_local_experts=3), "num_local_experts is 3 but model.layers.0.mlp."),
    (dict(num_attention_heads=8), "num_attention_heads is 8 but model.layers.0.self_attn."),
    (dict(num_hidden_layers=3), "num_hidden_layers is 3 but the weights hold 2 blocks"),
    (dict(layer_types=["full_attention", "sliding_attention"]), "llama.cpp's gpt-oss alternates sliding_attention"),
    (dict(swiglu_limit=5.0), "swiglu_limit is 5.0; llama.cpp's gpt-oss computes with 7.0"),
    (dict(attention_bias=False), "attention_bias is false; llama.cpp's gpt-oss loader requires"),
])
def test_config_that_disagrees_is_refused(changes, problem, folders, registered, run_ckpt, tmp_path):
    bad = _edited(folders[0]["bf16"], tmp_path / "bad", **changes)
    assert_refused(run_ckpt, tmp_path, ("convert", bad, "--to", "gguf-f16"), str(bad / "config.json"), problem)


def test_mxfp4_folder_whose_config_disagrees_is_refused(folders, registered, run_ckpt, tmp_path):
    bad = _edited(folders[0]["mxfp4"], tmp_path / "bad", num_local_experts=8)
    assert_refused(run_ckpt, tmp_path, ("convert", bad, "--to", "gguf-bf16"), str(bad),
                   "config.json (num_local_experts, hidden_size, intermediate_size) says")


def test_gguf_whose_metadata_disagrees_is_refused(folders, registered, run_ckpt, tmp_path):
    """Read back: an expert count the tensors do not have is one line naming both."""
    import gguf

    path = ckpt_gguf(run_ckpt, folders[0]["bf16"], "f16", tmp_path / "m.gguf")
    r = gguf.GGUFReader(str(path), "r+")
    field = r.fields["gpt-oss.expert_count"]
    field.parts[field.data[0]][0] = 3
    del r
    assert_refused(run_ckpt, tmp_path, ("convert", path, "--to", "bf16", "-o", tmp_path / "back"), str(path),
                   "as the metadata says (3 experts, embedding_length 256, feed_forward_length 256)")
