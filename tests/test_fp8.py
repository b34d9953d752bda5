"""FP8 layouts through the real CLI, against oracles computed here from each format's definition.

Every expected value is torch's own cast of `(codes.float() * scale_expanded)` (fp32 product, rounded
once), with the scale expanded in the test the way the format defines it. Bands are shrunk
(`ckpt.io.output.BAND_ELEMS`) so that tensors span several bands and scale slicing is exercised.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

FP8S = [torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz]
TARGETS = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
E4 = torch.float8_e4m3fn


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or tuple(a.shape) != tuple(b.shape):
        return False
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


def fp8(shape, dtype=E4, seed=0, scale=40.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * scale).to(dtype)


def rand(shape, dtype=torch.float32, seed=1, lo=0.001, hi=0.01):
    g = torch.Generator().manual_seed(seed)
    return (torch.rand(shape, generator=g) * (hi - lo) + lo).to(dtype)


def only_src_left(folder, *names):
    return sorted(p.name for p in folder.iterdir()) == sorted(names)


@pytest.fixture
def small_bands(monkeypatch):
    monkeypatch.setattr("ckpt.io.output.BAND_ELEMS", 64)


# --- plain fp8 ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("target", sorted(TARGETS))
def test_all_256_bit_patterns_cast_like_torch(tmp_path, run_ckpt, target):
    codes = torch.arange(256, dtype=torch.uint8).reshape(16, 16)
    src = tmp_path / "p.safetensors"
    save_file({f"t{i}": codes.view(d).clone() for i, d in enumerate(FP8S)}, src)
    code, out, err = run_ckpt("convert", src, "--to", target, "-o", tmp_path / "o.safetensors", "-q")
    assert code == 0, err
    got = load_file(tmp_path / "o.safetensors")
    for i, d in enumerate(FP8S):
        assert same_bytes(got[f"t{i}"], codes.view(d).to(TARGETS[target])), (d, target)  # NaN payloads too


def test_plain_to_fp8_saturates_like_torch_and_warns(tmp_path, run_ckpt):
    w = torch.tensor([[0.1, -3.0, 500.0, -1e4], [447.0, 449.0, 1e-3, 0.0]], dtype=torch.bfloat16)
    save_file({"a.weight": w}, tmp_path / "m.safetensors")
    code, out, err = run_ckpt("convert", tmp_path / "m.safetensors", "--to", "fp8_e4m3fn", "-o", tmp_path / "o.safetensors")
    assert code == 0, err
    assert same_bytes(load_file(tmp_path / "o.safetensors")["a.weight"], w.float().to(E4))
    assert "saturated" in err


# --- ComfyUI -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("target", ["bf16", "fp16"])
def test_comfy_legacy_scaled_fp8(tmp_path, run_ckpt, small_bands, target):
    t = {
        "scaled_fp8": torch.empty(0, dtype=E4),
        "a.weight": fp8((40, 24)),
        "a.scale_weight": torch.tensor(0.0123, dtype=torch.float32),
        "a.scale_input": torch.tensor(1.0),
        "a.bias": rand((40,), torch.bfloat16),
        "hi.weight": rand((8, 8), torch.bfloat16),  # high-precision layer with a dummy scale, as ComfyUI writes
        "hi.scale_weight": torch.tensor(1.0),
    }
    save_file(t, tmp_path / "m.safetensors")
    code, out, err = run_ckpt("convert", tmp_path / "m.safetensors", "--to", target, "-o", tmp_path / "o.safetensors", "-q")
    assert code == 0, err
    got, dst = load_file(tmp_path / "o.safetensors"), TARGETS[target]
    assert set(got) == {"a.weight", "a.bias", "hi.weight"}
    assert same_bytes(got["a.weight"], (t["a.weight"].float() * t["a.scale_weight"]).to(dst))
    assert same_bytes(got["hi.weight"], (t["hi.weight"].float() * 1.0).to(dst))
    assert same_bytes(got["a.bias"], t["a.bias"].to(dst))


def _comfy_json(conf: dict) -> torch.Tensor:
    return torch.tensor(list(json.dumps(conf).encode()), dtype=torch.uint8)


def test_comfy_quant_fp8_formats(tmp_path, run_ckpt, small_bands):
    t = {
        "x.weight": fp8((16, 12)),
        "x.weight_scale": torch.tensor(0.02),
        "x.input_scale": torch.tensor(0.5),
        "y.weight": fp8((10, 8), torch.float8_e5m2, seed=3, scale=1000.0),
        "y.weight_scale": torch.tensor(0.001),
        "y.comfy_quant": _comfy_json({"format": "float8_e5m2"}),
        "z.weight": rand((4, 4), torch.bfloat16),
    }
    meta = {"_quantization_metadata": json.dumps({"format_version": "1.0", "layers": {"x": {"format": "float8_e4m3fn"}}}),
            "modelspec.title": "tiny"}
    save_file(t, tmp_path / "m.safetensors", metadata=meta)
    code, out, err = run_ckpt("convert", tmp_path / "m.safetensors", "--to", "bf16", "-o", tmp_path / "o.safetensors", "-q")
    assert code == 0, err
    got = load_file(tmp_path / "o.safetensors")
    assert set(got) == {"x.weight", "y.weight", "z.weight"}
    assert same_bytes(got["x.weight"], (t["x.weight"].float() * t["x.weight_scale"]).bfloat16())
    assert same_bytes(got["y.weight"], (t["y.weight"].float() * t["y.weight_scale"]).bfloat16())
    assert same_bytes(got["z.weight"], t["z.weight"])
    with safe_open(tmp_path / "o.safetensors", "pt") as f:
        meta_out = f.metadata()
    assert "_quantization_metadata" not in meta_out and meta_out["modelspec.title"] == "tiny"


@pytest.mark.parametrize("fmt,weight", [  # a format ComfyUI knows and ckpt does not decode, and a made-up one
    ("float8_e4m3fn_blockwise", torch.zeros(8, 64, dtype=torch.uint8).view(E4)),  # (ConvRot, SVDQuant: their tests)
    ("int3_made_up", torch.zeros(8, 8, dtype=torch.int8)),
])
def test_comfy_quant_other_formats_refused(tmp_path, run_ckpt, fmt, weight):
    t = {"x.weight": weight, "x.weight_scale": torch.ones(1), "x.comfy_quant": _comfy_json({"format": fmt})}
    save_file(t, tmp_path / "m.safetensors")
    code, out, err = run_ckpt("convert", tmp_path / "m.safetensors", "--to", "bf16", "-q")
    assert code == 2
    assert err.startswith("error:") and err.count("\n") == 1 and fmt in err and "'x'" in err
    assert only_src_left(tmp_path, "m.safetensors")


# --- kohya / musubi ----------------------------------------------------------------------------------


def test_kohya_fp8_scaled_tensor_channel_block(tmp_path, run_ckpt, small_bands):
    bf = torch.bfloat16
    t = {
        "t.weight": fp8((10, 16)), "t.scale_weight": rand((1,), bf),
        "c.weight": fp8((12, 16), seed=2), "c.scale_weight": rand((12, 1), bf, seed=3),
        "b.weight": fp8((6, 128), seed=4), "b.scale_weight": rand((6, 2, 1), bf, seed=5),
        "b2.weight": fp8((5, 192), seed=6), "b2.scale_weight": rand((5, 3, 1), torch.float32, seed=7, lo=0.1, hi=1.0),
        "b2.scale_weight_tensor": torch.tensor(0.0173),
        "n.bias": rand((6,), bf),
    }
    save_file(t, tmp_path / "m.safetensors")
    # --keep t.*: the kept tensor comes out in the model's original dtype, which kohya records as the scale's
    code, out, err = run_ckpt("convert", tmp_path / "m.safetensors", "--to", "fp16", "--keep", "t.*",
                              "-o", tmp_path / "o.safetensors", "-q")
    assert code == 0, err
    got = load_file(tmp_path / "o.safetensors")
    assert set(got) == {"t.weight", "c.weight", "b.weight", "b2.weight", "n.bias"}
    assert same_bytes(got["t.weight"], (t["t.weight"].float() * t["t.scale_weight"].float()).to(bf))
    assert same_bytes(got["c.weight"], (t["c.weight"].float() * t["c.scale_weight"].float()).half())
    want_b = (t["b.weight"].float().view(6, 2, 64) * t["b.scale_weight"].float()).view(6, 128)
    assert same_bytes(got["b.weight"], want_b.half())
    total = t["b2.scale_weight"].float() * t["b2.scale_weight_tensor"]
    want_b2 = (t["b2.weight"].float().view(5, 3, 64) * total).view(5, 192)
    assert same_bytes(got["b2.weight"], want_b2.half())


# --- HF block FP8 ------------------------------------------------------------------------------------


def expand_blocks(s: torch.Tensor, shape, block=(128, 128)) -> torch.Tensor:
    e = s.float().repeat_interleave(block[0], dim=-2).repeat_interleave(block[1], dim=-1)
    return e[..., : shape[-2], : shape[-1]]


def test_hf_block_fp8_sharded_folder(tmp_path, run_ckpt, monkeypatch):
    monkeypatch.setattr("ckpt.io.output.BAND_ELEMS", 1000)  # 2-D: bands of 128 rows; experts: one per band
    src = tmp_path / "model"
    src.mkdir()
    cfg = {"architectures": ["TinyForCausalLM"], "torch_dtype": "bfloat16", "hidden_size": 8,
           "quantization_config": {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                                   "weight_block_size": [128, 128]}}
    (src / "config.json").write_text(json.dumps(cfg))
    (src / "tokenizer.json").write_text("{}")
    e8 = torch.randint(120, 134, (3, 2, 3), generator=torch.Generator().manual_seed(9), dtype=torch.uint8)
    shard1 = {"l.q.weight": fp8((300, 200)), "l.q.weight_scale_inv": rand((3, 2), lo=0.5, hi=2.0),
              "norm.weight": rand((300,), torch.bfloat16)}
    shard2 = {"l.e.weight": fp8((3, 130, 260), seed=5), "l.e.weight_scale_inv": e8.view(torch.float8_e8m0fnu),
              "l.k.weight": fp8((64, 64), seed=6), "l.k.weight_scale_inv": rand((1, 1), lo=0.5, hi=2.0),
              "l.k.activation_scale": torch.tensor([0.3])}
    names = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    save_file(shard1, src / names[0])
    save_file(shard2, src / names[1])
    wm = {k: names[0] for k in shard1} | {k: names[1] for k in shard2}
    (src / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": 0}, "weight_map": wm}))

    code, out, err = run_ckpt("convert", src, "--to", "bf16", "-o", tmp_path / "out", "-q")
    assert code == 0, err
    dst = tmp_path / "out"
    got = load_file(dst / names[0]) | load_file(dst / names[1])
    assert set(got) == {"l.q.weight", "norm.weight", "l.e.weight", "l.k.weight"}
    for k in ("l.q", "l.e", "l.k"):
        w, s = {**shard1, **shard2}[k + ".weight"], {**shard1, **shard2}[k + ".weight_scale_inv"]
        assert same_bytes(got[k + ".weight"], (w.float() * expand_blocks(s, w.shape)).bfloat16()), k
    assert same_bytes(got["norm.weight"], shard1["norm.weight"])
    out_cfg = json.loads((dst / "config.json").read_text())
    assert "quantization_config" not in out_cfg and out_cfg["torch_dtype"] == "bfloat16"
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(got)
    assert (dst / "tokenizer.json").read_text() == "{}"


# --- weight_scale family (compressed-tensors, FBGEMM, ModelOpt/AutoFP8, Mistral) --------------------


def test_weight_scale_per_tensor_channel_group_and_activation_scales(tmp_path, run_ckpt, small_bands):
    src = tmp_path / "model"
    src.mkdir()
    cfg = {"architectures": ["TinyForCausalLM"], "torch_dtype": "float16",
           "quantization_config": {"quant_method": "compressed-tensors", "format": "float-quantized"}}
    (src / "config.json").write_text(json.dumps(cfg))
    t = {
        "p.weight": fp8((20, 16)), "p.weight_scale": rand((20, 1), torch.bfloat16), "p.input_scale": torch.ones(1),
        "q.weight": fp8((8, 16), seed=2), "q.weight_scale": torch.tensor(0.004),
        "v.weight": fp8((9, 16), seed=3), "v.weight_scale": rand((9,), seed=4),  # 1-D per-channel (ModelOpt style)
        "g.weight": fp8((4, 64), seed=5), "g.weight_scale": rand((4, 2), seed=6),  # group of 32 along the input
        "f.weight": fp8((6, 16), seed=7), "f.weight_scale": rand((6, 1), seed=8), "f.input_scale_ub": torch.tensor([1e3]),
        "m.qscale_weight": torch.tensor(0.03), "m.weight": fp8((4, 4), seed=9), "m.qscale_act": torch.tensor(0.2),
        "attn.k_scale": torch.tensor(1.0), "attn.v_scale": torch.tensor(1.0),
        "ln.weight": rand((16,), torch.float16),
    }
    save_file(t, src / "model.safetensors")
    code, out, err = run_ckpt("convert", src, "--to", "fp32", "-o", tmp_path / "out", "-q")
    assert code == 0, err
    got = load_file(tmp_path / "out" / "model.safetensors")
    assert set(got) == {"p.weight", "q.weight", "v.weight", "g.weight", "f.weight", "m.weight", "ln.weight"}
    f32 = torch.float32
    assert same_bytes(got["p.weight"], t["p.weight"].float() * t["p.weight_scale"].float())
    assert same_bytes(got["q.weight"], t["q.weight"].float() * t["q.weight_scale"])
    assert same_bytes(got["v.weight"], t["v.weight"].float() * t["v.weight_scale"][:, None])
    want_g = (t["g.weight"].float().view(4, 2, 32) * t["g.weight_scale"][:, :, None]).view(4, 64)
    assert same_bytes(got["g.weight"], want_g)
    assert same_bytes(got["f.weight"], t["f.weight"].float() * t["f.weight_scale"])
    assert same_bytes(got["m.weight"], t["m.weight"].float() * t["m.qscale_weight"])
    assert same_bytes(got["ln.weight"], t["ln.weight"].to(f32))
    out_cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert "quantization_config" not in out_cfg and out_cfg["torch_dtype"] == "float32"


@pytest.mark.parametrize("tensors,needle", [
    ({"a.weight_scale_inv": torch.ones(1, 1), "b.weight": torch.ones(2, 2)}, "a.weight_scale_inv"),
    ({"a.weight": torch.ones(4, 4, dtype=torch.int8), "a.weight_scale": torch.ones(4, 1)}, "integer"),
    ({"a.weight": torch.ones(4, 2, dtype=torch.uint8), "a.weight_scale": torch.ones(4, 1).to(E4),
      "a.weight_scale_2": torch.ones(())}, "NVFP4"),
    ({"a.weight": fp8((4, 4)), "a.weight_scale_inv": torch.ones(3, 3)}, "fits no known layout"),
    ({"a.weight": fp8((4, 64)), "a.weight_scale": torch.ones(4, 2, dtype=torch.uint8)}, "MXFP8"),
    ({"a.weight": torch.ones(4, 4), "a.weight_scale": torch.ones(())}, "not FP8"),
    ({"a.weight": fp8((4, 4)), "a.weight_scale": torch.ones(()), "a.weight_zero_point": torch.ones(())}, "zero point"),
])
def test_undecodable_layouts_refused_before_output(tmp_path, run_ckpt, tensors, needle):
    save_file(tensors, tmp_path / "m.safetensors")
    code, out, err = run_ckpt("convert", tmp_path / "m.safetensors", "--to", "fp16")
    assert code == 2
    assert err.startswith("error:") and err.count("\n") == 1, err
    assert needle in err and "m.safetensors" in err
    assert only_src_left(tmp_path, "m.safetensors")


# --- --to fp8_e4m3fn --scaled ------------------------------------------------------------------------


def test_scaled_fp8_output_and_roundtrip(tmp_path, run_ckpt, small_bands):
    p = "model.diffusion_model."
    g = torch.Generator().manual_seed(0)
    t = {
        p + "a.weight": (torch.randn(40, 24, generator=g) * 0.05).bfloat16(),
        p + "a.bias": torch.randn(40, generator=g).bfloat16(),
        p + "b.weight": (torch.randn(8, 36, generator=g) * 3).half(),
        p + "zero.weight": torch.zeros(4, 4, dtype=torch.bfloat16),
        p + "conv.weight": torch.randn(8, 4, 3, 3, generator=g).half(),  # ComfyUI scales Linear layers only
        p + "tok_embed.weight": torch.randn(10, 4, generator=g).bfloat16(),
        "text_encoders.clip_l.fc.weight": torch.randn(4, 4, generator=g).bfloat16(),  # bundled: not scaled
        p + "kept.weight": torch.randn(6, 6, generator=g).bfloat16(),
        p + "pos": torch.arange(7),
    }
    save_file(t, tmp_path / "m.safetensors")
    code, out, err = run_ckpt("convert", tmp_path / "m.safetensors", "--to", "fp8_e4m3fn", "--scaled",
                              "--keep", "*kept*", "-o", tmp_path / "s.safetensors", "-q")
    assert code == 0, err
    got = load_file(tmp_path / "s.safetensors")
    scaled = ["a", "b", "zero"]
    assert set(got) == set(t) | {p + f"{n}.scale_weight" for n in scaled} | {p + "scaled_fp8"}
    assert got[p + "scaled_fp8"].dtype == E4 and got[p + "scaled_fp8"].numel() == 0
    for n in scaled:
        w = t[p + n + ".weight"].float()
        amax = w.abs().max()
        s = amax / 448 if amax > 0 else torch.tensor(1.0)
        assert same_bytes(got[p + n + ".scale_weight"], s.reshape(()).float()), n
        assert same_bytes(got[p + n + ".weight"], (w / s).clamp(-448, 448).to(E4)), n
    for k in (p + "a.bias", p + "kept.weight", p + "pos", p + "conv.weight", p + "tok_embed.weight",
              "text_encoders.clip_l.fc.weight"):
        assert same_bytes(got[k], t[k]), k

    code, out, err = run_ckpt("convert", tmp_path / "s.safetensors", "--to", "bf16", "-o", tmp_path / "r.safetensors", "-q")
    assert code == 0, err
    back = load_file(tmp_path / "r.safetensors")
    assert set(back) == set(t)
    for n in scaled:
        codes, s = got[p + n + ".weight"], got[p + n + ".scale_weight"]
        assert same_bytes(back[p + n + ".weight"], (codes.float() * s).bfloat16()), n
        w = t[p + n + ".weight"].float()
        assert torch.allclose(back[p + n + ".weight"].float(), w, rtol=0.07, atol=float(w.abs().max()) / 448 * 2 ** -6)


# --- the Tensor interface: any band start gives the same values ----------------------------------------


@pytest.mark.parametrize("wshape,sshape", [
    ((300, 200), (3, 2)),  # 128x128 blocks, ragged edges
    ((3, 130, 260), (3, 2, 3)),  # leading expert dim
    ((12, 128), (12, 2, 1)),  # kohya block-64
    ((12, 16), (12, 1)),  # per channel
    ((12, 16), (1,)),  # per tensor
])
def test_scaled_tensor_bands_match_whole_read(wshape, sshape):
    from ckpt.io.tensors import PickleTensor
    from ckpt.quant.common import ScaledTensor

    w = fp8(wshape)
    s = rand(sshape, lo=0.5, hi=2.0)
    st = ScaledTensor(PickleTensor("x.weight", w, ""), PickleTensor("x.scale", s, ""))
    cpu = torch.device("cpu")
    whole = st.read(0, st.rows, cpu)
    for a, b in [(0, 1), (1, 2), (5, st.rows), (st.rows - 1, st.rows)]:
        assert torch.equal(st.read(a, b, cpu), whole[a:b]), (a, b)
    assert torch.equal(w.float(), fp8(wshape).float())  # the source was not scaled in place


def test_pickle_input_kohya_scaled(tmp_path, run_ckpt):
    t = {"c.weight": fp8((12, 16)), "c.scale_weight": rand((12, 1), torch.bfloat16)}
    torch.save(t, tmp_path / "m.pt")
    code, out, err = run_ckpt("convert", tmp_path / "m.pt", "--to", "bf16", "-o", tmp_path / "o.safetensors", "-q")
    assert code == 0, err
    got = load_file(tmp_path / "o.safetensors")
    assert set(got) == {"c.weight"}
    assert same_bytes(got["c.weight"], (t["c.weight"].float() * t["c.scale_weight"].float()).bfloat16())


def test_fp8_config_without_scales_is_dropped(tmp_path, run_ckpt):
    src = tmp_path / "model"
    src.mkdir()
    cfg = {"architectures": ["Tiny"], "torch_dtype": "bfloat16", "quantization_config": {"quant_method": "fp8"}}
    (src / "config.json").write_text(json.dumps(cfg))
    save_file({"a.weight": fp8((4, 4))}, src / "model.safetensors")
    code, out, err = run_ckpt("convert", src, "--to", "fp16", "-o", tmp_path / "out", "-q")
    assert code == 0, err
    assert "quantization_config" not in json.loads((tmp_path / "out" / "config.json").read_text())
    assert same_bytes(load_file(tmp_path / "out" / "model.safetensors")["a.weight"], fp8((4, 4)).half())
