"""AWQ (AutoAWQ GEMM and GEMV packs) decoded by `ckpt dequant` / `ckpt convert`, bit for bit.

A tiny fp16 Llama is built here (no downloads); every Linear of its decoder layer is packed by AutoAWQ
0.2.9's own `WQLinear_GEMM.from_linear` / `WQLinear_GEMV.from_linear` with known scales and zero points, and
saved as AutoAWQ saves (safetensors + config.json `quantization_config`, quant_method awq).

Oracles: GEMM, AutoAWQ's CPU dequantizer `awq.utils.packing_utils.dequantize_gemm` (what `WQLinear_GEMM`'s
forward runs without its CUDA/Triton kernels). GEMV: AutoAWQ has no CPU dequantizer (its forward needs
`awq_ext`), so the expected weight is the AWQ formula scales * (code - zero) in fp16 on the integer codes
`from_linear` itself computes (restated from its loop, vectorized), with no unpacking involved. Both
checks also run on GEMM.

autoawq 0.2.9 installs on the CPU machine only with `pip install --no-deps autoawq` (its dependencies would
pull triton), and its package `__init__` imports `transformers` names gone in 5.x: `_awq()` registers an
empty `awq` package so that `awq.modules.linear` and `awq.utils` import without it. Without autoawq the
tests skip, saying so.
"""

from __future__ import annotations

import json

import pytest
import torch
from helpers.refusals import assert_refused, edit_saved
from safetensors.torch import load_file
from helpers.awq_base import build


def bits_equal(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.int16), b.view(torch.int16))


@pytest.mark.parametrize("version,group,hidden,spill", [
    ("gemm", 32, 64, False), ("gemm", 64, 128, False), ("gemm", -1, 64, False), ("gemm", 32, 64, True),
    ("gemv", 32, 64, False), ("gemv", 64, 128, False), ("gemv", 128, 128, False), ("gemv", 32, 512, False),
])
def test_dequant_equals_autoawq_bit_for_bit(tmp_path, run_ckpt, version, group, hidden, spill):
    expected = build(tmp_path / "q", version, group, hidden, 2 * hidden, spill=spill)
    code, _, err = run_ckpt("dequant", tmp_path / "q", "-o", tmp_path / "plain", "-q")
    assert code == 0, err
    out = load_file(tmp_path / "plain" / "model.safetensors")
    assert not any(k.endswith((".qweight", ".qzeros", ".scales")) for k in out)
    for name, (oracle, formula) in expected.items():
        if oracle is not None:
            assert bits_equal(out[name], oracle), ("AutoAWQ dequantize_gemm", name)
        if formula is not None:
            assert bits_equal(out[name], formula), ("scales * (code - zero) on from_linear's codes", name)


def test_old_autoawq_quant_config_json(tmp_path, run_ckpt):
    expected = build(tmp_path / "q", "gemm", 32)
    cfg = json.loads((tmp_path / "q" / "config.json").read_text())
    cfg.pop("quantization_config")
    (tmp_path / "q" / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "q" / "quant_config.json").write_text(json.dumps(
        {"zero_point": True, "q_group_size": 32, "w_bit": 4, "version": "GEMM"}))
    code, _, err = run_ckpt("dequant", tmp_path / "q", "-o", tmp_path / "plain", "-q")
    assert code == 0, err
    out = load_file(tmp_path / "plain" / "model.safetensors")
    assert not (tmp_path / "plain" / "quant_config.json").exists()  # the weights are no longer quantized
    for name, (oracle, _) in expected.items():
        assert bits_equal(out[name], oracle), name


# --- bad input: one line, exit 2, nothing written -----------------------------------------------------

L = "model.layers.0.self_attn.q_proj"


BAD = {
    "scales shape": (dict(tensors={f"{L}.scales": torch.ones(3, 64, dtype=torch.float16)}), f"{L}.scales"),
    "qzeros shape": (dict(tensors={f"{L}.qzeros": torch.zeros(2, 4, dtype=torch.int32)}), f"{L}.qzeros"),
    "groups": (dict(qc={"group_size": 48}), "not whole groups of 48"),
    "gemv layout of a gemm file": (dict(qc={"version": "gemv"}), "AWQ scales of"),
    "gemv_fast": (dict(qc={"version": "gemv_fast"}), "AWQ version 'gemv_fast'"),
    "bits": (dict(qc={"bits": 8}), "AWQ bits 8 is not supported"),
    "no zero points": (dict(qc={"zero_point": False}), "zero_point false"),
    "missing scales": (dict(drop=[f"{L}.scales"]), "is missing"),
    "missing qzeros": (dict(drop=[f"{L}.qzeros"]), "is missing"),
    "g_idx": (dict(tensors={f"{L}.g_idx": torch.zeros(64, dtype=torch.int32)}), "GPTQ group index"),
    "orphan qzeros": (dict(drop=[f"{L}.qweight"]), "has no"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input_one_line_exit_2_nothing_written(tmp_path, run_ckpt, case):
    edit, needle = BAD[case]
    build(tmp_path / "q", "gemm", 32)
    edit_saved(tmp_path / "q", **edit)
    for args in (("dequant", tmp_path / "q"), ("convert", tmp_path / "q", "--to", "fp16")):
        assert_refused(run_ckpt, tmp_path, (*args, "-o", tmp_path / "out", "-q"), "", needle)
