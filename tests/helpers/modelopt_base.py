"""The tiny modelopt_nvfp4 bases of `tests/test_modelopt_nvfp4.py`, shared with the other tests that need one (test modules do not
import each other)."""

from __future__ import annotations

import json
import warnings
import pytest
import torch
from safetensors.torch import save_file

LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
           "mlp.up_proj", "mlp.down_proj")


def _nvfp4():
    pytest.importorskip("omegaconf")
    pytest.importorskip("pulp")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mod = pytest.importorskip("modelopt.torch.quantization.qtensor.nvfp4_tensor",
                                  reason="nvidia-modelopt is not installed (pip install --no-deps nvidia-modelopt)")
    return mod.NVFP4QTensor


def bits_equal(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.int16), b.view(torch.int16))


def build(folder, dtype=torch.bfloat16, in_config=False, hidden=64, inter=128):
    """A ModelOpt NVFP4 export of a tiny Llama; returns {weight name: ModelOpt's dequantized weight}."""
    import transformers

    Q = _nvfp4()
    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).to(dtype)
    sd, expected = dict(model.state_dict()), {}
    for lin in LINEARS:
        name = f"model.layers.0.{lin}"
        w = sd[f"{name}.weight"]
        qt, scale, scale_2 = Q.quantize(w, 16)
        assert qt._quantized_data.dtype == torch.uint8 and scale.dtype == torch.float8_e4m3fn
        sd[f"{name}.weight"] = qt._quantized_data.contiguous()
        sd[f"{name}.weight_scale"] = scale.contiguous()
        sd[f"{name}.weight_scale_2"] = scale_2.reshape(()).to(torch.float32)
        sd[f"{name}.input_scale"] = torch.tensor(0.0123, dtype=torch.float32)
        expected[f"{name}.weight"] = qt.dequantize(dtype=dtype, scale=scale, double_scale=scale_2,
                                                   block_sizes={-1: 16})
    folder.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in sd.items()}, folder / "model.safetensors", metadata={"format": "pt"})
    model.config.save_pretrained(folder)
    c = json.loads((folder / "config.json").read_text())
    c["dtype"] = str(dtype).replace("torch.", "")  # the model's dtype, as an export of it declares
    (folder / "config.json").write_text(json.dumps(c))
    quant = {"quant_algo": "NVFP4", "kv_cache_quant_algo": None, "group_size": 16, "exclude_modules": ["lm_head"]}
    if in_config:
        c = json.loads((folder / "config.json").read_text())
        c["quantization_config"] = {"quant_method": "modelopt", **quant}
        (folder / "config.json").write_text(json.dumps(c))
    else:
        (folder / "hf_quant_config.json").write_text(json.dumps(
            {"producer": {"name": "modelopt", "version": "0.47.0"}, "quantization": quant}))
    return expected
