"""compressed-tensors (llm-compressor) checkpoints decoded by `ckpt dequant` / `ckpt convert`, bit for bit.

Oracle: the `compressed-tensors` package (0.20.0) itself, end to end (`helpers.ct_ref`): tiny bf16 Llamas
(no downloads) get a `QuantizationConfig` applied by the package (it decides which group each module gets),
min/max qparams, and are compressed and saved by `ModelCompressor`; the expected weights are the package's own
per-module `decompress` of the saved tensors. ckpt must give the same dtype and the same bits: integer packs
(dense 1..8-bit packing, 3-bit codes straddling words), naive int8, NVFP4, a mixed config (several groups,
class/regex/exact targets, an ignore list, two formats). What every format owes (a strict transformers load of
the output, `convert`, bands, no stored part left) is the conformance test's: tests/test_quant_formats.py.
"""

from __future__ import annotations

import json

import pytest
import torch
from helpers.refusals import assert_refused, edit_saved
from safetensors.torch import load_file

pytest.importorskip("compressed_tensors", reason="compressed-tensors is not installed (the oracle)")
pytest.importorskip("loguru")

from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme  # noqa: E402
from compressed_tensors.quantization.quant_scheme import NVFP4A16  # noqa: E402
from helpers import ct_ref  # noqa: E402


def bits_equal(a, b):
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    view = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[a.element_size()]
    return torch.equal(a.contiguous().view(view), b.contiguous().view(view))


int_args, linear = ct_ref.int_args, ct_ref.linear
MIXED, MIXED_IGNORE = ct_ref.mixed()


CASES = {
    "int4 group asym": ({"group_0": linear(int_args(4, "group", 32, False))}, None),
    "int4 group sym": ({"group_0": linear(int_args(4, "group", 32))}, None),
    "int8 channel sym": ({"group_0": linear(int_args(8, "channel"))}, None),
    "int8 channel asym": ({"group_0": linear(int_args(8, "channel", symmetric=False))}, None),
    "int3 channel asym (codes straddle words)": ({"group_0": linear(int_args(3, "channel", symmetric=False))}, None),
    "int2 tensor asym": ({"group_0": linear(int_args(2, "tensor", symmetric=False))}, None),
    "int6 group sym": ({"group_0": linear(int_args(6, "group", 16))}, None),
    "naive int8 channel": ({"group_0": linear(int_args(8, "channel"))}, "naive-quantized"),
    "naive int8 group asym": ({"group_0": linear(int_args(8, "group", 32, False))}, "naive-quantized"),
    "nvfp4": ({"group_0": QuantizationScheme(targets=["Linear"], **NVFP4A16)}, None),
}


def _dequant(run_ckpt, src, out, *extra):
    code, _, err = run_ckpt("dequant", src, "-o", out, "-q", *extra)
    assert code == 0, err
    return load_file(out / "model.safetensors")


def _check(out, expected, stored_keys):
    assert not any(k.endswith((".weight_packed", ".weight_scale", ".weight_zero_point", ".weight_shape",
                               ".weight_global_scale")) for k in out)
    for name, want in expected.items():
        assert bits_equal(out[name], want), (name, out[name].dtype, want.dtype)


@pytest.mark.parametrize("case", list(CASES))
def test_dequant_equals_compressed_tensors_bit_for_bit(tmp_path, run_ckpt, case):
    groups, fmt = CASES[case]
    schemes = ct_ref.build(tmp_path / "q", groups, ignore=["lm_head"], fmt=fmt)
    assert len(schemes) == 14  # every Linear of both decoder layers
    expected = ct_ref.oracle(tmp_path / "q", schemes)
    out = _dequant(run_ckpt, tmp_path / "q", tmp_path / "plain")
    _check(out, expected, load_file(tmp_path / "q" / "model.safetensors"))
    assert set(out) == set(ct_ref.tiny_llama()[1].state_dict())  # every model key, nothing extra


def test_fp32_scales_decode_in_fp32(tmp_path, run_ckpt):
    """The package returns the scale's dtype: an fp32 model's scales are fp32, and so is the output."""
    schemes = ct_ref.build(tmp_path / "q", {"g": linear(int_args(4, "group", 32, False))}, ignore=["lm_head"],
                           dtype=torch.float32)
    expected = ct_ref.oracle(tmp_path / "q", schemes)
    assert all(v.dtype == torch.float32 for v in expected.values())
    _check(_dequant(run_ckpt, tmp_path / "q", tmp_path / "plain"), expected, None)


def test_mixed_groups_and_ignore_list(tmp_path, run_ckpt):
    schemes = ct_ref.build(tmp_path / "q", MIXED, ignore=MIXED_IGNORE)
    qc = json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]
    assert qc["format"] == "mixed-precision"
    fmts = {n: s.format.value for n, s in schemes.items()}
    assert fmts["model.layers.1.mlp.up_proj"] == "pack-quantized" and fmts["model.layers.0.mlp.up_proj"] != fmts[
        "model.layers.1.mlp.up_proj"]  # the exact name won over the nvfp4 regex
    assert "model.layers.0.mlp.down_proj" not in schemes and "model.layers.1.self_attn.o_proj" not in schemes
    assert len(set(fmts.values())) == 2 and len(schemes) == 12
    expected = ct_ref.oracle(tmp_path / "q", schemes)
    out = _dequant(run_ckpt, tmp_path / "q", tmp_path / "plain")
    _check(out, expected, None)
    stored = load_file(tmp_path / "q" / "model.safetensors")
    for plain in ("model.layers.0.mlp.down_proj.weight", "model.layers.1.self_attn.o_proj.weight", "lm_head.weight"):
        assert bits_equal(out[plain], stored[plain])  # ignored modules pass through untouched


def test_fp8_group_beside_int4_is_left_to_the_fp8_decoder(tmp_path, run_ckpt):
    """An FP8 group (float 8-bit weights, stored as fp8 `weight` + `weight_scale`: the package's naive-quantized
    for weight-only FP8) is decoded by ckpt's FP8 decoder, the int4 group by this one: both bit for bit."""
    groups = {"fp8": linear(QuantizationArgs(num_bits=8, type="float", strategy="channel"),
                            targets=["re:.*self_attn\\..*"]),
              "int4": linear(int_args(4, "group", 32, False))}
    schemes = ct_ref.build(tmp_path / "q", groups, ignore=["lm_head"])
    assert {s.format.value for s in schemes.values()} == {"naive-quantized", "pack-quantized"}
    stored = load_file(tmp_path / "q" / "model.safetensors")
    assert stored["model.layers.0.self_attn.q_proj.weight"].dtype == torch.float8_e4m3fn
    expected = ct_ref.oracle(tmp_path / "q", schemes)
    _check(_dequant(run_ckpt, tmp_path / "q", tmp_path / "plain"), expected, None)


def test_dense_uncompressed_save_keeps_its_float_weights(tmp_path, run_ckpt):
    """A frozen, uncompressed save (format dense: float weights beside their qparams) is already plain: the
    weights pass through, the qparams are dropped, the config removed."""
    ct_ref.build(tmp_path / "q", {"g": linear(int_args(4, "group", 32, False))}, ignore=["lm_head"], fmt="dense")
    stored = load_file(tmp_path / "q" / "model.safetensors")
    assert stored[f"{L}.weight"].dtype == torch.bfloat16 and f"{L}.weight_scale" in stored
    out = _dequant(run_ckpt, tmp_path / "q", tmp_path / "plain")
    assert set(out) == set(ct_ref.tiny_llama()[1].state_dict())
    assert all(bits_equal(out[k], stored[k]) for k in out)
    assert "quantization_config" not in json.loads((tmp_path / "plain" / "config.json").read_text())


# --- bad input: one line, exit 2, nothing written -----------------------------------------------------

L = "model.layers.0.self_attn.q_proj"


def _bad(folder, case):
    groups = {"group_0": linear(int_args(4, "group", 32, False))}
    ct_ref.build(folder, groups, ignore=["lm_head"])
    stored = load_file(folder / "model.safetensors")
    n, words = stored[f"{L}.weight_packed"].shape
    edits = {
        "weight_shape wider than weight_packed": dict(tensors={f"{L}.weight_shape": torch.tensor([n, words * 8 + 32])}),
        "weight_shape rows": dict(tensors={f"{L}.weight_shape": torch.tensor([n + 1, words * 8])}),
        "missing weight_scale": dict(drop=[f"{L}.weight_scale"]),
        "missing weight_shape": dict(drop=[f"{L}.weight_shape"]),
        "missing zero point": dict(drop=[f"{L}.weight_zero_point"]),
        "scale shape": dict(tensors={f"{L}.weight_scale": torch.ones(n, 3, dtype=torch.bfloat16)}),
        "unsupported num_bits": dict(qc={"config_groups": {"group_0": {
            "targets": ["Linear"], "format": "pack-quantized",
            "weights": {"num_bits": 16, "type": "int", "strategy": "group", "group_size": 32, "symmetric": False}}}}),
        "sparse-24": dict(qc={"sparsity_config": {"format": "sparse-24-bitmask", "targets": ["Linear"]}}),
        "g_idx": dict(tensors={f"{L}.weight_g_idx": torch.zeros(words * 8, dtype=torch.int32)}),
        "ignored but packed": dict(qc={"ignore": ["lm_head", L]}),
        "ignore not a list": dict(qc={"ignore": True}),
        "config_groups not an object": dict(qc={"config_groups": 5}),
        "config says naive": dict(qc={"format": "naive-quantized", "config_groups": {"group_0": {
            "targets": ["Linear"], "format": "naive-quantized",
            "weights": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 32, "symmetric": False}}}}),
    }
    edit_saved(folder, **edits[case])


BAD = {
    "weight_shape wider than weight_packed": "weight_shape [64, 96] disagrees with weight_packed [64, 8]",
    "weight_shape rows": "disagrees with weight_packed",
    "missing weight_scale": f"weight_scale '{L}.weight_scale' is missing",
    "missing weight_shape": f"weight_shape '{L}.weight_shape' is missing",
    "missing zero point": "zero point",
    "scale shape": "strategy group needs",
    "unsupported num_bits": "num_bits 16 is not supported",
    "sparse-24": "sparse-24",
    "g_idx": "actorder group",
    "ignored but packed": "an ignore entry names it",
    "ignore not a list": "compressed-tensors ignore is boolean, not a list of module names or patterns",
    "config_groups not an object": "compressed-tensors config_groups is not an object",
    "config says naive": "says naive-quantized",
}


def test_pre_020_packing_refused_by_name(tmp_path, run_ckpt, capsys):
    """Before 0.20, compressed-tensors put 32 // bits codes in each word (10 3-bit codes, 2 bits unused); 0.20
    packs densely. A 3-bit weight_packed only the old width fits is refused by name, not misread."""
    ct_ref.build(tmp_path / "q", {"g": linear(int_args(3, "channel"))}, ignore=["lm_head"])
    n, k = 64, 64
    edit_saved(tmp_path / "q", tensors={f"{L}.weight_packed": torch.zeros(n, -(-k // 10), dtype=torch.int32)})
    capsys.readouterr()
    assert_refused(run_ckpt, tmp_path, ("dequant", tmp_path / "q", "-o", tmp_path / "out", "-q"), "",
                   "the packing of compressed-tensors before 0.20")


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_one_line_exit_2_nothing_written(tmp_path, run_ckpt, capsys, case):
    _bad(tmp_path / "q", case)
    capsys.readouterr()  # the package's progress bars while building
    assert_refused(run_ckpt, tmp_path, ("dequant", tmp_path / "q", "-o", tmp_path / "out", "-q"), "", BAD[case])
