"""`ckpt merge-lora --keep-format` on GGUF and optimum-quanto bases, and its bad inputs.

Oracles: the merged value is ckpt's own plain merge (`merge-lora --to fp32`, checked against PEFT/diffusers
elsewhere); each changed tensor must be the reference encoder applied to it, bit for bit (gguf's
`quants.quantize`; optimum-quanto's `quantize` + `freeze` on a model holding the merged weight); every other
stored key must be the input's bytes; the output must load with the reference reader (gguf's GGUFReader,
transformers' GGUF loader, quanto's `requantize` with strict loading); the reported error must be the one
measured here from the reference decoder's values.
"""

from __future__ import annotations

import json

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from gguf_helpers import hf_to_gguf, llama_permute, quantized, write_gguf
from helpers.keep_format import kohya_lora, plain_merge, rel_rms, reported

RNG = np.random.default_rng(7)


def gguf_fields(path) -> dict:
    r = gguf.GGUFReader(path)
    return {k: (list(f.types), f.contents()) for k, f in r.fields.items() if not k.startswith(("GGUF.", "ckpt."))}


def gguf_tensors(path) -> dict:
    return {t.name: t for t in gguf.GGUFReader(path).tensors}


# ---- GGUF (ComfyUI-GGUF diffusion layout) -------------------------------------------------------------

def test_gguf_changed_tensors_requantized_in_their_type_the_rest_byte_identical(tmp_path, run_ckpt, monkeypatch):
    import ckpt.io.output as output

    monkeypatch.setattr(output, "BAND_ELEMS", 1000)  # several bands per tensor: bands never cross a block row
    types = {"blocks.0.ffn.0.weight": T.Q8_0, "blocks.0.ffn.2.weight": T.Q4_0, "blocks.0.self_attn.q.weight": T.Q4_1,
             "blocks.0.self_attn.k.weight": T.Q5_0, "blocks.0.self_attn.v.weight": T.Q5_1,
             "blocks.0.self_attn.o.weight": T.F16, "blocks.1.ffn.0.weight": T.Q8_0}
    tensors, values = {}, {}
    for name, t in types.items():
        x = (RNG.standard_normal((64, 96)) * 0.05).astype(np.float32)
        if t == T.F16:
            tensors[name] = x.astype(np.float16)
            values[name] = x.astype(np.float16)
        else:
            tensors[name] = quantized(x, t)[0], t
    tensors["blocks.0.ffn.0.bias"] = RNG.standard_normal(64).astype(np.float32)
    kv = {"general.name": "tiny wan", "comfy.gguf.custom": 3, "x.float": 0.5}
    write_gguf(tmp_path / "m.gguf", "wan", tensors, kv)
    changed = [n for n in types if n != "blocks.1.ffn.0.weight"]
    lora = kohya_lora(tmp_path / "l.safetensors", {n[: -len(".weight")]: (64, 96) for n in changed})
    merged = plain_merge(run_ckpt, tmp_path / "m.gguf", lora, tmp_path)
    code, out, err = run_ckpt("merge-lora", tmp_path / "m.gguf", lora, "--keep-format", "-o", tmp_path / "o.gguf",
                              "--report", tmp_path / "r.json")
    assert code == 0, err
    assert "re-encoded 6 changed tensors" in out and "requantization error" in out

    src, dst = gguf_tensors(tmp_path / "m.gguf"), gguf_tensors(tmp_path / "o.gguf")
    assert list(dst) == list(src)  # same names, same order
    assert gguf_fields(tmp_path / "o.gguf") == gguf_fields(tmp_path / "m.gguf")  # every key-value, exact types
    rep = reported(tmp_path / "r.json")
    assert sorted(rep) == sorted(changed)
    for name, t in src.items():
        got = dst[name]
        assert got.tensor_type == t.tensor_type and list(got.shape) == list(t.shape)
        if name not in changed:
            assert np.asarray(got.data).tobytes() == np.asarray(t.data).tobytes(), name
            continue
        m = merged[name].numpy()
        want = gguf.quants.quantize(m, t.tensor_type) if t.tensor_type != T.F16 else m.astype(np.float16)
        assert np.asarray(got.data).tobytes() == np.asarray(want).tobytes(), name
        dec = gguf.quants.dequantize(got.data, got.tensor_type).reshape(m.shape)
        assert rep[name] == pytest.approx(rel_rms(torch.from_numpy(dec), merged[name]), rel=1e-9), name
    # what the LoRA did not touch carries no requantization noise: decoded, it is the base's decoded value
    code, _, err = run_ckpt("convert", tmp_path / "o.gguf", "--to", "fp32", "-o", tmp_path / "o.safetensors", "-q")
    assert code == 0, err
    assert torch.equal(load_file(tmp_path / "o.safetensors")["blocks.1.ffn.0.weight"],
                       merged["blocks.1.ffn.0.weight"])


def test_gguf_k_quants_changed_keep_their_type_and_other_iq_types_the_nearest_writable(tmp_path, run_ckpt, ggml_lib):
    """A changed K-quant tensor is encoded again in its own type, byte for byte what llama.cpp's quantizer writes for
    the merged values (ckpt.quant.kquants); an IQ type ckpt cannot encode without an importance matrix (IQ2_XS: ggml
    asserts one) goes to the nearest writable type."""
    from helpers import ggml_ref
    from helpers.gguf_ref import pack_blocks

    blk = 256
    q4k = pack_blocks(T.Q4_K, 32 * 2).reshape(32, -1)  # 32 rows of 512 values
    iq2 = pack_blocks(T.IQ2_XS, 32 * 2).reshape(32, -1)
    q6k_kept = pack_blocks(T.Q6_K, 16 * 2).reshape(16, -1)
    write_gguf(tmp_path / "k.gguf", "wan", {"blocks.0.ffn.0.weight": (q4k, T.Q4_K), "blocks.0.ffn.2.weight": (iq2, T.IQ2_XS),
                                            "blocks.1.ffn.0.weight": (q6k_kept, T.Q6_K)})
    lora = kohya_lora(tmp_path / "l.safetensors", {"blocks.0.ffn.0": (32, 2 * blk), "blocks.0.ffn.2": (32, 2 * blk)})
    merged = plain_merge(run_ckpt, tmp_path / "k.gguf", lora, tmp_path)
    code, out, err = run_ckpt("merge-lora", tmp_path / "k.gguf", lora, "--keep-format", "-o", tmp_path / "o.gguf")
    assert code == 0, err
    assert "Q4_K tensors changed" not in err
    assert "IQ2_XS tensors changed by the LoRA are written as Q4_0" in err
    dst = gguf_tensors(tmp_path / "o.gguf")
    assert dst["blocks.0.ffn.0.weight"].tensor_type == T.Q4_K
    assert np.asarray(dst["blocks.0.ffn.0.weight"].data).tobytes() == \
        ggml_ref.quantize("q4_K", merged["blocks.0.ffn.0.weight"].numpy())
    assert dst["blocks.0.ffn.2.weight"].tensor_type == T.Q4_0
    want = gguf.quants.quantize(merged["blocks.0.ffn.2.weight"].numpy(), T.Q4_0)
    assert np.asarray(dst["blocks.0.ffn.2.weight"].data).tobytes() == np.asarray(want).tobytes()
    assert dst["blocks.1.ffn.0.weight"].tensor_type == T.Q6_K
    assert np.asarray(dst["blocks.1.ffn.0.weight"].data).tobytes() == q6k_kept.tobytes()


def test_gguf_reshaped_sd_tensor_keeps_its_stored_rows(tmp_path, run_ckpt, monkeypatch):
    """ComfyUI-GGUF's rows of 256 + orig_shape: the merged conv weight is stored again in those rows."""
    import ckpt.io.output as output

    monkeypatch.setattr(output, "BAND_ELEMS", 2000)
    conv = (RNG.standard_normal((32, 8, 3, 3)) * 0.05).astype(np.float32)  # 2304 values = 9 rows of 256
    q, _ = quantized(conv.reshape(-1, 256), T.Q8_0)
    key = "input_blocks.1.0.in_layers.2.weight"
    write_gguf(tmp_path / "m.gguf", "sdxl", {key: (q, T.Q8_0)},
               kv={f"comfy.gguf.orig_shape.{key}": ([32, 8, 3, 3], gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.INT32)})
    g = torch.Generator().manual_seed(3)
    lora = tmp_path / "l.safetensors"
    save_file({"lora_unet_input_blocks_1_0_in_layers_2.lora_down.weight": torch.randn(4, 8, 3, 3, generator=g) * 0.1,
               "lora_unet_input_blocks_1_0_in_layers_2.lora_up.weight": torch.randn(32, 4, 1, 1, generator=g) * 0.1}, lora)
    merged = plain_merge(run_ckpt, tmp_path / "m.gguf", lora, tmp_path)
    code, _, err = run_ckpt("merge-lora", tmp_path / "m.gguf", lora, "--keep-format", "-o", tmp_path / "o.gguf", "-q")
    assert code == 0, err
    t = gguf_tensors(tmp_path / "o.gguf")[key]
    assert [int(d) for d in reversed(t.shape.tolist())] == [9, 256]
    want = gguf.quants.quantize(merged[key].numpy().reshape(-1, 256), T.Q8_0)
    assert np.asarray(t.data).tobytes() == np.asarray(want).tobytes()
    assert gguf_fields(tmp_path / "o.gguf") == gguf_fields(tmp_path / "m.gguf")


def test_gguf_llm_keeps_llama_cpp_names_and_permutes(tmp_path, run_ckpt):
    """A PEFT LoRA (HF names) on a llama Q8_0 GGUF: q/k go back through llama.cpp's permute; transformers'
    own GGUF loader reads the output as the merged model."""
    peft = pytest.importorskip("peft")
    from helpers.llm import load_strict, tiny

    model = tiny("llama")
    hf_to_gguf(model, "llama", tmp_path / "m.gguf", qtype=T.Q8_0, permute=True)
    run_ckpt("convert", tmp_path / "m.gguf", "--to", "fp32", "-o", tmp_path / "plain-base", "-q")
    base = load_strict(tmp_path / "plain-base", type(model))
    pm = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "o_proj"]))
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if "lora_" in n:
                p.add_(torch.randn(p.shape) * 0.2)
    pm.save_pretrained(tmp_path / "adapter")
    want_model = pm.merge_and_unload()
    merged = plain_merge(run_ckpt, tmp_path / "m.gguf", tmp_path / "adapter", tmp_path, name="plain")
    code, out, err = run_ckpt("merge-lora", tmp_path / "m.gguf", tmp_path / "adapter", "--keep-format",
                              "-o", tmp_path / "o.gguf", "-q")
    assert code == 0, err
    assert "re-encoded 6 changed tensors" in out
    src, dst = gguf_tensors(tmp_path / "m.gguf"), gguf_tensors(tmp_path / "o.gguf")
    assert list(dst) == list(src)
    assert gguf_fields(tmp_path / "o.gguf") == gguf_fields(tmp_path / "m.gguf")
    cfg = model.config
    for i in range(cfg.num_hidden_layers):
        for g_name, hf, heads in ((f"blk.{i}.attn_q.weight", f"model.layers.{i}.self_attn.q_proj.weight", cfg.num_attention_heads),
                                  (f"blk.{i}.attn_k.weight", f"model.layers.{i}.self_attn.k_proj.weight", cfg.num_key_value_heads),
                                  (f"blk.{i}.attn_output.weight", f"model.layers.{i}.self_attn.o_proj.weight", None)):
            x = merged[hf] if heads is None else llama_permute(merged[hf], heads)
            want = gguf.quants.quantize(x.numpy(), T.Q8_0)
            assert np.asarray(dst[g_name].data).tobytes() == np.asarray(want).tobytes(), g_name
        v = f"blk.{i}.attn_v.weight"
        assert np.asarray(dst[v].data).tobytes() == np.asarray(src[v].data).tobytes()
    transformers = pytest.importorskip("transformers")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="o.gguf", dtype=torch.float32)
    got = loaded.state_dict()
    for k, v in want_model.state_dict().items():  # the merged model, within Q8_0's rounding
        assert rel_rms(got[k], v) < 0.01, k


# ---- optimum-quanto -------------------------------------------------------------------------------------

quanto = pytest.importorskip("optimum.quanto")


def _tiny(dtype):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(256, 64), torch.nn.ReLU(), torch.nn.Linear(64, 48),
                               torch.nn.Linear(48, 1)).to(dtype)


def _quantized(qtype, dtype):
    m = _tiny(dtype)
    quanto.quantize(m, weights=qtype)
    quanto.freeze(m)
    return m


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and tuple(a.shape) == tuple(b.shape) and torch.equal(
        a.contiguous().view(torch.uint8) if a.dtype.itemsize == 1 else a, b.contiguous().view(torch.uint8) if b.dtype.itemsize == 1 else b)


@pytest.mark.parametrize("qname,dtype", [("qint8", torch.bfloat16), ("qfloat8", torch.float16), ("qint4", torch.bfloat16),
                                         ("qint4", torch.float32), ("qint2", torch.float16)])
def test_quanto_changed_weights_are_quantos_own_quantize_of_the_merge(tmp_path, run_ckpt, qname, dtype, monkeypatch):
    import ckpt.io.output as output

    monkeypatch.setattr(output, "BAND_ELEMS", 3000)  # packed rows interleave: bands read the merge in pieces
    qtype = quanto.qtypes[{"qfloat8": "qfloat8_e4m3fn"}.get(qname, qname)]
    m = _quantized(qtype, dtype)
    folder = tmp_path / "base"
    folder.mkdir()
    sd = {k: v.contiguous() for k, v in m.state_dict().items()}
    save_file(sd, folder / "model.safetensors", metadata={"format": "pt", "note": "tiny"})
    (folder / "quanto_qmap.json").write_text(json.dumps(quanto.quantization_map(m)))
    lora = kohya_lora(tmp_path / "l.safetensors", {"0": (64, 256), "3": (1, 48)}, seed=1)
    merged = plain_merge(run_ckpt, folder, lora, tmp_path, name="plain")
    code, out, err = run_ckpt("merge-lora", folder, lora, "--keep-format", "-o", tmp_path / "out",
                              "--report", tmp_path / "r.json")
    assert code == 0, err
    got = load_file(tmp_path / "out" / "model.safetensors")
    assert list(got) == list(load_file(folder / "model.safetensors"))  # stored order
    assert (tmp_path / "out" / "quanto_qmap.json").read_bytes() == (folder / "quanto_qmap.json").read_bytes()
    with safe_open(tmp_path / "out" / "model.safetensors", "pt") as f:
        assert f.metadata()["note"] == "tiny"

    # the reference: quanto quantizes a model whose changed weights hold the fp32 merge (in the module dtype)
    ref = _tiny(dtype)
    plain = {k: v for k, v in ref.state_dict().items()}
    for i in (0, 2, 3):
        plain[f"{i}.weight"] = merged[f"{i}.weight"].to(dtype)
        plain[f"{i}.bias"] = merged[f"{i}.bias"].to(dtype)
    ref.load_state_dict(plain)
    quanto.quantize(ref, weights=qtype)
    quanto.freeze(ref)
    want = ref.state_dict()
    for k in got:
        if k.startswith(("0.weight", "3.weight")):
            assert _same(got[k], want[k]), k
        else:
            assert _same(got[k], sd[k]), k  # unchanged: the input's bytes

    # loads strictly the optimum-quanto way, and the reported error is the measured one
    fresh = _tiny(dtype)
    quanto.requantize(fresh, got, json.loads((folder / "quanto_qmap.json").read_text()), device=torch.device("cpu"))
    rep = reported(tmp_path / "r.json")
    assert sorted(rep) == ["0.weight", "3.weight"]
    for i in (0, 3):
        dec = fresh[i].weight.dequantize().float()
        assert rep[f"{i}.weight"] == pytest.approx(rel_rms(dec, merged[f"{i}.weight"]), rel=1e-9)


def test_quanto_integer_shift_stays_integer(tmp_path, run_ckpt):
    """A qint4 weight quantized with a zero-point (uint8 shift) is encoded again with one."""
    from optimum.quanto.tensor.optimizers import MaxOptimizer

    lin = torch.nn.Linear(256, 32).to(torch.float32)
    opt = MaxOptimizer()
    scale, shift = opt(lin.weight.detach(), qtype=quanto.qint4, axis=0, group_size=128, zeropoint=True)
    q = quanto.quantize_weight(lin.weight.detach(), qtype=quanto.qint4, axis=0, scale=scale, shift=shift,
                               group_size=128, optimized=False)
    sd = {"l.weight._data._data": q._data._data.contiguous(), "l.weight._scale": q._scale.contiguous(),
          "l.weight._shift": q._shift.contiguous(), "l.bias": lin.bias.detach().clone()}
    assert sd["l.weight._shift"].dtype == torch.uint8
    save_file(sd, tmp_path / "b.safetensors")
    lora = kohya_lora(tmp_path / "l.safetensors", {"l": (32, 256)})
    merged = plain_merge(run_ckpt, tmp_path / "b.safetensors", lora, tmp_path)
    code, _, err = run_ckpt("merge-lora", tmp_path / "b.safetensors", lora, "--keep-format", "-o", tmp_path / "o.safetensors", "-q")
    assert code == 0, err
    got = load_file(tmp_path / "o.safetensors")
    w = merged["l.weight"]
    s2, z2 = opt(w, qtype=quanto.qint4, axis=0, group_size=128, zeropoint=True)
    want = quanto.quantize_weight(w, qtype=quanto.qint4, axis=0, scale=s2, shift=z2, group_size=128, optimized=False)
    assert _same(got["l.weight._data._data"], want._data._data)
    assert _same(got["l.weight._scale"], want._scale) and _same(got["l.weight._shift"], want._shift)


# ---- bad input: one line, exit 2, nothing written ------------------------------------------------------

def _plain_base(tmp_path):
    save_file({"a.weight": torch.randn(8, 6), "a.bias": torch.zeros(8)}, tmp_path / "plain.safetensors")
    return tmp_path / "plain.safetensors", kohya_lora(tmp_path / "pl.safetensors", {"a": (8, 6)})


def _gguf_base(tmp_path):
    x = (RNG.standard_normal((8, 32)) * 0.1).astype(np.float32)
    write_gguf(tmp_path / "m.gguf", "wan", {"blocks.0.ffn.0.weight": (quantized(x, T.Q8_0)[0], T.Q8_0)})
    return tmp_path / "m.gguf", kohya_lora(tmp_path / "gl.safetensors", {"blocks.0.ffn.0": (8, 32)})


def _bnb_base(tmp_path):
    F = pytest.importorskip("bitsandbytes.functional")
    q, st = F.quantize_4bit(torch.randn(16, 64), blocksize=64, quant_type="nf4")
    sd = {"l.weight": q} | {f"l.weight.{k}": v for k, v in st.as_dict(packed=True).items()}
    save_file(sd, tmp_path / "nf4.safetensors")
    return tmp_path / "nf4.safetensors", kohya_lora(tmp_path / "bl.safetensors", {"l": (16, 64)})


def _hf_block_fp8_base(tmp_path):
    w = torch.randn(128, 128).to(torch.float8_e4m3fn)
    save_file({"l.weight": w, "l.weight_scale_inv": torch.ones(1, 1)}, tmp_path / "fp8.safetensors")
    return tmp_path / "fp8.safetensors", kohya_lora(tmp_path / "fl.safetensors", {"l": (128, 128)})


BAD = {
    "plain base": (_plain_base, [], "stores plain tensors (no quantized encoding to keep)"),
    "--to with --keep-format": (_gguf_base, ["--to", "bf16"], "--to bf16 and --keep-format: choose one"),
    "gguf base, --format torch": (_gguf_base, ["--format", "torch"], "is a GGUF file, and so is the output"),
    "gguf base, -o x.safetensors": (_gguf_base, ["-o", "{tmp}/x.safetensors"], "name it .gguf"),
    "format without an encoder": (_hf_block_fp8_base, [], "has no encoder"),
    "bitsandbytes": (_bnb_base, [], "bitsandbytes is decoded only"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_keep_format_is_one_line_exit_2_nothing_written(tmp_path, run_ckpt, case):
    make, extra, message = BAD[case]
    base, lora = make(tmp_path)
    before = sorted(p.name for p in tmp_path.iterdir())
    args = [a.replace("{tmp}", str(tmp_path)) for a in extra]
    code, out, err = run_ckpt("merge-lora", base, lora, "--keep-format", *args)
    assert code == 2, (out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], err
    assert sorted(p.name for p in tmp_path.iterdir()) == before
