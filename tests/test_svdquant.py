"""SVDQuant W4A4 layers of ComfyUI `comfy_quant` checkpoints (`ckpt/quant/svdquant.py`), against comfy-kitchen 0.2.40's
own `TensorCoreSVDQuantW4A4Layout` (its eager CPU backend) as the oracle:

- decoding: ckpt's dense weight equals comfy-kitchen's `dequantize` (its kernel on an identity input, every parameter
  in fp32) within fp32 rounding: |ckpt - kitchen| <= 8 * 2^-24 * max|W| (the kernel's extra rounding of the identity's
  quantized activations, 7 * ((1 / s) / 7), and its own order of the low-rank sum); and the dense layer (weight and,
  for act_unsigned layers, the shifted bias) gives comfy-kitchen's runtime output (`F.linear` on the quantized
  weight) on inputs whose activation quantization is exact;
- `merge-lora --keep-format`: the LoRA baked into the low-rank branch: every stored key but proj_down / proj_up
  byte-identical, their stored columns byte-identical and the LoRA's factors appended (dtypes kept, the rank grown by
  the LoRA's), comfy-kitchen's dequantize of the result the base's plus the LoRA's delta within fp32 rounding, and its
  runtime on random inputs the base's output plus x @ delta.T (the activation quantization is the same for both);
  plain `merge-lora` writes the dense merge;
- comfy-kitchen's tile-packed layout (4-D codes, 3-D scales and proj_up, told apart by their rank as its eager kernel
  does): decoded as the natural layout it packs, the LoRA baked along proj_up's tile-packed rank axis;
- `inspect` names the format, group size and rank;
- bad input: one line, exit 2, nothing written; the intact twin converts.
"""

from __future__ import annotations

import json

import pytest
import torch
from helpers.comfy_ref import conf_tensor, same_bytes
from helpers.keep_format import kohya_lora, reported
from helpers.refusals import assert_refused
from safetensors.torch import load_file, save_file

ck = pytest.importorskip("comfy_kitchen")
from comfy_kitchen.backends.eager.svdquant import (_GELU_UNSIGNED_SHIFT, _pack_int4_row_major,  # noqa: E402
                                                   _tile_packed_lora_up_to_natural, _tile_packed_scales_to_natural,
                                                   _tile_packed_weight_to_row_major)
from comfy_kitchen.tensor import QuantizedTensor, TensorCoreSVDQuantW4A4Layout as Layout  # noqa: E402

QKV, FC2 = "double_blocks.0.img_attn.qkv", "double_blocks.0.img_mlp.2"
LAYERS = {QKV: (192, 128, 8, False), FC2: (64, 256, 16, True)}  # name -> (out N, in K, rank R, act_unsigned)
FP32_TOL = 8 * 2.0 ** -24


def svdq_layer(n, k, r, dtype, seed, unsigned=False) -> dict[str, torch.Tensor]:
    """One layer's stored tensors as comfy-kitchen's layout saves them (`state_dict_tensors` suffixes), random codes
    over the whole nibble range."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(-8, 8, (n, k), generator=g)
    params = Layout.Params(scale=(torch.rand(k // 64, n, generator=g) * 0.02 + 0.005).to(dtype),
                           orig_dtype=dtype, orig_shape=(n, k),
                           proj_down=(torch.randn(k, r, generator=g) * 0.1).to(dtype),
                           proj_up=(torch.randn(n, r, generator=g) * 0.1).to(dtype),
                           smooth_factor=(torch.rand(k, generator=g) + 0.5).to(dtype), act_unsigned=unsigned)
    saved = {f"weight{s}": t for s, t in Layout.state_dict_tensors(_pack_int4_row_major(codes), params).items()}
    conf = {"format": "svdquant_w4a4"} | ({"act_unsigned": True} if unsigned else {})
    return saved | {"comfy_quant": conf_tensor(conf), "bias": (torch.randn(n, generator=g) * 0.1).to(dtype)}


def model(path, dtype=torch.float32, layers=LAYERS) -> dict[str, torch.Tensor]:
    """A tiny Flux-like checkpoint: the SVDQuant block layers and plain ones beside them."""
    sd = {"img_in.weight": torch.randn(64, 32).to(dtype), "img_in.bias": torch.randn(64).to(dtype),
          "double_blocks.0.img_attn.norm.query_norm.scale": torch.randn(32).to(dtype)}
    for i, (name, (n, k, r, unsigned)) in enumerate(layers.items()):
        sd |= {f"{name}.{s}": t for s, t in svdq_layer(n, k, r, dtype, i, unsigned).items()}
    save_file(sd, path, metadata={"modelspec.title": "tiny"})
    return sd


def qtensor(sd, name, dtype=None) -> QuantizedTensor:
    """comfy-kitchen's quantized weight of layer `name`, its float parameters in `dtype` (None: as stored)."""
    conf = json.loads(sd[f"{name}.comfy_quant"].numpy().tobytes())
    f = (lambda t: t) if dtype is None else (lambda t: t.to(dtype))
    w = sd[f"{name}.weight"]
    shape = (w.shape[0] * 128, w.shape[1] * 64) if w.dim() == 4 else (w.shape[0], w.shape[1] * 2)
    params = Layout.Params(scale=f(sd[f"{name}.weight_scale"]), orig_dtype=dtype or sd[f"{name}.weight_scale"].dtype,
                           orig_shape=shape, proj_down=f(sd[f"{name}.weight_proj_down"]),
                           proj_up=f(sd[f"{name}.weight_proj_up"]), smooth_factor=f(sd[f"{name}.weight_smooth_factor"]),
                           act_unsigned=bool(conf.get("act_unsigned", False)))
    return QuantizedTensor(w, "TensorCoreSVDQuantW4A4Layout", params)


def kitchen_dense(sd, name) -> torch.Tensor:
    """comfy-kitchen's dequantize (its kernel on an identity input), every parameter in fp32."""
    q = qtensor(sd, name, torch.float32)
    with ck.use_backend("eager"):
        return Layout.dequantize(q._qdata, q._params)


def runtime(sd, name, x) -> torch.Tensor:
    """comfy-kitchen's eager runtime of the layer on `x` (activations quantized to int4 as ComfyUI runs it)."""
    with ck.use_backend("eager"):
        return torch.nn.functional.linear(x, qtensor(sd, name, torch.float32), sd[f"{name}.bias"].float())


def close(got, want, tol=FP32_TOL) -> bool:
    return bool(((got.float() - want.float()).abs() <= tol * want.float().abs().max()).all())


def convert(run_ckpt, src, out, to="fp32") -> dict[str, torch.Tensor]:
    code, _, err = run_ckpt("convert", src, "--to", to, "-o", out, "-q")
    assert code == 0, err
    return load_file(out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_decode_is_comfy_kitchens_dense_weight(tmp_path, run_ckpt, dtype):
    sd = model(tmp_path / "m.safetensors", dtype)
    dense = convert(run_ckpt, tmp_path / "m.safetensors", tmp_path / "d.safetensors")
    assert sorted(dense) == sorted(k for k in sd if "weight_" not in k and not k.endswith("comfy_quant"))
    for name in LAYERS:
        assert dense[f"{name}.weight"].dtype == torch.float32
        assert close(dense[f"{name}.weight"], kitchen_dense(sd, name)), name
    for k in ("img_in.weight", "img_in.bias", f"{QKV}.bias"):  # plain, and a signed layer's bias: as stored
        assert same_bytes(dense[k], sd[k].float()), k
    # the model's dtype (the scales') by default, every value rounded once from the fp32 decode
    code, _, err = run_ckpt("dequant", tmp_path / "m.safetensors", "-o", tmp_path / "n.safetensors", "-q")
    assert code == 0, err
    natural = load_file(tmp_path / "n.safetensors")
    assert all(same_bytes(natural[k], dense[k].to(dtype)) for k in dense)


@pytest.mark.parametrize("name", list(LAYERS))
def test_dense_layer_is_comfy_kitchens_runtime(tmp_path, run_ckpt, name):
    """Inputs whose int4 activation quantization is exact (one nonzero per row after the runtime's shift): the
    runtime's output is then the layer's exact value, which the dense weight and bias must give."""
    sd = model(tmp_path / "m.safetensors")
    dense = convert(run_ckpt, tmp_path / "m.safetensors", tmp_path / "d.safetensors")
    k = LAYERS[name][1]
    x = torch.eye(k) * 2.0
    if LAYERS[name][3]:  # act_unsigned: the runtime quantizes x + shift
        x = x - _GELU_UNSIGNED_SHIFT
        assert not same_bytes(dense[f"{name}.bias"], sd[f"{name}.bias"])  # the shift lives in the bias
    want = runtime(sd, name, x)
    got = torch.nn.functional.linear(x, dense[f"{name}.weight"], dense[f"{name}.bias"])
    assert close(got, want, 64 * 2.0 ** -24), (got - want).abs().max()


def test_inspect_names_format_group_and_rank(tmp_path, run_ckpt):
    model(tmp_path / "m.safetensors")
    code, out, err = run_ckpt("inspect", tmp_path / "m.safetensors", "--json")
    assert code == 0, err
    layers = {e["label"]: e for e in json.loads(out)["components"][0]["quantization"]["layers"]}
    assert set(layers) == {"SVDQuant W4A4, group 64, rank 8", "SVDQuant W4A4, group 64, rank 16"}
    assert layers["SVDQuant W4A4, group 64, rank 16"]["settings"]["act_unsigned"] is True
    code, out, err = run_ckpt("inspect", tmp_path / "m.safetensors")
    assert code == 0 and "SVDQuant W4A4, group 64, rank 8" in out, out + err


# ---------------------------------------------------------------------------------------------------
# merge-lora


def lora_delta(lora_path, name, rank, alpha) -> torch.Tensor:
    lo = load_file(lora_path)
    k = "lora_unet_" + name.replace(".", "_")
    return (alpha / rank) * lo[f"{k}.lora_up.weight"].float() @ lo[f"{k}.lora_down.weight"].float()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_keep_format_bakes_the_lora_into_the_low_rank_branch(tmp_path, run_ckpt, dtype):
    base = model(tmp_path / "m.safetensors", dtype)
    lora = kohya_lora(tmp_path / "l.safetensors", {QKV: (192, 128), FC2: (64, 256)}, rank=4, alpha=2.0)
    if dtype == torch.bfloat16:  # factors a bf16 base holds exactly (scale 1/2): the bake is then exact
        save_file({k: v.bfloat16() if v.dim() else v for k, v in load_file(lora).items()}, lora)
    code, out, err = run_ckpt("merge-lora", tmp_path / "m.safetensors", lora, "--keep-format", "-o",
                              tmp_path / "kf.safetensors", "--report", tmp_path / "r.json")
    assert code == 0, err
    got = load_file(tmp_path / "kf.safetensors")
    assert sorted(got) == sorted(base)
    grown = {f"{n}.weight_proj_{s}" for n in LAYERS for s in ("down", "up")}
    for key in set(base) - grown:  # codes, scales, smoothing, biases, configs, plain tensors: byte for byte
        assert same_bytes(got[key], base[key]), key
    torch.manual_seed(0)
    for name, (n, k, r, _) in LAYERS.items():
        for s in ("down", "up"):
            key = f"{name}.weight_proj_{s}"
            assert got[key].dtype == dtype and got[key].shape == (base[key].shape[0], r + 4), key
            assert same_bytes(got[key][:, :r].contiguous(), base[key]), key
        delta = lora_delta(lora, name, 4, 2.0)
        assert close(kitchen_dense(got, name), kitchen_dense(base, name) + delta), name
        x = torch.randn(5, k)
        assert close(runtime(got, name, x) - runtime(base, name, x), x @ delta.t(), 64 * 2.0 ** -24), name
    assert all(e < 1e-6 for e in reported(tmp_path / "r.json").values())
    # plain merge-lora: the dense merge, rounded once
    code, _, err = run_ckpt("merge-lora", tmp_path / "m.safetensors", lora, "--to", "fp32", "-o",
                            tmp_path / "plain.safetensors", "-q")
    assert code == 0, err
    plain = load_file(tmp_path / "plain.safetensors")
    for name in LAYERS:
        want = kitchen_dense(base, name) + lora_delta(lora, name, 4, 2.0)
        assert close(plain[f"{name}.weight"], want), name


# ---------------------------------------------------------------------------------------------------
# comfy-kitchen's tile-packed layout

TILED = {QKV: (256, 128, 8, False), FC2: (128, 256, 16, True)}


def tile_pack(sd: dict, name: str) -> dict[str, torch.Tensor]:
    """The layer's codes, scales and proj_up in comfy-kitchen's tile-packed layout, checked against its own
    unpacking helpers (the layout's definition)."""
    w, s, up = (sd[f"{name}.weight{x}"] for x in ("", "_scale", "_proj_up"))
    n, kh = w.shape
    tw = w.view(n // 128, 32, 4, kh // 32, 32).permute(0, 3, 1, 2, 4).contiguous().view(n // 128, kh // 32, 32, 128)
    ts = s.view(s.shape[0], n // 128, 128).permute(1, 0, 2).contiguous()
    tu = up.view(n // 128, 128, up.shape[1]).permute(0, 2, 1).contiguous()
    assert torch.equal(_tile_packed_weight_to_row_major(tw), w)
    assert torch.equal(_tile_packed_scales_to_natural(ts), s)
    assert torch.equal(_tile_packed_lora_up_to_natural(tu), up)
    return {f"{name}.weight": tw, f"{name}.weight_scale": ts, f"{name}.weight_proj_up": tu}


def tiled_model(tmp_path, dtype=torch.float32):
    natural = model(tmp_path / "nat.safetensors", dtype, TILED)
    sd = dict(natural)
    for name in TILED:
        sd |= tile_pack(natural, name)
    save_file(sd, tmp_path / "tiled.safetensors")
    return natural, sd


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_tile_packed_decodes_as_the_natural_layout_it_packs(tmp_path, run_ckpt, dtype):
    natural, tiled = tiled_model(tmp_path, dtype)
    want = convert(run_ckpt, tmp_path / "nat.safetensors", tmp_path / "n.safetensors")
    got = convert(run_ckpt, tmp_path / "tiled.safetensors", tmp_path / "t.safetensors")
    assert sorted(got) == sorted(want)
    for k in want:
        assert same_bytes(got[k], want[k]), k
    for name in TILED:  # and comfy-kitchen's kernel on the tile-packed tensors gives that weight
        assert close(got[f"{name}.weight"], kitchen_dense(tiled, name)), name
    code, out, err = run_ckpt("inspect", tmp_path / "tiled.safetensors", "--json")
    assert code == 0, err
    settings = [e["settings"] for e in json.loads(out)["components"][0]["quantization"]["layers"]]
    assert all(s["layout"] == "tile-packed" for s in settings) and len(settings) == 2


def test_tile_packed_keep_format_bakes_along_the_tile_packed_rank_axis(tmp_path, run_ckpt):
    _, base = tiled_model(tmp_path)
    lora = kohya_lora(tmp_path / "l.safetensors", {QKV: (256, 128), FC2: (128, 256)}, rank=4, alpha=2.0)
    code, _, err = run_ckpt("merge-lora", tmp_path / "tiled.safetensors", lora, "--keep-format", "-o",
                            tmp_path / "kf.safetensors", "--report", tmp_path / "r.json")
    assert code == 0, err
    got = load_file(tmp_path / "kf.safetensors")
    assert sorted(got) == sorted(base)
    grown = {f"{n}.weight_proj_{s}" for n in TILED for s in ("down", "up")}
    for key in set(base) - grown:
        assert same_bytes(got[key], base[key]), key
    for name, (n, k, r, _) in TILED.items():
        up = got[f"{name}.weight_proj_up"]
        assert up.shape == (n // 128, r + 4, 128)  # still tile-packed, the rank grown by the LoRA's
        assert same_bytes(up[:, :r].contiguous(), base[f"{name}.weight_proj_up"])
        assert same_bytes(got[f"{name}.weight_proj_down"][:, :r].contiguous(), base[f"{name}.weight_proj_down"])
        assert close(kitchen_dense(got, name), kitchen_dense(base, name) + lora_delta(lora, name, 4, 2.0)), name
    assert all(e < 1e-6 for e in reported(tmp_path / "r.json").values())


def test_keep_format_refuses_what_cannot_be_baked(tmp_path, run_ckpt):
    model(tmp_path / "m.safetensors")
    g = torch.Generator().manual_seed(1)
    k = "lora_unet_" + QKV.replace(".", "_")
    save_file({f"{k}.hada_w1_a": torch.randn(192, 2, generator=g), f"{k}.hada_w1_b": torch.randn(2, 128, generator=g),
               f"{k}.hada_w2_a": torch.randn(192, 2, generator=g), f"{k}.hada_w2_b": torch.randn(2, 128, generator=g),
               f"{k}.alpha": torch.tensor(2.0)}, tmp_path / "loha.safetensors")
    assert_refused(run_ckpt, tmp_path, ("merge-lora", tmp_path / "m.safetensors", tmp_path / "loha.safetensors",
                                        "--keep-format", "-o", tmp_path / "o.safetensors", "-q"),
                   "--keep-format", "plain LoRA factors")
    one = tmp_path / "one"  # a model merge would have to re-quantize: refused by name
    one.mkdir()
    model(one / "a.safetensors", layers={QKV: LAYERS[QKV]})
    model(one / "b.safetensors", layers={QKV: LAYERS[QKV]})
    assert_refused(run_ckpt, one, ("merge", one / "a.safetensors", one / "b.safetensors", "--keep-format", "-o",
                                   one / "o.safetensors", "-q"), "--keep-format", "only when a LoRA is baked")


# ---------------------------------------------------------------------------------------------------
# bad input


def _bad_cases():
    one = {f"l.{s}": t for s, t in svdq_layer(64, 128, 8, torch.bfloat16, 0).items()}
    fc2 = {f"l.{s}": t for s, t in svdq_layer(64, 128, 8, torch.bfloat16, 0, unsigned=True).items()}
    nat = {f"l.{s}": t for s, t in svdq_layer(128, 128, 8, torch.bfloat16, 0).items()}
    tiled = nat | tile_pack(nat, "l")
    return {
        "rank mismatch": (one | {"l.weight_proj_up": one["l.weight_proj_up"][:, :6].contiguous()}, "rank mismatch"),
        "scale shape": (one | {"l.weight_scale": one["l.weight_scale"].t().contiguous()}, "group scales"),
        "integer scale": (one | {"l.weight_scale": one["l.weight_scale"].to(torch.int32)}, "expected a floating dtype"),
        "integer smoothing": (one | {"l.weight_smooth_factor": one["l.weight_smooth_factor"].to(torch.int8)},
                              "smoothing"),
        "smoothing shape": (one | {"l.weight_smooth_factor": one["l.weight_smooth_factor"][:64].contiguous()},
                            "smoothing"),
        "proj_down width": (one | {"l.weight_proj_down": one["l.weight_proj_down"][:64].contiguous()},
                            "expected [128, rank]"),
        "missing proj_up": ({k: v for k, v in one.items() if k != "l.weight_proj_up"}, "is missing"),
        "codes as float": (one | {"l.weight": one["l.weight"].float()}, "expected I8"),
        "group size": (one | {"l.comfy_quant": conf_tensor({"format": "svdquant_w4a4", "group_size": 128})},
                       "group_size 128"),
        "width not a group multiple": (one | {"l.weight": torch.zeros(64, 48, dtype=torch.int8),
                                              "l.weight_scale": torch.ones(1, 64, dtype=torch.bfloat16),
                                              "l.weight_smooth_factor": torch.ones(96, dtype=torch.bfloat16),
                                              "l.weight_proj_down": torch.ones(96, 8, dtype=torch.bfloat16)},
                                       "does not divide"),
        "tile-packed codes of a wrong block": (one | {"l.weight": torch.zeros(1, 2, 16, 128, dtype=torch.int8)},
                                               "expected comfy-kitchen's tile-packed I8"),
        "tile-packed proj_up of a wrong block": (tiled | {"l.weight_proj_up": torch.zeros(1, 8, 64, dtype=torch.bfloat16)},
                                                 "expected the tile-packed [1, rank, 128]"),
        "tile-packed rank mismatch": (tiled | {"l.weight_proj_up": tiled["l.weight_proj_up"][:, :6].contiguous()},
                                      "rank mismatch"),
        "tile-packed scale shape": (tiled | {"l.weight_scale": tiled["l.weight_scale"][:, :1].contiguous()},
                                    "group scales"),
        "act_unsigned without bias": ({k: v for k, v in fc2.items() if k != "l.bias"}, "no bias"),
        "act_unsigned not a bool": (one | {"l.comfy_quant": conf_tensor({"format": "svdquant_w4a4",
                                                                        "act_unsigned": "yes"})}, "act_unsigned"),
    }


BAD = sorted(_bad_cases())


@pytest.mark.parametrize("what", BAD)
def test_bad_input_one_line_exit_2_nothing_written(tmp_path, run_ckpt, what):
    sd, needle = _bad_cases()[what]
    save_file(sd, tmp_path / "bad.safetensors")
    assert_refused(run_ckpt, tmp_path, ("convert", tmp_path / "bad.safetensors", "--to", "bf16", "-q"),
                   str(tmp_path / "bad.safetensors"), needle)


def test_intact_twin_converts_and_truncated_file_is_refused(tmp_path, run_ckpt):
    one = {f"l.{s}": t for s, t in svdq_layer(64, 128, 8, torch.bfloat16, 0).items()}
    save_file(one, tmp_path / "ok.safetensors")
    convert(run_ckpt, tmp_path / "ok.safetensors", tmp_path / "out" / "ok.safetensors", "bf16")
    data = (tmp_path / "ok.safetensors").read_bytes()
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "cut.safetensors").write_bytes(data[: len(data) - 100])
    assert_refused(run_ckpt, tmp_path / "t", ("convert", tmp_path / "t" / "cut.safetensors", "--to", "bf16", "-q"),
                   str(tmp_path / "t" / "cut.safetensors"), "truncated")
