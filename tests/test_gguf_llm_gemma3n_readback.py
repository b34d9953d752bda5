"""`ckpt convert GEMMA3N.gguf --to bf16|fp32 -o DIR`: a Gemma 3n GGUF (llama.cpp's `gemma3n`, as ckpt and llama.cpp's
convert_hf_to_gguf.py write it: tests/test_gguf_llm_vlm_text.py shows the files are the same) read back as the
`Gemma3nForCausalLM` folder it was converted from.

- `text`: a tiny random Gemma 3n as transformers saves it (no k/v projections in its 2 KV-sharing layers);
- `release`: the same model with its own k/v projections in every layer and the config sharing the last 2 layers'
  keys and values, as the Gemma 3n releases are stored (transformers ignores those k/v on load; the read back leaves
  them out, saying so).

What the GGUF does not hold exactly: `vocab_size_per_layer_input` (the converter padded the per-layer embeddings with
zero rows to `vocab_size` and recorded no size). The folder keeps every stored row; a token past the original table
then gets its zero row where transformers gives the original the pad row (row 0, zero as `padding_idx` keeps it):
the same logits for every token id (the ids below include the padded ones). A file whose padding cannot be told from
row 0 is refused.

Oracles: transformers (a strict `from_pretrained` of the read-back folder, the original model's logits: from an F32
GGUF to fp32 equal within 1e-6 (in fact bit for bit), every tensor equal to the original's); gguf's reader for the
metadata edits of the refusals.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from helpers.hf_vlm import gemma3n_folder
from helpers.refusals import assert_refused

TOL = 1e-6  # max |logit difference|, F32 GGUF -> fp32 folder vs the fp32 original (float32 rounding)
VOCAB, PER_LAYER_VOCAB = 336, 320  # the tiny model's vocab_size and vocab_size_per_layer_input (its tokenizer's)
IDS = [(i * 37 + 5) % VOCAB for i in range(40)] + list(range(PER_LAYER_VOCAB - 2, VOCAB))  # padded ids included


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """The two folders of the module docstring."""
    root = tmp_path_factory.mktemp("gemma3n_back")
    text = gemma3n_folder(root / "text")
    release = gemma3n_folder(root / "release", num_kv_shared_layers=0)
    cfg = json.loads((release / "config.json").read_text())
    cfg["num_kv_shared_layers"] = 2
    (release / "config.json").write_text(json.dumps(cfg, indent=2))
    return {"text": text, "release": release}


@pytest.fixture(scope="module")
def ggufs(folders, tmp_path_factory):
    """ckpt's F32 and BF16 GGUF of each folder (`ckpt convert FOLDER --to gguf-*`)."""
    from ckpt.cli import main

    root = tmp_path_factory.mktemp("gemma3n_gguf")
    out = {}
    for name, folder in folders.items():
        for outtype in ("f32", "bf16"):
            out[name, outtype] = path = root / f"{name}-{outtype}.gguf"
            try:
                main(["convert", str(folder), "--to", f"gguf-{outtype}", "-o", str(path), "-q"])
            except SystemExit as e:
                assert not e.code, e.code
    return out


def _strict(folder, dtype=torch.float32):
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs")), info
    return model.eval()


def _original_state(folder):
    """The original's tensors as transformers loads them (a release's k/v of KV-sharing layers ignored)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return model, {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}  # (tied)


@pytest.mark.parametrize("name", ["text", "release"])
def test_read_back_loads_strictly_with_the_original_logits(name, folders, ggufs, run_ckpt, tmp_path):
    from safetensors.torch import load_file

    code, out, err = run_ckpt("convert", ggufs[name, "f32"], "--to", "fp32", "-o", tmp_path / "back")
    assert code == 0, err
    assert ("2 KV-sharing layers left out" in out + err) == (name == "release"), out + err
    cfg = json.loads((tmp_path / "back" / "config.json").read_text())
    want = json.loads((folders[name] / "config.json").read_text())
    for key in ("altup_active_idx", "altup_num_inputs", "hidden_size_per_layer_input", "num_kv_shared_layers",
                "laurel_rank", "activation_sparsity_pattern", "layer_types", "sliding_window", "intermediate_size",
                "final_logit_softcapping", "rope_parameters", "vocab_size", "rms_norm_eps", "head_dim"):
        assert cfg[key] == want[key], key
    assert cfg["vocab_size_per_layer_input"] == VOCAB  # every stored row (want: PER_LAYER_VOCAB; module docstring)
    back = _strict(tmp_path / "back")
    original, sd = _original_state(folders[name])
    assert not sd["model.embed_tokens_per_layer.weight"][0].any()  # the pad row the original gives padded ids
    with torch.no_grad():
        want_logits, got = original(torch.tensor([IDS])).logits, back(torch.tensor([IDS])).logits
    assert (got - want_logits).abs().max().item() <= TOL
    theirs = load_file(tmp_path / "back" / "model.safetensors")
    assert set(theirs) == set(sd)
    for k, v in sd.items():
        if k == "model.embed_tokens_per_layer.weight":  # the converter's zero rows after the original's
            assert torch.equal(theirs[k][:PER_LAYER_VOCAB], v) and not theirs[k][PER_LAYER_VOCAB:].any()
        else:
            assert torch.equal(theirs[k], v), k


def test_bf16_gguf_reads_back_as_bf16(folders, ggufs, run_ckpt, tmp_path):
    """BF16 GGUF -> bf16 folder: loads strictly, each tensor the original's rounded to bfloat16 (norms and the other
    small tensors were kept F32 in the GGUF)."""
    from safetensors.torch import load_file

    code, _, err = run_ckpt("convert", ggufs["text", "bf16"], "--to", "bf16", "-o", tmp_path / "back", "-q")
    assert code == 0, err
    _strict(tmp_path / "back", torch.bfloat16)
    _, sd = _original_state(folders["text"])
    theirs = load_file(tmp_path / "back" / "model.safetensors")
    for k, v in sd.items():
        got = theirs[k][:PER_LAYER_VOCAB] if k == "model.embed_tokens_per_layer.weight" else theirs[k]
        assert got.dtype == torch.bfloat16 and torch.equal(got, v.to(torch.bfloat16)), k


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


def test_read_back_refuses_metadata_that_disagrees_with_the_tensors(ggufs, run_ckpt, tmp_path):
    src = ggufs["text", "f32"]
    cases = [
        ("gemma3n.embedding_length_per_layer_input", 128,
         "metadata 'gemma3n.embedding_length_per_layer_input' is 128, but per_layer_token_embd.weight is [336, 1024], "
         "not [336, 512]"),
        ("gemma3n.altup.num_inputs", 3, "metadata 'gemma3n.altup.num_inputs' is 3, but altup_proj.weight is "
                                        "[3, 128, 128], not [2, 128, 128]"),
        ("gemma3n.altup.active_idx", 4, "metadata 'gemma3n.altup.active_idx' is 4, not below"),
        ("gemma3n.attention.shared_kv_layers", 1, "metadata 'gemma3n.attention.shared_kv_layers' is 1, but "
                                                  "blk.2.attn_k.weight is missing"),
        ("gemma3n.attention.shared_kv_layers", 3, "metadata 'gemma3n.attention.shared_kv_layers' is 3, but layers "
                                                  "1-3 would share keys and values with no earlier layer"),
        ("gemma3n.activation_sparsity_scale", [float("nan")] * 4, "metadata 'gemma3n.activation_sparsity_scale' is "
                                                                  "[nan, nan, nan, nan], not 4 standard-normal"),
        ("gemma3n.block_count", 3, "metadata 'gemma3n.block_count' is 3, but the file has tensors for 4 blocks"),
        ("gemma3n.attention.head_count_kv", 1, "metadata 'gemma3n.attention.head_count_kv' is 1, but "
                                               "blk.0.attn_k.weight has 64 rows, not 1 heads of 32"),
    ]
    for i, (key, value, problem) in enumerate(cases):
        bad = _patched(src, tmp_path / f"bad{i}.gguf", key, value)
        assert_refused(run_ckpt, tmp_path, ("convert", bad, "--to", "fp32", "-o", tmp_path / f"out{i}"), str(bad),
                       problem)


def test_padding_that_cannot_be_told_apart_is_refused(folders, run_ckpt, tmp_path):
    """A per-layer table whose row 0 is not zero: the converter's zero rows after it give padded tokens other values
    than transformers gives tokens past the original table (row 0), and the table's size is not in the GGUF."""
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "row0"
    shutil.copytree(folders["text"], folder)
    sd = load_file(folder / "model.safetensors")
    sd["model.embed_tokens_per_layer.weight"][0] += 0.5
    save_file(sd, folder / "model.safetensors", metadata={"format": "pt"})
    src = tmp_path / "row0.gguf"
    code, _, err = run_ckpt("convert", folder, "--to", "gguf-f32", "-o", src, "-q")
    assert code == 0, err
    assert_refused(run_ckpt, tmp_path, ("convert", src, "--to", "fp32", "-o", tmp_path / "back"), str(src),
                   "tensor per_layer_token_embd.weight ends in zero rows")


def test_gguf_source_is_llama_quantize_and_reads_back(ggufs, run_ckpt, tmp_path):
    """Now that a Gemma 3n GGUF reads back, it is a source too: `convert model-BF16.gguf --to gguf-q4_k_m` is
    llama-quantize of it (every tensor's name, type and bytes, every key), and the Q4_K_M file reads back to a folder
    transformers loads strictly."""
    from helpers import llama_ref
    from helpers.hf_llm import read_gguf

    llama_ref.llama_cpp()
    src = ggufs["release", "bf16"]
    llama_ref.quantize_gguf(src, tmp_path / "ref.gguf", "MOSTLY_Q4_K_M")
    code, _, err = run_ckpt("convert", src, "--to", "gguf-q4_k_m", "-o", tmp_path / "ckpt.gguf", "-q")
    assert code == 0, err
    a, a_t = read_gguf(tmp_path / "ckpt.gguf")
    b, b_t = read_gguf(tmp_path / "ref.gguf")
    assert [x[:3] for x in a_t] == [x[:3] for x in b_t]
    assert all(x[3] == y[3] for x, y in zip(a_t, b_t))
    ckpt_only = {"ckpt.version", "ckpt.operation"}
    assert [k for k in a if k not in ckpt_only] == [k for k in b if k not in ckpt_only]
    assert all(a[k] == b[k] for k in b if k not in ckpt_only)
    code, _, err = run_ckpt("convert", tmp_path / "ckpt.gguf", "--to", "bf16", "-o", tmp_path / "back", "-q")
    assert code == 0, err
    with torch.no_grad():
        assert torch.isfinite(_strict(tmp_path / "back")(torch.tensor([IDS])).logits).all()
