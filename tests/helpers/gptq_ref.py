"""GPTQ oracles for the tests: AutoGPTQ's own `QuantLinear` (pack and its CPU torch dequantization) and
GPTQModel's own safetensors dequantizer (`gptqmodel.utils.model_dequant.convert_gptq_file`).

Why loaded by file path: auto-gptq 0.7.1 (the last release, a wheel) installs on the CPU machine with
`pip install --no-deps auto-gptq` (its dependencies would not pull another torch, but its `auto_gptq/__init__`
imports `transformers.modeling_utils.no_init_weights`, gone in transformers 5), so its package cannot be
imported; its `nn_modules/qlinear/qlinear_cuda_old.py` and `qlinear_cuda.py` import only torch, numpy and
transformers, and are loaded as files here. Their CUDA extensions are absent: `forward` takes the torch path,
AutoGPTQ's CPU dequantization. gptqmodel 7.7.0 (an sdist with no CUDA build needed) installs with
`pip install --no-deps gptqmodel PyPcre LogBar Device-SMI threadpoolctl TokeNicer Defuser` (with its
dependencies it would pull torch 2.14 and the CUDA wheels).

`restated_pack` is AutoGPTQ 0.7.1's `QuantLinear.pack` restated (qlinear_cuda.py, numpy), used where
auto-gptq is not installed.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import torch


def autogptq_quantlinear(kind: str):
    """AutoGPTQ's `QuantLinear` class of `qlinear_<kind>.py` ("cuda_old" or "cuda"), or None when auto-gptq
    is not installed."""
    spec = importlib.util.find_spec("auto_gptq")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / "nn_modules" / "qlinear" / f"qlinear_{kind}.py"
    mod_spec = importlib.util.spec_from_file_location(f"_autogptq_qlinear_{kind}", path)
    mod = importlib.util.module_from_spec(mod_spec)
    mod_spec.loader.exec_module(mod)
    return mod.QuantLinear


def gptqmodel_convert():
    """(GPTQModel's `convert_gptq_file(path, target_dtype, config, device)`, its name), or its restatement
    below where gptqmodel does not import."""
    try:
        from gptqmodel.utils.model_dequant import convert_gptq_file
    except Exception:  # noqa: BLE001 - not installed, or a dependency missing: the test says which oracle ran
        return restated_convert, "GPTQModel 7.7.0 convert_gptq_file restated (gptqmodel not installed)"
    return convert_gptq_file, "GPTQModel 7.7.0 convert_gptq_file"


def _unpack(words: np.ndarray, bits: int) -> np.ndarray:
    """GPTQModel's `unpack_rows` / `_unpack_rows_3bit` restated: int32 words [R, C] -> codes [R*32/bits, C]."""
    w = words.astype(np.int64) & 0xFFFFFFFF
    if bits != 3:
        per = 32 // bits
        out = np.empty((w.shape[0] * per, w.shape[1]), dtype=np.int64)
        for i in range(per):
            out[i::per] = (w >> (i * bits)) & ((1 << bits) - 1)
        return out
    w = w.reshape(-1, 3, w.shape[1])
    w0, w1, w2 = w[:, 0], w[:, 1], w[:, 2]
    out = np.empty((w.shape[0], 32, w.shape[2]), dtype=np.int64)
    for i in range(10):
        out[:, i] = (w0 >> (3 * i)) & 7
        out[:, 11 + i] = (w1 >> (1 + 3 * i)) & 7
        out[:, 22 + i] = (w2 >> (2 + 3 * i)) & 7
    out[:, 10] = ((w0 >> 30) & 3) | ((w1 << 2) & 4)
    out[:, 21] = ((w1 >> 31) & 1) | ((w2 << 1) & 6)
    return out.reshape(-1, w.shape[2])


def restated_convert(path, target_dtype, config, device="cpu") -> dict[str, torch.Tensor]:
    """GPTQModel 7.7.0 `model_dequant.convert_gptq_file` restated for int32 2/3/4/8-bit packs: v1 zero points
    corrected per field ((field + 1) & mask, `_correct_gptq_v1_qzeros`), W = (q - z[g_idx]) * scales[g_idx]
    in float32, then `.to(target_dtype)` and transposed. Only the quantized layers' weights are returned."""
    from safetensors.torch import load_file

    sd, bits = load_file(path), config.get("bits", 4)
    v1 = str(config.get("checkpoint_format") or "gptq").lower() in ("gptq", "gemm")
    out = {}
    for key in [k for k in sd if k.endswith(".qweight")]:
        p = key[: -len(".qweight")]
        q = torch.from_numpy(_unpack(sd[key].numpy(), bits))
        z = torch.from_numpy(_unpack(np.ascontiguousarray(sd[p + ".qzeros"].numpy().T), bits).T.copy())
        if v1:
            z = (z + 1) & ((1 << bits) - 1)
        g = sd[p + ".g_idx"].long()
        w = (q.float() - z.float()[g]) * sd[p + ".scales"].float()[g]
        out[p + ".weight"] = w.to(target_dtype).t().contiguous()
    return out


def autogptq_dequant(ql) -> torch.Tensor:
    """The [out, in] weight AutoGPTQ's torch path computes: forward of the identity (an exact matmul: one
    nonzero product per output), bias-free."""
    eye = torch.eye(ql.infeatures, dtype=ql.scales.dtype)
    return ql(eye).T.contiguous()


def _pack_fields(values: np.ndarray, bits: int) -> np.ndarray:
    """values uint32 [n, cols] packed along dim 0 into [n * bits / 32, cols] words (AutoGPTQ's loops)."""
    out = np.zeros((values.shape[0] // 32 * bits, values.shape[1]), dtype=np.uint32)
    i = row = 0
    while row < out.shape[0]:
        if bits in (2, 4, 8):
            for j in range(i, i + 32 // bits):
                out[row] |= values[j] << (bits * (j - i))
            i += 32 // bits
            row += 1
        else:
            for j in range(i, i + 10):
                out[row] |= values[j] << (3 * (j - i))
            i += 10
            out[row] |= values[i] << 30
            row += 1
            out[row] |= (values[i] >> 2) & 1
            i += 1
            for j in range(i, i + 10):
                out[row] |= values[j] << (3 * (j - i) + 1)
            i += 10
            out[row] |= values[i] << 31
            row += 1
            out[row] |= (values[i] >> 1) & 0x3
            i += 1
            for j in range(i, i + 10):
                out[row] |= values[j] << (3 * (j - i) + 2)
            i += 10
            row += 1
    return out


def restated_pack(weight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, g_idx: torch.Tensor,
                  bits: int) -> dict[str, torch.Tensor]:
    """AutoGPTQ 0.7.1 `QuantLinear.pack` (qlinear_cuda.py): weight [out, in] (fp16), scales/zeros [out, G]
    float; returns qweight, qzeros (v1: z - 1), scales (weight dtype), g_idx."""
    W = weight.clone()
    scales, zeros = scales.t().contiguous(), zeros.t().contiguous()
    scale_zeros = zeros * scales
    s = scales.clone().to(W.dtype)
    cols = [torch.round((W[:, i] + scale_zeros[g_idx[i]]) / s[g_idx[i]]).to(torch.int)[:, None]
            for i in range(W.shape[1])]
    intweight = torch.cat(cols, dim=1).t().contiguous().numpy().astype(np.uint32)
    qweight = _pack_fields(intweight, bits).astype(np.int32)
    return {"qweight": torch.from_numpy(np.ascontiguousarray(qweight)), "qzeros": pack_zeros(zeros.t(), bits),
            "scales": s, "g_idx": g_idx.to(torch.int32)}


def pack_zeros(zeros: torch.Tensor, bits: int, offset: int = 1) -> torch.Tensor:
    """Integer zeros [out, G] packed as qzeros [G, out * bits / 32]: v1 stores z - 1 (`offset` 1, AutoGPTQ's
    `zeros -= 1` before the same loops), gptq_v2 stores z (`offset` 0)."""
    z = (zeros.t().to(torch.int64) - offset).numpy().astype(np.uint32)
    return torch.from_numpy(np.ascontiguousarray(_pack_fields(np.ascontiguousarray(z.T), bits).T.astype(np.int32)))
