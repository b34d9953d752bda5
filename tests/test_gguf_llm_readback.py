"""`ckpt convert X.gguf --to fp32|bf16 -o DIR` of the llama.cpp GGUFs of the 2024 architectures: Mixtral (`llama`
with experts), Qwen3-MoE (`qwen3moe`), Gemma 2 (`gemma2`), Phi-3 (`phi3`) and Gemma 3 (`gemma3`), read back as the
transformers model they were converted from (`LLMArch.read_config` / `read_tensor` in `ckpt/families/llm/archs/`).

Oracles: transformers itself (the read-back folder loads with `from_pretrained` with no missing, unexpected or
mismatched key, and computes the original model's logits), the original folder's tensors, and llama.cpp's own
converter (`helpers.hf_llm.reference`), whose file reads back as ckpt's does.

The models are tiny random ones built here (`helpers.hf_llm.model_folder`), FP32, as the released models are where
the GGUF cannot say otherwise: Gemma 2 with tied embeddings (llama.cpp's converter leaves lm_head out and ties it),
Qwen3-MoE with `norm_topk_prob` (llama.cpp's qwen3moe always renormalizes the chosen experts). Small sliding
windows, a Phi-3 long-rope model and an input longer than its original context make the windows, the layer
pattern and the long RoPE factors count in the logits.

Tolerance: the read-back model is the original's weights in the same float32 model, so its logits equal the
original's within 1e-6 of the largest (fp32 rounding; they are equal bit for bit on this machine); from a BF16 GGUF
they equal those of the original with its weights rounded to bf16.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from helpers.hf_llm import bpe_hash, model_folder, reference
from helpers.refusals import assert_refused

PHI3_LONGROPE = {"rope_type": "longrope", "rope_theta": 10000.0, "long_factor": [1.0 + i / 8 for i in range(32)],
                 "short_factor": [1.0 + i / 64 for i in range(32)]}
# name -> (HF kind, tokenizer, config overrides, config.json keys the read-back config must have as the original)
MODELS = {
    "mixtral": ("mixtral", "spm", {}, ("num_local_experts", "num_experts_per_tok", "sliding_window")),
    "qwen3_moe": ("qwen3_moe", "bpe", dict(norm_topk_prob=True),
                  ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob", "head_dim",
                   "decoder_sparse_step", "use_sliding_window")),
    "gemma2": ("gemma2", "spm", dict(tie_word_embeddings=True, sliding_window=4),
               ("sliding_window", "layer_types", "attn_logit_softcapping", "final_logit_softcapping",
                "query_pre_attn_scalar", "hidden_activation", "head_dim", "pad_token_id")),
    "phi3": ("phi3", "spm", dict(rope_parameters=PHI3_LONGROPE, max_position_embeddings=512, sliding_window=48),
             ("rope_parameters", "original_max_position_embeddings", "sliding_window", "pad_token_id")),
    "gemma3": ("gemma3", "spm", dict(vocab_size=384, sliding_window=4),
               ("sliding_window", "layer_types", "query_pre_attn_scalar", "final_logit_softcapping", "head_dim",
                "vocab_size")),
}
IDS = [1] + [(i * 37 + 11) % 317 + 3 for i in range(159)]  # 160 tokens: past the windows and Phi-3's 128 context


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    out = {}
    for name, (kind, tok, cfg, _) in MODELS.items():
        f = model_folder(root / name, kind, tokenizer=tok, dtype=torch.float32, **cfg)
        out[name] = (f, (bpe_hash(f), "qwen2") if tok == "bpe" else None)
    return out


@pytest.fixture
def registered(folders, monkeypatch):
    """The test BPE vocabulary's hash in ckpt's pre-tokenizer table, under llama.cpp's `qwen2`."""
    from ckpt.targets.planners import gguf_vocab

    for _, pre in folders.values():
        if pre:
            monkeypatch.setitem(gguf_vocab.PRE_TOKENIZERS, *pre)


def to_gguf(run_ckpt, folder, out, outtype="f32"):
    code, _, err = run_ckpt("convert", folder, "--to", f"gguf-{outtype}", "-o", out, "-q")
    assert code == 0, err
    return out


def read_back(run_ckpt, gguf_file, out, to="fp32"):
    """`convert X.gguf --to fp32|bf16`; its notes."""
    code, stdout, err = run_ckpt("convert", gguf_file, "--to", to, "-o", out)
    assert code == 0, err
    return stdout + err


def logits(folder, weights_dtype=torch.float32):
    """transformers' float32 logits of IDS (with the weights rounded to `weights_dtype` first)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():  # (the weights only: the RoPE frequencies stay float32)
            p.copy_(p.to(weights_dtype))
        return model(torch.tensor([IDS])).logits[0]


def loads_strictly(folder, original):
    """The read-back folder as transformers loads it: the original's class, no missing, unexpected or mismatched
    key; returns the model."""
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(folder, output_loading_info=True, dtype=torch.float32)
    assert type(model).__name__ == json.loads((original / "config.json").read_text())["architectures"][0]
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs")), info
    return model


def as_stored(name, key, v):
    """An original FP32 tensor as it reads back from an F32 GGUF: itself, but Gemma's norms, which the converter
    stores + 1 in float32 and the reader takes 1 off again (float32 rounding of that sum)."""
    return (v + 1.0) - 1.0 if name.startswith("gemma") and key.endswith("norm.weight") else v


def same_logits(ours, theirs):
    assert ours.shape == theirs.shape
    assert (ours - theirs).abs().max() <= 1e-6 * theirs.abs().max(), (ours - theirs).abs().max()


# ---- 1. ckpt's F32 file: the original's tensors, config and logits


@pytest.mark.parametrize("name", list(MODELS))
def test_read_back_loads_strictly_with_the_original_logits(name, folders, registered, run_ckpt, tmp_path):
    """The f32 file ckpt writes reads back as the original folder's tensors (the stacked experts one per expert,
    Gemma's norms less the converter's + 1, Phi-3's fused projections as they were; exact but for the float32
    rounding of Gemma's norm + 1 - 1), and a config.json whose
    model class loads them strictly, with the keys that shape the computation as the original's (the MoE keys, the
    sliding windows and their layers, the softcappings and query scale, Phi-3's long-rope parameters) and the
    original's logits."""
    from safetensors.torch import load_file
    from transformers import AutoConfig

    folder, _ = folders[name]
    to_gguf(run_ckpt, folder, tmp_path / "m.gguf")
    notes = read_back(run_ckpt, tmp_path / "m.gguf", tmp_path / "back")
    back = load_file(tmp_path / "back" / "model.safetensors")
    sd = load_file(folder / "model.safetensors")
    assert set(back) == set(sd)
    for k, v in sd.items():
        assert torch.equal(back[k], as_stored(name, k, v)), k
    model = loads_strictly(tmp_path / "back", folder)
    want = AutoConfig.from_pretrained(folder)
    for key in MODELS[name][3]:
        assert getattr(model.config, key) == getattr(want, key), (key, getattr(model.config, key),
                                                                   getattr(want, key))
    with torch.no_grad():
        ours = model(torch.tensor([IDS])).logits[0]
    same_logits(ours, logits(folder))
    if name in ("mixtral", "qwen3_moe"):  # the keys the GGUF does not record, said
        assert "note: config.json " + ("sliding_window: none" if name == "mixtral" else "norm_topk_prob: true") in notes


# ---- 2. llama.cpp's own files read back the same


@pytest.fixture(scope="module")
def refs(folders, tmp_path_factory):
    """convert_hf_to_gguf.py's f32 file of every folder, and its bf16 file of Mixtral's (one run per folder)."""
    root = tmp_path_factory.mktemp("ref")
    out = {}
    for name, (folder, pre) in folders.items():
        files = {t: root / f"{name}-{t}.gguf" for t in (("f32", "bf16") if name == "mixtral" else ("f32",))}
        reference(folder, files, pre=pre)
        out[name] = files
    return out


@pytest.mark.parametrize("name", list(MODELS))
def test_the_reference_s_file_reads_back_as_the_original(name, folders, refs, run_ckpt, tmp_path):
    from safetensors.torch import load_file

    folder, _ = folders[name]
    read_back(run_ckpt, refs[name]["f32"], tmp_path / "back")
    back = load_file(tmp_path / "back" / "model.safetensors")
    sd = load_file(folder / "model.safetensors")
    assert set(back) == set(sd) and all(torch.equal(back[k], as_stored(name, k, v)) for k, v in sd.items())
    loads_strictly(tmp_path / "back", folder)
    same_logits(logits(tmp_path / "back"), logits(folder))


def test_a_bf16_file_reads_back_as_bf16(folders, refs, run_ckpt, tmp_path):
    """The reference's BF16 Mixtral `--to bf16`: the original's tensors rounded to bf16 (the router and norms,
    which the reference keeps F32, too), and the logits of the original with its weights so rounded."""
    from safetensors.torch import load_file

    folder, _ = folders["mixtral"]
    read_back(run_ckpt, refs["mixtral"]["bf16"], tmp_path / "back", to="bf16")
    back = load_file(tmp_path / "back" / "model.safetensors")
    sd = load_file(folder / "model.safetensors")
    assert set(back) == set(sd)
    for k, v in sd.items():
        assert back[k].dtype == torch.bfloat16 and torch.equal(back[k], v.to(torch.bfloat16)), k
    loads_strictly(tmp_path / "back", folder)
    same_logits(logits(tmp_path / "back"), logits(folder, torch.bfloat16))


# ---- 3. Phi-3's attention factor


def _patched(src, dst, key, value):
    """A copy of a GGUF with one scalar metadata value changed in place (its type kept)."""
    import gguf

    shutil.copy(src, dst)
    r = gguf.GGUFReader(str(dst), "r+")
    f = r.fields[key]
    f.parts[f.data[0]][0] = value
    del r
    return dst


def test_phi3_attention_factor_that_is_not_the_derived_one_goes_into_the_config(folders, run_ckpt, tmp_path):
    """A Phi-3 whose longrope attention factor is not the one transformers derives (its config.json sets
    `attention_factor`, which llama.cpp's converter does not read: the file's key is patched to it, as a converter
    that did would write it) reads back with that factor in rope_parameters, computing that model's logits."""
    folder, _ = folders["phi3"]
    own = tmp_path / "phi3-af"
    shutil.copytree(folder, own)
    cfg = json.loads((own / "config.json").read_text())
    cfg["rope_parameters"]["attention_factor"] = 1.25
    (own / "config.json").write_text(json.dumps(cfg))
    to_gguf(run_ckpt, folder, tmp_path / "m.gguf")
    bad = _patched(tmp_path / "m.gguf", tmp_path / "af.gguf", "phi3.rope.scaling.attn_factor", 1.25)
    notes = read_back(run_ckpt, bad, tmp_path / "back")
    assert "attention_factor 1.25 from phi3.rope.scaling.attn_factor" in notes
    model = loads_strictly(tmp_path / "back", folder)
    assert model.config.rope_parameters["attention_factor"] == 1.25
    with torch.no_grad():
        ours = model(torch.tensor([IDS])).logits[0]
    same_logits(ours, logits(own))
    assert (ours - logits(folder)).abs().max() > 1e-3  # the factor counts


# ---- 4. refusals: metadata that disagrees with the tensors, one line, exit 2, nothing written


CASES = {
    "mixtral": ("llama.expert_count", 8, "metadata 'llama.expert_count' is 8, but blk.0.ffn_"),
    "qwen3_moe": ("qwen3moe.expert_feed_forward_length", 128,
                  "metadata 'qwen3moe.expert_feed_forward_length' is 128, but blk.0.ffn_"),
    "gemma2": ("gemma2.attention.key_length", 128, "metadata 'gemma2.attention.key_length' is 128, but the q rows "
                                                   "give heads of 64"),
    "phi3": ("phi3.attention.head_count_kv", 1, "metadata 'phi3.attention.head_count_kv' is 1, but "
                                                "blk.0.attn_qkv.weight is [512, 256], not 4 query + 2 x 1 key/value "
                                                "heads of 64"),
    "gemma3": ("gemma3.attention.key_length", 128, "metadata 'gemma3.attention.key_length' is 128, but the q rows "
                                                   "give heads of 64"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_read_back_refuses_metadata_that_disagrees_with_the_tensors(name, folders, registered, run_ckpt, tmp_path):
    folder, _ = folders[name]
    key, value, problem = CASES[name]
    src = to_gguf(run_ckpt, folder, tmp_path / "m.gguf", "f16")
    bad = _patched(src, tmp_path / "bad.gguf", key, value)
    assert_refused(run_ckpt, tmp_path, ("convert", bad, "--to", "fp32", "-o", tmp_path / "out"), str(bad), problem)
