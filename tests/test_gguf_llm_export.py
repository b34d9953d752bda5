"""`ckpt convert ./my-llm --to gguf-<type>`: Hugging Face causal LM folders as llama.cpp GGUFs
(`ckpt.targets.planners.gguf_llm_out`, `ckpt.targets.planners.gguf_vocab`), held to llama.cpp's own converter.

Oracles: llama.cpp's `convert_hf_to_gguf.py` (llama-cpp-python 0.3.36's vendored tree, run in a subprocess with
its own gguf-py: `helpers.hf_llm.reference`), transformers' GGUF loader (weights and tokenizer), ckpt's own
GGUF -> HF reader, and llama.cpp itself through llama-cpp-python where it imports (`helpers.llama_ref`).

The models are tiny random ones built here (`helpers.hf_llm`) with real tokenizers trained here: a SentencePiece
model (Llama, Mistral) and byte-level BPE tokenizer.json files (Qwen2, Qwen3, a Llama 3 style one). A BPE
vocabulary's `tokenizer.ggml.pre` is looked up by the hash of its token ids for a check text, and a tokenizer
trained here is in neither table: the tests register its hash under a real pre-tokenizer name for both ckpt
(monkeypatching `gguf_vocab.PRE_TOKENIZERS`) and the reference (its `get_vocab_base_pre` wrapped in the driver
script `helpers.hf_llm.reference` writes).

Metadata: every key and value (and value type, and key order) is the reference's; ckpt only adds `ckpt.version`
and `ckpt.operation` (its provenance, as in every GGUF ckpt writes). The `general.*` keys agree too: both come
from gguf's `Metadata.load` over the same folder.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from helpers.hf_llm import SAMPLES, bpe_hash, model_folder, read_gguf, reference
from helpers.refusals import assert_refused

CKPT_ONLY = {"ckpt.version", "ckpt.operation"}
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
PHI3_LONGROPE = {"rope_type": "longrope", "rope_theta": 10000.0, "long_factor": [1.0 + i / 8 for i in range(32)],
                 "short_factor": [1.0 + i / 64 for i in range(32)]}
# name -> (HF kind, tokenizer, source dtype, config overrides, pre-tokenizer name registered for a BPE vocabulary
#          (the BPE tokenizers are one trained tokenizer, so one hash and one name),
#          outtypes compared with the reference)
MODELS = {
    "llama": ("llama", "spm", torch.float32, {}, None, ("f16", "q8_0", "bf16", "f32")),
    "mistral": ("mistral", "spm", torch.bfloat16, {}, None, ("f16",)),
    "llama3": ("llama", "bpe", torch.float32, dict(rope_parameters=LLAMA3_ROPE, tie_word_embeddings=True),
               "qwen2", ("f16",)),
    "qwen2": ("qwen2", "bpe", torch.float32, {}, "qwen2", ("f16", "q8_0")),
    "qwen3": ("qwen3", "bpe", torch.bfloat16, dict(tie_word_embeddings=True, head_dim=128), "qwen2",
              ("bf16", "q8_0", "f16")),
    "gemma2": ("gemma2", "spm", torch.bfloat16, {}, None, ("f16", "q8_0")),
    "gemma3": ("gemma3", "spm", torch.float16, {}, None, ("f16", "bf16")),
    "phi3": ("phi3", "spm", torch.float32, dict(rope_parameters=PHI3_LONGROPE, max_position_embeddings=512),
             None, ("f16", "q8_0")),
    "mixtral": ("mixtral", "spm", torch.bfloat16, {}, None, ("f16", "q8_0")),
    "qwen3_moe": ("qwen3_moe", "bpe", torch.float32, {}, "qwen2", ("f16", "q8_0")),
}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    out = {}
    for name, (kind, tok, dtype, cfg, pre, _) in MODELS.items():
        f = model_folder(root / name, kind, tokenizer=tok, dtype=dtype, **cfg)
        out[name] = (f, (bpe_hash(f), pre) if pre else None)
    return out


@pytest.fixture
def registered(folders, monkeypatch):
    """The test BPE vocabularies' hashes in ckpt's pre-tokenizer table."""
    from ckpt.targets.planners import gguf_vocab

    for _, pre in folders.values():
        if pre:
            monkeypatch.setitem(gguf_vocab.PRE_TOKENIZERS, *pre)


def ckpt_gguf(run_ckpt, folder, outtype, out):
    code, _, err = run_ckpt("convert", folder, "--to", f"gguf-{outtype}", "-o", out, "-q")
    assert code == 0, err
    return out


def original(folder) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(folder / "model.safetensors")


# ---- 1. the reference's file, key for key and byte for byte


@pytest.mark.slow
@pytest.mark.parametrize("name", list(MODELS))
def test_same_file_as_convert_hf_to_gguf(name, folders, registered, run_ckpt, tmp_path):
    """Every outtype of the reference for this model: same metadata (keys, value types, values, order) but ckpt's
    two provenance keys, and the same tensors (names, order, types, shapes, bytes)."""
    folder, pre = folders[name]
    outtypes = MODELS[name][5]
    reference(folder, {t: tmp_path / f"ref-{t}.gguf" for t in outtypes}, pre=pre)
    for t in outtypes:
        ours, _ = read_gguf(ckpt_gguf(run_ckpt, folder, t, tmp_path / f"ckpt-{t}.gguf"))
        theirs, _ = read_gguf(tmp_path / f"ref-{t}.gguf")
        assert set(ours) - set(theirs) == CKPT_ONLY and set(theirs) <= set(ours), (t, set(ours) ^ set(theirs))
        assert [k for k in ours if k not in CKPT_ONLY] == list(theirs), t
        for k in theirs:
            assert ours[k] == theirs[k], (t, k, str(ours[k])[:200], str(theirs[k])[:200])
        _, ours_t = read_gguf(tmp_path / f"ckpt-{t}.gguf")
        _, theirs_t = read_gguf(tmp_path / f"ref-{t}.gguf")
        assert [x[:3] for x in ours_t] == [x[:3] for x in theirs_t], t
        for a, b in zip(ours_t, theirs_t):
            assert a[3] == b[3], (t, a[0])


def test_llama_specifics_in_the_file(folders, registered, run_ckpt, tmp_path):
    """Without the reference: llama's q/k rows permuted per head, tied embeddings without output.weight, Llama 3
    RoPE factors as rope_freqs.weight, norms F32, the Llama 3 tokenizer as gpt2 BPE with merges."""
    folder, _ = folders["llama3"]
    meta, tensors = read_gguf(ckpt_gguf(run_ckpt, folder, "f32", tmp_path / "a.gguf"))
    by_name = {n: (t, s, b) for n, t, s, b in tensors}
    assert tensors[0][0] == "rope_freqs.weight" and "output.weight" not in by_name
    assert meta["tokenizer.ggml.model"][0] == "gpt2" and meta["tokenizer.ggml.pre"][0] == "qwen2"
    assert len(meta["tokenizer.ggml.merges"][0]) > 10
    assert by_name["blk.0.attn_norm.weight"][0] == "F32"
    sd = original(folder)
    q = sd["model.layers.0.self_attn.q_proj.weight"]
    hd = q.shape[0] // 4
    want = q.reshape(4, 2, hd // 2, -1).transpose(1, 2).reshape(q.shape)
    got = torch.from_numpy(np.frombuffer(by_name["blk.0.attn_q.weight"][2], dtype=np.float32).copy()).reshape(q.shape)
    assert torch.equal(got, want)


# ---- 2. round trips


@pytest.mark.parametrize("name", ["llama", "qwen2", "qwen3"])
def test_round_trip_through_transformers_and_ckpt(name, folders, registered, run_ckpt, tmp_path):
    """The f32 file loads in transformers' GGUF loader and back through ckpt's own GGUF -> HF reader with every
    original tensor exact; the f16 file within fp16 rounding; the GGUF tokenizer gives the original's ids."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, _ = folders[name]
    sd = original(folder)
    ckpt_gguf(run_ckpt, folder, "f32", tmp_path / "m-f32.gguf")
    model = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="m-f32.gguf", dtype=torch.float32)
    loaded = model.state_dict()
    for k, v in sd.items():
        assert torch.equal(loaded[k], v.float()), k
    code, _, err = run_ckpt("convert", tmp_path / "m-f32.gguf", "--to", "fp32", "-o", tmp_path / "back", "-q")
    assert code == 0, err
    back = load_file(tmp_path / "back" / "model.safetensors")
    assert set(back) == set(sd)
    for k, v in sd.items():
        assert torch.equal(back[k], v.float()), k

    ckpt_gguf(run_ckpt, folder, "f16", tmp_path / "m-f16.gguf")
    code, _, err = run_ckpt("convert", tmp_path / "m-f16.gguf", "--to", "fp32", "-o", tmp_path / "back16", "-q")
    assert code == 0, err
    back = load_file(tmp_path / "back16" / "model.safetensors")
    for k, v in sd.items():
        want = v.float() if v.dim() == 1 else v.to(torch.float16).float()
        assert torch.equal(back[k], want), k

    ours = AutoTokenizer.from_pretrained(tmp_path, gguf_file="m-f32.gguf")
    theirs = AutoTokenizer.from_pretrained(folder)
    for s in SAMPLES:  # the text's own ids (whether BOS is added is the file's add_bos_token, the reference's)
        assert ours.encode(s, add_special_tokens=False) == theirs.encode(s, add_special_tokens=False), s


# ---- 3. llama.cpp runs it as it runs the reference's file


@pytest.mark.slow
@pytest.mark.parametrize("name,outtype", [("llama", "f16"), ("qwen2", "q8_0"), ("qwen3", "bf16")])
def test_llama_cpp_logits_match_the_reference_file(name, outtype, folders, registered, run_ckpt, tmp_path):
    from helpers import llama_ref

    llama_ref.llama_cpp()  # skips, saying why, where llama-cpp-python does not import
    folder, pre = folders[name]
    reference(folder, {outtype: tmp_path / "ref.gguf"}, pre=pre)
    ckpt_gguf(run_ckpt, folder, outtype, tmp_path / "ckpt.gguf")
    ids = [1, 5, 17, 42, 99, 3, 250, 7]
    a = llama_ref.logits(tmp_path / "ckpt.gguf", ids)
    b = llama_ref.logits(tmp_path / "ref.gguf", ids)
    assert np.array_equal(a, b)


# ---- 4. refusals: one line, exit 2, nothing written, inputs unchanged


def _copy(src, dst, drop=()):
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns(*drop) if drop else None)
    return dst


def test_refusals(folders, run_ckpt, tmp_path, monkeypatch):
    from ckpt.targets.planners import gguf_vocab

    llama, _ = folders["llama"]
    qwen, pre = folders["qwen2"]
    monkeypatch.delitem(gguf_vocab.PRE_TOKENIZERS, pre[0], raising=False)

    odd = _copy(llama, tmp_path / "odd")
    cfg = json.loads((odd / "config.json").read_text())
    cfg["architectures"] = ["GPTNeoXForCausalLM"]
    (odd / "config.json").write_text(json.dumps(cfg))
    assert_refused(run_ckpt, tmp_path, ("convert", odd, "--to", "gguf-f16"), str(odd),
                   "architecture 'GPTNeoXForCausalLM' cannot be written as a llama.cpp GGUF")

    bare = _copy(llama, tmp_path / "bare", drop=("tokenizer*", "special_tokens_map.json"))
    assert_refused(run_ckpt, tmp_path, ("convert", bare, "--to", "gguf-q8_0"), str(bare),
                   "no tokenizer (tokenizer.model or tokenizer.json)")

    unknown = _copy(qwen, tmp_path / "unknown")
    assert_refused(run_ckpt, tmp_path, ("convert", unknown, "--to", "gguf-f16"), str(unknown),
                   f"BPE pre-tokenizer not recognized (check-text hash {pre[0]})")

    from safetensors.torch import load_file, save_file

    fused = _copy(folders["qwen3_moe"][0], tmp_path / "fused")
    sd = load_file(fused / "model.safetensors")
    for w in ("gate_proj", "up_proj", "down_proj"):
        sd[f"model.layers.0.mlp.experts.{w}"] = torch.stack([sd.pop(f"model.layers.0.mlp.experts.{x}.{w}.weight")
                                                             for x in range(4)])
    save_file(sd, fused / "model.safetensors")
    assert_refused(run_ckpt, tmp_path, ("convert", fused, "--to", "gguf-f16"), str(fused / "model.safetensors"),
                   "expert tensor 'model.layers.0.mlp.experts.down_proj' is not one expert's matrix")

    noconfig = _copy(llama, tmp_path / "noconfig", drop=("config.json",))
    code, out, err = run_ckpt("convert", noconfig, "--to", "gguf-f16")
    assert code == 2 and err.count("\n") == 1 and err.startswith("error: "), err


# ---- 5. K-quant and IQ mixes: the reference's file through llama-quantize


@pytest.mark.slow
@pytest.mark.parametrize("name,mix,pure", [("mistral", "q4_k_m", False), ("qwen3", "q5_k_s", False),
                                           ("qwen3", "iq4_xs", False), ("mistral", "q3_k_m", True),
                                           ("gemma2", "q4_k_m", False), ("mixtral", "q4_k_m", False)])
def test_mix_is_llama_quantize_of_the_reference_file(name, mix, pure, folders, registered, run_ckpt, tmp_path):
    """`--to gguf-<mix>` of a BF16 model is `convert_hf_to_gguf.py --outtype bf16` then `llama-quantize <MIX>`
    (`--pure`): the same tensors in llama-quantize's order (block, then name), types and bytes, and the same
    metadata (llama-quantize keeps every key and sets general.file_type), ckpt's provenance keys aside. (From
    an F32 model ckpt quantizes the F32 values, where the two-step route rounds them to F16 first.)"""
    from helpers import llama_ref

    from ckpt.targets.planners.gguf_mixes import mix as mix_of

    llama_ref.llama_cpp()
    folder, pre = folders[name]
    reference(folder, {"bf16": tmp_path / "ref-bf16.gguf"}, pre=pre)
    llama_ref.quantize_gguf(tmp_path / "ref-bf16.gguf", tmp_path / "ref.gguf", mix_of(mix).ftype, pure=pure)
    args = ("--pure",) if pure else ()
    code, _, err = run_ckpt("convert", folder, "--to", f"gguf-{mix}", "-o", tmp_path / "ckpt.gguf", "-q", *args)
    assert code == 0, err
    ours, ours_t = read_gguf(tmp_path / "ckpt.gguf")
    theirs, theirs_t = read_gguf(tmp_path / "ref.gguf")
    assert [x[:3] for x in ours_t] == [x[:3] for x in theirs_t]
    for a, b in zip(ours_t, theirs_t):
        assert a[3] == b[3], a[0]
    assert [k for k in ours if k not in CKPT_ONLY] == list(theirs)
    for k in theirs:
        assert ours[k] == theirs[k], (k, str(ours[k])[:200], str(theirs[k])[:200])


# ---- 6. a llama.cpp GGUF as the source: llama-quantize


@pytest.mark.slow
@pytest.mark.parametrize("name,mix", [("llama", "q4_k_m"), ("qwen3", "q6_k"), ("qwen2", "q5_k_m")])
def test_gguf_source_is_llama_quantize(name, mix, folders, registered, run_ckpt, tmp_path):
    """`convert model-F16.gguf --to gguf-<mix>` is `llama-quantize model-F16.gguf <MIX>`: same tensors (order, types,
    bytes: unquantized ones copied) and metadata; ckpt's own provenance keys replaced, not repeated. An already
    quantized file is not requantized into another type (llama-quantize's --allow-requantize)."""
    from helpers import llama_ref

    from ckpt.targets.planners.gguf_mixes import mix as mix_of

    llama_ref.llama_cpp()
    folder, _ = folders[name]
    src = ckpt_gguf(run_ckpt, folder, "f16", tmp_path / "m-F16.gguf")
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
    assert ours["ckpt.operation"][0] == f"convert --to gguf-{mix}"
    assert_refused(run_ckpt, tmp_path, ("convert", tmp_path / "ckpt.gguf", "--to", "gguf-q8_0"),
                   str(tmp_path / "ckpt.gguf"), "requantizing it as Q8_0 loses precision twice")


# ---- 7. merge-lora --to gguf-*: a PEFT LoRA merged on the way, into an HF base or a GGUF base


def test_merge_lora_into_hf_and_gguf_bases(folders, run_ckpt, tmp_path):
    """PEFT's merge_and_unload is the oracle: the merged model written as a GGUF from the HF base (f32: exact) and
    from the F16 GGUF base (the changed tensors re-permuted and re-encoded, the others copied as stored) reads back
    as PEFT's merged weights."""
    from peft import LoraConfig, get_peft_model
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    folder, _ = folders["llama"]
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    torch.manual_seed(1)
    peft = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "down_proj"],
                                            init_lora_weights=False))
    peft.save_pretrained(tmp_path / "lora")
    merged = {k: v.detach().clone() for k, v in peft.merge_and_unload().state_dict().items()}
    base16 = ckpt_gguf(run_ckpt, folder, "f16", tmp_path / "base-F16.gguf")
    for base, to, tol in ((folder, "gguf-f32", 0.0), (base16, "gguf-f16", 2e-3)):
        out = tmp_path / f"merged-{to}.gguf"
        code, _, err = run_ckpt("merge-lora", base, tmp_path / "lora", "--to", to, "-o", out, "-q")
        assert code == 0, err
        code, _, err = run_ckpt("convert", out, "--to", "fp32", "-o", tmp_path / f"back-{to}", "-q")
        assert code == 0, err
        back = load_file(tmp_path / f"back-{to}" / "model.safetensors")
        assert set(back) == set(merged)
        for k, v in merged.items():
            err = (back[k] - v).abs().max().item() / max(v.abs().max().item(), 1e-9)
            assert err <= tol, (to, k, err)


def test_a_qwen3_moe_with_a_sentencepiece_model_takes_the_bpe_vocabulary_as_the_reference_does(tmp_path, run_ckpt,
                                                                                                   capsys):
    """Qwen2MoeModel is a TextModel, not a Qwen2Model: its set_vocab is BPE from tokenizer.json whatever
    tokenizer.model says, so a vocabulary llama.cpp has no pre-tokenizer for fails there, and is refused here in one
    line (ckpt once wrote the SentencePiece vocabulary for it, a file the reference never makes)."""
    folder = model_folder(tmp_path / "q3m", "qwen3_moe", tokenizer="spm", dtype=torch.float32)
    capsys.readouterr()  # transformers' progress bar while saving
    with pytest.raises(AssertionError, match="BPE pre-tokenizer was not recognized"):
        reference(folder, {"f16": tmp_path / "ref.gguf"})
    assert_refused(run_ckpt, tmp_path, ("convert", folder, "--to", "gguf-f16", "-o", tmp_path / "o.gguf"), str(folder),
                   "BPE pre-tokenizer not recognized")
