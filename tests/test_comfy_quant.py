"""ComfyUI comfy_quant nvfp4 / mxfp8 / int8 both ways, against comfy-kitchen (its eager CPU backend).

Oracles: files are made by comfy-kitchen's own layouts (`quantize` + `state_dict_tensors`, what ComfyUI
saves), decoded values are comfy-kitchen's `dequantize` with output dtype float32 (ckpt rounds that once
to the target), and ckpt's encoded tensors are compared byte for byte with comfy-kitchen's quantize of the
same fp32 values. `comfy_load` repeats what ComfyUI's loader (`comfy/ops.py _load_quantized_module`) does
with a layer's tensors, so an output that passes it loads in ComfyUI.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

ck_tensor = pytest.importorskip("comfy_kitchen.tensor")
from helpers.comfy_ref import (ck_dequantize_fp32, ck_quantize, comfy_load, conf_tensor, same_bytes,  # noqa: E402
                               weight)

def only(folder, *names):
    return sorted(p.name for p in folder.iterdir()) == sorted(names)


@pytest.fixture
def small_bands(monkeypatch):
    monkeypatch.setattr("ckpt.io.output.BAND_ELEMS", 2048)  # a 288-row weight spans several 128-row bands


# --- the arithmetic against comfy-kitchen's own helpers ----------------------------------------------


def test_e2m1_rounding_blocked_layout_and_e8m0_match_comfy_kitchen():
    from comfy_kitchen.float_utils import _f32_to_floatx_unpacked, e8m0_to_f32, from_blocked, to_blocked

    from ckpt.quant import microscaling as mx

    # every multiple of 1/8 in [-6, 6] and both float32 neighbours of each (all ties and their sides)
    grid = torch.arange(-48, 49, dtype=torch.float32) / 8
    vals = torch.cat([grid, torch.nextafter(grid, torch.tensor(-7.0)), torch.nextafter(grid, torch.tensor(7.0)),
                      torch.tensor([0.0, -0.0, 1e-38, -1e-38, 1e-45]), torch.randn(4096) * 2]).clamp(-6, 6)
    assert torch.equal(mx.encode_e2m1(vals), _f32_to_floatx_unpacked(vals.clone(), 2, 1))
    codes = torch.arange(256, dtype=torch.uint8)
    assert torch.equal(mx.unpack_e2m1(codes.reshape(-1, 1)).reshape(-1, 2),
                       torch.stack([mx.unpack_e2m1(torch.tensor([[c]], dtype=torch.uint8)).reshape(2) for c in codes]))
    assert torch.equal(mx.e8m0_to_float(codes).view(torch.int32), e8m0_to_f32(codes).view(torch.int32))
    for rows, blocks in [(1, 1), (130, 5), (256, 8), (384, 3)]:
        nat = torch.randint(0, 256, (rows, blocks), dtype=torch.uint8, generator=torch.Generator().manual_seed(rows))
        grid_rows, grid_cols = mx.scale_grid(rows, blocks)
        blocked = mx.swizzle(mx.pad_grid(nat, grid_rows, grid_cols))
        assert torch.equal(blocked, to_blocked(nat, flatten=False))
        assert torch.equal(mx.unswizzle(blocked)[:rows, :blocks], from_blocked(blocked, rows, blocks))


# --- decoding: files written by comfy-kitchen ---------------------------------------------------------

# shapes: rows not a multiple of 128, blocks per row not a multiple of 4 (padding in the blocked layout)
DECODE_CASES = [
    ("nvfp4", (144, 80)), ("nvfp4", (16, 48)), ("nvfp4", (288, 112)),
    ("mxfp8", (160, 96)), ("mxfp8", (32, 32)), ("mxfp8", (288, 160)),
    ("int8_tensorwise", (40, 72)), ("int8_rowwise", (40, 72)),
]


@pytest.mark.parametrize("fmt,shape", DECODE_CASES)
def test_decode_matches_comfy_kitchen(tmp_path, run_ckpt, small_bands, fmt, shape):
    rowwise = fmt == "int8_rowwise"
    fmt = "int8_tensorwise" if rowwise else fmt
    w = weight(shape)
    q, p, saved = ck_quantize(fmt, w, rowwise)
    sd = {f"blocks.0.lin.weight{k}": v for k, v in saved.items()}
    sd["blocks.0.lin.comfy_quant"] = conf_tensor({"format": fmt})
    sd["blocks.0.lin.input_scale"] = torch.tensor(1.0)  # activation scale: dropped
    sd["blocks.0.lin.bias"] = w[:, 0].clone()
    sd["head.weight"] = w[:8].clone()
    save_file(sd, tmp_path / "q.safetensors", metadata={"_quantization_metadata": json.dumps(
        {"format_version": "1.0", "layers": {"blocks.0.lin": {"format": fmt}}}), "modelspec.title": "t"})
    want = ck_dequantize_fp32(fmt, q, p)
    for target, dt in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        out = tmp_path / f"o-{target}.safetensors"
        code, _, err = run_ckpt("convert", tmp_path / "q.safetensors", "--to", target, "-o", out, "-q")
        assert code == 0, err
        got = load_file(out)
        assert sorted(got) == ["blocks.0.lin.bias", "blocks.0.lin.weight", "head.weight"]
        assert same_bytes(got["blocks.0.lin.weight"], want.to(dt))  # fp32 values, rounded once
        assert same_bytes(got["blocks.0.lin.weight"], comfy_load(sd, "blocks.0.lin", shape).to(dt))
        with safe_open(out, "pt") as f:
            meta = f.metadata()
        assert "_quantization_metadata" not in meta and meta["modelspec.title"] == "t"


def test_padded_weight_takes_its_shape_from_orig_shape_or_shapes_from(tmp_path, run_ckpt):
    """comfy-kitchen pads a (40, 72) nvfp4 weight to (48, 80); the file alone says only that."""
    w = weight((40, 72))
    q, p, saved = ck_quantize("nvfp4", w)
    assert tuple(saved[""].shape) == (48, 40)
    sd = {f"l.weight{k}": v for k, v in saved.items()} | {"l.bias": torch.zeros(40)}
    want = comfy_load(sd | {"l.comfy_quant": conf_tensor({"format": "nvfp4"})}, "l", (40, 72))
    assert same_bytes(want, ck_dequantize_fp32("nvfp4", q, p)[:40, :72])
    save_file(sd | {"l.comfy_quant": conf_tensor({"format": "nvfp4", "orig_shape": [40, 72]})}, tmp_path / "a.safetensors")
    code, _, err = run_ckpt("convert", tmp_path / "a.safetensors", "--to", "fp32", "-o", tmp_path / "a-out.safetensors", "-q")
    assert code == 0, err
    assert same_bytes(load_file(tmp_path / "a-out.safetensors")["l.weight"], want)
    save_file(sd | {"l.comfy_quant": conf_tensor({"format": "nvfp4"})}, tmp_path / "b.safetensors")
    save_file({"l.weight": torch.zeros(40, 72), "l.bias": torch.zeros(40)}, tmp_path / "ref.safetensors")
    code, _, err = run_ckpt("dequant", tmp_path / "b.safetensors", "--shapes-from", tmp_path / "ref.safetensors",
                            "--to", "fp32", "-o", tmp_path / "b-out.safetensors", "-q")
    assert code == 0, err
    assert same_bytes(load_file(tmp_path / "b-out.safetensors")["l.weight"], want)


def test_nvfp4_pre_quant_scale_folded_into_columns(tmp_path, run_ckpt):
    """ComfyUI multiplies the input by `pre_quant_scale` (AWQ smoothing): the plain weight is W * s[None, :]."""
    w = weight((32, 64))
    q, p, saved = ck_quantize("nvfp4", w)
    s = torch.linspace(0.5, 2.0, 64)
    sd = {f"l.weight{k}": v for k, v in saved.items()} | {"l.pre_quant_scale": s, "l.comfy_quant": conf_tensor({"format": "nvfp4"})}
    save_file(sd, tmp_path / "q.safetensors")
    code, _, err = run_ckpt("convert", tmp_path / "q.safetensors", "--to", "fp32", "-o", tmp_path / "o.safetensors", "-q")
    assert code == 0, err
    got = load_file(tmp_path / "o.safetensors")
    assert sorted(got) == ["l.weight"]
    assert same_bytes(got["l.weight"], ck_dequantize_fp32("nvfp4", q, p) * s[None, :])


# --- encoding: ckpt convert --to nvfp4 | mxfp8 | int8 | int8_rowwise ---------------------------------

FLUXLIKE = {  # original (BFL) names: img_in / final_layer stay high precision, block Linear weights quantize
    "img_in.weight": (64, 32), "img_in.bias": (64,),
    "double_blocks.0.img_attn.qkv.weight": (192, 64), "double_blocks.0.img_attn.qkv.bias": (192,),
    "double_blocks.0.img_attn.norm.query_norm.scale": (32,),
    "double_blocks.0.img_mlp.0.weight": (256, 64), "single_blocks.0.linear2.weight": (64, 320),
    "single_blocks.0.odd.weight": (48, 72),  # 72 inputs: no nvfp4/mxfp8 block size divides them
    "final_layer.linear.weight": (32, 64),
}
ENCODE = {"nvfp4": ("nvfp4", False), "mxfp8": ("mxfp8", False), "int8": ("int8_tensorwise", False),
          "int8_rowwise": ("int8_tensorwise", True)}


def fluxlike(path, dtype=torch.bfloat16):
    sd = {k: weight(s, seed=i, dtype=dtype) if len(s) == 2 else torch.randn(s).to(dtype)
          for i, (k, s) in enumerate(FLUXLIKE.items())}
    save_file(sd, path, metadata={"modelspec.title": "tiny"})
    return sd


@pytest.mark.parametrize("target", sorted(ENCODE))
def test_encode_matches_comfy_kitchen_and_loads_like_comfyui(tmp_path, run_ckpt, small_bands, target):
    fmt, rowwise = ENCODE[target]
    src = fluxlike(tmp_path / "m.safetensors")
    out = tmp_path / f"m-{target}.safetensors"
    code, _, err = run_ckpt("convert", tmp_path / "m.safetensors", "--to", target, "-o", out)
    assert code == 0, err
    got = load_file(out)
    with safe_open(out, "pt") as f:
        meta = f.metadata()
    quantized = [k[: -len(".weight")] for k, s in FLUXLIKE.items() if len(s) == 2 and "blocks." in k
                 and (fmt == "int8_tensorwise" or k != "single_blocks.0.odd.weight")]
    assert json.loads(meta["_quantization_metadata"]) == {"format_version": "1.0",
                                                          "layers": {q: {"format": fmt} for q in quantized}}
    assert meta["modelspec.title"] == "tiny"
    for layer in quantized:
        w = src[f"{layer}.weight"]
        q, p, saved = ck_quantize(fmt, w, rowwise)
        for suffix, t in saved.items():
            assert same_bytes(got[f"{layer}.weight{suffix}"], t), (layer, suffix)
        assert json.loads(got[f"{layer}.comfy_quant"].numpy().tobytes()) == {"format": fmt}
        assert same_bytes(comfy_load(got, layer, w.shape), ck_dequantize_fp32(fmt, q, p))
    kept = [k for k in FLUXLIKE if k[: -len(".weight")] not in quantized]
    for k in kept:  # untouched: same dtype, same bytes
        assert same_bytes(got[k], src[k]), k
    stored = {f"{q}.weight{x}" for q in quantized for x in ck_quantize(fmt, src[f"{q}.weight"], rowwise)[2]}
    assert sorted(got) == sorted(set(kept) | stored | {f"{q}.comfy_quant" for q in quantized})
    if fmt != "int8_tensorwise":
        assert "1 weight kept in high precision: dimensions not multiples of" in err
    assert "Flux" in err and "high-precision layers kept" in err  # the family's rule (ckpt/families/flux1.py)
    # decode(encode(W)) == comfy-kitchen's dequantize(quantize(W)), rounded once
    back = tmp_path / "back.safetensors"
    code, _, err = run_ckpt("convert", out, "--to", "fp32", "-o", back, "-q")
    assert code == 0, err
    plain = load_file(back)
    assert sorted(plain) == sorted(FLUXLIKE)
    for layer in quantized:
        q, p, _ = ck_quantize(fmt, src[f"{layer}.weight"], rowwise)
        assert same_bytes(plain[f"{layer}.weight"], ck_dequantize_fp32(fmt, q, p))


def test_encode_streams_any_band_size_to_the_same_bytes(tmp_path, run_ckpt, monkeypatch):
    fluxlike(tmp_path / "m.safetensors", dtype=torch.float32)
    outs = []
    for band in (1 << 23, 700):  # one band per tensor; a few rows per band
        monkeypatch.setattr("ckpt.io.output.BAND_ELEMS", band)
        for target in ("nvfp4", "int8"):
            out = tmp_path / f"{target}-{band}.safetensors"
            assert run_ckpt("convert", tmp_path / "m.safetensors", "--to", target, "-o", out, "-q")[0] == 0
            outs.append((target, out.read_bytes()))
    for target in ("nvfp4", "int8"):
        blobs = [b for t, b in outs if t == target]
        assert blobs[0] == blobs[1]


@pytest.mark.parametrize("spec", ["float8_e4m3fn", "float8_e5m2", "int8_tensorwise", "int8_rowwise", "nvfp4", "mxfp8"])
def test_encode_api_one_call_per_weight(spec):
    """`encode(spec, tensor)`: the stored tensors of one weight, what a merge that keeps the base's format
    calls with the decoded layer's `spec` (float8 layers too, which `convert --to` does not write)."""
    from ckpt.io.tensors import ComputedTensor
    from ckpt.quant.comfy_quant import QuantSpec, encode
    from ckpt.report import Report

    rowwise = spec == "int8_rowwise"
    qs = QuantSpec("int8_tensorwise" if rowwise else spec, rowwise=rowwise)
    w = weight((160, 96), dtype=torch.float32)
    src = ComputedTensor("a.weight", lambda: w, torch.float32, w.shape)
    src.row_align = 1
    got = {o.name: o.apply(o.source.read(0, o.source.rows, torch.device("cpu"))) for o in encode(qs, src, Report())}
    if spec.startswith("float8"):
        dt = getattr(torch, spec)
        scale = w.abs().amax() / torch.finfo(dt).max  # ComfyUI's "recalculate" scale, comfy-kitchen's quantize
        want = {"a.weight": ck_tensor.TensorCoreFP8Layout.quantize(w, scale=scale, dtype=dt)[0], "a.weight_scale": scale}
    else:
        want = {f"a.weight{k}": v for k, v in ck_quantize(qs.format, w, rowwise)[2].items()}
    assert sorted(got) == sorted(want)
    for k in want:
        assert same_bytes(got[k], want[k]), k


def test_all_zero_weight_decodes_to_zeros(tmp_path, run_ckpt):
    """comfy-kitchen's nvfp4 global scale of an all-zero weight is 0, whose block scales are 0/0 (NaN on
    load); ckpt writes 1 there (any scale encodes zeros). int8 and mxfp8 match comfy-kitchen as usual."""
    zeros = torch.zeros(32, 64)
    save_file({"blocks.0.a.weight": zeros}, tmp_path / "z.safetensors")
    for target in ("nvfp4", "mxfp8", "int8"):
        out = tmp_path / f"z-{target}.safetensors"
        assert run_ckpt("convert", tmp_path / "z.safetensors", "--to", target, "-o", out, "-q")[0] == 0
        got = load_file(out)
        fmt = ENCODE[target][0]
        if target == "nvfp4":
            assert got["blocks.0.a.weight_scale_2"].item() == 1.0
        else:
            for suffix, t in ck_quantize(fmt, zeros)[2].items():
                assert same_bytes(got[f"blocks.0.a.weight{suffix}"], t)
        assert same_bytes(comfy_load(got, "blocks.0.a", (32, 64)), zeros)


@pytest.mark.parametrize("target", ["nvfp4", "int8"])
def test_nonfinite_input_counted_and_left_out_of_the_scale(tmp_path, run_ckpt, target):
    w = weight((32, 64), dtype=torch.float32)
    w[3, 5], w[4, 6], w[5, 7] = float("nan"), float("inf"), -float("inf")
    save_file({"blocks.0.a.weight": w}, tmp_path / "m.safetensors")
    code, _, err = run_ckpt("convert", tmp_path / "m.safetensors", "--to", target, "-o", tmp_path / "q.safetensors", "-q")
    assert code == 0, err
    assert "3 NaN/Inf input values were quantized" in err and "in 1 tensor: blocks.0.a.weight (3)" in err
    got = load_file(tmp_path / "q.safetensors")
    finite = w.nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)
    key = "blocks.0.a.weight_scale_2" if target == "nvfp4" else "blocks.0.a.weight_scale"
    assert same_bytes(got[key], ck_quantize(ENCODE[target][0], finite)[1].scale)


def test_tiny_diffusers_flux_roundtrip_loads_strictly(tmp_path, run_ckpt):
    diffusers = pytest.importorskip("diffusers")
    torch.manual_seed(0)
    model = diffusers.FluxTransformer2DModel(patch_size=1, in_channels=16, num_layers=1, num_single_layers=1,
                                             attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
                                             pooled_projection_dim=32, axes_dims_rope=[4, 6, 6]).to(torch.bfloat16)
    sd = {k: v.contiguous() for k, v in model.state_dict().items()}
    save_file(sd, tmp_path / "t.safetensors")
    code, _, err = run_ckpt("convert", tmp_path / "t.safetensors", "--to", "mxfp8", "-o", tmp_path / "q.safetensors")
    assert code == 0, err
    q = load_file(tmp_path / "q.safetensors")
    assert "transformer_blocks.0.attn.to_q.comfy_quant" in q and "x_embedder.comfy_quant" not in q
    assert "proj_out.comfy_quant" not in q and "single_transformer_blocks.0.proj_out.comfy_quant" in q
    code, _, err = run_ckpt("convert", tmp_path / "q.safetensors", "--to", "bf16", "-o", tmp_path / "p.safetensors", "-q")
    assert code == 0, err
    plain = load_file(tmp_path / "p.safetensors")
    model.load_state_dict(plain, strict=True)
    for k, v in sd.items():
        layer = k[: -len(".weight")]
        if f"{layer}.comfy_quant" in q:
            qq, p, _ = ck_quantize("mxfp8", v)
            assert same_bytes(plain[k], ck_dequantize_fp32("mxfp8", qq, p).bfloat16()), k
        else:
            assert same_bytes(plain[k], v), k
    # renamed to the original (BFL) layout and quantized in one pass: the family's rule in that layout
    code, _, err = run_ckpt("convert", tmp_path / "t.safetensors", "--layout", "original", "--to", "nvfp4",
                            "-o", tmp_path / "bfl.safetensors", "-q")
    assert code == 0, err
    bfl = load_file(tmp_path / "bfl.safetensors")
    quantized = {k[: -len(".comfy_quant")] for k in bfl if k.endswith(".comfy_quant")}
    assert quantized == {k[: -len(".weight")] for k, v in bfl.items() if k.endswith(".weight") and v.dim() == 2
                         and k.startswith(("double_blocks.", "single_blocks."))}
    assert bfl["img_in.weight"].dtype == bfl["final_layer.linear.weight"].dtype == torch.bfloat16


def test_unknown_family_quantizes_transformer_blocks_only(tmp_path, run_ckpt):
    sd = {"blocks.0.attn.q.weight": weight((64, 64)), "blocks.0.norm.weight": torch.ones(64),
          "patchify.weight": weight((64, 64)), "blocks.1.ff.weight": weight((128, 64)), "head.weight": weight((32, 64)),
          "blocks.1.tok_embed.weight": weight((64, 64))}
    save_file(sd, tmp_path / "m.safetensors")
    code, _, err = run_ckpt("convert", tmp_path / "m.safetensors", "--to", "int8", "--keep", "blocks.1.*",
                            "-o", tmp_path / "q.safetensors")
    assert code == 0, err
    assert "family not recognised" in err
    got = load_file(tmp_path / "q.safetensors")
    assert sorted(k for k in got if k.endswith(".comfy_quant")) == ["blocks.0.attn.q.comfy_quant"]


def test_inspect_names_the_formats(tmp_path, run_ckpt):
    fluxlike(tmp_path / "m.safetensors")
    assert run_ckpt("convert", tmp_path / "m.safetensors", "--to", "nvfp4", "-o", tmp_path / "q.safetensors", "-q")[0] == 0
    code, out, err = run_ckpt("inspect", tmp_path / "q.safetensors", "--json")
    assert code == 0, err
    (comp,) = json.loads(out)["components"]
    assert "comfy-quant-nvfp4" in comp["encodings"]
    assert not any("cannot be decoded" in w for w in comp["warnings"])


# --- bad input: one line, exit 2, nothing written -----------------------------------------------------


def _nvfp4_layer(shape=(32, 64)):
    _, _, saved = ck_quantize("nvfp4", weight(shape))
    return {f"l.weight{k}": v for k, v in saved.items()} | {"l.comfy_quant": conf_tensor({"format": "nvfp4"})}


def _bad_cases():
    good = _nvfp4_layer()
    mx = {f"l.weight{k}": v for k, v in ck_quantize("mxfp8", weight((32, 64)))[2].items()}
    mx["l.comfy_quant"] = conf_tensor({"format": "mxfp8"})
    return [
        ("scale shape mismatch", good | {"l.weight_scale": good["l.weight_scale"][:64]}, "block scales"),
        ("unknown format", good | {"l.comfy_quant": conf_tensor({"format": "nvfp5"})}, "'nvfp5'"),
        ("truncated packed data", good | {"l.weight": good["l.weight"][:, :30].contiguous()}, "block size 16"),
        ("missing global scale", {k: v for k, v in good.items() if k != "l.weight_scale_2"}, "weight_scale_2"),
        ("packed weight not U8", good | {"l.weight": good["l.weight"].view(torch.int8)}, "not U8"),
        ("mxfp8 codes as U8", mx | {"l.weight": mx["l.weight"].view(torch.uint8)}, "not F8_E4M3"),
        ("orig_shape misfit", good | {"l.comfy_quant": conf_tensor({"format": "nvfp4", "orig_shape": [32, 40]})}, "orig_shape"),
        ("config not JSON", good | {"l.comfy_quant": torch.tensor([1, 2, 3], dtype=torch.uint8)}, "not ComfyUI quantization JSON"),
        ("int8 convrot", {"l.weight": torch.zeros(4, 256, dtype=torch.int8), "l.weight_scale": torch.ones(4, 1),
                          "l.comfy_quant": conf_tensor({"format": "int8_tensorwise", "convrot": True,
                                                        "convrot_groupsize": 1024})}, "convrot_groupsize 1024"),
    ]


@pytest.mark.parametrize("case", range(9))
def test_bad_input_one_line_exit_2_nothing_written(tmp_path, run_ckpt, case):
    what, sd, needle = _bad_cases()[case]
    save_file(sd, tmp_path / "bad.safetensors")
    for args in (("convert", "--to", "bf16"), ("dequant",)):
        code, out, err = run_ckpt(args[0], tmp_path / "bad.safetensors", *args[1:], "-q")
        assert code == 2, what
        assert err.startswith("error:") and err.count("\n") == 1 and needle in err, (what, err)
        assert only(tmp_path, "bad.safetensors"), what


def test_bad_quantization_metadata_refused(tmp_path, run_ckpt):
    save_file(_nvfp4_layer(), tmp_path / "bad.safetensors", metadata={"_quantization_metadata": "{not json"})
    code, out, err = run_ckpt("convert", tmp_path / "bad.safetensors", "--to", "bf16", "-q")
    assert code == 2 and err.count("\n") == 1 and "_quantization_metadata" in err
    assert only(tmp_path, "bad.safetensors")


def test_clamp_with_a_quantized_target_refused(tmp_path, run_ckpt):
    fluxlike(tmp_path / "m.safetensors")
    code, out, err = run_ckpt("convert", tmp_path / "m.safetensors", "--to", "nvfp4", "--clamp")
    assert code == 2 and err.count("\n") == 1 and "--clamp" in err
    assert only(tmp_path, "m.safetensors")
