"""mlx-lm LoRA adapters merged as `mlx_lm fuse` merges them, against mlx-lm 0.32.2 itself (.venv-serve).

The adapters are made with mlx-lm's own LoRA layers (`linear_to_lora_layers` on the loaded base, random lora_b in
place of training) and saved as its trainer saves them (`trainable_parameters()` to adapters.safetensors, the
arguments to adapter_config.json); mlx-lm's `fuse` command is the oracle:
- `merge-lora MLX_BASE ADAPTERS --keep-format` == `mlx_lm fuse` (tensors byte for byte, config.json text);
- `merge-lora MLX_BASE ADAPTERS --to bf16` == `mlx_lm fuse --dequantize` (tensors byte for byte);
- `merge-lora HF_BASE ADAPTERS` == `mlx_lm fuse` on the Hugging Face folder (tensors byte for byte).
"""

from __future__ import annotations

import contextlib
import io
import json
import subprocess
import sys

import pytest
import torch

mx = pytest.importorskip("mlx.core", reason="mlx is the oracle (.venv-serve: make setup-serve)")
pytest.importorskip("mlx_lm", reason="mlx-lm is the oracle (.venv-serve)")

from helpers.hf_llm import model_folder  # noqa: E402
from safetensors.torch import load_file  # noqa: E402


def _quiet(fn, *args, **kw):
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        return fn(*args, **kw)


def _raw(t):
    return (t.view(torch.int32) if t.dtype == torch.uint32 else t).contiguous().view(torch.uint8)


def _hf(tmp_path, kind="llama", dtype=torch.bfloat16, **cfg):
    folder = tmp_path / f"hf-{kind}"
    _quiet(model_folder, folder, kind, tokenizer="bpe", dtype=dtype,
           **({"hidden_size": 128, "intermediate_size": 256, "head_dim": 32, "num_hidden_layers": 3} | cfg))
    return folder


def _mlx(tmp_path, src, bits, group):
    from mlx_lm.convert import convert

    _quiet(convert, str(src), str(tmp_path / "mlx"), quantize=True, q_bits=bits, q_group_size=group)
    return tmp_path / "mlx"


def make_adapters(base, folder, rank=8, scale=20.0, num_layers=2, keys=None, seed=0):
    """What `mlx_lm lora --train` leaves, with random factors instead of trained ones."""
    from mlx.utils import tree_flatten
    from mlx_lm.tuner.utils import linear_to_lora_layers
    from mlx_lm.utils import load, save_config

    mx.random.seed(seed)
    model, _ = _quiet(load, str(base))
    model.freeze()
    params = {"rank": rank, "scale": scale, "dropout": 0.0} | ({"keys": keys} if keys else {})
    linear_to_lora_layers(model, num_layers, params)
    for _, m in model.named_modules():
        if hasattr(m, "lora_b"):
            m.lora_b = mx.random.normal(m.lora_b.shape) * 0.02
    folder.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(folder / "adapters.safetensors"), dict(tree_flatten(model.trainable_parameters())))
    save_config({"model": str(base), "fine_tune_type": "lora", "num_layers": num_layers, "lora_parameters": params,
                 "train": True, "seed": seed}, folder / "adapter_config.json")
    return folder


def fuse(base, adapters, out, *extra):
    proc = subprocess.run([sys.executable, "-m", "mlx_lm", "fuse", "--model", str(base), "--adapter-path",
                           str(adapters), "--save-path", str(out), *extra], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return out


def assert_same_tensors(ours, theirs):
    a, b = load_file(ours / "model.safetensors"), load_file(theirs / "model.safetensors")
    assert sorted(a) == sorted(b)
    bad = [k for k in a if a[k].dtype != b[k].dtype or a[k].shape != b[k].shape or not torch.equal(_raw(a[k]), _raw(b[k]))]
    assert not bad, bad[:5]


@pytest.mark.parametrize("bits,group,rank,scale", [(4, 64, 8, 20.0), (8, 32, 4, 2.0), (3, 32, 16, 0.5)])
def test_keep_format_is_mlx_lm_fuse(tmp_path, run_ckpt, bits, group, rank, scale):
    base = _mlx(tmp_path, _hf(tmp_path), bits, group)
    adapters = make_adapters(base, tmp_path / "adapters", rank=rank, scale=scale)
    ref = fuse(base, adapters, tmp_path / "ref")
    code, _, err = run_ckpt("merge-lora", base, adapters, "--keep-format", "-o", tmp_path / "ours")
    assert code == 0, err
    assert_same_tensors(tmp_path / "ours", ref)
    assert (tmp_path / "ours" / "config.json").read_text() == (ref / "config.json").read_text()


def test_to_bf16_is_mlx_lm_fuse_dequantize(tmp_path, run_ckpt):
    base = _mlx(tmp_path, _hf(tmp_path), 4, 32)
    adapters = make_adapters(base, tmp_path / "adapters", num_layers=-1,
                             keys=["self_attn.q_proj", "self_attn.v_proj", "mlp.down_proj"])
    ref = fuse(base, adapters, tmp_path / "ref", "--dequantize")
    code, _, err = run_ckpt("merge-lora", base, adapters, "--to", "bf16", "-o", tmp_path / "ours")
    assert code == 0, err
    assert_same_tensors(tmp_path / "ours", ref)
    ours = json.loads((tmp_path / "ours" / "config.json").read_text())
    theirs = json.loads((ref / "config.json").read_text())
    assert "quantization" not in ours and "quantization_config" not in ours
    assert ours == theirs


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_plain_base_is_mlx_lm_fuse_of_it(tmp_path, run_ckpt, dtype):
    base = _hf(tmp_path, dtype=dtype)
    adapters = make_adapters(base, tmp_path / "adapters", rank=4, scale=10.0)
    ref = fuse(base, adapters, tmp_path / "ref")
    code, _, err = run_ckpt("merge-lora", base, adapters, "-o", tmp_path / "ours")
    assert code == 0, err
    assert_same_tensors(tmp_path / "ours", ref)
