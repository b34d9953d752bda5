"""MLX both ways against mlx 0.32.4 (mlx-cpu) and mlx-lm 0.32.2 themselves (.venv-serve):

- ckpt's quantizer and decoder (`ckpt.quant.mlx`) and the main suite's restatement (tests/helpers/mlx_ref.py) are
  `mx.quantize` / `mx.dequantize` bit for bit, over every bit width, group size and dtype, on rows that take the
  kernel's edge cases (all zero, constant, min or max the larger in magnitude);
- `ckpt convert F --to mlx-qN --group-size G` writes the tensors `mlx_lm.convert --hf-path F -q --q-bits N
  --q-group-size G` writes, byte for byte, and the same config.json and index text (tiny Llama / Qwen2 / Qwen3 folders
  built here with a real tokenizer, a width that is no multiple of the group, a torch_dtype cast);
- `ckpt dequant` of an mlx-lm folder (uniform, and a mixed recipe with per-layer overrides) gives the tensors
  `mlx_lm.convert --dequantize` writes, byte for byte.
"""

from __future__ import annotations

import contextlib
import io
import json

import pytest
import torch

mx = pytest.importorskip("mlx.core", reason="mlx is the oracle (.venv-serve: make setup-serve)")
mlx_convert = pytest.importorskip("mlx_lm.convert", reason="mlx-lm is the oracle (.venv-serve)").convert

from helpers import mlx_ref  # noqa: E402
from helpers.hf_llm import model_folder  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from ckpt.quant import mlx as ck  # noqa: E402

MX = {torch.bfloat16: mx.bfloat16, torch.float16: mx.float16, torch.float32: mx.float32}


def _np(a):
    import numpy as np

    return torch.from_numpy(np.array(a.astype(mx.float32) if a.dtype != mx.uint32 else a.view(mx.int32)))


def _bits(t):
    return t.view(torch.int32) if t.dtype == torch.uint32 else t


def _raw(t):
    return _bits(t).contiguous().view(torch.uint8)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("bits", ck.BITS)
def test_quantizer_and_decoder_are_mlx_bit_for_bit(dtype, bits):
    torch.manual_seed(bits)
    for group in ck.GROUPS:
        w = torch.randn(16, 512) * 0.05
        w[0, :group] = 0  # all zero: q0 == 0, bias 0
        w[1, :group] = 0.5  # constant
        w[2, :group // 2] = -3  # min the larger in magnitude
        w[3] = torch.linspace(-1, 1, 512)
        w[4, :group] = torch.randn(group) * 1e-9  # scale at its 1e-7 floor
        w = w.to(dtype)
        qw, s, b = mx.quantize(mx.array(w.float().numpy()).astype(MX[dtype]), group_size=group, bits=bits)
        want = (_np(qw), _np(s), _np(b))
        for impl in (ck.quantize, mlx_ref.quantize):
            got = impl(w, group, bits)
            assert torch.equal(_bits(got[0]), want[0]), (impl.__module__, group)
            assert torch.equal(got[1].float(), want[1]) and torch.equal(got[2].float(), want[2]), (impl.__module__, group)
            assert got[1].dtype == dtype
        deq = _np(mx.dequantize(qw, s, b, group_size=group, bits=bits))
        codes, scales, biases = ck.quantize(w, group, bits)
        assert torch.equal(ck.dequantize(codes, scales, biases, group, bits).float(), deq), group
        assert torch.equal(mlx_ref.dequantize(codes, scales, biases, group, bits).float(), deq), group


def _quiet(fn, *args, **kw):
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        return fn(*args, **kw)


def _folder(tmp_path, kind, dtype=torch.bfloat16, **cfg):
    folder = tmp_path / f"hf-{kind}"
    _quiet(model_folder, folder, kind, tokenizer="bpe", dtype=dtype,
           **({"hidden_size": 128, "intermediate_size": 96, "head_dim": 32} | cfg))
    return folder


def _assert_same_folder(ours, theirs):
    a, b = load_file(ours / "model.safetensors"), load_file(theirs / "model.safetensors")
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert torch.equal(_raw(a[k]), _raw(b[k])), k


CASES = [("llama", 4, 64), ("llama", 2, 32), ("llama", 3, 32), ("llama", 5, 64), ("llama", 6, 128), ("llama", 8, 32),
         ("qwen2", 4, 32), ("qwen3", 8, 64), ("llama", 4, 128)]


@pytest.mark.parametrize("kind,bits,group", CASES)
def test_convert_is_mlx_lm_convert(tmp_path, run_ckpt, kind, bits, group):
    src = _folder(tmp_path, kind)
    _quiet(mlx_convert, str(src), str(tmp_path / "ref"), quantize=True, q_bits=bits, q_group_size=group)
    code, _, err = run_ckpt("convert", src, "--to", f"mlx-q{bits}", "--group-size", group, "-o", tmp_path / "ours")
    assert code == 0, err
    _assert_same_folder(tmp_path / "ours", tmp_path / "ref")
    for name in ("config.json", "model.safetensors.index.json"):
        assert (tmp_path / "ours" / name).read_text() == (tmp_path / "ref" / name).read_text(), name


def test_convert_casts_to_torch_dtype_as_mlx_lm(tmp_path, run_ckpt):
    """fp32 weights under config `torch_dtype: bfloat16`: mlx-lm casts every floating tensor before quantizing."""
    src = _folder(tmp_path, "llama", dtype=torch.float32)
    cfg = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps(cfg | {"torch_dtype": "bfloat16"}, indent=2))
    _quiet(mlx_convert, str(src), str(tmp_path / "ref"), quantize=True, q_bits=4, q_group_size=64)
    code, _, err = run_ckpt("convert", src, "--to", "mlx-q4", "-o", tmp_path / "ours")
    assert code == 0, err
    _assert_same_folder(tmp_path / "ours", tmp_path / "ref")
    assert (tmp_path / "ours" / "config.json").read_text() == (tmp_path / "ref" / "config.json").read_text()


@pytest.mark.parametrize("recipe,bits,group", [(None, 4, 64), (None, 3, 32), ("mixed_3_6", None, 32)])
def test_dequant_is_mlx_lm_dequantize(tmp_path, run_ckpt, recipe, bits, group):
    src = _folder(tmp_path, "llama", num_hidden_layers=8)
    _quiet(mlx_convert, str(src), str(tmp_path / "q"), quantize=True, q_bits=bits, q_group_size=group,
           quant_predicate=recipe)
    qcfg = json.loads((tmp_path / "q" / "config.json").read_text())["quantization"]
    if recipe:  # per-layer entries of two widths
        assert {v["bits"] for v in qcfg.values() if isinstance(v, dict)} == {3, 6}
    _quiet(mlx_convert, str(tmp_path / "q"), str(tmp_path / "ref"), dequantize=True)
    code, _, err = run_ckpt("dequant", tmp_path / "q", "-o", tmp_path / "ours", "-q")
    assert code == 0, err
    _assert_same_folder(tmp_path / "ours", tmp_path / "ref")
    ours = json.loads((tmp_path / "ours" / "config.json").read_text())
    assert "quantization" not in ours and "quantization_config" not in ours
