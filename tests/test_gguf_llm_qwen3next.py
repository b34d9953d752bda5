"""`ckpt convert FOLDER --to gguf-<type>` for Qwen3-Next (`qwen3next`), Qwen3.5 (`qwen35`) and Qwen3.5-MoE
(`qwen35moe`): gated DeltaNet + full-attention hybrids (`ckpt.families.llm.archs.qwen3next`, `.qwen35`,
`.qwen35moe`), held to llama.cpp's own converter and llama.cpp itself.

Oracles: `convert_hf_to_gguf.py` of llama-cpp-python 0.3.36's vendored tree (`helpers.hf_llm.reference`) for the
file (every key, value, type and order; every tensor's name, type, shape and bytes), llama-quantize of its BF16 /
F16 file for a K-quant mix (and of ckpt's own file for a GGUF source), llama.cpp's logits (`helpers.llama_ref`) on
both files, transformers for the read back folder (a strict `from_pretrained`, the original model's logits), and
PEFT's merge_and_unload for `merge-lora --to gguf-*`.

The models are tiny random ones built here from transformers' own classes (4 layers: three DeltaNet layers and one
full-attention layer, as `layer_types` gives them; more value heads than key heads, so Qwen3.5's value-head reorder
is exercised), with the byte-level BPE tokenizer of `helpers.hf_llm` registered under `qwen2` on both sides. A
folder transformers saves has no MTP tensors (transformers has no MTP module): the reference fails on it without
`--no-mtp`, and ckpt writes what it writes with that flag. The MTP folder gets an `mtp.*` block added here (a copy
of the full-attention layer, the fc projection and its norms, as the released checkpoints store it) and is compared
with the reference's default run, which writes it as an extra nextn layer. The fused-experts folder stores
`mlp.experts.gate_up_proj` / `down_proj` [experts, ...] as newer Qwen3.5-MoE checkpoints do. The `_vlm` folders
are the released Qwen3.5 layout (`Qwen3_5ForConditionalGeneration`, a tiny vision tower beside the text model):
their text model is written, as the reference writes it without `--mmproj`.

Read back: from an F32 GGUF of an F32 model, every tensor within float32 rounding (A_log = log(-(-exp(A_log))),
norms (w + 1) - 1: a few 1e-8 here) and the logits equal within 1e-5 (measured: equal); the MTP layer is left out
(transformers has no module for it), fused experts come back one tensor per expert (as transformers saves them).
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from helpers.hf_llm import bpe_hash, bpe_tokenizer, read_gguf, reference
from helpers.refusals import assert_refused

CKPT_ONLY = {"ckpt.version", "ckpt.operation"}
NO_MTP = ("--no-mtp",)
SMALL = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, head_dim=64, linear_num_key_heads=2, linear_num_value_heads=4,
             linear_key_head_dim=32, linear_value_head_dim=32, linear_conv_kernel_dim=4, max_position_embeddings=512,
             rms_norm_eps=1e-5, tie_word_embeddings=False)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=256, shared_expert_intermediate_size=128)
CLASSES = {"qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM", MOE),
           "qwen3_5": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", {}),
           "qwen3_5_moe": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM", MOE),
           # the released Qwen3.5 checkpoints: vision-language folders, the text model under model.language_model
           "qwen3_5_vlm": ("Qwen3_5Config", "Qwen3_5ForConditionalGeneration", {}),
           "qwen3_5_moe_vlm": ("Qwen3_5MoeConfig", "Qwen3_5MoeForConditionalGeneration", MOE)}
VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=256,
              num_position_embeddings=16)
# name -> (kind, source dtype, config overrides, the folder's edit, reference options, outtypes compared)
MODELS = {
    "qwen3_next": ("qwen3_next", torch.bfloat16, {}, None, NO_MTP, ("bf16", "f16", "q8_0")),
    "qwen3_5": ("qwen3_5", torch.float16, dict(mtp_num_hidden_layers=1), None, NO_MTP, ("f16", "bf16", "q8_0")),
    "qwen3_5_moe": ("qwen3_5_moe", torch.bfloat16, {}, None, NO_MTP, ("bf16", "f16")),
    # key and value head sizes apart (llama.cpp's loader wants them equal; the converter does not), three value
    # heads per key head, tied embeddings
    "qwen3_5_dims": ("qwen3_5", torch.float32, dict(linear_key_head_dim=16, linear_value_head_dim=32,
                                                     linear_num_value_heads=6, tie_word_embeddings=True),
                     None, NO_MTP, ("f32", "f16")),
    "qwen3_next_mtp": ("qwen3_next", torch.bfloat16, {}, "mtp", (), ("bf16", "q8_0")),
    "qwen3_5_moe_fused": ("qwen3_5_moe", torch.bfloat16, {}, "fused", NO_MTP, ("bf16",)),
    # the text model of a vision-language folder (the vision tower left out, as without --mmproj)
    "qwen3_5_vlm": ("qwen3_5_vlm", torch.bfloat16, {}, None, NO_MTP, ("bf16",)),
    "qwen3_5_moe_vlm": ("qwen3_5_moe_vlm", torch.bfloat16, {}, None, NO_MTP, ("f16",)),
    # F32 models read back from F32 GGUFs (no reference run)
    "rt_qwen3_next_mtp": ("qwen3_next", torch.float32, {}, "mtp", (), ()),
    "rt_qwen3_5_moe_fused": ("qwen3_5_moe", torch.float32, {}, "fused", (), ()),
}


def build(folder, kind: str, dtype, edit=None, **cfg):
    """A tiny random `kind` model with the test BPE tokenizer; norms, A_log and dt_bias moved off their init so a
    dropped or swapped transform shows."""
    import transformers
    from safetensors.torch import load_file, save_file

    folder.mkdir(parents=True, exist_ok=True)
    vocab = bpe_tokenizer(folder)
    config_cls, model_cls, extra = CLASSES[kind]
    torch.manual_seed(0)
    text = {**SMALL, **extra, "vocab_size": vocab, "bos_token_id": None, "eos_token_id": vocab - 1, **cfg}
    if kind.endswith("_vlm"):  # (the vision token ids inside the tiny vocabulary)
        config = getattr(transformers, config_cls)(text_config=text, vision_config=VISION, image_token_id=vocab - 3,
                                                   video_token_id=vocab - 3, vision_start_token_id=vocab - 3,
                                                   vision_end_token_id=vocab - 3)
    else:
        config = getattr(transformers, config_cls)(**text)
    model = getattr(transformers, model_cls)(config).eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n or n.endswith((".A_log", ".dt_bias")):
                p.add_(torch.randn(p.shape) * 0.1)
    model.to(dtype).save_pretrained(folder)
    if edit is None:
        return folder
    sd = load_file(folder / "model.safetensors")
    if edit == "mtp":  # the released checkpoints' MTP block: one full-attention MoE layer, fc and its norms
        torch.manual_seed(1)
        last = SMALL["num_hidden_layers"] - 1
        for k in [k for k in sd if k.startswith(f"model.layers.{last}.")]:
            sd["mtp.layers.0." + k.split(".", 3)[3]] = (sd[k].float() + 0.01 * torch.randn(sd[k].shape)).to(dtype)
        hidden = SMALL["hidden_size"]
        sd["mtp.fc.weight"] = (torch.randn(hidden, 2 * hidden) * 0.02).to(dtype)
        for n in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
            sd[f"mtp.{n}.weight"] = (torch.randn(hidden) * 0.1).to(dtype)
    elif edit == "fused":  # mlp.experts.gate_up_proj [experts, 2 x ff, hidden] and down_proj [experts, hidden, ff]
        for i in range(SMALL["num_hidden_layers"]):
            p = f"model.layers.{i}.mlp.experts"
            n = MOE["num_experts"]
            gate = [sd.pop(f"{p}.{x}.gate_proj.weight") for x in range(n)]
            up = [sd.pop(f"{p}.{x}.up_proj.weight") for x in range(n)]
            sd[f"{p}.gate_up_proj"] = torch.stack([torch.cat([g, u]) for g, u in zip(gate, up)])
            sd[f"{p}.down_proj"] = torch.stack([sd.pop(f"{p}.{x}.down_proj.weight") for x in range(n)])
    save_file(sd, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    out = {name: build(root / name, kind, dtype, edit, **cfg)
           for name, (kind, dtype, cfg, edit, _, _) in MODELS.items()}
    pre = (bpe_hash(out["qwen3_next"]), "qwen2")  # one trained tokenizer: one hash
    return out, pre


@pytest.fixture(scope="module")
def references(folders, tmp_path_factory):
    """The reference's files, one converter run per folder for all its outtypes."""
    paths, pre = folders
    root = tmp_path_factory.mktemp("ref")
    out = {}
    for name, (_, _, _, _, args, outtypes) in MODELS.items():
        files = {t: root / f"{name}-{t}.gguf" for t in outtypes}
        if files:
            reference(paths[name], files, pre=pre, args=args)
        out[name] = files
    return out


@pytest.fixture
def registered(folders, monkeypatch):
    from ckpt.targets.planners import gguf_vocab

    monkeypatch.setitem(gguf_vocab.PRE_TOKENIZERS, *folders[1])


def ckpt_gguf(run_ckpt, folder, outtype, out, *args):
    code, _, err = run_ckpt("convert", folder, "--to", f"gguf-{outtype}", "-o", out, "-q", *args)
    assert code == 0, err
    return out


def assert_same_file(ours_path, theirs_path, what):
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


@pytest.mark.parametrize("name", [n for n, m in MODELS.items() if m[5]])
def test_same_file_as_convert_hf_to_gguf(name, folders, references, registered, run_ckpt, tmp_path):
    """Every outtype of the reference: same metadata (keys, types, values, order) but ckpt's two provenance keys,
    same tensors (names, order, types, shapes, bytes): the DeltaNet transforms (-exp(A_log), dt_bias, the squeezed
    conv1d, norms + 1 but the gated one, qkvz split, Qwen3.5's value-head reorder), the stacked or split experts,
    the shared expert and its gate, the MTP layer where the folder has one."""
    paths, _ = folders
    for t, ref in references[name].items():
        assert_same_file(ckpt_gguf(run_ckpt, paths[name], t, tmp_path / f"{name}-{t}.gguf"), ref, (name, t))


def test_what_the_files_say(folders, references):
    """The facts the comparison rests on, read from the reference's own files: hybrid layers recorded, the MTP
    layer written as block 4 where the folder has one and not otherwise (the config's mtp_num_hidden_layers
    alone does not add one), Qwen3.5's default MRoPE sections."""
    meta, tensors = read_gguf(references["qwen3_next"]["bf16"])
    assert meta["qwen3next.attention.recurrent_layers"][0] == [True, True, True, False]
    assert meta["qwen3next.block_count"][0] == 4 and "qwen3next.nextn_predict_layers" not in meta
    names = {n: t for n, t, _, _ in tensors}
    assert names["blk.0.ssm_conv1d.weight"] == "F32" and "blk.0.attn_gate.weight" in names
    meta, tensors = read_gguf(references["qwen3_next_mtp"]["bf16"])
    assert meta["qwen3next.block_count"][0] == 5 and meta["qwen3next.nextn_predict_layers"][0] == 1
    assert meta["qwen3next.attention.recurrent_layers"][0] == [True, True, True, False, False]
    assert {"blk.4.nextn.eh_proj.weight", "blk.4.ffn_gate_exps.weight"} <= {n for n, *_ in tensors}
    meta, _ = read_gguf(references["qwen3_5"]["f16"])
    assert json.loads((folders[0]["qwen3_5"] / "config.json").read_text())["mtp_num_hidden_layers"] == 1
    assert meta["qwen35.block_count"][0] == 4 and meta["qwen35.rope.dimension_sections"][0] == [11, 11, 10, 0]


# ---- 2. K-quant mix: the reference's file through llama-quantize


@pytest.mark.parametrize("name,mix", [("qwen3_next", "q4_k_m"), ("qwen3_5", "q4_k_m"), ("qwen3_5_moe", "q4_k_m"),
                                      ("qwen3_next_mtp", "q4_k_m")])
def test_mix_is_llama_quantize_of_the_reference_file(name, mix, folders, references, registered, run_ckpt,
                                                     tmp_path):
    """`--to gguf-<mix>` of a BF16 / F16 model is the reference's --outtype bf16 / f16 file through
    llama-quantize: the same tensors in its order, types and bytes, and the same metadata."""
    from helpers import llama_ref

    from ckpt.targets.planners.gguf_mixes import mix as mix_of

    llama_ref.llama_cpp()
    base = "f16" if MODELS[name][1] == torch.float16 else "bf16"
    llama_ref.quantize_gguf(references[name][base], tmp_path / "ref.gguf", mix_of(mix).ftype)
    ours = ckpt_gguf(run_ckpt, folders[0][name], mix, tmp_path / "ckpt.gguf")
    assert_same_file(ours, tmp_path / "ref.gguf", (name, mix))


# ---- 3. llama.cpp runs ckpt's file as it runs the reference's


@pytest.mark.parametrize("name,outtype", [("qwen3_next", "bf16"), ("qwen3_5", "f16"), ("qwen3_5_moe", "bf16"),
                                          ("qwen3_next_mtp", "q8_0")])
def test_llama_cpp_logits_match_the_reference_file(name, outtype, folders, references, registered, run_ckpt,
                                                   tmp_path):
    from helpers import llama_ref

    llama_ref.llama_cpp()
    ours = ckpt_gguf(run_ckpt, folders[0][name], outtype, tmp_path / "ckpt.gguf")
    ids = [1, 5, 17, 42, 99, 3, 250, 7]
    a = llama_ref.logits(ours, ids)
    b = llama_ref.logits(references[name][outtype], ids)
    assert np.isfinite(a).all() and np.array_equal(a, b)


# ---- 4. refusals: one line naming config.json and what disagrees, exit 2, nothing written


def _edited(src, dst, **changes):
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(changes)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize("name,changes,problem", [
    ("qwen3_next", dict(num_attention_heads=8), "num_attention_heads"),
    ("qwen3_next", dict(num_experts=8), "num_experts is 8 but model.layers.0.mlp.gate.weight has 4 rows"),
    ("qwen3_5_moe", dict(num_experts=2, num_experts_per_tok=1), "num_experts is 2 but"),
    ("qwen3_5", dict(num_hidden_layers=5, layer_types=["linear_attention"] * 3 + ["full_attention"] * 2),
     "num_hidden_layers is 5 but the weights hold 4 blocks"),
    ("qwen3_5", dict(num_hidden_layers=3, layer_types=["linear_attention"] * 3), "num_hidden_layers is 3 but"),
    ("qwen3_5", dict(layer_types=["full_attention"] + ["linear_attention"] * 3),
     "layer_types[0] is 'full_attention' but model.layers.0 has linear_attn tensors"),
    ("qwen3_next", dict(linear_num_value_heads=8),
     "linear_num_value_heads is 8 but model.layers.0.linear_attn.A_log has 4"),
    ("qwen3_5", dict(linear_key_head_dim=16), "linear_key_head_dim"),
    ("qwen3_next_mtp", dict(mtp_num_hidden_layers=2),
     "mtp_num_hidden_layers is 2 but the weights hold 1 MTP layer (mtp.layers.0-0)"),
])
def test_a_config_that_disagrees_with_the_tensors_is_refused(name, changes, problem, folders, registered, run_ckpt,
                                                            tmp_path):
    bad = _edited(folders[0][name], tmp_path / "bad", **changes)
    assert_refused(run_ckpt, tmp_path, ("convert", bad, "--to", "gguf-f16"), str(bad / "config.json"), problem)


def _patched(src, dst, key, value):
    """A copy of a GGUF with one metadata value changed in place (same type: a scalar, or every element of an
    array)."""
    import gguf

    shutil.copy(src, dst)
    r = gguf.GGUFReader(str(dst), "r+")
    f = r.fields[key]
    for i, v in zip(f.data, value if isinstance(value, list) else [value]):
        f.parts[i][0] = v
    del r
    return dst


def test_read_back_refuses_metadata_that_disagrees_with_the_tensors(folders, registered, run_ckpt, tmp_path):
    src = ckpt_gguf(run_ckpt, folders[0]["qwen3_next_mtp"], "bf16", tmp_path / "m.gguf")
    cases = [
        ("qwen3next.ssm.time_step_rank", 8, "metadata 'qwen3next.ssm.time_step_rank' is 8, but blk.0.ssm_a is [4], "
                                            "not [8]"),
        ("qwen3next.ssm.state_size", 16, "metadata 'qwen3next.ssm.state_size' is 16, but blk.0.ssm_conv1d.weight is "
                                         "[256, 4], not [192, 4]"),
        ("qwen3next.ssm.conv_kernel", 3, "metadata 'qwen3next.ssm.conv_kernel' is 3, but blk.0.ssm_conv1d.weight"),
        ("qwen3next.expert_count", 8, "metadata 'qwen3next.expert_count' is 8, but blk.0.ffn_down_exps.weight"),
        ("qwen3next.expert_shared_feed_forward_length", 64, "metadata 'qwen3next.expert_shared_feed_forward_length' "
                                                            "is 64, but blk.0.ffn_down_shexp.weight"),
        ("qwen3next.block_count", 6, "metadata 'qwen3next.block_count' is 6, but "
                                     "qwen3next.attention.recurrent_layers has 5 values"),
        ("qwen3next.block_count", 3, "metadata 'qwen3next.block_count' is 3, but the file has tensors for 5 blocks"),
        ("qwen3next.nextn_predict_layers", 2, "tensor blk.3.nextn.eh_proj.weight is missing"),
        ("qwen3next.attention.recurrent_layers", [True, True, True, True, False],
         "but block 3 is a full-attention layer (blk.3.attn_q.weight)"),
        ("qwen3next.attention.recurrent_layers", [True, True, True, False, True],
         "metadata 'qwen3next.attention.recurrent_layers' is '[True, True, True, False, True]', but the MTP layers"),
    ]
    for i, (key, value, problem) in enumerate(cases):
        bad = _patched(src, tmp_path / f"bad{i}.gguf", key, value)
        assert_refused(run_ckpt, tmp_path, ("convert", bad, "--to", "fp32", "-o", tmp_path / f"out{i}"), str(bad),
                       problem)


# ---- 5. GGUF -> HF: transformers loads the folder strictly and computes the original model's logits


@pytest.mark.parametrize("name", ["qwen3_5_dims", "rt_qwen3_next_mtp", "rt_qwen3_5_moe_fused"])
def test_read_back_loads_strictly_with_the_original_logits(name, folders, registered, run_ckpt, tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    folder = folders[0][name]
    src = ckpt_gguf(run_ckpt, folder, "f32", tmp_path / "m.gguf")
    code, _, err = run_ckpt("convert", src, "--to", "fp32", "-o", tmp_path / "back", "-q")
    assert code == 0, err
    back, info = AutoModelForCausalLM.from_pretrained(tmp_path / "back", dtype=torch.float32, output_loading_info=True)
    assert not any(info.values()), info
    original = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    ids = torch.tensor([[1, 5, 17, 42, 99, 3, 250, 7]])
    with torch.no_grad():
        want, got = original(ids).logits, back(ids).logits
    assert (got - want).abs().max().item() <= 1e-5
    sd, theirs = load_file(folder / "model.safetensors"), load_file(tmp_path / "back" / "model.safetensors")
    if MODELS[name][3] == "fused":  # one tensor per expert, as transformers saves them
        for k in [k for k in sd if k.endswith("mlp.experts.gate_up_proj")]:
            both = sd.pop(k)
            ff = both.shape[1] // 2
            down = sd.pop(k.replace("gate_up_proj", "down_proj"))
            for x in range(both.shape[0]):
                sd[k.replace("gate_up_proj", f"{x}.gate_proj.weight")] = both[x, :ff]
                sd[k.replace("gate_up_proj", f"{x}.up_proj.weight")] = both[x, ff:]
                sd[k.replace("gate_up_proj", f"{x}.down_proj.weight")] = down[x]
    if MODELS[name][3] == "mtp":  # no MTP module in transformers: left out
        sd = {k: v for k, v in sd.items() if not k.startswith("mtp.")}
    assert set(theirs) == set(sd)
    for k, v in sd.items():
        assert torch.allclose(theirs[k], v, rtol=1e-6, atol=1e-7), (k, (theirs[k] - v).abs().max().item())


def test_gguf_source_is_llama_quantize_and_reads_back(folders, registered, run_ckpt, tmp_path):
    """`convert model-BF16.gguf --to gguf-q4_k_m` is llama-quantize of it (the shared-expert gate [1, hidden] as its
    [hidden], the MTP layer kept); the Q4_K_M file reads back to a folder transformers loads strictly."""
    from helpers import llama_ref
    from transformers import AutoModelForCausalLM

    llama_ref.llama_cpp()
    src = ckpt_gguf(run_ckpt, folders[0]["qwen3_next_mtp"], "bf16", tmp_path / "m-BF16.gguf")
    llama_ref.quantize_gguf(src, tmp_path / "ref.gguf", "MOSTLY_Q4_K_M")
    ours = ckpt_gguf(run_ckpt, src, "q4_k_m", tmp_path / "ckpt.gguf")
    a, a_t = read_gguf(ours)
    b, b_t = read_gguf(tmp_path / "ref.gguf")
    assert [x[:3] for x in a_t] == [x[:3] for x in b_t]
    assert all(x[3] == y[3] for x, y in zip(a_t, b_t))
    assert [k for k in a if k not in CKPT_ONLY] == [k for k in b if k not in CKPT_ONLY]
    assert all(a[k] == b[k] for k in b if k not in CKPT_ONLY)
    code, _, err = run_ckpt("convert", ours, "--to", "bf16", "-o", tmp_path / "back", "-q")
    assert code == 0, err
    model, info = AutoModelForCausalLM.from_pretrained(tmp_path / "back", output_loading_info=True)
    assert not any(info.values()), info
    with torch.no_grad():
        assert torch.isfinite(model(torch.tensor([[1, 5, 17]])).logits).all()


# ---- 6. merge-lora --to gguf-*: a PEFT LoRA on the DeltaNet and attention projections merged on the way


def test_merge_lora_into_the_hf_base(folders, registered, run_ckpt, tmp_path):
    """PEFT's merge_and_unload is the oracle: `merge-lora BASE LORA --to gguf-f32` read back gives PEFT's merged
    weights (within the norms' float32 rounding): the merged projections go through the same transforms (qkv's
    value heads reordered, out_proj's columns, the shared-expert gate [1, hidden])."""
    from peft import LoraConfig, get_peft_model
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    folder = folders[0]["rt_qwen3_5_moe_fused"]
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    torch.manual_seed(1)
    targets = ["in_proj_qkv", "in_proj_z", "in_proj_a", "out_proj", "q_proj", "shared_expert_gate"]
    peft = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False))
    peft.save_pretrained(tmp_path / "lora")
    merged = {k: v.detach().clone() for k, v in peft.merge_and_unload().state_dict().items()}
    out = tmp_path / "merged.gguf"
    code, _, err = run_ckpt("merge-lora", folder, tmp_path / "lora", "--to", "gguf-f32", "-o", out, "-q")
    assert code == 0, err
    code, _, err = run_ckpt("convert", out, "--to", "fp32", "-o", tmp_path / "back", "-q")
    assert code == 0, err
    back = load_file(tmp_path / "back" / "model.safetensors")
    changed = [k for k in merged if any(f".{t}." in k for t in targets)]
    base = load_file(folder / "model.safetensors")
    assert changed and set(changed) <= set(back) and all(not torch.equal(merged[k], base[k]) for k in changed)
    for k, v in merged.items():  # (transformers' module holds the experts fused; the files one per expert)
        if k in back:
            assert torch.allclose(back[k], v, rtol=1e-6, atol=1e-7), k
