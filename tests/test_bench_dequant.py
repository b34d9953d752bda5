"""scripts/bench_dequant.py --format gptq / awq / ct at a tiny size: each synthetic 4-bit Llama (written header-first
without ckpt code), dequantized by its library's whole-model load-and-dequantize (`gptq_way`, `awq_way`, `ct_way`)
and by `ckpt dequant`, gives identical files. GPTQ: the baseline's dequantization is AutoGPTQ's own `QuantLinear`
(qlinear_cuda_old, torch path) on the same words. AWQ and compressed-tensors: the baselines are the libraries' own
code (AutoAWQ's `dequantize_gemm`, compressed-tensors' `convert_checkpoint`), and the synthetic folders have the
tensors (names, dtypes, shapes) and `quantization_config` that AutoAWQ's `from_linear` / compressed-tensors'
`compress_model` + `update_config` write for a tiny model of the same shape (tests/helpers/awq_base.py, ct_ref.py).
The quanto cases' tiny test is tests/test_dequant.py's."""

from __future__ import annotations

import importlib.util
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


def _header(path):
    """{name: (safetensors dtype, shape)} of a safetensors file."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        head = json.loads(f.read(n))
    return {k: (v["dtype"], tuple(v["shape"])) for k, v in head.items() if k != "__metadata__"}


def _shape_of(cfg):
    """The bench's shape dict (`bench_dequant.llm_shape`'s keys that the entries use) of a tiny Llama config."""
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    kv = cfg["num_key_value_heads"] * (cfg.get("head_dim") or h // cfg["num_attention_heads"])
    linears = {"self_attn.q_proj": (h, h), "self_attn.k_proj": (kv, h), "self_attn.v_proj": (kv, h),
               "self_attn.o_proj": (h, h), "mlp.gate_proj": (inter, h), "mlp.up_proj": (inter, h),
               "mlp.down_proj": (h, inter)}
    return {"hidden": h, "inter": inter, "vocab": cfg["vocab_size"], "layers": cfg["num_hidden_layers"],
            "linears": linears}


def _entries_header(entries):
    return {name: (dt, tuple(shape)) for name, dt, shape, _ in entries}


def _needs(fmt):
    """Skip, saying why, without the format's library (found, not imported: `import awq` imports transformers and
    AutoAWQ's models, seconds that no test here needs)."""
    module, pip = {"gptq": ("torch", "torch"), "awq": ("awq", "autoawq==0.2.9 --no-deps"),
                   "ct": ("compressed_tensors", "compressed-tensors==0.20.0")}[fmt]
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"{module} is not installed (pip install {pip})")


def _ckpt_equals_way(src, way, tmp_path):
    from ckpt.dequant.command import DequantOptions, dequant

    way(str(src), str(tmp_path / "oracle"))
    out, _ = dequant(str(src), tmp_path / "ckpt", DequantOptions(quiet=True))
    a, b = load_file(out / "model.safetensors"), load_file(tmp_path / "oracle" / "model.safetensors")
    assert set(a) == set(b)
    assert all(_bits_equal(a[k], b[k]) for k in a), [k for k in a if not _bits_equal(a[k], b[k])][:5]
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    return a


@pytest.mark.parametrize("fmt", ["awq", "ct"])
def test_awq_and_ct_sources_dequantize_as_their_libraries_do(tmp_path, fmt):
    """ckpt dequant of the synthetic folder equals the library's own full-load way, bit for bit; every quantized
    Linear became a plain 16-bit weight of its [out, in] shape."""
    _needs(fmt)
    qtype, dt = next(iter(bench_dequant.FORMATS[fmt].values()))
    info = bench_dequant.write_source(str(tmp_path / "src"), 0.001, qtype, dt)
    assert info["layers"] >= 4
    a = _ckpt_equals_way(tmp_path / "src", bench_dequant.WAYS[fmt], tmp_path)
    s = bench_dequant.llm_shape(0.001e9, fmt)
    want = torch.float16 if fmt == "awq" else torch.bfloat16
    for p, n, k in bench_dequant.llm_linears(s):
        assert a[p + ".weight"].shape == (n, k) and a[p + ".weight"].dtype == want, p
    assert not any(k.endswith((".qweight", ".qzeros", ".scales", ".weight_packed", ".weight_scale",
                               ".weight_shape")) for k in a)
    assert list(a[info["largest"]].shape) == info["largest_shape"]


def test_awq_source_is_what_autoawq_saves(tmp_path):
    """The synthetic AWQ folder's tensors and quantization_config are those of a folder AutoAWQ's own
    `WQLinear_GEMM.from_linear` packed (group 128) and saved, for a tiny Llama of the same shape; the baseline's
    `dequantize_gemm` is the installed AutoAWQ's."""
    from helpers import awq_base

    awq_base.build(tmp_path / "real", "gemm", group=128, hidden=128, inter=256)
    cfg = json.loads((tmp_path / "real" / "config.json").read_text())
    assert bench_dequant.llm_quantization_config("awq") == cfg["quantization_config"]
    real = _header(tmp_path / "real" / "model.safetensors")
    assert _entries_header(bench_dequant.awq_entries(_shape_of(cfg))) == real
    assert bench_dequant.awq_packing_utils().__file__ == sys.modules["awq.utils.packing_utils"].__file__


def test_ct_source_is_what_compressed_tensors_saves(tmp_path):
    """The synthetic compressed-tensors folder's tensors and quantization_config are those compressed-tensors'
    `ModelCompressor.compress_model` + `update_config` write for llm-compressor's W4A16 preset (lm_head ignored)
    on a tiny bf16 Llama of the same shape."""
    _needs("ct")
    from compressed_tensors.quantization import preset_name_to_scheme
    from helpers import ct_ref

    ct_ref.build(tmp_path / "real", {"group_0": preset_name_to_scheme("W4A16", ["Linear"])}, ignore=["lm_head"],
                 hidden=128, inter=256)
    cfg = json.loads((tmp_path / "real" / "config.json").read_text())
    assert bench_dequant.llm_quantization_config("ct") == cfg["quantization_config"]
    real = _header(tmp_path / "real" / "model.safetensors")
    assert _entries_header(bench_dequant.ct_entries(_shape_of(cfg))) == real
    info = bench_dequant.write_source(str(tmp_path / "src"), 0.001, "ct-w4a16", "bf16")
    stored = load_file(tmp_path / "src" / "model.safetensors")
    for p, n, k in bench_dequant.llm_linears(bench_dequant.llm_shape(0.001e9, "ct")):
        assert stored[p + ".weight_shape"].tolist() == [n, k], p
    assert info["tensors"] == len(stored)


@pytest.mark.slow
@pytest.mark.parametrize("fmt,case,way", [("gptq", "gptq-4bit", "autogptq-way"), ("awq", "awq-4bit", "autoawq-way"),
                                          ("ct", "ct-w4a16", "ct-way")])
def test_bench_runs_the_llm_case(tmp_path, capsys, fmt, case, way):
    """The whole driver at a tiny size: table rows for ckpt, cp + sync and the oracle way, outputs identical."""
    _needs(fmt)
    code = bench_dequant.main(["--format", fmt, "--size-gb", "0.001", "--workdir", str(tmp_path),
                               "--json", str(tmp_path / "r.json")])
    out = capsys.readouterr().out
    assert code == 0, out
    assert f"| {case} |" in out and way in out and "outputs identical: True" in out
    (res,) = json.loads((tmp_path / "r.json").read_text())["results"]
    assert res["case"] == case and res["identical"]["equal"] is True
