"""scripts/bench_dequant.py --format gptq at a tiny size: its synthetic GPTQ 4-bit Llama (written header-first without
ckpt code), dequantized by the oracle's whole-model load-and-dequantize (`gptq_way`) and by `ckpt dequant`, gives
identical files; the baseline's dequantization is AutoGPTQ's own `QuantLinear` (qlinear_cuda_old, torch path) on
the same words. The quanto cases' tiny test is tests/test_dequant.py's."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import bench_dequant  # noqa: E402


def _bits_equal(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.int16), b.view(torch.int16))


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    src = tmp_path_factory.mktemp("bench") / "src"
    info = bench_dequant.write_source(str(src), 0.001, "gptq4", "fp16")
    return src, info


def test_source_is_a_gptq_llm_and_the_oracle_way_equals_ckpt(source, tmp_path):
    from ckpt.dequant.command import DequantOptions, dequant

    src, info = source
    cfg = json.loads((src / "config.json").read_text())
    assert cfg["quantization_config"] == {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False,
                                          "sym": False, "checkpoint_format": "gptq"}
    assert info["layers"] >= 4 and cfg["num_hidden_layers"] == info["layers"]
    stored = load_file(src / "model.safetensors")
    assert sum(k.endswith(".qweight") for k in stored) == 7 * info["layers"]
    bench_dequant.gptq_way(str(src), str(tmp_path / "oracle"))
    out, _ = dequant(str(src), tmp_path / "ckpt", DequantOptions(quiet=True))
    a, b = load_file(out / "model.safetensors"), load_file(tmp_path / "oracle" / "model.safetensors")
    assert set(a) == set(b) and not any(k.endswith((".qweight", ".qzeros", ".scales", ".g_idx")) for k in a)
    assert all(_bits_equal(a[k], b[k]) for k in a)
    w = a[info["largest"]]
    assert list(w.shape) == info["largest_shape"] and w.dtype == torch.float16
    assert "quantization_config" not in json.loads((out / "config.json").read_text())


def test_baseline_dequantization_is_autogptqs(source):
    from helpers import gptq_ref

    ql_cls = gptq_ref.autogptq_quantlinear("cuda_old")
    if ql_cls is None:
        pytest.skip("auto-gptq is not installed (pip install --no-deps auto-gptq==0.7.1)")
    src, _ = source
    sd = load_file(src / "model.safetensors")
    for p in ("model.layers.0.self_attn.q_proj", "model.layers.0.mlp.down_proj"):
        qw, qz, sc, gi = (sd[f"{p}.{s}"] for s in ("qweight", "qzeros", "scales", "g_idx"))
        k, n = qw.shape[0] * 8, qw.shape[1]
        ql = ql_cls(4, 128, k, n, bias=False)
        ql.qweight, ql.qzeros, ql.scales, ql.g_idx = qw, qz, sc, gi
        with torch.no_grad():
            want = gptq_ref.autogptq_dequant(ql)
        assert _bits_equal(bench_dequant.autogptq_torch_dequant(qw, qz, sc, gi, 4), want), p


@pytest.mark.slow
def test_bench_runs_the_gptq_case(tmp_path, capsys):
    """The whole driver at a tiny size: table rows for ckpt, cp + sync and the oracle way, outputs identical."""
    code = bench_dequant.main(["--format", "gptq", "--size-gb", "0.001", "--workdir", str(tmp_path),
                               "--json", str(tmp_path / "r.json")])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "| gptq-4bit |" in out and "autogptq-way" in out and "outputs identical: True" in out
    (res,) = json.loads((tmp_path / "r.json").read_text())["results"]
    assert res["case"] == "gptq-4bit" and res["identical"]["equal"] is True
