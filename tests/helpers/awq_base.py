"""The tiny awq bases of `tests/test_awq.py`, shared with the other tests that need one (test modules do not
import each other)."""

from __future__ import annotations

import importlib.util
import json
import sys
import types
import pytest
import torch
from safetensors.torch import save_file

LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
           "mlp.up_proj", "mlp.down_proj")


def _awq():
    if not hasattr(sys.modules.get("awq"), "__path__"):
        spec = importlib.util.find_spec("awq")
        if spec is None or not spec.submodule_search_locations:
            pytest.skip("autoawq is not installed (pip install --no-deps autoawq)")
        pkg = types.ModuleType("awq")
        pkg.__path__, pkg.__spec__ = list(spec.submodule_search_locations), spec
        sys.modules["awq"] = pkg
    from awq.modules.linear.gemm import WQLinear_GEMM
    from awq.modules.linear.gemv import WQLinear_GEMV
    from awq.utils.packing_utils import dequantize_gemm

    return WQLinear_GEMM, WQLinear_GEMV, dequantize_gemm


def _tiny(hidden=64, inter=128):
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    return cfg, transformers.LlamaForCausalLM(cfg).half()


def pack(version, lin, scales, zeros, group):
    """AutoAWQ's own packing of the fp16 linear `lin` on the grid (`scales`, `zeros`: [out, groups])."""
    GEMM, GEMV, _ = _awq()
    if version == "gemm":
        return GEMM.from_linear(lin, 4, group, scales=scales.t().contiguous(), zeros=zeros.t().contiguous())
    return GEMV.from_linear(lin, 4, group, scales=scales, zeros=zeros)


def build(folder, version="gemm", group=32, hidden=64, inter=128, seed=1, spill=False, grids=None):
    """An AutoAWQ folder; returns {weight name: (oracle weight or None, formula weight)} in fp16 [out, in].
    `grids`, a dict, receives each layer's grid: {layer: (fp16 scales, integer zeros, group of each column)}."""
    dequantize_gemm = _awq()[2]
    cfg, model = _tiny(hidden, inter)
    gen = torch.Generator().manual_seed(seed)
    sd, expected = dict(model.state_dict()), {}
    for lin_name in LINEARS:
        name = f"model.layers.0.{lin_name}"
        lin = model.get_submodule(name)
        n, k = lin.weight.shape
        gs = k if group == -1 else group
        G = k // gs
        g = torch.arange(k) // gs
        scales = torch.rand(n, G, generator=gen) * 0.01 + 0.002
        zeros = torch.randint(0, 16, (n, G), generator=gen).float()
        q = torch.randint(0, 16, (n, k), generator=gen).float()
        noise = (torch.rand(n, k, generator=gen) - 0.5) * 0.5
        if spill:  # codes past 15 or below 0: the packer does not clamp, the dequantizer masks per field
            noise[::7, ::5] += 3.0
        lin.weight.data = ((q - zeros[:, g] + noise) * scales[:, g]).half()
        s16 = scales.half()
        codes = torch.round((lin.weight.data.float() + (zeros * scales)[:, g]) / s16[:, g].float())
        formula = None if spill else (s16[:, g].float() * (codes.long() - zeros[:, g].long()).float()).half()  # integer: no -0
        ql = pack(version, lin, scales, zeros, gs)
        oracle = dequantize_gemm(ql.qweight, ql.qzeros, ql.scales, 4, gs).T.contiguous() if version == "gemm" else None
        expected[f"{name}.weight"] = (oracle, formula)
        if grids is not None:
            grids[name] = (s16, zeros.long(), g)
        del sd[f"{name}.weight"]
        for key in ("qweight", "qzeros", "scales"):
            sd[f"{name}.{key}"] = getattr(ql, key).contiguous()
    folder.mkdir(parents=True, exist_ok=True)
    save_file(sd, folder / "model.safetensors", metadata={"format": "pt"})
    qc = {"quant_method": "awq", "zero_point": True, "group_size": group, "bits": 4, "version": version,
          "modules_to_not_convert": None}
    (folder / "config.json").write_text(json.dumps(cfg.to_dict() | {"quantization_config": qc,
                                                                    "torch_dtype": "float16"}))
    return expected
