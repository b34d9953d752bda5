"""GPTQ (AutoGPTQ / GPTQModel / optimum packs) decoded by `ckpt dequant` and `ckpt convert`, bit for bit
against the libraries' own CPU dequantization.

Each test builds a tiny fp16 Llama here (no downloads), quantizes every Linear of its decoder layer with
known scales, zero points and `g_idx` by AutoGPTQ's own `QuantLinear.pack`, and writes the folder
AutoGPTQ / optimum save (safetensors + config.json `quantization_config`). Oracles (tests/helpers/gptq_ref.py):
AutoGPTQ 0.7.1's QuantLinear torch path (its CPU dequantization: `qlinear_cuda_old` for sequential groups,
`qlinear_cuda` where `g_idx` is permuted, since `cuda_old` ignores `g_idx`), and GPTQModel 7.7.0's safetensors
dequantizer `convert_gptq_file` (restated in gptq_ref where gptqmodel is not installed: installed into the
shared venv, it prints a banner to stdout and sets CUDA env variables whenever PEFT is imported, which broke
other tests' JSON output; the restatement was checked equal to gptqmodel 7.7.0 on these cases). Where auto-gptq is not installed, AutoGPTQ's pack is
restated from its source (`gptq_ref.restated_pack`) and the expected weight is the format's formula on the
known integer codes; the test says which ran. The one place the two AutoGPTQ paths and GPTQModel disagree (a
v1 asymmetric zero of 0, stored as -1, overflowing into its word) is tested against the masked decode
(GPTQModel, and AutoGPTQ `cuda_old` for 2/4/8 bits): see `ckpt/quant/gptq.py`.
"""

from __future__ import annotations

import json

import pytest
import torch
from helpers import gptq_ref
from helpers.refusals import assert_refused, edit_saved
from safetensors.torch import load_file
from helpers.gptq_base import build


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.int16), b.view(torch.int16))


CASES = [  # bits, group, desc_act, sym
    (4, 32, False, False), (4, 32, True, False), (4, -1, False, True), (2, 32, False, False), (3, 32, False, False),
    (3, 16, True, True), (8, 32, False, False), (8, -1, True, False), (2, -1, True, True),
    (4, 48, True, False),  # act-order over groups of unequal length (the last one short: 64 = 48 + 16)
]


@pytest.mark.parametrize("bits,group,desc_act,sym", CASES)
def test_dequant_equals_autogptq_bit_for_bit(tmp_path, run_ckpt, bits, group, desc_act, sym):
    expected, oracle = build(tmp_path / "q", bits, group, desc_act, sym)
    code, _, err = run_ckpt("dequant", tmp_path / "q", "-o", tmp_path / "plain", "-q")
    assert code == 0, err
    out = load_file(tmp_path / "plain" / "model.safetensors")
    assert not any(k.endswith((".qweight", ".qzeros", ".scales", ".g_idx")) for k in out)
    for name, want in expected.items():
        assert bits_equal(out[name], want), (oracle, name)
    convert, which = gptq_ref.gptqmodel_convert()  # GPTQModel's own dequantizer on the same file
    qc = json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]
    theirs = convert(tmp_path / "q" / "model.safetensors", torch.float16, qc, "cpu")
    for name in expected:
        assert bits_equal(out[name], theirs[name]), (which, name)


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_gptq_v2_zero_points_decode_like_v1(tmp_path, run_ckpt, bits):
    expected, _ = build(tmp_path / "v1", bits, 32, False, False)
    build(tmp_path / "v2", bits, 32, False, False, fmt="gptq_v2")
    for v in ("v1", "v2"):
        code, _, err = run_ckpt("dequant", tmp_path / v, "-o", tmp_path / f"{v}-plain", "-q")
        assert code == 0, err
        out = load_file(tmp_path / f"{v}-plain" / "model.safetensors")
        for name, want in expected.items():
            assert bits_equal(out[name], want), (v, name)


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_v1_zero_of_zero_overflow_decodes_masked(tmp_path, run_ckpt, bits):
    """A v1 asymmetric zero of 0 is packed as -1 and sets every higher field of its word; per field,
    (field + 1) & mask gives 0 there. AutoGPTQ's `cuda_old` torch path computes that for 2/4/8 bits; its
    3-bit path adds 1 after masking (8), so 3 bits is checked against GPTQModel's dequantizer only."""
    expected, oracle = build(tmp_path / "q", bits, 32, False, False, zero0=True)
    q = load_file(tmp_path / "q" / "model.safetensors")
    assert any(int((v == -1).sum()) or int((v < 0).sum()) for k, v in q.items() if k.endswith(".qzeros"))
    code, _, err = run_ckpt("dequant", tmp_path / "q", "-o", tmp_path / "plain", "-q")
    assert code == 0, err
    out = load_file(tmp_path / "plain" / "model.safetensors")
    convert, which = gptq_ref.gptqmodel_convert()
    qc = json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]
    theirs = convert(tmp_path / "q" / "model.safetensors", torch.float16, qc, "cpu")
    for name in expected:
        assert bits_equal(out[name], theirs[name]), (which, name)
    if "AutoGPTQ 0.7.1" in oracle:
        for name, want in expected.items():
            same = bits_equal(out[name], want)
            assert same if bits != 3 else not same, (oracle, name)  # 3 bits: AutoGPTQ gives z = 8 there


def test_bands_read_only_their_columns(tmp_path):
    """Any band of output rows equals the same rows of the whole tensor; a band reads only its columns."""
    from ckpt.io import header
    from ckpt.io.checkpoint import open_checkpoint
    from ckpt.quant import common, gptq
    from ckpt.quant.view import logical_view

    build(tmp_path / "q", 3, 32, True, False)
    with open_checkpoint(str(tmp_path / "q")) as ck:
        view = logical_view(ck.components[0])
        t = view.tensors["model.layers.0.mlp.gate_proj.weight"]
        assert isinstance(t, gptq.GptqWeight) and t.shape == (128, 64) and t.dtype == torch.float16
        assert view.consumed["model.layers.0.mlp.gate_proj.g_idx"].startswith("group index")
        cpu = torch.device("cpu")
        whole = t.read(0, 128, cpu)
        got, real = [], header.read_into

        def counting(fd, buf, offset, path):
            got.append(len(buf))
            return real(fd, buf, offset, path)

        header_read, common.read_into = common.read_into, counting  # read_columns' preads
        try:
            for a, b in [(0, 5), (5, 37), (37, 100), (100, 128)]:
                got.clear()
                assert bits_equal(t.read(a, b, cpu), whole[a:b].contiguous()), (a, b)
                words = 3 * (-(-b // 32) - a // 32)  # the 3-word blocks of zero points holding outputs a..b
                assert sum(got) <= (b - a) * (6 * 4 + 2 * 2) + 2 * 4 * words, (a, b, sum(got))
        finally:
            common.read_into = header_read


def test_quantize_config_json_beside_the_weights(tmp_path, run_ckpt):
    """AutoGPTQ's own save: no quantization_config in config.json, `quantize_config.json` beside the weights."""
    expected, _ = build(tmp_path / "q", 4, 32, False, True)
    cfg = json.loads((tmp_path / "q" / "config.json").read_text())
    (tmp_path / "q" / "quantize_config.json").write_text(json.dumps(cfg.pop("quantization_config")))
    (tmp_path / "q" / "config.json").write_text(json.dumps(cfg))
    code, _, err = run_ckpt("dequant", tmp_path / "q", "-o", tmp_path / "plain", "-q")
    assert code == 0, err
    out = load_file(tmp_path / "plain" / "model.safetensors")
    assert not (tmp_path / "plain" / "quantize_config.json").exists()  # the weights are no longer quantized
    for name, want in expected.items():
        assert bits_equal(out[name], want), name


def test_gptqmodel_dynamic_per_module_bits(tmp_path, run_ckpt):
    """GPTQModel's `dynamic` overrides: per-module bits and group size, read from each module's shapes."""
    over = {"mlp.down_proj": (8, 64), "self_attn.k_proj": (2, -1)}
    expected, oracle = build(tmp_path / "q", 4, 32, False, False, overrides=over)
    cfg = json.loads((tmp_path / "q" / "config.json").read_text())
    cfg["quantization_config"]["dynamic"] = {r"+:.*mlp\.down_proj": {"bits": 8, "group_size": 64},
                                             r"+:.*k_proj": {"bits": 2, "group_size": -1}}
    (tmp_path / "q" / "config.json").write_text(json.dumps(cfg))
    code, out, err = run_ckpt("dequant", tmp_path / "q", "-o", tmp_path / "plain")
    assert code == 0, err
    assert "2+4+8-bit" in out + err
    plain = load_file(tmp_path / "plain" / "model.safetensors")
    for name, want in expected.items():
        assert bits_equal(plain[name], want), (oracle, name)


def test_sequential_groups_without_g_idx(tmp_path, run_ckpt):
    """GPTQ-for-LLaMa-era files without `g_idx` (no act-order): inputs grouped in order by group_size."""
    expected, _ = build(tmp_path / "q", 4, 32, False, False)
    edit_saved(tmp_path / "q", drop=[k for k in load_file(tmp_path / "q" / "model.safetensors") if k.endswith(".g_idx")])
    code, out, err = run_ckpt("dequant", tmp_path / "q", "-o", tmp_path / "plain")
    assert code == 0, err
    assert "have no g_idx" in out + err
    out = load_file(tmp_path / "plain" / "model.safetensors")
    for name, want in expected.items():
        assert bits_equal(out[name], want), name


def test_groups_of_unequal_length_in_order(tmp_path, run_ckpt):
    """A group size that does not divide the inputs (64 = 48 + 16), inputs in order: the short last group is
    repeated per input, not viewed as whole groups. AutoGPTQ's in-order dequantizer reshapes into whole groups and
    cannot load it, so the oracle is GPTQModel's converter on the same file."""
    build(tmp_path / "q", 4, 48, True, False)
    sd = load_file(tmp_path / "q" / "model.safetensors")
    edit_saved(tmp_path / "q", tensors={k: (torch.arange(v.numel()) // 48).to(torch.int32)
                                        for k, v in sd.items() if k.endswith(".g_idx")}, qc={"desc_act": False})
    code, _, err = run_ckpt("dequant", tmp_path / "q", "-o", tmp_path / "plain", "-q")
    assert code == 0, err
    out = load_file(tmp_path / "plain" / "model.safetensors")
    convert, which = gptq_ref.gptqmodel_convert()
    qc = json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]
    theirs = convert(tmp_path / "q" / "model.safetensors", torch.float16, qc, "cpu")
    names = [k[: -len(".qweight")] + ".weight" for k in sd if k.endswith(".qweight")]
    assert names and all(bits_equal(out[n], theirs[n]) for n in names), which


# --- bad input: one line, exit 2, nothing written -----------------------------------------------------

L = "model.layers.0.self_attn.q_proj"


BAD = {
    "scales shape": (dict(tensors={f"{L}.scales": torch.ones(3, 64, dtype=torch.float16)}), f"{L}.scales"),
    "qzeros shape": (dict(tensors={f"{L}.qzeros": torch.zeros(2, 4, dtype=torch.int32)}), f"{L}.qzeros"),
    "g_idx length": (dict(tensors={f"{L}.g_idx": torch.zeros(60, dtype=torch.int32)}), "does not pack the 60 inputs"),
    "g_idx range": (dict(tensors={f"{L}.g_idx": torch.full((64,), 7, dtype=torch.int32)}), "outside [0, 2)"),
    "bits disagree": (dict(qc={"bits": 8}), "but the config says bits 8"),
    "group_size disagrees": (dict(qc={"group_size": 64}), "expected a floating dtype, shape ["),
    "unsupported bits": (dict(qc={"bits": 16}), "bits 16 is not supported"),
    "planar 6-bit": (dict(qc={"bits": 6}), "planar layout"),
    "marlin": (dict(qc={"checkpoint_format": "marlin"}), "Marlin-repacked"),
    "unknown format": (dict(qc={"checkpoint_format": "foo"}), "unknown GPTQ checkpoint_format"),
    "missing qzeros": (dict(drop=[f"{L}.qzeros"]), "is missing"),
    "missing scales": (dict(drop=[f"{L}.scales"]), "is missing"),
    "orphan g_idx": (dict(drop=[f"{L}.qweight"]), "has no"),
    "act-order without g_idx": (dict(drop=[f"{L}.g_idx"], qc={"desc_act": True}), "which desc_act (act-order) needs"),
    "float qweight": (dict(tensors={f"{L}.qweight": torch.zeros(8, 64)}), "expected I32"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input_one_line_exit_2_nothing_written(tmp_path, run_ckpt, case):
    edit, needle = BAD[case]
    build(tmp_path / "q", 4, 32, False, False)
    edit_saved(tmp_path / "q", **edit)
    for args in (("dequant", tmp_path / "q"), ("convert", tmp_path / "q", "--to", "fp16")):
        assert_refused(run_ckpt, tmp_path, (*args, "-o", tmp_path / "out", "-q"), "", needle)
