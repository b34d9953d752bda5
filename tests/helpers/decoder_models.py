"""Tiny quantized checkpoints of the formats a single file carries (bitsandbytes, ComfyUI comfy_quant, the scaled
FP8 layouts, optimum-quanto), each with its oracle: the fuzz test of the decoders (tests/test_decoder_fuzz.py)
mutates them, the conformance test of every registered format (tests/test_quant_formats.py, through
tests/helpers/format_cases.py) decodes them as made.

Each checkpoint is made by the format's own library (bitsandbytes, comfy-kitchen, optimum-quanto) or, for the
FP8 scaled layouts no installed library writes (kohya fp8_scaled, HF block FP8, weight_scale FP8, ComfyUI legacy
scaled_fp8), from the layout definition in docs/format-facts.md.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Callable

import pytest
import torch

E4 = torch.float8_e4m3fn


@dataclass
class Model:
    """A tiny quantized checkpoint and its oracle: `oracle(sd)` gives the fp32 values of the decoded
    weights of a (mutated) state dict, or raises when the format cannot give any."""

    sd: dict[str, torch.Tensor]
    weights: list[str]  # the decoded (logical) weight names
    oracle: Callable[[dict], dict[str, torch.Tensor]]
    plain: set[str] = field(default_factory=set)  # stored keys written as they are (biases)
    optional: set[str] = field(default_factory=set)  # keys whose absence changes no value (activation scales)
    metadata: dict | None = None
    config: dict | None = None  # written as config.json beside model.safetensors


def _rand(shape, seed, scale=0.05):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * scale


# ---------------------------------------------------------------------------------------------------
# checkpoints and oracles


def bnb_4bit(quant_type: str, nested: bool) -> Model:
    F = pytest.importorskip("bitsandbytes.functional")
    w = _rand((24, 64), 1 if nested else 2).bfloat16()
    q, st = F.quantize_4bit(w, blocksize=64, quant_type=quant_type, compress_statistics=nested)
    sd = {"m.weight": q} | {f"m.weight.{k}": v for k, v in st.as_dict(packed=True).items()}
    sd["m.bias"] = _rand((24,), 3).bfloat16()

    def oracle(sd):
        parts = {k[len("m.weight."):]: v for k, v in sd.items() if k.startswith("m.weight.")}
        parts.setdefault("quant_map", st.code)  # the format's fixed table: bitsandbytes writes it, needs it
        state = F.QuantState.from_dict(parts, device=torch.device("cpu"))
        state.dtype = torch.float32
        a = sd["m.weight"]
        return {"m.weight": F.dequantize_4bit(a if a.dtype == torch.uint8 else a.contiguous().view(torch.uint8), state)}

    return Model(sd, ["m.weight"], oracle, plain={"m.bias"})


def bnb_int8() -> Model:
    F = pytest.importorskip("bitsandbytes.functional")
    w = _rand((16, 32), 4)
    cb, scb, _ = F.int8_vectorwise_quant(w)
    sd = {"m.weight": cb, "m.SCB": scb, "m.weight_format": torch.tensor(0, dtype=torch.uint8),
          "m.bias": _rand((16,), 5)}

    def oracle(sd):
        assert sd["m.weight"].dtype == torch.int8 and sd["m.SCB"].dtype == torch.float32
        return {"m.weight": F.int8_vectorwise_dequant(sd["m.weight"], sd["m.SCB"])}

    return Model(sd, ["m.weight"], oracle, plain={"m.bias"}, optional={"m.weight_format"})


def comfy(fmt: str, shape=(32, 64)) -> Model:
    ck = pytest.importorskip("comfy_kitchen.tensor")
    w = _rand(shape, 6)
    w[-1, -1] = 0.4
    conf = {"format": "int8_tensorwise" if fmt.startswith("int8") else fmt}
    if fmt == "float8_e4m3fn":
        q, p = ck.TensorCoreFP8Layout.quantize(w)
        saved = ck.TensorCoreFP8Layout.state_dict_tensors(q, p)
    else:
        from helpers.comfy_ref import ck_quantize

        _, _, saved = ck_quantize(conf["format"], w, rowwise=fmt == "int8_rowwise")
    sd = {f"m.weight{k}": v for k, v in saved.items()}
    sd["m.comfy_quant"] = torch.tensor(list(json.dumps(conf).encode()), dtype=torch.uint8)
    sd["m.input_scale"] = torch.tensor(1.0)
    sd["m.bias"] = _rand((shape[0],), 7)

    def oracle(sd):
        w = sd["m.weight"]
        # the file says the shape only by its stored weight (no orig_shape here, nothing padded)
        stored = (w.shape[0], w.shape[1] * 2) if conf["format"] == "nvfp4" else tuple(w.shape)
        if fmt == "float8_e4m3fn":  # ComfyUI: a float8 layer without weight_scale has scale 1
            s = sd.get("m.weight_scale", torch.ones(()))
            assert w.dtype == E4 and s.dtype.is_floating_point and s.dtype.itemsize > 1
            params = ck.TensorCoreFP8Layout.Params(scale=s, orig_dtype=torch.float32, orig_shape=stored)
            return {"m.weight": ck.QuantizedTensor(w, "TensorCoreFP8Layout", params).dequantize()}
        from helpers.comfy_ref import STORAGE, comfy_load

        assert w.dtype == STORAGE[conf["format"]]
        s = sd["m.weight_scale"]
        if conf["format"] != "int8_tensorwise" and s.dim() == 1:  # ckpt reads flattened blocked scales too
            s = s.reshape(128, -1)
        return {"m.weight": comfy_load(sd | {"m.weight_scale": s}, "m", stored)}

    optional = {"m.input_scale"} | ({"m.comfy_quant"} if fmt == "float8_e4m3fn" else set())
    return Model(sd, ["m.weight"], oracle, plain={"m.bias"}, optional=optional)


def _fp8_codes(shape, seed):
    return (_rand(shape, seed, 40.0)).to(E4)


def _row_or_tensor(s: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """A scale as the layouts define it: one value, or one per dim-0 row ([rows], [rows, 1], ...),
    shaped to broadcast over `w`."""
    if s.numel() == 1:
        return s.float().reshape(())
    rows = w.shape[0]
    assert s.shape[0] == rows and s.numel() == rows, s.shape
    return s.float().reshape(rows, *[1] * (w.dim() - 1))


def kohya() -> Model:
    """musubi-tuner fp8_scaled: per-row [out, 1] scale; blocks of 64 along the input ([out, nb, 1]) with
    a second-level scalar `scale_weight_tensor`; the scales in the model's dtype (bf16)."""
    sd = {"a.weight": _fp8_codes((16, 32), 8), "a.scale_weight": (_rand((16, 1), 9).abs() + 0.01).bfloat16(),
          "b.weight": _fp8_codes((8, 128), 10), "b.scale_weight": (_rand((8, 2, 1), 11).abs() + 0.01).bfloat16(),
          "b.scale_weight_tensor": torch.tensor([0.5], dtype=torch.bfloat16), "a.bias": _rand((16,), 12).bfloat16()}

    def oracle(sd):
        out = {}
        for layer in ("a", "b"):
            w, s = sd[f"{layer}.weight"], sd[f"{layer}.scale_weight"]
            assert w.dtype == E4 and s.dtype.is_floating_point and s.dtype.itemsize > 1
            t = sd.get(f"{layer}.scale_weight_tensor")
            rows = w.shape[0]
            if s.numel() == 1 or s.numel() == rows and s.shape[0] == rows:  # one value, or one per row
                s = _row_or_tensor(s, w)
                tot = s if t is None else s * t.float().reshape(())
                out[f"{layer}.weight"] = w.float() * tot
            else:  # blocks along the input dimension of a Linear weight
                rows, cols = w.shape
                assert s.dim() in (2, 3) and s.shape[0] == rows and (s.dim() == 2 or s.shape[2] == 1), s.shape
                nb = s.shape[1]
                assert cols % nb == 0
                tot = s.float().reshape(rows, nb, 1) * (1.0 if t is None else t.float().reshape(()))
                out[f"{layer}.weight"] = (w.float().view(rows, nb, -1) * tot).view(rows, cols)
            if t is not None:
                assert t.numel() == 1 and t.dtype.is_floating_point and t.dtype.itemsize > 1
        return out

    return Model(sd, ["a.weight", "b.weight"], oracle, plain={"a.bias"})


def hf_block() -> Model:
    """HF fine-grained FP8: `weight_scale_inv` [ceil(out/128), ceil(in/128)] multiplies its 128x128 block."""
    sd = {"a.weight": _fp8_codes((200, 130), 13), "a.weight_scale_inv": _rand((2, 2), 14).abs() + 0.01,
          "b.weight": _fp8_codes((64, 64), 15), "b.weight_scale_inv": _rand((1, 1), 16).abs() + 0.01,
          "a.activation_scale": torch.tensor([1.0]), "norm.weight": _rand((64,), 17).bfloat16()}

    def oracle(sd):
        out = {}
        for layer in ("a", "b"):
            w, s = sd[f"{layer}.weight"], sd[f"{layer}.weight_scale_inv"]
            assert w.dtype == E4 and s.dtype.is_floating_point and s.dtype.itemsize > 1
            *lead, rows, cols = w.shape  # a matrix, or a bank of them (experts)
            if s.numel() == 1:
                out[f"{layer}.weight"] = w.float() * s.float().reshape(())
                continue
            assert tuple(s.shape) == (*lead, -(-rows // 128), -(-cols // 128)), s.shape
            full = s.float().repeat_interleave(128, -2).repeat_interleave(128, -1)[..., :rows, :cols]
            out[f"{layer}.weight"] = w.float() * full
        return out

    return Model(sd, ["a.weight", "b.weight"], oracle, plain={"norm.weight"}, optional={"a.activation_scale"},
                 config={"architectures": ["LlamaForCausalLM"], "torch_dtype": "bfloat16",
                         "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}})


def weight_scale() -> Model:
    """compressed-tensors / FBGEMM FP8: `weight_scale` per channel [out, 1] or per tensor, `input_scale`."""
    sd = {"a.weight": _fp8_codes((32, 64), 18), "a.weight_scale": _rand((32, 1), 19).abs() + 0.01,
          "a.input_scale": torch.tensor(0.5), "b.weight": _fp8_codes((16, 32), 20),
          "b.weight_scale": torch.tensor(0.02), "a.bias": _rand((32,), 21).bfloat16()}

    def oracle(sd):
        out = {}
        for layer in ("a", "b"):
            w, s = sd[f"{layer}.weight"], sd[f"{layer}.weight_scale"]
            assert w.dtype == E4 and s.dtype.is_floating_point and s.dtype.itemsize > 1
            out[f"{layer}.weight"] = w.float() * _row_or_tensor(s, w)
        return out

    return Model(sd, ["a.weight", "b.weight"], oracle, plain={"a.bias"}, optional={"a.input_scale"})


def comfy_legacy() -> Model:
    """ComfyUI legacy scaled fp8: `scaled_fp8` marker, fp32 scalar `scale_weight` (a dummy 1.0 on a
    high-precision layer), `scale_input`. Like ComfyUI, a layer without scale_weight has scale 1."""
    sd = {"scaled_fp8": torch.zeros(0, dtype=E4), "a.weight": _fp8_codes((16, 32), 22),
          "a.scale_weight": torch.tensor(0.003), "a.scale_input": torch.tensor(1.0),
          "b.weight": _rand((8, 16), 23).bfloat16(), "b.scale_weight": torch.tensor(1.0)}

    def oracle(sd):
        out = {}
        assert "scaled_fp8" in sd
        for layer in ("a", "b"):
            w, s = sd[f"{layer}.weight"], sd.get(f"{layer}.scale_weight", torch.ones(()))
            assert w.dtype.is_floating_point and s.dtype.is_floating_point and s.dtype.itemsize > 1
            out[f"{layer}.weight"] = w.float() * _row_or_tensor(s, w)
        return out

    return Model(sd, ["a.weight", "b.weight"], oracle, optional={"a.scale_input"})


def quanto(qtype: str) -> Model:
    oq = pytest.importorskip("optimum.quanto")

    def module(dtype=torch.float16, q=qtype):
        torch.manual_seed(24)
        m = torch.nn.ModuleDict({"lin": torch.nn.Linear(64, 32)}).to(dtype)
        oq.quantize(m, weights=oq.qtypes[q])
        oq.freeze(m)
        return m

    sd = {k: v.contiguous() for k, v in module().state_dict().items()}

    def oracle(sd):
        # 8-bit data says its qtype by its dtype (no quanto_qmap.json here): an int8 -> fp8 cast is a qfloat8 file
        d = sd.get("lin.weight._data")
        by_dtype = {torch.int8: "qint8", E4: "qfloat8_e4m3fn", torch.float8_e5m2: "qfloat8_e5m2"}
        m = module(q=by_dtype[d.dtype] if d is not None and qtype != "qint4" else qtype)
        # the weight's values: the bias and the activation scales are no part of them (the module's own)
        part = sd | {k: v for k, v in m.state_dict().items() if k in model.plain | model.optional}
        s, d = part.get("lin.weight._scale"), part.get("lin.weight._data")
        if s is not None and d is not None and s.dim() == 1 and s.numel() > 1 and d.dim() == 2:
            # ckpt reads a 1-D [rows] scale as one per row (tests/test_bad_quant_and_pickles.py pins it);
            # quanto's `scale * data` cannot broadcast it: given as the [rows, 1] it stands for
            part["lin.weight._scale"] = s.reshape(-1, 1)
        m.load_state_dict(part, strict=True)
        return {"lin.weight": m.lin.weight.dequantize()}

    model = Model(sd, ["lin.weight"], oracle, plain={"lin.bias"}, optional={"lin.input_scale", "lin.output_scale"})
    return model


MODELS = {
    "bnb-nf4-nested": lambda: bnb_4bit("nf4", True), "bnb-fp4": lambda: bnb_4bit("fp4", False), "bnb-int8": bnb_int8,
    "comfy-nvfp4": lambda: comfy("nvfp4"), "comfy-mxfp8": lambda: comfy("mxfp8"),
    "comfy-int8": lambda: comfy("int8_tensorwise"), "comfy-int8-rowwise": lambda: comfy("int8_rowwise"),
    "comfy-fp8": lambda: comfy("float8_e4m3fn"), "kohya-fp8-scaled": kohya, "hf-block-fp8": hf_block,
    "weight-scale-fp8": weight_scale, "comfy-legacy-fp8": comfy_legacy,
    "quanto-qint8": lambda: quanto("qint8"), "quanto-qfloat8": lambda: quanto("qfloat8_e4m3fn"),
    "quanto-qint4": lambda: quanto("qint4"),
}
