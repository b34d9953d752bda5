"""`ckpt convert FOLDER --to gguf-*` for GLM-4.5 (`Glm4MoeForCausalLM`, llama.cpp `glm4moe`) and MiniMax-M2
(`MiniMaxM2ForCausalLM`, `minimax-m2`), held to llama.cpp's own converter and quantizer
(`ckpt/families/llm/archs/glm4moe.py`, `minimax_m2.py`).

Oracles: llama.cpp's `convert_hf_to_gguf.py` of the llama-cpp-python 0.3.36 tree (`helpers.hf_llm.reference`, its
own gguf-py), `llama-quantize` and llama.cpp's logits through llama-cpp-python (`helpers.llama_ref`; skipped, with
the reason, where it does not import). Tiny random models from transformers' own classes with BPE tokenizers
trained here (`helpers.glm_minimax`); each tokenizer's pre-tokenizer hash is registered under llama.cpp's name for
that model family (`glm4`, `minimax-m2`) on both sides.

The folders: GLM-4.5 as released (BF16, q/k/v biases, no q/k norms, one dense layer then MoE, and its NextN/MTP
layer stored as the layer after the last), a GLM variant with q/k norms, grouped routing and no MTP tensors (the
reference still counts the NextN block: its way, followed here), and MiniMax-M2 (BF16).

Read back (`convert X.gguf --to fp32|bf16`): the original folder's tensors and transformers' logits of the
original model; metadata that disagrees with the tensors is refused in one line.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from helpers.glm_minimax import glm_folder, minimax_folder
from helpers.hf_llm import bpe_hash, read_gguf, reference
from helpers.refusals import assert_refused

CKPT_ONLY = {"ckpt.version", "ckpt.operation"}
# name -> (builder, its arguments, llama.cpp's pre-tokenizer name, outtypes compared with the reference)
MODELS = {
    "glm45": (glm_folder, dict(dtype=torch.bfloat16, mtp=True, attention_bias=True), "glm4", ("f16", "bf16", "q8_0")),
    "glm_qknorm": (glm_folder, dict(use_qk_norm=True, n_group=2, topk_group=1, routed_scaling_factor=1.0,
                                    norm_topk_prob=False), "glm4", ("f32", "f16", "q8_0")),
    "minimax": (minimax_folder, dict(dtype=torch.bfloat16), "minimax-m2", ("bf16", "f16", "f32")),
}
IDS = [1, 5, 17, 42, 99, 3, 250, 7, 380, 12]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    out = {}
    for name, (build, kw, pre, _) in MODELS.items():
        f = build(root / name, **kw)
        out[name] = (f, (bpe_hash(f), pre))
    hashes = {pre[0]: pre[1] for _, pre in out.values()}
    assert len(hashes) == len({pre for _, pre in out.values()}), "two test tokenizers share a hash"
    return out


@pytest.fixture(scope="module")
def refs(folders, tmp_path_factory):
    """The reference's file of every folder for every outtype compared (one converter run per folder)."""
    root = tmp_path_factory.mktemp("ref")
    out = {}
    for name, (_, _, _, outtypes) in MODELS.items():
        folder, pre = folders[name]
        files = {t: root / f"{name}-{t}.gguf" for t in outtypes}
        reference(folder, files, pre=pre)
        out[name] = files
    return out


@pytest.fixture
def registered(folders, monkeypatch):
    from ckpt.targets.planners import gguf_vocab

    for _, pre in folders.values():
        monkeypatch.setitem(gguf_vocab.PRE_TOKENIZERS, *pre)


def ckpt_gguf(run_ckpt, folder, to, out, *args):
    code, stdout, err = run_ckpt("convert", folder, "--to", f"gguf-{to}", "-o", out, *args)
    assert code == 0, err
    return stdout + err


def same_file(ours_path, theirs_path, label):
    """Same metadata (keys, order, value types and values) but ckpt's provenance keys, same tensors (names,
    order, types, shapes, bytes)."""
    ours, ours_t = read_gguf(ours_path)
    theirs, theirs_t = read_gguf(theirs_path)
    assert set(ours) - set(theirs) == CKPT_ONLY and set(theirs) <= set(ours), (label, set(ours) ^ set(theirs))
    assert [k for k in ours if k not in CKPT_ONLY] == list(theirs), label
    for k in theirs:
        assert ours[k] == theirs[k], (label, k, str(ours[k])[:200], str(theirs[k])[:200])
    assert [x[:3] for x in ours_t] == [x[:3] for x in theirs_t], label
    for a, b in zip(ours_t, theirs_t):
        assert a[3] == b[3], (label, a[0])


# ---- 1. the reference's file, key for key and byte for byte


@pytest.mark.parametrize("name", list(MODELS))
def test_same_file_as_convert_hf_to_gguf(name, folders, refs, registered, run_ckpt, tmp_path):
    folder, _ = folders[name]
    for t, theirs in refs[name].items():
        ckpt_gguf(run_ckpt, folder, t, tmp_path / f"ckpt-{t}.gguf", "-q")
        same_file(tmp_path / f"ckpt-{t}.gguf", theirs, (name, t))


# ---- 2. what the files hold, without the reference


def _values(tensors, name, dtype=np.float32):
    t = next(x for x in tensors if x[0] == name)
    return torch.from_numpy(np.frombuffer(t[3], dtype=dtype).copy()).reshape(tuple(reversed(t[2])))


def test_glm_nextn_layers_the_reference_s_way(folders, registered, run_ckpt, tmp_path):
    """The folder with the MTP layer: block_count counts it and its tensors are `blk.3.*` / `blk.3.nextn.*`; the
    folder without MTP tensors: the same block count (transformers' num_nextn_predict_layers 1) and no blk.3
    tensors, said in the summary. q/k rows as stored (NeoX RoPE: no permutation), the score correction as the F32
    bias `exp_probs_b.bias`, the partial rotary dimensions."""
    from safetensors.torch import load_file

    folder, _ = folders["glm45"]
    ckpt_gguf(run_ckpt, folder, "f32", tmp_path / "a.gguf", "-q")
    meta, tensors = read_gguf(tmp_path / "a.gguf")
    names = {t[0] for t in tensors}
    assert meta["glm4moe.block_count"][0] == 4 and meta["glm4moe.nextn_predict_layers"][0] == 1
    assert {"blk.3.nextn.eh_proj.weight", "blk.3.nextn.shared_head_head.weight", "blk.3.ffn_gate_exps.weight",
            "blk.0.ffn_gate.weight", "blk.1.ffn_up_shexp.weight"} <= names
    assert "blk.0.ffn_gate_exps.weight" not in names and meta["glm4moe.leading_dense_block_count"][0] == 1
    assert meta["glm4moe.rope.dimension_count"][0] == 32  # head_dim 64 x partial_rotary_factor 0.5
    sd = load_file(folder / "model.safetensors")
    q = sd["model.layers.1.self_attn.q_proj.weight"].float()
    assert torch.equal(_values(tensors, "blk.1.attn_q.weight"), q)
    bias = sd["model.layers.1.mlp.gate.e_score_correction_bias"].float()
    assert torch.equal(_values(tensors, "blk.1.exp_probs_b.bias"), bias)
    up = torch.stack([sd[f"model.layers.2.mlp.experts.{x}.up_proj.weight"].float() for x in range(4)])
    assert torch.equal(_values(tensors, "blk.2.ffn_up_exps.weight"), up)

    bare, _ = folders["glm_qknorm"]
    said = ckpt_gguf(run_ckpt, bare, "f16", tmp_path / "b.gguf")
    meta, tensors = read_gguf(tmp_path / "b.gguf")
    assert meta["glm4moe.block_count"][0] == 4 and not any(t[0].startswith("blk.3.") for t in tensors)
    assert "no tensors for the NextN layer" in said
    assert meta["glm4moe.expert_group_count"][0] == 2 and meta["glm4moe.expert_weights_norm"][0] is False


def test_minimax_norms_over_all_heads(folders, registered, run_ckpt, tmp_path):
    """q/k norms of heads x head_dim values each, rotary_dim as the rotary dimensions, sigmoid gating from
    config.json's scoring_func, the experts' size from intermediate_size."""
    folder, _ = folders["minimax"]
    ckpt_gguf(run_ckpt, folder, "f16", tmp_path / "m.gguf", "-q")
    meta, tensors = read_gguf(tmp_path / "m.gguf")
    shapes = {t[0]: t[2] for t in tensors}
    assert shapes["blk.0.attn_q_norm.weight"] == (4 * 64,) and shapes["blk.0.attn_k_norm.weight"] == (2 * 64,)
    assert meta["minimax-m2.rope.dimension_count"][0] == 32 and meta["minimax-m2.expert_gating_func"][0] == 2
    assert meta["minimax-m2.expert_feed_forward_length"][0] == 256
    assert shapes["blk.1.ffn_down_exps.weight"] == (256, 256, 4)


# ---- 3. llama.cpp: the same logits, the same llama-quantize mix


@pytest.mark.parametrize("name,outtype", [("glm45", "f16"), ("glm_qknorm", "q8_0"), ("minimax", "bf16")])
def test_llama_cpp_logits_match_the_reference_file(name, outtype, folders, refs, registered, run_ckpt, tmp_path):
    from helpers import llama_ref

    llama_ref.llama_cpp()
    folder, _ = folders[name]
    ckpt_gguf(run_ckpt, folder, outtype, tmp_path / "ckpt.gguf", "-q")
    a = llama_ref.logits(tmp_path / "ckpt.gguf", IDS)
    b = llama_ref.logits(refs[name][outtype], IDS)
    assert a.shape == (len(IDS), 400) and np.isfinite(a).all()
    assert np.array_equal(a, b)


@pytest.mark.parametrize("name,mix", [("glm45", "q4_k_m"), ("glm45", "iq4_xs"), ("minimax", "q4_k_m")])
def test_mix_is_llama_quantize_of_the_reference_file(name, mix, folders, refs, registered, run_ckpt, tmp_path):
    """`--to gguf-<mix>` of a BF16 model is `convert_hf_to_gguf.py --outtype bf16` then `llama-quantize <MIX>`:
    the same tensors in llama-quantize's order, types and bytes, and the same metadata."""
    from helpers import llama_ref

    from ckpt.targets.planners.gguf_mixes import mix as mix_of

    llama_ref.llama_cpp()
    folder, _ = folders[name]
    llama_ref.quantize_gguf(refs[name]["bf16"], tmp_path / "ref.gguf", mix_of(mix).ftype)
    ckpt_gguf(run_ckpt, folder, mix, tmp_path / "ckpt.gguf", "-q")
    same_file(tmp_path / "ckpt.gguf", tmp_path / "ref.gguf", (name, mix))


@pytest.mark.parametrize("name,mix", [("glm45", "q4_k_m"), ("minimax", "q6_k")])
def test_gguf_source_is_llama_quantize(name, mix, folders, refs, registered, run_ckpt, tmp_path):
    """`convert model-BF16.gguf --to gguf-<mix>` (read through the architecture's read-back) is `llama-quantize
    model-BF16.gguf <MIX>`: the same file, ckpt's provenance keys aside."""
    from helpers import llama_ref

    from ckpt.targets.planners.gguf_mixes import mix as mix_of

    llama_ref.llama_cpp()
    llama_ref.quantize_gguf(refs[name]["bf16"], tmp_path / "ref.gguf", mix_of(mix).ftype)
    ckpt_gguf(run_ckpt, refs[name]["bf16"], mix, tmp_path / "ckpt.gguf", "-q")
    same_file(tmp_path / "ckpt.gguf", tmp_path / "ref.gguf", (name, mix))


# ---- 4. read back: the transformers model of the original, with its logits


def original_logits(folder):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        return model(torch.tensor([IDS])).logits[0]


@pytest.mark.parametrize("name,outtype,to", [("glm_qknorm", "f32", "fp32"), ("glm45", "bf16", "bf16"),
                                             ("minimax", "bf16", "bf16")])
def test_read_back_loads_strictly_with_the_original_logits(name, outtype, to, folders, registered, run_ckpt,
                                                           tmp_path):
    """`convert X.gguf --to fp32|bf16` gives the original folder's tensors (the stacked experts one per expert
    again, the score correction under its HF name, GLM-4.5's NextN layer as the release stores it) with the
    values as they were (f32 of an FP32 model, bf16 of a BF16 one: exact), and a config.json transformers loads
    with no missing or mismatched key, computing the original's logits (equal within 1e-6 of the largest: the
    same weights in the same float32 model). The only keys transformers does not take are GLM-4.5's NextN layer's,
    which its model class has no module for (it ignores them by pattern for the released sizes)."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    folder, _ = folders[name]
    ckpt_gguf(run_ckpt, folder, outtype, tmp_path / "m.gguf", "-q")
    code, _, err = run_ckpt("convert", tmp_path / "m.gguf", "--to", to, "-o", tmp_path / "back", "-q")
    assert code == 0, err
    back = load_file(tmp_path / "back" / "model.safetensors")
    sd = load_file(folder / "model.safetensors")
    assert set(back) == set(sd)
    for k, v in sd.items():
        assert torch.equal(back[k], v.to(back[k].dtype)), k
    model, info = AutoModelForCausalLM.from_pretrained(tmp_path / "back", output_loading_info=True,
                                                       dtype=torch.float32)
    assert type(model).__name__ == json.loads((folder / "config.json").read_text())["architectures"][0]
    assert not any(info[k] for k in ("missing_keys", "mismatched_keys", "error_msgs")), info
    nextn = f"model.layers.{json.loads((folder / 'config.json').read_text())['num_hidden_layers']}."
    assert all(k.startswith(nextn) for k in info["unexpected_keys"]), info["unexpected_keys"]
    assert bool(info["unexpected_keys"]) == any(k.startswith(nextn) for k in sd)
    with torch.no_grad():
        ours = model(torch.tensor([IDS])).logits[0]
    theirs = original_logits(folder)
    assert (ours - theirs).abs().max() <= 1e-6 * theirs.abs().max(), (ours - theirs).abs().max()


def _patched(src, dst, key, value):
    """A copy of a GGUF with one uint32 metadata value changed in place."""
    import gguf

    shutil.copy(src, dst)
    r = gguf.GGUFReader(str(dst), "r+")
    f = r.fields[key]
    f.parts[f.data[0]][0] = value
    del r
    return dst


def test_read_back_refuses_metadata_that_disagrees_with_the_tensors(folders, registered, run_ckpt, tmp_path):
    glm, _ = folders["glm45"]
    mm, _ = folders["minimax"]
    ckpt_gguf(run_ckpt, glm, "f16", tmp_path / "glm.gguf", "-q")
    ckpt_gguf(run_ckpt, mm, "f16", tmp_path / "mm.gguf", "-q")
    cases = [
        ("glm.gguf", "glm4moe.expert_count", 8, "metadata 'glm4moe.expert_count' is 8, but blk.1."),
        ("glm.gguf", "glm4moe.leading_dense_block_count", 2, "metadata 'glm4moe.leading_dense_block_count' is 2, "
                                                             "but the file has no blk.1.ffn_gate.weight"),
        ("glm.gguf", "glm4moe.expert_shared_count", 2, "metadata 'glm4moe.expert_shared_count' is 2, but"),
        ("glm.gguf", "glm4moe.block_count", 6, "metadata 'glm4moe.block_count' is 6, but the file has tensors for "
                                               "4 blocks"),
        ("mm.gguf", "minimax-m2.expert_feed_forward_length", 128, "metadata "
                                                                  "'minimax-m2.expert_feed_forward_length' is 128"),
        ("mm.gguf", "minimax-m2.rope.dimension_count", 33, "metadata 'minimax-m2.rope.dimension_count' is 33, not "
                                                           "an even number"),
    ]
    for i, (src, key, value, problem) in enumerate(cases):
        bad = _patched(tmp_path / src, tmp_path / f"bad{i}.gguf", key, value)
        assert_refused(run_ckpt, tmp_path, ("convert", bad, "--to", "fp32", "-o", tmp_path / f"out{i}"), str(bad),
                       problem)


# ---- 5. refusals: one line naming both sides, exit 2, nothing written


def _variant(src, dst, config=None, drop_config=(), replace=None):
    """A copy of a folder with config.json changed (`config` set, `drop_config` removed) and, in the tokenizer
    files, `replace` = (old, new) text replaced."""
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(config or {})
    for k in drop_config:
        cfg.pop(k, None)
    (dst / "config.json").write_text(json.dumps(cfg))
    if replace:
        for p in dst.iterdir():
            if p.name.startswith(("tokenizer", "chat_template", "special_tokens")):
                p.write_text(p.read_text().replace(*replace))
    return dst


def test_refusals(folders, registered, run_ckpt, tmp_path):
    glm, _ = folders["glm45"]
    mm, _ = folders["minimax"]
    cases = [
        (glm, dict(config={"n_routed_experts": 8}), "n_routed_experts is 8 but model.layers.1.mlp.gate"),
        (glm, dict(config={"num_attention_heads": 8}), "num_attention_heads x head_dim is 8 x 64 = 512 but"),
        (glm, dict(config={"num_hidden_layers": 2}), "num_hidden_layers is 2 but the weights hold 4 blocks"),
        (glm, dict(config={"num_hidden_layers": 4}), "num_hidden_layers is 4 but model.layers.3.eh_proj.weight is a "
                                                     "NextN/MTP layer's"),
        (glm, dict(config={"first_k_dense_replace": 2}),
         "first_k_dense_replace is 2 but model.layers.1.mlp.experts.0.down_proj.weight is an expert's"),
        (glm, dict(config={"first_k_dense_replace": 0}), "first_k_dense_replace is 0 but "
                                                         "model.layers.0.mlp.gate_proj.weight is a dense MLP's"),
        (glm, dict(config={"n_shared_experts": 2}), "moe_intermediate_size x n_shared_experts is 256 x 2 = 512 but"),
        (glm, dict(config={"num_nextn_predict_layers": 600}), "num_nextn_predict_layers is 600, not an integer from"),
        (mm, dict(config={"num_local_experts": 8}), "num_local_experts is 8 but model.layers.0.block_sparse_moe"),
        (mm, dict(config={"scoring_func": "relu"}), "scoring_func is 'relu', not one of softmax, sigmoid"),
        (mm, dict(drop_config=("rotary_dim",)), "has no rotary_dim, which llama.cpp's MiniMax-M2 converter"),
        (mm, dict(config={"rotary_dim": 33}), "rotary_dim is 33, not an even number of the head's 64 values"),
    ]
    for i, (src, change, problem) in enumerate(cases):
        bad = _variant(src, tmp_path / f"bad{i}", **change)
        assert_refused(run_ckpt, tmp_path, ("convert", bad, "--to", "gguf-f16"), str(bad / "config.json"), problem)
    nomask = _variant(glm, tmp_path / "nomask", replace=("[gMASK]", "[gMASK2]"))
    assert_refused(run_ckpt, tmp_path, ("convert", nomask, "--to", "gguf-f16"), str(nomask / "tokenizer.json"),
                   "has no added token '[gMASK]', which llama.cpp's GLM converter sets as the bos token")
