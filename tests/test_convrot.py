"""ComfyUI's ConvRot layers both ways (issue 35 item 1): `int8_tensorwise` with `convrot`, `convrot_w4a4` and
`asym_w4a8_int8` (`ckpt.quant.convrot`, `ckpt.quant.convrot_encode`), with comfy-kitchen 0.2.40's eager backend as
the oracle of every byte:

- decoding (`dequant`, `convert --to`) equals comfy-kitchen's dequantize of the layer ComfyUI's loader builds from
  the file (its config read at the top level or under `params`, from the tensor or `_quantization_metadata`);
- `convert --to int8_convrot|convrot_w4a4|asym_w4a8_int8` writes exactly what comfy-kitchen's quantizer makes of the
  same fp32 values, with ComfyUI's own `comfy_quant` configs, weights it cannot store kept and said;
- `--group-size N` (the rotation group of int8_convrot / convrot_w4a4, the W4A8 group of asym_w4a8_int8) is
  comfy-kitchen's quantizer with that group; a size it cannot use is refused, a width the group does not divide kept;
- W6A8 (6-bit asym_w4a8_int8 storage) decodes as comfy-kitchen's dequantize;
- `merge-lora --keep-format` re-quantizes a changed layer as comfy-kitchen's `requantize_from_float` does (the
  base's parameters and W4A8 codebook, asymmetric and W6A8 bases included), every other byte unchanged;
- `inspect` names each format with its parameters; bad input is one line, exit 2, nothing written.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from helpers.keep_format import kohya_lora, plain_merge, reported
from helpers.refusals import assert_refused
from safetensors import safe_open
from safetensors.torch import load_file, save_file

ck = pytest.importorskip("comfy_kitchen.tensor")
from comfy_kitchen.tensor import (AsymW4A8Int8Layout, QuantizedTensor, TensorCoreConvRotW4A4Layout,  # noqa: E402
                                  TensorWiseINT8Layout)

LAYOUT = {"int8_tensorwise": TensorWiseINT8Layout, "convrot_w4a4": TensorCoreConvRotW4A4Layout,
          "asym_w4a8_int8": AsymW4A8Int8Layout}
TARGET = {"int8_tensorwise": "int8_convrot", "convrot_w4a4": "convrot_w4a4", "asym_w4a8_int8": "asym_w4a8_int8"}
FORMATS = tuple(LAYOUT)


def weight(shape, seed=0, heavy=False):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=g) * 0.05
    if heavy:  # the rotation of a sparse matrix: rotated (256-groups) it is sparse again, heavy-tailed, and
        # comfy-kitchen fits its W4A8 codebook instead of taking the frozen one
        from comfy_kitchen.tensor.int8_utils import _build_hadamard, _rotate_weight

        w = _rotate_weight(w * (torch.rand(shape, generator=g) < 0.05) * 20, _build_hadamard(256), 256)
    w[0, :8] = 0
    w[-1, -1] = 0.4
    return w


def conf_tensor(conf: dict) -> torch.Tensor:
    return torch.tensor(list(json.dumps(conf).encode()), dtype=torch.uint8)


def ck_quantize(fmt, w, g=256, **kw):
    """comfy-kitchen's quantize of `w`'s fp32 values: (saved tensors by suffix, ComfyUI's config of the layer)."""
    if fmt == "int8_tensorwise":
        q, p = TensorWiseINT8Layout.quantize(w.float(), per_channel=True, convrot=True, convrot_groupsize=g)
        return {"": q, "_scale": p.scale}, {"format": fmt, "convrot": True, "convrot_groupsize": g}
    if fmt == "convrot_w4a4":
        q, p = TensorCoreConvRotW4A4Layout.quantize(w.float(), convrot_groupsize=g)
        return TensorCoreConvRotW4A4Layout.state_dict_tensors(q, p), {"format": fmt, "convrot_groupsize": g}
    q, p = AsymW4A8Int8Layout.quantize(w.float(), convrot_groupsize=g, **kw)
    return AsymW4A8Int8Layout.state_dict_tensors(q, p), {"format": fmt, "group_size": kw.get("group_size", 16), "convrot_groupsize": g}


def ck_layer(sd: dict, layer: str, conf: dict, shape, dtype=torch.float32) -> QuantizedTensor:
    """ComfyUI's loader (`comfy/ops.py`) for one ConvRot Linear: the keys and parameters as it reads them."""
    fmt = conf["format"]
    params = conf.get("params", {})

    def p(k, d):
        return conf.get(k, params.get(k, d))

    w = sd[f"{layer}.weight"]
    if fmt == "int8_tensorwise":
        lp = TensorWiseINT8Layout.Params(scale=sd[f"{layer}.weight_scale"], orig_dtype=dtype, orig_shape=shape,
                                         convrot=True, convrot_groupsize=p("convrot_groupsize", 256))
    elif fmt == "convrot_w4a4":
        lp = TensorCoreConvRotW4A4Layout.Params(scale=sd[f"{layer}.weight_scale"], orig_dtype=dtype,
                                                orig_shape=shape, convrot_groupsize=p("convrot_groupsize", 256))
    else:
        s = sd[f"{layer}.weight_s_rel"]
        lp = AsymW4A8Int8Layout.Params(
            scale=s.view(torch.float8_e4m3fn) if s.dtype == torch.uint8 else s, s_channel=sd[f"{layer}.weight_s_channel"],
            correction=sd.get(f"{layer}.weight_correction"), codebook=sd.get(f"{layer}.weight_codebook"),
            orig_dtype=dtype, orig_shape=shape, group_size=p("group_size", 16),
            convrot_groupsize=p("convrot_groupsize", 256))
    return QuantizedTensor(w.to(torch.int8), LAYOUT[fmt].__name__, lp)


def bits(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(torch.uint8) if x.element_size() == 1 else x.contiguous().view(torch.int8)


def same_bytes(a, b) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))


def checkpoint(path, layers: dict, conf_where="tensor", extra=None):
    """A file of ConvRot layers {name: (fmt, weight, quantize kwargs, config edit)} made by comfy-kitchen, plus a
    bias and an embedding; returns {name: (config, stored shape)}."""
    sd, meta_layers, info = {"embed.weight": weight((8, 16), 9)}, {}, {}
    for name, (fmt, w, kw, edit) in layers.items():
        saved, conf = ck_quantize(fmt, w, **kw)
        conf = edit(conf) if edit else conf
        sd |= {f"{name}.weight{k}": v for k, v in saved.items()}
        sd[f"{name}.bias"] = torch.randn(w.shape[0], generator=torch.Generator().manual_seed(3))
        if conf_where == "tensor":
            sd[f"{name}.comfy_quant"] = conf_tensor(conf)
        else:
            meta_layers[name] = conf
        info[name] = (conf, tuple(w.shape))
    sd |= extra or {}
    meta = {"_quantization_metadata": json.dumps({"format_version": "1.0", "layers": meta_layers})} if meta_layers else None
    save_file(sd, path, metadata=meta)
    return info


def oracle(path, info, dtype=torch.float32) -> dict[str, torch.Tensor]:
    sd = load_file(path)
    return {f"{n}.weight": ck_layer(sd, n, conf, shape, dtype).dequantize() for n, (conf, shape) in info.items()}


def nest_params(conf):
    """The config under `params`, as ComfyUI also accepts it."""
    return {"format": conf["format"], "params": {k: v for k, v in conf.items() if k != "format"}}


# ---------------------------------------------------------------------------------------------------
# decoding

DECODE_CASES = {
    "int8": {"blocks.0.q": ("int8_tensorwise", weight((48, 512), 1), {}, None)},
    "int8-group16-params": {"blocks.0.q": ("int8_tensorwise", weight((40, 256), 2), {"g": 16}, nest_params)},
    "w4a4": {"blocks.0.q": ("convrot_w4a4", weight((48, 512), 3), {}, None)},
    "w4a4-group64-params": {"blocks.0.q": ("convrot_w4a4", weight((24, 192), 4), {"g": 64}, nest_params)},
    "w4a8": {"blocks.0.q": ("asym_w4a8_int8", weight((48, 512), 5), {}, None)},
    "w4a8-fitted-codebook": {"blocks.0.q": ("asym_w4a8_int8", weight((64, 512), 6, heavy=True), {}, None)},
    "w4a8-uniform": {"blocks.0.q": ("asym_w4a8_int8", weight((32, 256), 7), {"codebook": False}, None)},
    "w4a8-asym-fp32-scales-group32": {"blocks.0.q": ("asym_w4a8_int8", weight((32, 256), 8),
                                                     {"symmetric": False, "scale_dtype": torch.float32,
                                                      "group_size": 32}, nest_params)},
    "w6a8": {"blocks.0.q": ("asym_w4a8_int8", weight((48, 512), 14), {"bits": 6}, None)},
    "w6a8-fp32-scales-group32": {"blocks.0.q": ("asym_w4a8_int8", weight((32, 256), 15),
                                                {"bits": 6, "scale_dtype": torch.float32, "group_size": 32}, nest_params)},
    "mixed": {"blocks.0.a": ("int8_tensorwise", weight((32, 256), 10), {}, None),
              "blocks.0.b": ("convrot_w4a4", weight((32, 256), 11), {}, None),
              "blocks.1.c": ("asym_w4a8_int8", weight((32, 256), 12), {}, None)},
}


def _kw(kw):
    kw = dict(kw)
    return {"g": kw.pop("g", 256), **kw}


@pytest.mark.parametrize("case", DECODE_CASES)
@pytest.mark.parametrize("where", ["tensor", "metadata"])
def test_dequant_equals_comfy_kitchen(tmp_path, run_ckpt, case, where):
    layers = {n: (f, w, _kw(kw), e) for n, (f, w, kw, e) in DECODE_CASES[case].items()}
    info = checkpoint(tmp_path / "in.safetensors", layers, where)
    want = oracle(tmp_path / "in.safetensors", info)
    code, _, err = run_ckpt("dequant", tmp_path / "in.safetensors", "--to", "fp32", "-o", tmp_path / "o.safetensors", "-q")
    assert code == 0, err
    got = load_file(tmp_path / "o.safetensors")
    stored = load_file(tmp_path / "in.safetensors")
    assert set(got) == set(want) | {k for k in stored if k.endswith(".bias")} | {"embed.weight"}
    for k, v in want.items():
        assert same_bytes(got[k], v), k
    code, _, err = run_ckpt("convert", tmp_path / "in.safetensors", "--to", "bf16", "-o", tmp_path / "b.safetensors", "-q")
    assert code == 0, err
    got = load_file(tmp_path / "b.safetensors")
    for k, v in want.items():  # comfy-kitchen's fp32 values, rounded once
        assert same_bytes(got[k], v.bfloat16()), k


def test_w6a8_storage_is_what_the_packed_width_says(tmp_path):
    """comfy-kitchen stores W6A8 in the asym_w4a8_int8 format, the bit depth implied by the packed row: 3*in/4 bytes."""
    q, p = AsymW4A8Int8Layout.quantize(weight((16, 256)), bits=6)
    assert tuple(q.shape) == (16, 192) and p.codebook is None and p.correction is None


# ---------------------------------------------------------------------------------------------------
# encoding


def plain_model(path, shapes: dict[str, tuple[int, int]], heavy=()):
    sd = {f"{n}.weight": weight(s, i + 20, heavy=n in heavy) for i, (n, s) in enumerate(shapes.items())}
    sd["blocks.0.attn.qkv.bias"] = torch.randn(shapes["blocks.0.attn.qkv"][0])
    sd["embed.weight"] = weight((8, 256), 40)
    save_file(sd, path)
    return sd


SHAPES = {"blocks.0.attn.qkv": (96, 512), "blocks.0.mlp.fc": (40, 256), "blocks.1.mlp.fc": (24, 1024),
          "blocks.1.odd": (16, 200), "head": (8, 256)}


@pytest.mark.parametrize("fmt", FORMATS)
def test_convert_to_convrot_is_comfy_kitchens_quantize(tmp_path, run_ckpt, fmt):
    sd = plain_model(tmp_path / "in.safetensors", SHAPES, heavy={"blocks.1.mlp.fc"})
    out = tmp_path / "o.safetensors"
    code, stdout, err = run_ckpt("convert", tmp_path / "in.safetensors", "--to", TARGET[fmt], "-o", out)
    assert code == 0, err
    assert "1 weight kept in high precision: input width not a multiple of 256 (blocks.1.odd.weight)" in stdout + err
    got = load_file(out)
    with safe_open(out, "pt") as f:
        meta = json.loads(f.metadata()["_quantization_metadata"])
    quantized = ["blocks.0.attn.qkv", "blocks.0.mlp.fc", "blocks.1.mlp.fc"]
    assert sorted(meta["layers"]) == quantized
    for layer in quantized:
        want, conf = ck_quantize(fmt, sd[f"{layer}.weight"])
        assert meta["layers"][layer] == conf
        assert json.loads(got[f"{layer}.comfy_quant"].numpy().tobytes()) == conf
        assert {k[len(layer) + 7:] for k in got if k.startswith(f"{layer}.weight")} == set(want)
        for suffix, v in want.items():
            assert same_bytes(got[f"{layer}.weight{suffix}"], v), (layer, suffix)
        if layer == "blocks.1.mlp.fc" and fmt == "asym_w4a8_int8":  # the heavy-tailed one: a fitted codebook
            from comfy_kitchen.tensor.w4a8_packed import default_w4a8_codebook

            assert not torch.equal(want["_codebook"], default_w4a8_codebook())
        # ComfyUI loads it: the layer dequantizes to what ckpt's own dequant gives
        back = ck_layer(got, layer, conf, sd[f"{layer}.weight"].shape).dequantize()
        assert torch.equal(back, oracle(out, {layer: (conf, tuple(sd[f"{layer}.weight"].shape))})[f"{layer}.weight"])
    for k in ("blocks.1.odd.weight", "head.weight", "embed.weight", "blocks.0.attn.qkv.bias"):
        assert same_bytes(got[k], sd[k]), k  # kept as stored
    code, _, err = run_ckpt("dequant", out, "--to", "fp32", "-o", tmp_path / "d.safetensors", "-q")
    assert code == 0, err


def test_w4a8_encode_in_comfy_kitchens_row_chunks(tmp_path):
    """A weight of more than 2**22 values is rotated and quantized in comfy-kitchen's own row chunks, with one
    codebook decided from an evenly strided row sample."""
    from ckpt.quant.convrot import ConvRotSpec
    from ckpt.quant.convrot_encode import quantize

    w = weight((260, 16384), 50)
    want, _ = ck_quantize("asym_w4a8_int8", w)
    got = quantize(ConvRotSpec("asym_w4a8_int8"), w)
    for suffix, v in want.items():
        assert same_bytes(got["weight" + suffix], v), suffix


GROUP_CASES = {"int8_tensorwise": (16, 64), "convrot_w4a4": (16, 64), "asym_w4a8_int8": (4, 8, 32, 64)}


@pytest.mark.parametrize("fmt,n", [(f, n) for f, ns in GROUP_CASES.items() for n in ns])
def test_group_size_is_comfy_kitchens_quantize_with_that_group(tmp_path, run_ckpt, fmt, n):
    """--group-size N: the rotation group of int8_convrot / convrot_w4a4, the W4A8 group of asym_w4a8_int8 (its
    rotation stays 256); a weight whose width the layout cannot take with it is kept and said."""
    shapes = {"blocks.0.attn.qkv": (48, 512), "blocks.0.mlp.fc": (24, 192), "blocks.1.mlp.fc": (16, 200), "head": (8, 256)}
    sd = plain_model(tmp_path / "in.safetensors", shapes)
    out = tmp_path / "o.safetensors"
    code, stdout, err = run_ckpt("convert", tmp_path / "in.safetensors", "--to", TARGET[fmt], "--group-size", n, "-o", out)
    assert code == 0, err
    need = {"int8_tensorwise": n, "convrot_w4a4": max(n, 64), "asym_w4a8_int8": 256}[fmt]
    fits = [layer for layer in ("blocks.0.attn.qkv", "blocks.0.mlp.fc", "blocks.1.mlp.fc") if shapes[layer][1] % need == 0]
    kept = sorted(f"{layer}.weight" for layer in ("blocks.0.mlp.fc", "blocks.1.mlp.fc") if layer not in fits)
    assert f"kept in high precision: input width not a multiple of {need} ({', '.join(kept)})" in stdout + err
    got = load_file(out)
    with safe_open(out, "pt") as f:
        meta = json.loads(f.metadata()["_quantization_metadata"])
    assert sorted(meta["layers"]) == sorted(fits)
    for layer in fits:
        kw = {"group_size": n} if fmt == "asym_w4a8_int8" else {"g": n}
        want, conf = ck_quantize(fmt, sd[f"{layer}.weight"], **kw)
        assert meta["layers"][layer] == conf
        for suffix, v in want.items():
            assert same_bytes(got[f"{layer}.weight{suffix}"], v), (layer, suffix)
    for k in kept:
        assert same_bytes(got[k], sd[k]), k
    code, _, err = run_ckpt("dequant", out, "--to", "fp32", "-o", tmp_path / "d.safetensors", "-q")
    assert code == 0, err
    back = load_file(tmp_path / "d.safetensors")
    want = oracle(out, {layer: (meta["layers"][layer], shapes[layer]) for layer in fits})
    for k, v in want.items():
        assert same_bytes(back[k], v), k


@pytest.mark.parametrize("target,n,problem", [
    ("int8_convrot", 128, "--to int8_convrot takes 16, 64, 256"),
    ("convrot_w4a4", 4, "--to convrot_w4a4 takes 16, 64, 256"),
    ("asym_w4a8_int8", 12, "--to asym_w4a8_int8 takes 4, 8, 16, 32, 64, 128, 256")])
def test_group_size_comfy_kitchen_cannot_use_is_refused(tmp_path, run_ckpt, target, n, problem):
    plain_model(tmp_path / "in.safetensors", {"blocks.0.attn.qkv": (16, 256)})
    assert_refused(run_ckpt, tmp_path, ("convert", tmp_path / "in.safetensors", "--to", target, "--group-size", n,
                                        "-o", tmp_path / "o.safetensors"), f"--group-size {n}", problem)


# ---------------------------------------------------------------------------------------------------
# merge-lora --keep-format


KF = {"int8_tensorwise": {}, "convrot_w4a4": {"g": 64}, "asym_w4a8_int8": {},
      "asym_w4a8_int8-fp32-uniform": {"scale_dtype": torch.float32, "codebook": False},
      "asym_w4a8_int8-asymmetric": {"symmetric": False},
      "asym_w4a8_int8-asymmetric-fp32-group32": {"symmetric": False, "scale_dtype": torch.float32, "group_size": 32},
      "asym_w4a8_int8-w6a8": {"bits": 6}, "asym_w4a8_int8-w6a8-fp32-group32-g64": {"bits": 6, "group_size": 32,
                                                                                  "scale_dtype": torch.float32, "g": 64}}


@pytest.mark.parametrize("case", KF)
def test_keep_format_requantizes_as_comfy_kitchen(tmp_path, run_ckpt, case):
    fmt = case.split("-")[0]
    kw = _kw(KF[case])
    layers = {"blocks.0.a": (fmt, weight((32, 256), 60), kw, None), "blocks.0.b": (fmt, weight((16, 256), 61), kw, None)}
    info = checkpoint(tmp_path / "base.safetensors", layers)
    if case == "asym_w4a8_int8":  # a U8 copy of the group scales, as older tools save them
        sd = load_file(tmp_path / "base.safetensors")
        sd["blocks.0.a.weight_s_rel"] = sd["blocks.0.a.weight_s_rel"].view(torch.uint8)
        save_file(sd, tmp_path / "base.safetensors")
    lora = kohya_lora(tmp_path / "lora.safetensors", {"blocks.0.a": (32, 256)})
    merged = plain_merge(run_ckpt, tmp_path / "base.safetensors", lora, tmp_path)
    code, _, err = run_ckpt("merge-lora", tmp_path / "base.safetensors", lora, "--keep-format", "-o",
                            tmp_path / "kf.safetensors", "--report", tmp_path / "r.json")
    assert code == 0, err
    base, kept = load_file(tmp_path / "base.safetensors"), load_file(tmp_path / "kf.safetensors")
    assert set(base) == set(kept)
    changed = {k for k in base if k.startswith("blocks.0.a.weight") and not k.endswith("_codebook")}
    for k in set(base) - changed:
        assert same_bytes(kept[k], base[k]), k  # every other byte unchanged (W4A8's codebook kept)
    conf, shape = info["blocks.0.a"]
    rq = ck_layer(base, "blocks.0.a", conf, shape).requantize_from_float(merged["blocks.0.a.weight"])
    want = LAYOUT[fmt].state_dict_tensors(rq._qdata, rq._params)
    if fmt == "int8_tensorwise":
        want = {"": rq._qdata, "_scale": rq._params.scale}
    for suffix, v in want.items():
        k = f"blocks.0.a.weight{suffix}"
        assert same_bytes(kept[k].view(v.dtype) if kept[k].dtype != v.dtype else kept[k], v), k
    assert not same_bytes(kept["blocks.0.a.weight"], base["blocks.0.a.weight"])
    decoded = oracle(tmp_path / "kf.safetensors", {"blocks.0.a": info["blocks.0.a"]})["blocks.0.a.weight"]
    m = merged["blocks.0.a.weight"].double()
    err_rms = float(((decoded.double() - m) ** 2).sum().sqrt() / (m * m).sum().sqrt())
    assert reported(tmp_path / "r.json")["blocks.0.a.weight"] == pytest.approx(err_rms, rel=1e-6)


def test_keep_format_refuses_an_asymmetric_w4a8_base_with_a_codebook(tmp_path, run_ckpt):
    """comfy-kitchen's requantize of such a layer (no tool writes one) drops its codebook: not a keep-format."""
    checkpoint(tmp_path / "base.safetensors",
               {"blocks.0.a": ("asym_w4a8_int8", weight((32, 256), 62), {"g": 256, "symmetric": False}, None)},
               extra={"blocks.0.a.weight_codebook": torch.linspace(-1, 1, 16)})
    lora = kohya_lora(tmp_path / "lora.safetensors", {"blocks.0.a": (32, 256)})
    assert_refused(run_ckpt, tmp_path, ("merge-lora", tmp_path / "base.safetensors", lora, "--keep-format", "-o",
                                        tmp_path / "kf.safetensors"), "", "drops the codebook")


# ---------------------------------------------------------------------------------------------------
# inspect


def test_inspect_names_each_format_with_its_parameters(tmp_path, run_ckpt):
    layers = {n: (f, w, _kw(kw), e) for n, (f, w, kw, e) in DECODE_CASES["mixed"].items()}
    layers["blocks.2.d"] = ("convrot_w4a4", weight((16, 128), 13), {"g": 64}, None)
    checkpoint(tmp_path / "in.safetensors", layers)
    code, out, err = run_ckpt("inspect", tmp_path / "in.safetensors", "--json")
    assert code == 0, err
    (comp,) = json.loads(out)["components"]
    labels = {entry["label"]: entry["tensors"] for entry in comp["quantization"]["layers"]}
    assert labels == {
        "ComfyUI ConvRot W8A8 (int8_tensorwise, rotation group 256, per-channel scales)": 1,
        "ComfyUI ConvRot W4A4 (convrot_w4a4, rotation group 256, per-row scales)": 1,
        "ComfyUI ConvRot W4A4 (convrot_w4a4, rotation group 64, per-row scales)": 1,
        "ComfyUI ConvRot W4A8 (asym_w4a8_int8, rotation group 256, e4m3 group scales), group 16": 1}
    w4a8 = next(e["settings"] for e in comp["quantization"]["layers"] if "W4A8" in e["label"])
    assert w4a8 == {"format": "ComfyUI ConvRot", "type": "W4A8 (asym_w4a8_int8, rotation group 256, e4m3 group scales)",
                    "bits": 4, "convrot_groupsize": 256, "group_size": 16, "codebook": "16 levels"}


def test_inspect_names_w6a8_and_asymmetric_w4a8(tmp_path, run_ckpt):
    checkpoint(tmp_path / "in.safetensors", {"blocks.0.a": ("asym_w4a8_int8", weight((16, 256), 14), {"g": 256, "bits": 6}, None),
                                             "blocks.0.b": ("asym_w4a8_int8", weight((16, 256), 15),
                                                            {"g": 256, "symmetric": False, "group_size": 32}, None)})
    code, out, err = run_ckpt("inspect", tmp_path / "in.safetensors", "--json")
    assert code == 0, err
    (comp,) = json.loads(out)["components"]
    settings = {e["label"]: e["settings"] for e in comp["quantization"]["layers"]}
    assert settings == {
        "ComfyUI ConvRot W6A8 (asym_w4a8_int8, rotation group 256, e4m3 group scales), group 16": {
            "format": "ComfyUI ConvRot", "type": "W6A8 (asym_w4a8_int8, rotation group 256, e4m3 group scales)",
            "bits": 6, "convrot_groupsize": 256, "group_size": 16, "codebook": "uniform"},
        "ComfyUI ConvRot W4A8 (asym_w4a8_int8, rotation group 256, e4m3 group scales, asymmetric), group 32": {
            "format": "ComfyUI ConvRot",
            "type": "W4A8 (asym_w4a8_int8, rotation group 256, e4m3 group scales, asymmetric)",
            "bits": 4, "convrot_groupsize": 256, "group_size": 32, "codebook": "uniform", "asymmetric": True}}


# ---------------------------------------------------------------------------------------------------
# bad input


def _good(fmt):
    saved, conf = ck_quantize(fmt, weight((32, 256), 70))
    sd = {f"l.weight{k}": v for k, v in saved.items()}
    sd["l.comfy_quant"] = conf_tensor(conf)
    return sd, conf


def _bad_cases():
    i8, i8c = _good("int8_tensorwise")
    w4, w4c = _good("convrot_w4a4")
    w8, w8c = _good("asym_w4a8_int8")
    cases = {
        "int8 row scales [out]": (i8 | {"l.weight_scale": i8["l.weight_scale"].reshape(-1)}, "has shape [32], not [32, 1]"),
        "int8 integer scale": (i8 | {"l.weight_scale": i8["l.weight_scale"].to(torch.int32)}, "expected a floating dtype"),
        "int8 codes as fp16": (i8 | {"l.weight": i8["l.weight"].half()}, "stored as F16, not I8"),
        "group not dividing the width": (i8 | {"l.comfy_quant": conf_tensor(i8c | {"convrot_groupsize": 1024})},
                                         "convrot_groupsize 1024 does not divide the input width 256"),
        "group not a power of 4": (i8 | {"l.comfy_quant": conf_tensor(i8c | {"convrot_groupsize": 128})},
                                   "convrot_groupsize 128 is not a power of 4"),
        "group a string": (w4 | {"l.comfy_quant": conf_tensor({"format": "convrot_w4a4", "params": {"convrot_groupsize": "x"}})},
                           "is not a power of 4"),
        "w4a4 missing scale": ({k: v for k, v in w4.items() if k != "l.weight_scale"}, "has no per-row scale 'l.weight_scale'"),
        "w4a4 truncated codes": (w4 | {"l.weight": w4["l.weight"][:, :100].contiguous()},
                                 "does not divide the input width 200"),
        "w4a4 bad linear_dtype": (w4 | {"l.comfy_quant": conf_tensor(w4c | {"linear_dtype": "fp8"})}, "linear_dtype 'fp8'"),
        "w4a8 s_rel shape": (w8 | {"l.weight_s_rel": w8["l.weight_s_rel"][:, :8].contiguous()}, "has shape [32, 8], not [32, 16]"),
        "w4a8 s_rel fp16": (w8 | {"l.weight_s_rel": w8["l.weight_s_rel"].half()}, "expected F8_E4M3 or U8 or F32"),
        "w4a8 missing s_channel": ({k: v for k, v in w8.items() if k != "l.weight_s_channel"},
                                   "has no channel scales 'l.weight_s_channel'"),
        "w4a8 integer s_channel": (w8 | {"l.weight_s_channel": torch.ones(32, dtype=torch.int32)}, "expected a floating dtype"),
        "w4a8 codebook of 8": (w8 | {"l.weight_codebook": w8["l.weight_codebook"][:8].contiguous()}, "not [16]"),
        "w4a8 group size 12": (w8 | {"l.comfy_quant": conf_tensor(w8c | {"group_size": 12})}, "group_size 12 is not"),
        "w4a8 group not dividing": (w8 | {"l.comfy_quant": conf_tensor(w8c | {"group_size": 512})},
                                    "group_size 512 does not divide the input width 256"),
        "3-D codes": (i8 | {"l.weight": i8["l.weight"].reshape(2, 16, 256)}, "is a 3-D weight"),
    }
    q, p = AsymW4A8Int8Layout.quantize(weight((32, 256), 71), bits=6)
    w6 = {f"l.weight{k}": v for k, v in AsymW4A8Int8Layout.state_dict_tensors(q, p).items()} | {"l.comfy_quant": w8["l.comfy_quant"]}
    cases |= {
        "w6a8 with a codebook": (w6 | {"l.weight_codebook": w8["l.weight_codebook"]}, "uniform and symmetric: no codebook"),
        "w6a8 with a correction": (w6 | {"l.weight_correction": torch.zeros(16, 32)}, "no correction"),
        "w6a8 group 8": (w6 | {"l.weight_s_rel": torch.ones(32, 32, dtype=torch.float8_e4m3fn),
                              "l.comfy_quant": conf_tensor(w8c | {"group_size": 8})},
                         "a group_size multiple of 16 (not 8)"),
        "w6a8 truncated plane": (w6 | {"l.weight": w6["l.weight"][:, :150].contiguous()}, "does not divide the input width 300"),
    }
    return cases


BAD = _bad_cases()


@pytest.mark.parametrize("case", BAD)
def test_bad_input_is_refused_in_one_line(tmp_path, run_ckpt, case):
    sd, problem = BAD[case]
    save_file(sd, tmp_path / "in.safetensors")
    for args in (("dequant", tmp_path / "in.safetensors", "-o", tmp_path / "o.safetensors"),
                 ("convert", tmp_path / "in.safetensors", "--to", "bf16", "-o", tmp_path / "o.safetensors")):
        assert_refused(run_ckpt, tmp_path, args, str(tmp_path / "in.safetensors"), problem)


@pytest.mark.parametrize("fmt", FORMATS)
def test_truncated_file_is_refused_and_its_intact_twin_converts(tmp_path, run_ckpt, fmt):
    sd, _ = _good(fmt)
    save_file(sd, tmp_path / "twin.safetensors")
    code, _, err = run_ckpt("convert", tmp_path / "twin.safetensors", "--to", "bf16", "-o", tmp_path / "ok.safetensors", "-q")
    assert code == 0, err
    data = (tmp_path / "twin.safetensors").read_bytes()
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "in.safetensors").write_bytes(data[: len(data) - 100])
    assert_refused(run_ckpt, tmp_path / "bad", ("convert", tmp_path / "bad" / "in.safetensors", "--to", "bf16", "-o",
                                                tmp_path / "bad" / "o.safetensors"), str(tmp_path / "bad" / "in.safetensors"), "")
    shutil.rmtree(tmp_path / "bad")
