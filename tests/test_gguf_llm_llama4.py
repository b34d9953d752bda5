"""Llama 4 as llama.cpp's `llama4` (`ckpt.families.llm.archs.llama4`): `ckpt convert FOLDER --to gguf-*` of a
`Llama4ForConditionalGeneration` folder (its text model; the vision tower and projector left out, as
convert_hf_to_gguf.py leaves them without --mmproj) and of a `Llama4ForCausalLM`, and the GGUF read back.

Oracles: llama.cpp's `convert_hf_to_gguf.py` (llama-cpp-python 0.3.36's vendored tree, `helpers.hf_llm.reference`)
for every key, value, tensor name, type and byte; its `llama-quantize` for the Q4_K_M mix of the reference's BF16
file; llama.cpp itself (`helpers.llama_ref.logits`) for the logits of ckpt's file against the reference's;
transformers for the read back folder (loaded strictly, logits against the original model's).

Tiny random models (`helpers.llama4_llm`): a float32 conditional-generation folder with interleaved dense and
MoE layers and Llama 3 RoPE scaling with a smoothed band; a bfloat16 causal LM with MoE in every layer, two
experts per token and Llama 4 Scout's RoPE scaling (equal low and high frequency factors); a causal LM with only
full attention (MobileLLM's variant: the `sliding_window` 0 the reference writes for it, a file llama.cpp
0c1e57098 aborts evaluating, so it has no logits test). Their BPE vocabulary's pre-tokenizer hash is registered as
`qwen2` for both ckpt and the reference, as in tests/test_gguf_llm_export.py.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from helpers.hf_llm import bpe_hash, read_gguf, reference
from helpers.llama4_llm import SCOUT_ROPE, edited_gguf, llama4_folder, text_logits
from helpers.refusals import assert_refused

CKPT_ONLY = {"ckpt.version", "ckpt.operation"}
IDS = [1, 5, 17, 42, 99, 3, 250, 7, 64, 128]
# name -> (kind, source dtype, text config overrides, outtypes compared with the reference)
MODELS = {
    "conditional": ("conditional", torch.float32, {}, ("f16", "bf16", "f32", "q8_0")),
    "causal": ("causal", torch.bfloat16, dict(rope_parameters=dict(SCOUT_ROPE), interleave_moe_layer_step=1,
                                              num_experts_per_tok=2), ("bf16", "f16")),
    "full_attention": ("causal", torch.float32, dict(attention_chunk_size=None, no_rope_layers=[1, 1, 1, 1]),
                       ("f16",)),
}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """Each model's folder, its pre-tokenizer registration, and the reference's file per outtype (one run of the
    converter per folder)."""
    root = tmp_path_factory.mktemp("llama4")
    out = {}
    for name, (kind, dtype, over, outtypes) in MODELS.items():
        folder = llama4_folder(root / name, kind, dtype, **over)
        pre = (bpe_hash(folder), "qwen2")
        refs = {t: root / f"{name}-ref-{t}.gguf" for t in outtypes}
        reference(folder, refs, pre=pre)
        out[name] = (folder, pre, refs)
    return out


@pytest.fixture
def registered(folders, monkeypatch):
    from ckpt.targets.planners import gguf_vocab

    for _, pre, _ in folders.values():
        monkeypatch.setitem(gguf_vocab.PRE_TOKENIZERS, *pre)


def ckpt_gguf(run_ckpt, folder, outtype, out, *args):
    code, _, err = run_ckpt("convert", folder, "--to", f"gguf-{outtype}", "-o", out, "-q", *args)
    assert code == 0, err
    return out


def assert_same_gguf(ours_path, theirs_path):
    """Same metadata (keys, order, value types, values) but ckpt's provenance keys, same tensors (names, order,
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


# ---- 1. the reference's file, key for key and byte for byte


@pytest.mark.parametrize("name", list(MODELS))
def test_same_file_as_convert_hf_to_gguf(name, folders, registered, run_ckpt, tmp_path):
    folder, _, refs = folders[name]
    for t, ref in refs.items():
        assert_same_gguf(ckpt_gguf(run_ckpt, folder, t, tmp_path / f"ckpt-{t}.gguf"), ref)


def test_llama4_specifics_in_the_file(folders, registered, run_ckpt, tmp_path):
    """Without the reference: the fused experts split and transposed into llama.cpp's [experts, ff, hidden]
    gate / up and [experts, hidden, ff] down, the shared expert and router as they are, dense and MoE blocks
    interleaved, Llama 4's own keys, no vision tensor; the all-full-attention model's sliding window 0."""
    from safetensors.torch import load_file

    folder, _, _ = folders["conditional"]
    meta, tensors = read_gguf(ckpt_gguf(run_ckpt, folder, "f32", tmp_path / "a.gguf"))
    by_name = {n: (s, b) for n, _, s, b in tensors}
    sd = load_file(folder / "model.safetensors")

    def value(gname):
        shape, data = by_name[gname]
        return torch.from_numpy(np.frombuffer(data, dtype=np.float32).copy()).reshape(tuple(reversed(shape)))

    gate_up = sd["language_model.model.layers.1.feed_forward.experts.gate_up_proj"]
    ff = gate_up.shape[2] // 2
    assert torch.equal(value("blk.1.ffn_gate_exps.weight"), gate_up[:, :, :ff].transpose(1, 2))
    assert torch.equal(value("blk.1.ffn_up_exps.weight"), gate_up[:, :, ff:].transpose(1, 2))
    assert torch.equal(value("blk.3.ffn_down_exps.weight"),
                       sd["language_model.model.layers.3.feed_forward.experts.down_proj"].transpose(1, 2))
    assert torch.equal(value("blk.1.ffn_gate_inp.weight"), sd["language_model.model.layers.1.feed_forward.router.weight"])
    assert "blk.0.ffn_gate.weight" in by_name and "blk.0.ffn_gate_exps.weight" not in by_name
    assert "blk.1.ffn_up_shexp.weight" in by_name and "blk.1.ffn_up.weight" not in by_name
    assert not any(n.startswith(("v.", "mm.")) for n in by_name)
    assert meta["llama4.interleave_moe_layer_step"][0] == 2 and meta["llama4.expert_feed_forward_length"][0] == ff
    assert meta["llama4.feed_forward_length"][0] == 512 and "llama4.attention.sliding_window" not in meta
    assert tensors[0][0] == "rope_freqs.weight"

    full, _, _ = folders["full_attention"]
    meta, _ = read_gguf(ckpt_gguf(run_ckpt, full, "f16", tmp_path / "b.gguf"))
    assert meta["llama4.attention.sliding_window"][0] == 0


# ---- 2. llama-quantize's mix of the reference's BF16 file


def test_mix_is_llama_quantize_of_the_reference_file(folders, registered, run_ckpt, tmp_path):
    """`--to gguf-q4_k_m` of the BF16 model is `convert_hf_to_gguf.py --outtype bf16` then `llama-quantize
    Q4_K_M`: same tensors in llama-quantize's order, types and bytes, same metadata."""
    from helpers import llama_ref

    llama_ref.llama_cpp()
    folder, _, refs = folders["causal"]
    llama_ref.quantize_gguf(refs["bf16"], tmp_path / "ref.gguf", "MOSTLY_Q4_K_M")
    assert_same_gguf(ckpt_gguf(run_ckpt, folder, "q4_k_m", tmp_path / "ckpt.gguf"), tmp_path / "ref.gguf")


def test_gguf_source_is_llama_quantize(folders, registered, run_ckpt, tmp_path):
    """`convert model-F16.gguf --to gguf-q4_k_m` of the reference's F16 file is `llama-quantize` of it: the
    experts' tensors (read back transposed, so not in place) taken as stored."""
    from helpers import llama_ref

    llama_ref.llama_cpp()
    _, _, refs = folders["conditional"]
    llama_ref.quantize_gguf(refs["f16"], tmp_path / "ref.gguf", "MOSTLY_Q4_K_M")
    assert_same_gguf(ckpt_gguf(run_ckpt, refs["f16"], "q4_k_m", tmp_path / "ckpt.gguf"), tmp_path / "ref.gguf")


# ---- 3. llama.cpp runs ckpt's file as it runs the reference's


@pytest.mark.parametrize("name,outtype", [("conditional", "f16"), ("causal", "bf16")])
def test_llama_cpp_logits_match_the_reference_file(name, outtype, folders, registered, run_ckpt, tmp_path):
    from helpers import llama_ref

    llama_ref.llama_cpp()
    folder, _, refs = folders[name]
    ours = llama_ref.logits(ckpt_gguf(run_ckpt, folder, outtype, tmp_path / "ckpt.gguf"), IDS)
    theirs = llama_ref.logits(refs[outtype], IDS)
    assert np.isfinite(ours).all() and np.array_equal(ours, theirs)


# ---- 4. read back: a transformers Llama4ForCausalLM with the original logits


@pytest.mark.parametrize("name,outtype,to", [("conditional", "f32", "fp32"), ("causal", "bf16", "bf16"),
                                             ("full_attention", "f32", "fp32")])
def test_read_back_loads_strictly_with_the_original_logits(name, outtype, to, folders, registered, run_ckpt,
                                                           tmp_path):
    """The GGUF read back (`convert X.gguf --to fp32|bf16`) is a Llama4ForCausalLM folder transformers loads with
    no missing or unexpected key, holding every text tensor of the original as it was (the fused experts joined
    again; a VLM's `language_model.` prefix gone), and computing the original's logits: equal, since the
    weights are the same values and the Llama 3 RoPE parameters fitted to rope_freqs.weight give the same
    frequencies (within 1e-6 of the largest logit allowed for float32 rounding of those frequencies)."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    folder, _, _ = folders[name]
    src = ckpt_gguf(run_ckpt, folder, outtype, tmp_path / "m.gguf")
    code, _, err = run_ckpt("convert", src, "--to", to, "-o", tmp_path / "back", "-q")
    assert code == 0, err
    back = load_file(tmp_path / "back" / "model.safetensors")
    sd = {k.replace("language_model.", ""): v for k, v in load_file(folder / "model.safetensors").items()
          if not k.startswith(("vision_model.", "multi_modal_projector."))}
    assert set(back) == set(sd)
    for k, v in sd.items():
        assert torch.equal(back[k], v), k
    model, info = AutoModelForCausalLM.from_pretrained(tmp_path / "back", output_loading_info=True,
                                                       dtype=torch.float32)
    assert type(model).__name__ == "Llama4ForCausalLM"
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs")), info
    with torch.no_grad():
        ours = model(torch.tensor([IDS])).logits[0]
    theirs = text_logits(folder, IDS)
    assert (ours - theirs).abs().max() <= 1e-6 * theirs.abs().max(), (ours - theirs).abs().max()


# ---- 5. refusals: one line naming both values, exit 2, nothing written


def _edited(src, dst, **text):
    """A copy of `src` with text config keys changed (a VLM's under text_config)."""
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    (cfg.get("text_config", cfg)).update(text)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize("name,change,problem", [
    ("conditional", dict(num_local_experts=3),
     "num_local_experts is 3 but model.layers.1.feed_forward.experts.down_proj has 4 rows"),
    ("causal", dict(num_local_experts=8, num_experts_per_tok=1),
     "num_local_experts is 8 but model.layers.0.feed_forward.experts.down_proj has 4 rows"),
    ("conditional", dict(num_attention_heads=8, num_key_value_heads=2),
     "num_attention_heads x head_dim is 8 x 64 = 512 but model.layers.0.self_attn.o_proj.weight has 256 columns"),
    ("causal", dict(num_hidden_layers=5), "num_hidden_layers is 5 but the weights hold 4 blocks"),
    ("conditional", dict(intermediate_size_mlp=256),
     "intermediate_size_mlp is 256 but model.layers.0.feed_forward.down_proj.weight has 512 columns"),
    ("conditional", dict(interleave_moe_layer_step=1),
     "interleave_moe_layer_step is 1, making block 0 an MoE layer in llama.cpp, but the weights have no "
     "model.layers.0.feed_forward.router.weight"),
    ("conditional", dict(moe_layers=[0, 1, 3]),
     "moe_layers is [0, 1, 3] but interleave_moe_layer_step 2 makes llama.cpp's MoE layers [1, 3]"),
], ids=["experts", "experts-all-moe", "heads", "layers", "dense-ff", "interleave", "moe_layers"])
def test_a_config_that_disagrees_with_the_tensors_is_refused(name, change, problem, folders, registered, run_ckpt,
                                                             tmp_path):
    bad = _edited(folders[name][0], tmp_path / "bad", **change)
    assert_refused(run_ckpt, tmp_path, ("convert", bad, "--to", "gguf-f16"), str(bad / "config.json"), problem)


@pytest.mark.parametrize("change,problem", [
    (dict(llama4__interleave_moe_layer_step=1),
     "metadata 'llama4.interleave_moe_layer_step' is 1, but the file has no blk.0.ffn_gate_exps.weight (block 0 is "
     "MoE at that step)"),
    (dict(llama4__expert_count=8),
     "metadata 'llama4.expert_count' is 8, but blk.1.ffn_down_exps.weight is [4, 256, 256]"),
    (dict(llama4__expert_feed_forward_length=128),
     "metadata 'llama4.expert_feed_forward_length' is 128, but blk.1.ffn_down_exps.weight is [4, 256, 256]"),
    (dict(llama4__attention__head_count=8),  # (q's 256 rows in 8 heads of 32: k's 128 rows are not 2 of them)
     "metadata 'llama4.attention.head_count_kv' is 2, but blk.0.attn_k.weight has 128 rows, not 2 heads of 32"),
    (dict(llama4__block_count=5), "metadata 'llama4.block_count' is 5, but the file has tensors for 4 blocks"),
], ids=["interleave", "experts", "expert_ff", "heads", "blocks"])
def test_a_gguf_that_disagrees_with_its_tensors_is_not_read_back(change, problem, folders, run_ckpt, tmp_path):
    _, _, refs = folders["conditional"]
    bad = edited_gguf(refs["f32"], tmp_path / "bad.gguf", **change)
    assert_refused(run_ckpt, tmp_path, ("convert", bad, "--to", "fp32", "-o", tmp_path / "back"), str(bad), problem)
