"""HQQ layers (`HQQLinear.state_dict()` flattened under each layer's prefix, as transformers' HQQ save writes
them) decoded by `ckpt dequant` / `ckpt convert`, bit for bit with hqq.

A tiny Llama is built here (no downloads); every Linear of its decoder layer is replaced by hqq 0.2.8's own
`HQQLinear(linear, BaseQuantizeConfig(nbits, group_size, axis), compute_dtype, device="cpu")` (its quantizer,
with its proximal optimizer, runs on the CPU), and the model's state dict (what `save_pretrained` writes for
an HQQ model) is saved to safetensors with config.json `quantization_config` (quant_method hqq).

Oracles: `HQQLinear.dequantize()` of the quantizing layer, and of a fresh `HQQLinear` that loads the saved
file's keys through hqq's own `load_state_dict` (its decoding of the encoded metadata). hqq 0.2.8.post1
installs on the CPU machine with `DISABLE_CUDA=1 pip install --no-deps hqq` plus einops and termcolor;
without it the tests skip, saying so.
"""

from __future__ import annotations

import pytest
import torch
from helpers.refusals import assert_refused, edit_saved
from safetensors.torch import load_file
from helpers.format_cases import assert_bands_equal_the_whole
from helpers.hqq_base import L, build, reloaded


def bits_equal(a, b):
    ints = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(ints[a.dtype]), b.view(ints[b.dtype]))


CASES = [(4, 64, 1, torch.float16), (4, 64, 0, torch.bfloat16), (2, 32, 1, torch.bfloat16), (2, 64, 0, torch.float16),
         (8, 64, 1, torch.float16), (8, 32, 0, torch.bfloat16), (3, 64, 1, torch.float16), (3, 64, 0, torch.bfloat16),
         (1, 64, 1, torch.float16), (5, 64, 0, torch.float16), (1.58, 64, 1, torch.float16)]  # 1.58: nbits as F32


@pytest.mark.parametrize("nbits,group,axis,compute", CASES)
def test_dequant_equals_hqq_bit_for_bit(tmp_path, run_ckpt, nbits, group, axis, compute):
    expected = build(tmp_path / "q", nbits, group, axis, compute)
    stored = load_file(tmp_path / "q" / "model.safetensors")
    code, _, err = run_ckpt("dequant", tmp_path / "q", "-o", tmp_path / "plain", "-q")
    assert code == 0, err
    out = load_file(tmp_path / "plain" / "model.safetensors")
    assert not any(k.endswith((".W_q", ".zero", ".nbits", ".packing", ".stores_quant_config")) for k in out)
    for name, want in expected.items():
        layer = name[: -len(".weight")]
        assert bits_equal(out[name], want), ("HQQLinear.dequantize", name)
        assert bits_equal(out[name], reloaded(tmp_path / "q", layer, compute)), ("hqq load_state_dict", name)
        if layer.split(".")[-2] == "self_attn":  # attention_bias: the HQQLinear's plain bias, kept
            assert bits_equal(out[f"{layer}.bias"], stored[f"{layer}.bias"])
    assert_bands_equal_the_whole(tmp_path / "q", list(expected))  # bands unpack other rows per nbits and axis


def test_view_as_float(tmp_path, run_ckpt):
    for nbits in (4, 3):
        expected = build(tmp_path / f"q{nbits}", nbits, 64, 1, torch.float16, view_as_float=True)
        assert load_file(tmp_path / f"q{nbits}" / "model.safetensors")[f"{L}.W_q"].dtype == torch.float16
        code, _, err = run_ckpt("dequant", tmp_path / f"q{nbits}", "-o", tmp_path / f"p{nbits}", "-q")
        assert code == 0, err
        out = load_file(tmp_path / f"p{nbits}" / "model.safetensors")
        for name, want in expected.items():
            assert bits_equal(out[name], want), (nbits, name)


# --- bad input: one line, exit 2, nothing written -----------------------------------------------------


def _s(text):
    return torch.tensor([ord(c) for c in text], dtype=torch.uint8)


BAD = {
    "missing zero": (dict(drop=[f"{L}.zero"]), "is missing"),
    "missing shape": (dict(drop=[f"{L}.shape"]), "is missing"),
    "missing W_q": (dict(drop=[f"{L}.W_q"]), "has no"),
    "scale shape": (dict(tensors={f"{L}.scale": torch.ones(32, 1, dtype=torch.float16)}), "HQQ scales of"),
    "W_q shape": (dict(tensors={f"{L}.W_q": torch.zeros(16, 64, dtype=torch.uint8)}), "HQQ packed codes"),
    "shape not groups": (dict(tensors={f"{L}.shape": torch.tensor([60, 61])}), "not whole groups of 64"),
    "nbits vs packing": (dict(tensors={f"{L}.nbits": torch.tensor(3, dtype=torch.int32)}),
                         "HQQ nbits 3 is not stored with packing '4bit_u8'"),
    "unknown packing": (dict(tensors={f"{L}.packing": _s("4bit_u32")}), "HQQ packing '4bit_u32'"),
    "compute dtype": (dict(tensors={f"{L}.compute_dtype": _s("torch.float8_e4m3fn")}), "HQQ compute_dtype"),
    "axis": (dict(tensors={f"{L}.axis": torch.tensor(2, dtype=torch.int32)}), "HQQ axis 2"),
    "quantized zero": (dict(tensors={f"{L}.quant_zero": torch.tensor(1, dtype=torch.uint8)}), "is set"),
    "zero_scale": (dict(tensors={f"{L}.zero_scale": torch.ones(2, 128, 1, dtype=torch.float16)}),
                   "offloaded scale/zero"),
    "plain and packed": (dict(tensors={f"{L}.weight": torch.zeros(64, 64, dtype=torch.float16)}),
                         "both a plain"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input_one_line_exit_2_nothing_written(tmp_path, run_ckpt, case):
    edit, needle = BAD[case]
    build(tmp_path / "q")
    edit_saved(tmp_path / "q", **edit)
    for args in (("dequant", tmp_path / "q"), ("convert", tmp_path / "q", "--to", "fp16")):
        assert_refused(run_ckpt, tmp_path, (*args, "-o", tmp_path / "out", "-q"), "", needle)
