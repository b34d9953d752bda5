"""The tiny hqq bases of `tests/test_hqq.py`, shared with the other tests that need one (test modules do not
import each other)."""

from __future__ import annotations

import json
import pytest
import torch
from safetensors.torch import load_file, save_file

LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
           "mlp.up_proj", "mlp.down_proj")
L = "model.layers.0.self_attn.q_proj"


def _hqq():
    try:
        from hqq.core.quantize import BaseQuantizeConfig, HQQLinear
    except ImportError:
        pytest.skip("hqq is not installed (DISABLE_CUDA=1 pip install --no-deps hqq einops termcolor)")
    return HQQLinear, BaseQuantizeConfig


def build(folder, nbits=4, group=64, axis=1, compute=torch.float16, view_as_float=False, hidden=64, inter=128):
    """An HQQ folder; returns {weight name: HQQLinear.dequantize() of the quantizing layer}."""
    import transformers

    HQQLinear, BaseQuantizeConfig = _hqq()
    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   attention_bias=True)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).to(compute)
    qc = BaseQuantizeConfig(nbits=nbits, group_size=group, axis=axis, view_as_float=view_as_float)
    expected = {}
    for lin_name in LINEARS:
        name = f"model.layers.0.{lin_name}"
        parent, _, attr = name.rpartition(".")
        lin = model.get_submodule(name)
        q = HQQLinear(lin, quant_config=qc, compute_dtype=compute, device="cpu")
        setattr(model.get_submodule(parent), attr, q)
        expected[f"{name}.weight"] = q.dequantize()
    sd = {k: v.contiguous() for k, v in model.state_dict().items() if v is not None}
    folder.mkdir(parents=True, exist_ok=True)
    save_file(sd, folder / "model.safetensors", metadata={"format": "pt"})
    hq = {"quant_method": "hqq", "skip_modules": ["lm_head"],
          "quant_config": {k: v for k, v in qc.items() if k != "offload_meta"}}
    dtype = str(compute).removeprefix("torch.")
    (folder / "config.json").write_text(json.dumps(cfg.to_dict() | {"quantization_config": hq, "torch_dtype": dtype}))
    return expected


def reloaded(folder, layer, compute):
    """hqq's own reading of the saved keys: a fresh HQQLinear loads them and dequantizes."""
    HQQLinear, _ = _hqq()
    sd = load_file(folder / "model.safetensors")
    q = HQQLinear(None, quant_config=None, compute_dtype=compute, device="cpu", initialize=False)
    q.load_state_dict({k[len(layer) + 1:]: v for k, v in sd.items() if k.startswith(layer + ".")})
    return q.dequantize()
