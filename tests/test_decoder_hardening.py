"""Issue #20, one test per reproduction: decoders check every companion they consume (1), a config.json
that is not a JSON object (2), inspect's parameter counts for quantized layouts (3), a legacy
optimum-quanto pickle whose weight is a nested dict (4).

Files are made by the formats' own libraries (bitsandbytes, comfy-kitchen, optimum-quanto) and then
broken the way the filer broke them. Bad input: exit 2, one `error: <file>: ...` line naming the key, what
it is and what was expected, nothing written, the input unchanged. Fuzzed versions of the same property:
tests/test_decoder_fuzz.py.
"""

from __future__ import annotations

import hashlib
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

E4 = torch.float8_e4m3fn


def _digest(folder) -> dict:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else None
            for p in sorted(folder.rglob("*"))}


def assert_refused(run_ckpt, folder, args, culprit, *needles):
    """One `error: CULPRIT...` line with every needle, exit 2, nothing written, FOLDER byte for byte as it was."""
    before = _digest(folder)
    code, out, err = run_ckpt(*args)
    assert code == 2, (code, out, err)
    assert err.startswith(f"error: {culprit}") and err.count("\n") == 1, err
    for n in needles:
        assert n in err, (n, err)
    assert _digest(folder) == before, "something was written or changed"
    return err


def _save(tmp_path, sd, name="q.safetensors", metadata=None):
    p = tmp_path / name
    save_file({k: v.contiguous() for k, v in sd.items()}, p, metadata=metadata)
    return p


def _both(run_ckpt, tmp_path, src, *needles):
    """Refused by convert and by dequant alike (both read through the one logical view)."""
    for args in (("convert", src, "--to", "bf16"), ("dequant", src)):
        assert_refused(run_ckpt, tmp_path, args, f"{src}:", *needles)


# ---------------------------------------------------------------- 1. companions: dtype and shape


def _nf4(nested=True, quant_type="nf4", shape=(16, 64)):
    from helpers.bnb_ref import bnb_4bit

    w = (torch.randn(shape, generator=torch.Generator().manual_seed(1)) * 0.1).bfloat16()
    return bnb_4bit(w, quant_type, 64, nested, "m.weight")


@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
def test_bnb_packed_weight_stored_as_float32_is_refused(tmp_path, run_ckpt, quant_type):
    sd, _ = _nf4(quant_type=quant_type)
    assert sd["m.weight"].dtype == torch.uint8 and tuple(sd["m.weight"].shape) == (512, 1)
    src = _save(tmp_path, sd | {"m.weight": sd["m.weight"].float()})  # the filer's mutant: 4x the bytes
    _both(run_ckpt, tmp_path, src, "'m.weight'", "F32 [512, 1]", "expected 512 bytes")


def test_bnb_int64_nested_absmax_is_refused(tmp_path, run_ckpt):
    sd, _ = _nf4()
    key = "m.weight.nested_absmax"
    src = _save(tmp_path, sd | {key: sd[key].to(torch.int64)})
    _both(run_ckpt, tmp_path, src, f"'{key}'", "I64", "expected F32")


@pytest.mark.parametrize("key,mutant,needle", [
    ("m.weight.absmax", lambda t: t.reshape(2, -1), "expected U8, shape [16]"),  # read per block: rows matter
    ("m.weight.nested_quant_map", lambda t: t.half(), "expected F32"),
    ("m.weight.quant_state.bitsandbytes__nf4", lambda t: t.to(torch.int64), "expected U8"),
])
def test_bnb_other_companions_checked(tmp_path, run_ckpt, key, mutant, needle):
    sd, _ = _nf4()
    src = _save(tmp_path, sd | {key: mutant(sd[key])})
    _both(run_ckpt, tmp_path, src, f"'{key}'", needle)


def _int8_layer(prefix, rows=8, cols=32, seed=0):
    F = pytest.importorskip("bitsandbytes.functional")
    cb, scb, _ = F.int8_vectorwise_quant(torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed)))
    return {f"{prefix}.weight": cb, f"{prefix}.SCB": scb, f"{prefix}.weight_format": torch.tensor(0, dtype=torch.uint8)}


def test_llm_int8_layer_without_scb_is_refused(tmp_path, run_ckpt):
    # the layer alone (its weight_format says LLM.int8)
    sd = _int8_layer("a")
    src = _save(tmp_path, {k: v for k, v in sd.items() if k != "a.SCB"}, "one.safetensors")
    _both(run_ckpt, tmp_path, src, "'a.weight_format'", "no row scales 'a.SCB'")
    # beside a complete layer, without weight_format either
    sd = _int8_layer("a") | _int8_layer("b", seed=1)
    src = _save(tmp_path, {k: v for k, v in sd.items() if k not in ("b.SCB", "b.weight_format")}, "two.safetensors")
    _both(run_ckpt, tmp_path, src, "'b.weight'", "without row scales 'b.SCB'")
    # a transformers folder: config.json says load_in_8bit
    folder = tmp_path / "hf"
    folder.mkdir()
    _save(folder, {"a.weight": sd["a.weight"], "norm.weight": torch.ones(32)}, "model.safetensors")
    (folder / "config.json").write_text(json.dumps({"quantization_config": {"quant_method": "bitsandbytes",
                                                                            "load_in_8bit": True}}))
    for args in (("convert", folder, "--to", "bf16"), ("dequant", folder)):
        assert_refused(run_ckpt, tmp_path, args, f"{folder / 'model.safetensors'}:", "'a.weight'", "'a.SCB'")


def test_llm_int8_scb_and_weight_shapes(tmp_path, run_ckpt):
    sd = _int8_layer("a")
    src = _save(tmp_path, sd | {"a.SCB": sd["a.SCB"].double()}, "f64.safetensors")
    _both(run_ckpt, tmp_path, src, "'a.SCB'", "F64 [8]", "expected F32")
    src = _save(tmp_path, sd | {"a.weight": sd["a.weight"].reshape(8, 32, 1)}, "3d.safetensors")
    _both(run_ckpt, tmp_path, src, "needs an int8 matrix 'a.weight'")


def _comfy(fmt, rowwise=False, shape=(32, 64)):
    from helpers.comfy_ref import ck_quantize, conf_tensor, weight

    _, _, saved = ck_quantize(fmt, weight(shape), rowwise)
    return {f"l.weight{k}": v for k, v in saved.items()} | {"l.comfy_quant": conf_tensor({"format": fmt})}


@pytest.mark.parametrize("fmt,key,mutant,needles", [
    ("nvfp4", "l.weight_scale_2", lambda t: t.to(torch.int64), ("I64", "expected a floating dtype")),
    ("nvfp4", "l.weight_scale", lambda t: t.reshape(64, -1), ("[64, 8]", "[128, 4]")),
    ("mxfp8", "l.weight_scale", lambda t: t.view(torch.uint8).reshape(256, -1), ("[256, 2]", "[128, 4]")),
    ("mxfp8", "l.weight_scale", lambda t: t.view(torch.uint8).float(), ("stored as F32",)),
    ("int8_tensorwise", "l.weight_scale", lambda t: t.to(torch.int64), ("I64", "expected a floating dtype")),
    ("int8_rowwise", "l.weight_scale", lambda t: t.reshape(-1), ("[32]", "[32, 1], as comfy-kitchen")),
    ("nvfp4", "l.comfy_quant", lambda t: t.to(torch.int64), ("I64", "expected U8")),
    ("int8_tensorwise", "l.weight", lambda t: t.reshape(1, 32, 64), ("3-D",)),
], ids=["nvfp4-global-i64", "nvfp4-blocks-reshaped", "mxfp8-blocks-reshaped", "mxfp8-blocks-f32", "int8-scale-i64",
        "int8-row-scale-1d", "config-i64", "int8-3d"])
def test_comfy_quant_companions_checked(tmp_path, run_ckpt, fmt, key, mutant, needles):
    sd = _comfy("int8_tensorwise" if fmt == "int8_rowwise" else fmt, rowwise=fmt == "int8_rowwise")
    src = _save(tmp_path, sd | {key: mutant(sd[key])})
    _both(run_ckpt, tmp_path, src, f"'{key}'", *needles)


def test_comfy_fp8_weight_of_the_other_fp8_kind_is_refused(tmp_path, run_ckpt):
    from helpers.comfy_ref import conf_tensor

    sd = {"l.weight": torch.randn(16, 32).to(torch.float8_e5m2), "l.weight_scale": torch.tensor(0.01),
          "l.comfy_quant": conf_tensor({"format": "float8_e4m3fn"})}
    _both(run_ckpt, tmp_path, _save(tmp_path, sd), "'l.weight'", "F8_E5M2, not F8_E4M3")


def _fp8(shape, seed=0):
    return (torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 40).to(E4)


@pytest.mark.parametrize("sd,key,needles", [
    # kohya: a second-level scale of two values (read as one scalar), an fp8 scale, a weight whose scale is gone
    ({"a.weight": _fp8((8, 16)), "a.scale_weight": torch.ones(8, 1), "a.scale_weight_tensor": torch.ones(2)},
     "a.scale_weight_tensor", ("F32 [2]", "expected a floating dtype, 1 value")),
    ({"a.weight": _fp8((8, 16)), "a.scale_weight": torch.ones(8, 1).to(E4)}, "a.scale_weight", ("stored as F8_E4M3",)),
    ({"a.weight": _fp8((8, 16)), "a.scale_weight": torch.ones(8, 1), "b.weight": _fp8((8, 16), 1)}, "b.weight",
     ("has no scale", "1 other FP8 weight")),
    # block FP8: a scale that fits only as per-row scales is no block scale; a 1-D weight has no blocks
    ({"a.weight": _fp8((2, 300)), "a.weight_scale_inv": torch.ones(2, 3)}, "a.weight_scale_inv",
     ("block scale", "needs [1, 3]")),
    ({"a.weight": _fp8((64,)), "a.weight_scale_inv": torch.ones(1, 1)}, "a.weight", ("blocks tile",)),
    # weight_scale FP8: one layer lost its scale
    ({"a.weight": _fp8((8, 16)), "a.weight_scale": torch.ones(8, 1), "b.weight": _fp8((8, 16), 1),
      "b.input_scale": torch.tensor(1.0)}, "b.weight", ("has no scale",)),
], ids=["kohya-tensor-scale-2", "kohya-fp8-scale", "kohya-lost-scale", "block-row-fit", "block-1d", "ct-lost-scale"])
def test_fp8_scaled_layout_companions_checked(tmp_path, run_ckpt, sd, key, needles):
    _both(run_ckpt, tmp_path, _save(tmp_path, sd), f"'{key}'", *needles)


def _quanto_sd(qtype):
    oq = pytest.importorskip("optimum.quanto")
    torch.manual_seed(0)
    m = torch.nn.ModuleDict({"lin": torch.nn.Linear(64, 32)}).half()
    oq.quantize(m, weights=oq.qtypes[qtype])
    oq.freeze(m)
    return {k: v.contiguous() for k, v in m.state_dict().items()}


@pytest.mark.parametrize("qtype,key,mutant,needles", [
    ("qint4", "lin.weight._shift", lambda t: t.to(torch.int64), ("I64", "expected F16 or U8 or I8")),
    ("qint8", "lin.weight._scale", lambda t: t.to(E4), ("F8_E4M3", "expected F32 or F16 or BF16")),
    ("qint8", "lin.weight._data", lambda t: t.reshape(32, 64, 1), ("does not fit 'lin.weight._data' [32, 64, 1]",)),
], ids=["shift-i64", "scale-fp8", "data-rank-3"])
def test_quanto_companions_checked(tmp_path, run_ckpt, qtype, key, mutant, needles):
    sd = _quanto_sd(qtype)
    src = _save(tmp_path, sd | {key: mutant(sd[key])})
    assert_refused(run_ckpt, tmp_path, ("dequant", src), f"{src}:", *needles)


# ---------------------------------------------------------------- 2. config.json that is not a JSON object


@pytest.mark.parametrize("text,needle", [("[1, 2]", "holds a JSON list"), ('"abc"', "holds a JSON string"),
                                         ("null", "holds a JSON null"), ("{\"a\": ", "is not valid JSON"),
                                         ("\xff\xfe{}", "is not UTF-8 text")], ids=["list", "string", "null", "broken",
                                                                              "not-utf8"])
def test_config_json_not_an_object(tmp_path, run_ckpt, text, needle):
    folder = tmp_path / "model"
    folder.mkdir()
    _save(folder, {"double_blocks.0.img_attn.qkv.weight": torch.zeros(12, 4), "img_in.weight": torch.zeros(4, 4)},
          "model.safetensors")
    (folder / "config.json").write_bytes(text.encode("latin-1"))
    for args in (("inspect", folder), ("convert", folder, "--to", "fp16"), ("convert", folder, "--layout", "diffusers"),
                 ("dequant", folder)):
        assert_refused(run_ckpt, tmp_path, args, f"{folder / 'config.json'}:", needle)


# ---------------------------------------------------------------- 3. inspect counts logical parameters


def _inspect(run_ckpt, src) -> dict:
    code, out, err = run_ckpt("inspect", src, "--json")
    assert code == 0, err
    (c,) = json.loads(out)["components"]
    return c


def test_inspect_counts_the_plain_model_parameters_of_quantized_layouts(tmp_path, run_ckpt):
    from helpers.bnb_ref import bnb_4bit
    from helpers.comfy_ref import ck_quantize, conf_tensor, weight

    g = torch.Generator().manual_seed(2)
    sd = {}
    for name, shape in (("a", (24, 64)), ("b", (40, 72))):
        part, _ = bnb_4bit((torch.randn(shape, generator=g) * 0.1).bfloat16(), "nf4", 64, True, f"{name}.weight")
        sd |= part
    sd["a.bias"] = torch.zeros(24, dtype=torch.bfloat16)
    c = _inspect(run_ckpt, _save(tmp_path, sd, "bnb.safetensors"))
    assert c["parameters"] == 24 * 64 + 40 * 72 + 24  # not the packed bytes (half) plus absmax and tables
    assert c["dtypes"]["u8"]["parameters"] == 24 * 64 + 40 * 72 and c["dtypes"]["fp32"]["parameters"] == 0
    assert c["tensors"] == len(sd) and c["bytes"] == sum(t.numel() * t.element_size() for t in sd.values())
    # nvfp4 padded by comfy-kitchen to (48, 80), two values a byte: the layer config's orig_shape counts
    _, _, saved = ck_quantize("nvfp4", weight((40, 72)))
    sd = {f"l.weight{k}": v for k, v in saved.items()} | {
        "l.comfy_quant": conf_tensor({"format": "nvfp4", "orig_shape": [40, 72]}), "l.bias": torch.zeros(40)}
    assert c["parameters"] != sum(t.numel() for t in sd.values())
    assert _inspect(run_ckpt, _save(tmp_path, sd, "nvfp4.safetensors"))["parameters"] == 40 * 72 + 40
    # quanto qint4: packed rows, scale and shift per row, activation scales
    assert _inspect(run_ckpt, _save(tmp_path, _quanto_sd("qint4"), "q4.safetensors"))["parameters"] == 32 * 64 + 32
    # text output: the same count
    code, out, _ = run_ckpt("inspect", tmp_path / "q4.safetensors")
    assert code == 0 and "parameters 2.08K" in out


def test_inspect_of_an_undecodable_layout_counts_stored_elements(tmp_path, run_ckpt):
    sd, _ = _nf4()
    sd["m.weight.nested_absmax"] = sd["m.weight.nested_absmax"].to(torch.int64)
    c = _inspect(run_ckpt, _save(tmp_path, sd))
    assert any(w.startswith("cannot be decoded by ckpt:") and "nested_absmax" in w for w in c["warnings"])
    assert c["parameters"] == sum(t.numel() for t in sd.values())


# ---------------------------------------------------------------- 4. legacy quanto pickle, nested dict


def test_legacy_quanto_pickle_with_a_nested_weight_dict(tmp_path, run_ckpt):
    """optimum-quanto <= 0.2.2 era pickle whose weight is a dict of its three stored tensors (and strings):
    it was summarised as "1 tensor 8 params" (the bias) and the weight left out of every output."""
    from helpers.quanto_ref import int_shift_weight, unpack_by_definition

    qw = int_shift_weight(torch.float16)
    parts: dict = {}
    qw.save_to_state_dict(parts, "", False)
    packed, scale, shift = parts["_data._data"], parts["_scale"], parts["_shift"]
    codes = unpack_by_definition(packed, 4, scale.shape[0]).to(torch.int8)
    want = (scale * (codes - shift.to(torch.int8))).reshape(32, 256)
    assert torch.equal(want, qw.dequantize())
    src = tmp_path / "old.pt"
    torch.save({"lin.weight": {"_data": {"_data": packed}, "_scale": scale, "_zeropoint": shift, "qtype": "qint4",
                               "size": "[32, 256]"},
                "lin.bias": torch.zeros(32, dtype=torch.float16), "lin.weight_qtype": "qint4"}, src)
    c = _inspect(run_ckpt, src)
    assert c["tensors"] == 4 and c["parameters"] == 32 * 256 + 32
    assert "optimum-quanto qint4/qint2 (packed)" in c["encodings"]
    assert any("3 tensors stored in nested dicts" in n and "lin.weight._data._data" in n for n in c["notes"])
    code, out, err = run_ckpt("inspect", src)
    assert code == 0 and "tensors     4   parameters 8.22K" in out, out
    code, _, err = run_ckpt("dequant", src, "-o", tmp_path / "plain.safetensors", "-q")
    assert code == 0, err
    got = load_file(tmp_path / "plain.safetensors")
    assert sorted(got) == ["lin.bias", "lin.weight"] and torch.equal(got["lin.weight"], want)


def test_pickle_name_given_flat_and_nested_is_refused(tmp_path, run_ckpt):
    src = tmp_path / "twice.pt"
    torch.save({"a.b": torch.ones(2), "a": {"b": torch.zeros(2)}}, src)
    assert_refused(run_ckpt, tmp_path, ("inspect", src), f"{src}:", "'a.b' twice")
