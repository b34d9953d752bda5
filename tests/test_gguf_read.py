"""Reading GGUF: every type gguf knows decodes bit for bit as gguf's own dequantize; ComfyUI-GGUF reshape
metadata; llama.cpp LLMs back to Hugging Face folders that transformers loads strictly (and equal to
transformers' own GGUF loader); bad files are one-line errors with nothing written."""

from __future__ import annotations

import json
import struct

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from safetensors.torch import load_file

from gguf_helpers import hf_to_gguf, quantized, write_gguf
from helpers.gguf_ref import HAND_PACKED, pack_blocks
from helpers.llm import load_strict, tiny

RNG = np.random.default_rng(0)
# Every block type gguf's Python package can write (K- and IQ-quants have no Python encoder).
WRITABLE = [T.F32, T.F16, T.BF16, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.TQ1_0, T.TQ2_0, T.MXFP4]


def gguf_values(path) -> dict[str, np.ndarray]:
    """The oracle: gguf's reader and dequantize on the same file, in torch order and shape."""
    r = gguf.GGUFReader(path)
    out = {}
    for t in r.tensors:
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        out[t.name] = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32).reshape(shape)
    return out


def test_every_writable_type_decodes_bit_for_bit(tmp_path, run_ckpt, monkeypatch):
    import ckpt.io.output as output

    monkeypatch.setattr(output, "BAND_ELEMS", 1024)  # several bands per tensor
    tensors = {}
    for t in WRITABLE:
        blk = gguf.GGML_QUANT_SIZES[t][0]
        x = RNG.standard_normal((24, max(blk, 64) * 2)).astype(np.float32)
        tensors[f"blocks.{t.name}.weight"] = (quantized(x, t)[0], t)
    src = tmp_path / "m.gguf"
    write_gguf(src, "flux", tensors)
    code, out, err = run_ckpt("convert", src, "--to", "fp32", "-o", tmp_path / "o.safetensors", "-q")
    assert code == 0, err
    got, want = load_file(tmp_path / "o.safetensors"), gguf_values(src)
    assert set(got) == set(want)
    for k in want:
        assert torch.equal(got[k], torch.from_numpy(want[k])), k


def test_bf16_output_is_fp32_values_rounded_once(tmp_path, run_ckpt):
    x = RNG.standard_normal((8, 64)).astype(np.float32) * 3
    q, values = quantized(x, T.Q5_1)
    write_gguf(tmp_path / "m.gguf", "sd3", {"w": (q, T.Q5_1)})
    code, out, err = run_ckpt("convert", tmp_path / "m.gguf", "--to", "bf16", "-q", "-o", tmp_path / "o.safetensors")
    assert code == 0, err
    assert torch.equal(load_file(tmp_path / "o.safetensors")["w"], torch.from_numpy(values).to(torch.bfloat16))


# ---- K-quants and IQ4_NL: blocks packed by hand from ggml's layouts, decoded by a reference written
# from ggml-quants.c (dequantize_row_*, in tests/helpers/gguf_ref.py), cross-checked with gguf's dequantize.


@pytest.mark.parametrize("t", list(HAND_PACKED), ids=lambda t: t.name)
def test_hand_packed_blocks_decode_as_ggml_specifies(tmp_path, run_ckpt, t):
    blk, size = gguf.GGML_QUANT_SIZES[t]
    rows, per_row = 3, 2  # blocks per row
    blocks = pack_blocks(t, rows * per_row, RNG)
    ref = np.stack([HAND_PACKED[t][0](b) for b in blocks]).reshape(rows, per_row * blk)
    assert np.array_equal(gguf.quants.dequantize(blocks.reshape(rows, per_row * size), t), ref)  # spec == gguf
    write_gguf(tmp_path / "k.gguf", "wan", {"blocks.0.ffn.0.weight": (blocks.reshape(rows, per_row * size), t)})
    code, out, err = run_ckpt("convert", tmp_path / "k.gguf", "--to", "fp32", "-q", "-o", tmp_path / "o.safetensors")
    assert code == 0, err
    assert torch.equal(load_file(tmp_path / "o.safetensors")["blocks.0.ffn.0.weight"], torch.from_numpy(ref))


def test_comfyui_reshaped_and_5d_tensors(tmp_path, run_ckpt, monkeypatch):
    """ComfyUI-GGUF stores SD conv weights flattened to rows of 256 with `comfy.gguf.orig_shape.<name>`
    (INT32 array) and Wan/HunyuanVideo 5-D patch embeddings as F32; both come back in their shapes."""
    import ckpt.io.output as output

    monkeypatch.setattr(output, "BAND_ELEMS", 2000)  # bands must start on a stored 256-row
    conv = RNG.standard_normal((320, 4, 3, 3)).astype(np.float32)
    q, conv_vals = quantized(conv.reshape(-1, 256), T.Q8_0)
    patch = RNG.standard_normal((16, 4, 1, 2, 2)).astype(np.float32)
    write_gguf(tmp_path / "m.gguf", "sdxl", {"input_blocks.1.0.in_layers.2.weight": (q, T.Q8_0), "patch.weight": patch},
               kv={"comfy.gguf.orig_shape.input_blocks.1.0.in_layers.2.weight":
                   ([320, 4, 3, 3], gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.INT32)})
    code, out, err = run_ckpt("convert", tmp_path / "m.gguf", "--to", "fp32", "-o", tmp_path / "o.safetensors")
    assert code == 0, err
    assert "1 tensor restored to its original shape (" in err
    got = load_file(tmp_path / "o.safetensors")
    assert torch.equal(got["input_blocks.1.0.in_layers.2.weight"], torch.from_numpy(conv_vals.reshape(320, 4, 3, 3)))
    assert torch.equal(got["patch.weight"], torch.from_numpy(patch))


# ---- llama.cpp LLMs -> Hugging Face folders


def test_llama_f32_gguf_gives_back_the_hf_state_dict(tmp_path, run_ckpt, monkeypatch):
    """q/k rows were permuted per head (GQA: k with the kv heads); convert undoes it exactly, in bands of
    whole heads."""
    import ckpt.io.output as output

    monkeypatch.setattr(output, "BAND_ELEMS", 700)
    model = tiny("llama", head_dim=16, rope_theta=50000.0)
    hf_to_gguf(model, "llama", tmp_path / "m.gguf", permute=True)
    code, out, err = run_ckpt("convert", tmp_path / "m.gguf", "--to", "fp32", "-q")
    assert code == 0, err
    folder = tmp_path / "m-fp32"
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", "model.safetensors"]
    cfg = json.loads((folder / "config.json").read_text())
    want_cfg = model.config.to_dict()
    for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
              "head_dim", "vocab_size", "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings"):
        assert cfg[k] == want_cfg[k], k
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["torch_dtype"] == "float32"
    loaded = load_strict(folder, type(model))
    assert loaded.config.rope_parameters["rope_theta"] == 50000.0
    for k, v in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v), k
    ids = torch.arange(10).reshape(1, -1)
    assert torch.equal(loaded(ids).logits, model(ids).logits)


@pytest.mark.parametrize("kind,qtype,extra", [("llama", T.Q4_0, {}), ("qwen2", T.Q8_0, {"tie_word_embeddings": True}),
                                              ("qwen3", T.Q5_1, {})],
                         ids=["llama-Q4_0", "qwen2-tied-Q8_0", "qwen3-Q5_1"])
def test_quantized_llm_matches_transformers_gguf_loader(tmp_path, run_ckpt, kind, qtype, extra):
    """transformers' own GGUF loader (gguf dequantize + its reverse permutes) is the oracle."""
    import transformers

    model = tiny(kind, **extra)
    hf_to_gguf(model, kind, tmp_path / "m.gguf", qtype=qtype, permute=kind == "llama")
    code, out, err = run_ckpt("convert", tmp_path / "m.gguf", "--to", "fp32", "-o", tmp_path / "out", "-q")
    assert code == 0, err
    loaded = load_strict(tmp_path / "out", type(model))
    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="m.gguf", dtype=torch.float32)
    want = ref.state_dict()
    got = loaded.state_dict()
    assert set(got) == set(model.state_dict())
    for k in got:
        assert torch.equal(got[k], want[k]), k
    assert json.loads((tmp_path / "out" / "config.json").read_text())["tie_word_embeddings"] == \
        model.config.tie_word_embeddings


def test_llm_gguf_to_bf16_and_dequant(tmp_path, run_ckpt):
    """head_dim != hidden / heads (Qwen3): taken from the tensor shapes (transformers' GGUF loader, 5.23,
    does not read it for qwen3)."""
    model = tiny("qwen3", head_dim=32)
    stored = hf_to_gguf(model, "qwen3", tmp_path / "m.gguf", qtype=T.Q8_0)
    code, out, err = run_ckpt("convert", tmp_path / "m.gguf", "--to", "bf16", "-o", tmp_path / "bf16", "-q")
    assert code == 0, err
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    sd = load_file(tmp_path / "bf16" / "model.safetensors")
    assert torch.equal(sd["model.layers.1.mlp.down_proj.weight"],
                       torch.from_numpy(stored["blk.1.ffn_down.weight"]).to(torch.bfloat16))
    code, out, err = run_ckpt("dequant", tmp_path / "m.gguf", "-o", tmp_path / "dq", "-q")
    assert code == 0, err
    assert load_file(tmp_path / "dq" / "model.safetensors")["model.norm.weight"].dtype == torch.float32
    assert json.loads((tmp_path / "dq" / "config.json").read_text())["head_dim"] == 32
    load_strict(tmp_path / "dq", type(model))


def test_merge_lora_into_gguf_llm(tmp_path, run_ckpt):
    """merge-lora reads a GGUF base through the same view; the oracle is PEFT's merge into the model the
    GGUF decodes to."""
    peft = pytest.importorskip("peft")
    model = tiny("llama")
    hf_to_gguf(model, "llama", tmp_path / "m.gguf", qtype=T.Q8_0, permute=True)
    run_ckpt("convert", tmp_path / "m.gguf", "--to", "fp32", "-o", tmp_path / "plain", "-q")
    base = load_strict(tmp_path / "plain", type(model))
    pm = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj"]))
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if "lora_" in n:
                p.add_(torch.randn(p.shape) * 0.2)
    pm.save_pretrained(tmp_path / "adapter")
    want = pm.merge_and_unload().state_dict()
    code, out, err = run_ckpt("merge-lora", tmp_path / "m.gguf", tmp_path / "adapter", "--to", "fp32",
                              "-o", tmp_path / "merged", "-q")
    assert code == 0, err
    assert "base tensors changed: 6" in out
    got = load_file(tmp_path / "merged" / "model.safetensors")
    for k, v in want.items():
        torch.testing.assert_close(got[k], v, rtol=1e-5, atol=1e-6, msg=k)


def test_inspect_gguf(tmp_path, run_ckpt):
    model = tiny("qwen2")
    hf_to_gguf(model, "qwen2", tmp_path / "m.gguf", qtype=T.Q8_0)
    code, out, err = run_ckpt("inspect", tmp_path / "m.gguf", "--json")
    assert code == 0, err
    c = json.loads(out)["components"][0]
    assert c["container"] == "gguf" and c["config_class"] == "Qwen2ForCausalLM"
    assert c["dtypes"]["Q8_0"]["parameters"] == sum(v.numel() for v in model.state_dict().values() if v.dim() == 2)
    assert c["metadata"]["general.architecture"] == "qwen2"
    assert any("GGUF-quantized" in w for w in c["warnings"])


def test_folder_with_one_gguf(tmp_path, run_ckpt):
    d = tmp_path / "repo"
    d.mkdir()
    _small(d)
    (d / "README.md").write_text("a model card")
    code, out, err = run_ckpt("convert", d, "--to", "fp16", "-q")
    assert code == 0, err
    assert set(load_file(tmp_path / "repo-fp16" / "model.safetensors")) == {"a.weight", "b.weight"}
    assert (tmp_path / "repo-fp16" / "README.md").exists()
    write_gguf(d / "other.gguf", "flux", {"c": RNG.standard_normal((2, 32)).astype(np.float32)})
    code, out, err = run_ckpt("convert", d, "--to", "fp16", "-q", "-o", tmp_path / "x")
    assert code == 2 and "several GGUF files (m.gguf, other.gguf); pass the one you mean" in err


# ---- bad input: one line, exit 2, nothing written


def _tensor_info_offset(data: bytes, name: str) -> int:
    """Byte offset of a tensor's GGML type field in its tensor info."""
    raw = name.encode()
    i = data.index(struct.pack("<Q", len(raw)) + raw) + 8 + len(raw)
    n_dims = struct.unpack_from("<I", data, i)[0]
    return i + 4 + 8 * n_dims


def _small(tmp):
    p = tmp / "m.gguf"
    write_gguf(p, "flux", {"a.weight": (quantized(RNG.standard_normal((4, 64)).astype(np.float32), T.Q8_0)[0], T.Q8_0),
                           "b.weight": RNG.standard_normal((4, 64)).astype(np.float32)})
    return p


def bad_truncated_header(tmp):
    p = _small(tmp)
    p.write_bytes(p.read_bytes()[:40])
    return p, "truncated or corrupt"


def bad_data_past_eof(tmp):
    p = _small(tmp)
    p.write_bytes(p.read_bytes()[:-100])
    return p, "runs past the end of the file"


def bad_unknown_type(tmp):
    p = _small(tmp)
    data = bytearray(p.read_bytes())
    struct.pack_into("<I", data, _tensor_info_offset(bytes(data), "a.weight"), 99)
    p.write_bytes(bytes(data))
    return p, "unknown tensor type"


def bad_arch_without_name_table(tmp):
    p = tmp / "m.gguf"
    write_gguf(p, "t5encoder", {"token_embd.weight": RNG.standard_normal((8, 32)).astype(np.float32)})
    return p, "GGUF architecture 't5encoder' is an LLM architecture ckpt has no HF name table for"


def bad_unknown_llm_tensor(tmp):
    p = tmp / "m.gguf"
    write_gguf(p, "qwen2", {"token_embd.weight": RNG.standard_normal((8, 32)).astype(np.float32),
                            "blk.0.mystery.weight": RNG.standard_normal((8, 32)).astype(np.float32)},
               kv={"qwen2.attention.head_count": 2, "qwen2.embedding_length": 32, "qwen2.feed_forward_length": 64,
                   "qwen2.block_count": 1, "qwen2.attention.layer_norm_rms_epsilon": 1e-6,
                   "qwen2.context_length": 64})
    return p, "tensor 'blk.0.mystery.weight' has no Hugging Face name"


def bad_magic(tmp):
    p = tmp / "m.gguf"
    p.write_bytes(b"NOPE" + bytes(60))
    return p, "not a GGUF file"


def bad_empty(tmp):
    p = tmp / "m.gguf"
    p.write_bytes(b"")
    return p, "empty file"


def bad_orig_shape(tmp):
    p = tmp / "m.gguf"
    write_gguf(p, "sdxl", {"w": RNG.standard_normal((2, 256)).astype(np.float32)},
               kv={"comfy.gguf.orig_shape.w": ([3, 3], gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.INT32)})
    return p, "gives shape [3, 3] for a tensor of 512 values"


BAD = {k[4:]: f for k, f in globals().items() if k.startswith("bad_")}


@pytest.mark.parametrize("case", sorted(BAD))
@pytest.mark.parametrize("command", ["convert", "inspect"])
def test_bad_gguf_is_one_line_exit_2(tmp_path, run_ckpt, case, command):
    src, problem = BAD[case](tmp_path)
    before = sorted(p.name for p in tmp_path.rglob("*"))
    args = ["convert", src, "--to", "bf16"] if command == "convert" else ["inspect", src]
    code, out, err = run_ckpt(*args)
    if command == "inspect" and case in ("arch_without_name_table", "unknown_llm_tensor", "orig_shape"):
        assert code == 0 and problem in out  # inspect reports what convert would refuse
        return
    assert code == 2, (out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {src}:") and problem in lines[0], err
    assert sorted(p.name for p in tmp_path.rglob("*")) == before
