"""comfy-kitchen as the oracle of ComfyUI's `comfy_quant` layouts: its quantize of W's fp32 values, its
dequantize, ComfyUI's loader for one quantized Linear, the `comfy_quant` config tensor, and test weights
with an all-zero block and one large value (block scales that differ widely)."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("comfy_kitchen.tensor")
from comfy_kitchen.tensor import (QuantizedTensor, TensorCoreFP8Layout, TensorCoreMXFP8Layout,  # noqa: E402
                                  TensorCoreNVFP4Layout, TensorWiseINT8Layout)

LAYOUTS = {"nvfp4": TensorCoreNVFP4Layout, "mxfp8": TensorCoreMXFP8Layout, "int8_tensorwise": TensorWiseINT8Layout,
           "float8_e4m3fn": TensorCoreFP8Layout, "float8_e5m2": TensorCoreFP8Layout}


STORAGE = {"nvfp4": torch.uint8, "mxfp8": torch.float8_e4m3fn, "int8_tensorwise": torch.int8,
           "float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2}


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.dtype == b.dtype and tuple(a.shape) == tuple(b.shape)
            and torch.equal(a.reshape(-1).contiguous().view(torch.uint8), b.reshape(-1).contiguous().view(torch.uint8)))


def conf_tensor(conf: dict) -> torch.Tensor:
    return torch.tensor(list(json.dumps(conf).encode()), dtype=torch.uint8)


def weight(shape, seed=0, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=g) * 0.05
    w[0, : min(32, shape[1])] = 0  # an all-zero block
    w[-1, -1] = 0.4  # one large value: block scales differ widely
    return w.to(dtype)


def ck_quantize(fmt, w: torch.Tensor, rowwise=False):
    """comfy-kitchen's quantize of W's fp32 values: (qdata, params, {suffix: tensor} as saved)."""
    layout = LAYOUTS[fmt]
    if fmt == "int8_tensorwise":
        q, p = layout.quantize(w.float(), per_channel=rowwise)
    elif fmt.startswith("float8"):
        q, p = layout.quantize(w.float(), dtype=STORAGE[fmt])
    else:
        q, p = layout.quantize(w.float())
    return q, p, layout.state_dict_tensors(q, p)


def ck_dequantize_fp32(fmt, q, p) -> torch.Tensor:
    return LAYOUTS[fmt].dequantize(q, type(p)(**{**p.__dict__, "orig_dtype": torch.float32}))


def comfy_load(sd: dict, layer: str, orig_shape, compute_dtype=torch.float32) -> torch.Tensor:
    """ComfyUI's loader for one quantized Linear: its config, its scales viewed as the layout wants, the
    shape from the module (`orig_shape`); returns the dequantized weight."""
    conf = json.loads(sd[f"{layer}.comfy_quant"].numpy().tobytes())
    fmt = conf["format"]
    w = sd[f"{layer}.weight"]
    if fmt == "nvfp4":
        scales = {"scale": sd[f"{layer}.weight_scale_2"], "block_scale": sd[f"{layer}.weight_scale"].view(torch.float8_e4m3fn)}
    elif fmt == "mxfp8":
        scales = {"scale": sd[f"{layer}.weight_scale"].view(torch.float8_e8m0fnu)}
    else:
        scales = {"scale": sd[f"{layer}.weight_scale"]}
    layout = LAYOUTS[fmt]
    params = layout.Params(**scales, orig_dtype=compute_dtype, orig_shape=tuple(orig_shape))
    return QuantizedTensor(w.to(dtype=STORAGE[fmt]), layout.__name__, params).dequantize()
