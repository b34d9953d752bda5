"""ModelOpt NVFP4 exports decoded by `ckpt dequant`, bit for bit against ModelOpt itself.

Oracle: NVIDIA ModelOpt 0.47 (`nvidia-modelopt`, installed with `--no-deps` plus `omegaconf` and `pulp`, which
its quantization package imports; its declared dependencies would pull another torch). Every Linear of a tiny
Llama (no downloads) is quantized by ModelOpt's own `NVFP4QTensor.quantize` (block scales e4m3, per-tensor
`weight_scale_2` = amax / (448 * 6)) and saved as ModelOpt's HF export lays it out (`X.weight` uint8,
`X.weight_scale`, 0-d `X.weight_scale_2`, `X.input_scale`; `hf_quant_config.json`, or config.json
`quantization_config` with `quant_method: modelopt`). The expected weights are `NVFP4QTensor.dequantize`
(its non-fast path, the one that runs on CPU) in the model's dtype. Without ModelOpt the tests skip, saying so.
"""

from __future__ import annotations

import json

import pytest
import torch
from helpers.refusals import assert_refused, edit_saved
from safetensors.torch import load_file, save_file
from helpers.modelopt_base import bits_equal, build


@pytest.mark.parametrize("dtype,in_config", [(torch.bfloat16, False), (torch.float16, False),
                                             (torch.bfloat16, True)])
def test_dequant_equals_modelopt_bit_for_bit(tmp_path, run_ckpt, dtype, in_config):
    expected = build(tmp_path / "q", dtype, in_config)
    code, _, err = run_ckpt("dequant", tmp_path / "q", "-o", tmp_path / "plain", "-q")
    assert code == 0, err
    out = load_file(tmp_path / "plain" / "model.safetensors")
    assert not any(k.endswith((".weight_scale", ".weight_scale_2", ".input_scale")) for k in out)
    for name, want in expected.items():
        assert bits_equal(out[name], want), name
    assert not (tmp_path / "plain" / "hf_quant_config.json").exists()
    assert "quantization_config" not in json.loads((tmp_path / "plain" / "config.json").read_text())


def test_compressed_tensors_reading_of_the_same_codes(tmp_path, run_ckpt):
    """compressed-tensors' own ModelOpt converter (weight_scale_2 -> weight_global_scale = 1 / weight_scale_2)
    then its NVFP4 decompression divides by the reciprocal: ckpt's compressed-tensors decoder on the converted
    tensors equals the package; against ModelOpt's multiply the two readings differ by at most one bf16 ulp."""
    pytest.importorskip("compressed_tensors")
    pytest.importorskip("loguru")
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.entrypoints.convert.converters.modelopt_nvfp4 import ModelOptNvfp4Converter
    from compressed_tensors.quantization import QuantizationScheme
    from compressed_tensors.quantization.quant_scheme import NVFP4A16

    expected = build(tmp_path / "q")
    sd = load_file(tmp_path / "q" / "model.safetensors")
    conv = ModelOptNvfp4Converter(ignore=["lm_head"], targets=["Linear"])
    ct = conv.process(dict(sd))
    scheme = QuantizationScheme(targets=["Linear"], **NVFP4A16)
    for name in expected:
        layer = name[: -len(".weight")]
        ct[f"{layer}.weight_global_scale"] = ct[f"{layer}.weight_global_scale"].reshape(1)
    d = tmp_path / "ct"
    d.mkdir()
    save_file(ct, d / "model.safetensors", metadata={"format": "pt"})
    c = json.loads((tmp_path / "q" / "config.json").read_text())
    group = json.loads(scheme.model_dump_json())
    c["quantization_config"] = {"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized",
                                "ignore": ["lm_head"], "config_groups": {"group_0": group}}
    (d / "config.json").write_text(json.dumps(c))
    code, _, err = run_ckpt("dequant", d, "-o", tmp_path / "plain", "-q")
    assert code == 0, err
    out = load_file(tmp_path / "plain" / "model.safetensors")
    for name, modelopt_value in expected.items():
        layer = name[: -len(".weight")]
        local = {k: ct[f"{layer}.{k}"] for k in ("weight_packed", "weight_scale", "weight_global_scale")}
        want = BaseCompressor.get_value_from_registry("nvfp4-pack-quantized").decompress(local, scheme)["weight"]
        assert bits_equal(out[name], want), name
        ulp = (out[name].float() - modelopt_value.float()).abs() / modelopt_value.float().abs().clamp(min=1e-30)
        assert float(ulp.max()) <= 2 ** -7, name  # one bf16 ulp at most


# --- bad input: one line, exit 2, nothing written -----------------------------------------------------

L = "model.layers.0.self_attn.q_proj"


BAD = {
    "missing weight_scale_2": (dict(drop=[f"{L}.weight_scale_2"]), "has no"),
    "missing weight_scale": (dict(drop=[f"{L}.weight_scale"]), "is missing"),
    "block scale shape": (dict(tensors={f"{L}.weight_scale": torch.ones(64, 3).to(torch.float8_e4m3fn)}),
                          "expected F8_E4M3, shape [64, 4]"),
    "weight not packed": (dict(tensors={f"{L}.weight": torch.ones(64, 32, dtype=torch.bfloat16)}), "U8"),
    "nvfp4_awq": (dict(quant={"quant_algo": "NVFP4_AWQ"}), "quant_algo 'NVFP4_AWQ'"),
    "group size": (dict(quant={"group_size": 32}), "group_size 32"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_one_line_exit_2_nothing_written(tmp_path, run_ckpt, case):
    build(tmp_path / "q")
    edit, needle = BAD[case]
    edit_saved(tmp_path / "q", **edit)
    assert_refused(run_ckpt, tmp_path, ("dequant", tmp_path / "q", "-o", tmp_path / "out", "-q"), "", needle)
