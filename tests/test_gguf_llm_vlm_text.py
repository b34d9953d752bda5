"""`ckpt convert VLM_FOLDER --to gguf-<type>` (no `--mmproj`): the language model of a vision-language folder as
llama.cpp's `convert_hf_to_gguf.py` writes it, and that GGUF read back as the text model's causal LM.

- `Mistral3ForConditionalGeneration` (llama.cpp's `mistral3`, the reference's Mistral3Model -> Ministral3Model, a
  LlamaModel): a Mistral Small 3.x text config (`mistral`), and a Ministral 3 one (`ministral3`: YaRN RoPE with
  the log multiplier and Llama 4 attention temperature scale the reference adds), the latter stored under the newer
  `model.language_model.*` names and with a byte-level BPE tokenizer.
- `Gemma3ForConditionalGeneration` (`gemma3`, Gemma3Model): norms + 1, embedding rows beyond the tokenizer, a
  sliding window, linear RoPE scaling on the global layers.
- Gemma 3n (`gemma3n`, Gemma3NModel): a text-only `Gemma3nForCausalLM` with KV-sharing layers, and the language model
  of a `Gemma3nForConditionalGeneration` folder (vision and audio towers left out) without them. (transformers saves
  no k/v projections for KV-sharing layers, which llama.cpp's gemma3n requires, so llama.cpp loads neither the
  reference's nor ckpt's file of the first: its logits are compared on the second.) Gemma 3n's read back: tests/test_gguf_llm_gemma3n_readback.py.

The vision tower (with more layers than the language model) and the projector are left out as the reference
leaves them out (`ckpt.families.llm.multimodal`).

Oracles: the reference converter (`helpers.hf_llm.reference`, run once per folder for every outtype), llama.cpp
itself (`helpers.llama_ref`: llama-quantize, logits), transformers (the VLM's text-only logits against the read-back
causal LM, loaded strictly).
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from helpers.hf_llm import bpe_hash, read_gguf, reference
from helpers.hf_vlm import causal_lm_logits, gemma3n_folder, text_logits, vlm_folder
from helpers.refusals import assert_refused

CKPT_ONLY = {"ckpt.version", "ckpt.operation"}
MINISTRAL3_YARN = {"rope_type": "yarn", "rope_theta": 1000000.0, "factor": 16.0, "original_max_position_embeddings": 64,
                   "max_position_embeddings": 1024, "beta_fast": 32.0, "beta_slow": 1.0, "mscale_all_dim": 1.0,
                   "mscale": 1.0, "llama_4_scaling_beta": 0.1}
GEMMA3_ROPE = {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
               "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}
# name -> (llama.cpp architecture, the folder (built in `root`), a BPE tokenizer (its pre-tokenizer registered),
#          outtypes compared with the reference (the first: what llama.cpp's logits start from))
MODELS = {
    "mistral3": ("mistral3", lambda root: vlm_folder(root / "mistral3", "mistral3"), False,
                 ("f16", "bf16", "f32", "q8_0")),
    "ministral3": ("mistral3", lambda root: vlm_folder(root / "ministral3", "mistral3", tokenizer="bpe",
                                                       dtype=torch.bfloat16, names="model", model_type="ministral3",
                                                       rope_parameters=MINISTRAL3_YARN), True, ("bf16", "f16", "f32")),
    "gemma3": ("gemma3", lambda root: vlm_folder(root / "gemma3", "gemma3", dtype=torch.bfloat16, extra_vocab=16,
                                                 num_hidden_layers=7, sliding_window=4, rope_parameters=GEMMA3_ROPE),
               False, ("bf16", "f16", "f32")),
    "gemma3n_text": ("gemma3n", lambda root: gemma3n_folder(root / "gemma3n_text"), False, ("f16", "f32")),
    "gemma3n": ("gemma3n", lambda root: gemma3n_folder(root / "gemma3n", vlm=True, dtype=torch.bfloat16,
                                                       num_kv_shared_layers=0), False, ("bf16", "f16")),
}
LLAMA_CPP_LOADS = ["mistral3", "ministral3", "gemma3", "gemma3n"]
IDS = [(i * 37 + 5) % 300 + 6 for i in range(80)]  # past Ministral 3's original context (64): temperature scaling


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """Each VLM folder, its BPE pre-tokenizer registration (or None) and the reference's file per outtype."""
    root = tmp_path_factory.mktemp("vlm")
    out = {}
    for name, (_, build, bpe, outtypes) in MODELS.items():
        f = build(root)
        pre = (bpe_hash(f), "qwen2") if bpe else None
        refs = {t: root / f"{name}-ref-{t}.gguf" for t in outtypes}
        reference(f, refs, pre=pre)
        out[name] = (f, pre, refs)
    return out


@pytest.fixture
def registered(folders, monkeypatch):
    from ckpt.targets.planners import gguf_vocab

    for _, pre, _ in folders.values():
        if pre:
            monkeypatch.setitem(gguf_vocab.PRE_TOKENIZERS, *pre)


def ckpt_gguf(run_ckpt, folder, to, out, *args):
    code, _, err = run_ckpt("convert", folder, "--to", to, "-o", out, "-q", *args)
    assert code == 0, err
    return out


def same_file(ours_path, theirs_path, provenance_replaced=False):
    """Same metadata (keys, order, value types, values) but ckpt's provenance keys, same tensors (names, order,
    types, shapes, bytes)."""
    ours, ours_t = read_gguf(ours_path)
    theirs, theirs_t = read_gguf(theirs_path)
    if provenance_replaced:  # a ckpt GGUF as the source: its provenance keys replaced, not repeated
        theirs = {k: v for k, v in theirs.items() if k not in CKPT_ONLY}
    assert [k for k in ours if k not in CKPT_ONLY] == list(theirs)
    for k in theirs:
        assert ours[k] == theirs[k], (k, str(ours[k])[:200], str(theirs[k])[:200])
    assert [x[:3] for x in ours_t] == [x[:3] for x in theirs_t]
    for a, b in zip(ours_t, theirs_t):
        assert a[3] == b[3], a[0]
    return ours, ours_t


# ---- 1. the reference's file, key for key and byte for byte


@pytest.mark.parametrize("name", list(MODELS))
def test_same_file_as_convert_hf_to_gguf(name, folders, registered, run_ckpt, tmp_path):
    """Every outtype: the text model only (no vision or projector tensor), named, typed and valued as the reference
    writes it, with the same metadata (mistral3's YaRN log multiplier and temperature scale for Ministral 3)."""
    folder, _, refs = folders[name]
    for t, ref in refs.items():
        meta, tensors = same_file(ckpt_gguf(run_ckpt, folder, f"gguf-{t}", tmp_path / f"{t}.gguf"), ref)
        assert not any(n.startswith(("v.", "a.", "mm.")) for n, *_ in tensors), t  # no projector-file tensor
    assert meta["general.architecture"][0] == MODELS[name][0]
    if name == "ministral3":
        assert meta["mistral3.attention.temperature_scale"][0] == pytest.approx(0.1)
        assert meta["mistral3.rope.scaling.yarn_log_multiplier"][0] == 1.0


# ---- 2. K-quant mixes: the reference's BF16 file through llama-quantize, and a GGUF source requantized


@pytest.mark.parametrize("name", ["ministral3", "gemma3", "gemma3n"])
def test_mix_is_llama_quantize_of_the_reference_file(name, folders, registered, run_ckpt, tmp_path):
    """`--to gguf-q4_k_m` of a BF16 VLM is `convert_hf_to_gguf.py --outtype bf16` then `llama-quantize Q4_K_M`; and
    `convert ref-BF16.gguf --to gguf-q4_k_m` is the same llama-quantize run where ckpt reads the architecture back
    (Gemma 3's shifted norms copied as stored through the reader's un-shift)."""
    from helpers import llama_ref

    llama_ref.llama_cpp()
    folder, _, refs = folders[name]
    llama_ref.quantize_gguf(refs["bf16"], tmp_path / "ref.gguf", "MOSTLY_Q4_K_M")
    same_file(ckpt_gguf(run_ckpt, folder, "gguf-q4_k_m", tmp_path / "ckpt.gguf"), tmp_path / "ref.gguf")
    if MODELS[name][0] != "gemma3n":
        same_file(ckpt_gguf(run_ckpt, refs["bf16"], "gguf-q4_k_m", tmp_path / "from-gguf.gguf"),
                  tmp_path / "ref.gguf")


# ---- 3. llama.cpp runs ckpt's file as it runs the reference's


@pytest.mark.parametrize("name", LLAMA_CPP_LOADS)
def test_llama_cpp_logits_match_the_reference_file(name, folders, registered, run_ckpt, tmp_path):
    from helpers import llama_ref

    llama_ref.llama_cpp()
    folder, _, refs = folders[name]
    t = next(iter(refs))
    ours = ckpt_gguf(run_ckpt, folder, f"gguf-{t}", tmp_path / "ckpt.gguf")
    a = llama_ref.logits(ours, IDS, n_ctx=128)
    b = llama_ref.logits(refs[t], IDS, n_ctx=128)
    assert np.array_equal(a, b)


# ---- 4. read back: the text model's causal LM, with the VLM's text-only logits


@pytest.mark.parametrize("name,to,hf_class", [("mistral3", "fp32", "MistralForCausalLM"),
                                              ("ministral3", "bf16", "Ministral3ForCausalLM"),
                                              ("gemma3", "fp32", "Gemma3ForCausalLM")])
def test_read_back_is_the_text_models_causal_lm(name, to, hf_class, folders, registered, run_ckpt, tmp_path):
    """The f32 GGUF -> `--to fp32|bf16` folder loads strictly in transformers as the text config's causal LM and
    gives the VLM's text-only logits: equal (an fp32 model through F32; a BF16 one back to BF16; Gemma's norms
    read back as stored - 1, which the RMSNorm's 1 + w makes exact again); atol 1e-5 stands for fp32 rounding."""
    folder, _, refs = folders[name]
    back = tmp_path / "back"
    code, _, err = run_ckpt("convert", refs["f32"], "--to", to, "-o", back, "-q")
    assert code == 0, err
    got_class, got = causal_lm_logits(back, IDS)
    assert got_class == hf_class
    want = text_logits(folder, IDS)
    n_vocab = json.loads((back / "config.json").read_text())["vocab_size"]
    assert torch.allclose(got, want[:, :n_vocab], rtol=0, atol=1e-5), (got - want[:, :n_vocab]).abs().max()


# ---- 5. refusals: one line, exit 2, nothing written


def _edited(src, dst, **text):
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["text_config"].update(text)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_refusals(folders, registered, run_ckpt, tmp_path):
    """A text config that disagrees with the language model's tensors names both (the vision tower's 3 layers are
    not the language model's blocks); variants the reference cannot convert (a mistral4 text model, which it
    converts as DeepSeek-V2; a ministral3 one without YaRN, which it asserts; Gemma 3n with other than 4 AltUp
    inputs) are refused by name."""
    mistral3, _, _ = folders["mistral3"]
    gemma3, _, _ = folders["gemma3"]
    ministral3, _, _ = folders["ministral3"]
    gemma3n, _, _ = folders["gemma3n"]
    for args, culprit, problem in (
            (_edited(gemma3n, tmp_path / "altup", altup_num_inputs=3), "config.json",
             "altup_num_inputs is 3, not the 4 llama.cpp's converter supports"),
            (_edited(gemma3n, tmp_path / "perlayer", hidden_size_per_layer_input=128), "config.json",
             "hidden_size_per_layer_input x num_hidden_layers is 128 x 4 = 512 but model.embed_tokens_per_layer.weight"
             " is [320, 1024]"),
            (_edited(gemma3n, tmp_path / "ff", intermediate_size=[256, 256, 256]), "config.json",
             "intermediate_size is [256, 256, 256], 3 values for the 4 layers of num_hidden_layers"),
            (_edited(mistral3, tmp_path / "fflist", intermediate_size=[512, 512]), "config.json",
             "intermediate_size is [512, 512], not an integer from 1 to 2^32 - 1 (a list is per-layer sizes, which a "
             "mistral3 GGUF does not have)"),
            (_edited(mistral3, tmp_path / "layers", num_hidden_layers=3), "config.json",
             "num_hidden_layers is 3 but the weights hold 2 blocks"),
            (_edited(gemma3, tmp_path / "heads", num_attention_heads=8), "config.json",
             "num_attention_heads x head_dim is 8 x 64 = 512 but model.layers.0.self_attn.o_proj.weight has 256 "
             "columns"),
            (_edited(mistral3, tmp_path / "m4", model_type="mistral4"), "config.json",
             "with a mistral4 text model"),
            (_edited(ministral3, tmp_path / "noyarn", rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
             "config.json", "has rope_type 'default', not the 'yarn'")):
        assert_refused(run_ckpt, tmp_path, ("convert", args, "--to", "gguf-f16", "-o", tmp_path / "x.gguf"),
                       str(args / culprit), problem)
