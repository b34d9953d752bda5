"""`ckpt merge-lora --keep-format` on ComfyUI comfy_quant (fp8, int8, nvfp4, mxfp8), ComfyUI legacy scaled fp8
and kohya/musubi fp8_scaled bases.

Oracles: the merged value is ckpt's plain fp32 merge; comfy_quant layers must be comfy-kitchen's own quantize of
it (its layouts' `quantize` + `state_dict_tensors`, bit for bit) and load the way ComfyUI loads them; legacy scaled
fp8 layers must be what the layout's writer, `convert --to fp8_e4m3fn --scaled`, writes for the plain merge (W / s,
ComfyUI's "tensor / scale"), which comfy-kitchen's `x * (1 / s)` meets except for values one fp8 step apart
(`ckpt merge --keep-format` over a tiny Flux, every tensor, with values planted where the two roundings part);
kohya/musubi layers have no installable reference (musubi-tuner is not on PyPI), so
they are checked against musubi-tuner's published formula restated here, bit for bit, and decoded the way
ComfyUI / musubi decode them (codes * scale). Unchanged stored keys (codes, scales, configs, markers,
activation scales, metadata) must be the input's bytes; the reported error must be the measured one.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from helpers.keep_format import kohya_lora, plain_merge, rel_rms, reported

pytest.importorskip("comfy_kitchen.tensor")
from helpers.comfy_ref import comfy_load, ck_quantize, same_bytes  # noqa: E402


def ck_state(fmt: str, w: torch.Tensor, rowwise=False) -> dict[str, torch.Tensor]:
    """comfy-kitchen's stored tensors ({suffix: tensor}) of W's fp32 values."""
    return ck_quantize(fmt, w, rowwise)[2]


def weight(shape, seed):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=g) * 0.05
    w[0, :16] = 0
    return w.to(torch.bfloat16)


def conf(fmt: str) -> torch.Tensor:
    return torch.tensor(list(json.dumps({"format": fmt}).encode()), dtype=torch.uint8)


# layer -> (format, row-wise int8, shape)
COMFY = {"blocks.0.a": ("nvfp4", False, (144, 80)), "blocks.0.b": ("mxfp8", False, (160, 96)),
         "blocks.0.c": ("int8_tensorwise", False, (40, 72)), "blocks.0.d": ("int8_tensorwise", True, (40, 72)),
         "blocks.0.e": ("float8_e4m3fn", False, (48, 64)), "blocks.0.f": ("float8_e5m2", False, (48, 64)),
         "blocks.1.a": ("nvfp4", False, (32, 64))}  # blocks.1.a: left alone by the LoRA


def test_comfy_quant_layers_requantized_by_comfy_kitchen_the_rest_byte_identical(tmp_path, run_ckpt, monkeypatch):
    import ckpt.io.output as output

    monkeypatch.setattr(output, "BAND_ELEMS", 2048)  # a 144-row weight spans several 128-row bands
    sd, meta_layers = {}, {}
    for i, (layer, (fmt, rowwise, shape)) in enumerate(COMFY.items()):
        for suffix, t in ck_state(fmt, weight(shape, i), rowwise).items():
            sd[f"{layer}.weight{suffix}"] = t
        sd[f"{layer}.comfy_quant"] = conf(fmt)
        sd[f"{layer}.input_scale"] = torch.tensor(0.5)
        sd[f"{layer}.bias"] = torch.randn(shape[0]).to(torch.bfloat16)
        meta_layers[layer] = {"format": fmt}
    sd["head.weight"] = torch.randn(16, 32).to(torch.bfloat16)
    meta = {"_quantization_metadata": json.dumps({"format_version": "1.0", "layers": meta_layers}), "title": "t"}
    save_file(sd, tmp_path / "q.safetensors", metadata=meta)
    changed = [k for k in COMFY if k != "blocks.1.a"] + ["head"]
    lora = kohya_lora(tmp_path / "l.safetensors",
                      {k: COMFY[k][2] if k in COMFY else (16, 32) for k in changed}, seed=5)
    merged = plain_merge(run_ckpt, tmp_path / "q.safetensors", lora, tmp_path)
    code, out, err = run_ckpt("merge-lora", tmp_path / "q.safetensors", lora, "--keep-format",
                              "-o", tmp_path / "o.safetensors", "--report", tmp_path / "r.json")
    assert code == 0, err
    got = load_file(tmp_path / "o.safetensors")
    assert sorted(got) == sorted(sd)
    with safe_open(tmp_path / "o.safetensors", "pt") as f:
        out_meta = f.metadata()
    assert out_meta["_quantization_metadata"] == meta["_quantization_metadata"] and out_meta["title"] == "t"
    rewritten = set()
    for layer in changed:
        if layer == "head":
            assert same_bytes(got["head.weight"], merged["head.weight"].to(torch.bfloat16))
            rewritten.add("head.weight")
            continue
        fmt, rowwise, shape = COMFY[layer]
        for suffix, want in ck_state(fmt, merged[f"{layer}.weight"], rowwise).items():
            key = f"{layer}.weight{suffix}"
            assert same_bytes(got[key], want.to(sd[key].dtype) if want.dtype != sd[key].dtype else want), key
            rewritten.add(key)
    for key, t in sd.items():
        if key not in rewritten:
            assert same_bytes(got[key], t), key  # codes, scales, configs, input scales, biases as stored
    rep = reported(tmp_path / "r.json")
    assert sorted(rep) == sorted(f"{k}.weight" for k in changed)
    for layer in changed[:-1]:
        dec = comfy_load(got, layer, COMFY[layer][2])
        assert rep[f"{layer}.weight"] == pytest.approx(rel_rms(dec, merged[f"{layer}.weight"]), rel=1e-9), layer
    assert rep["head.weight"] == pytest.approx(rel_rms(got["head.weight"].float(), merged["head.weight"]), rel=1e-9)


def test_padded_nvfp4_and_pre_quant_scale(tmp_path, run_ckpt):
    """A (40, 72) nvfp4 weight comfy-kitchen padded to (48, 80) is padded again; an AWQ pre_quant_scale is kept
    and the merge divided by it before encoding."""
    w = weight((40, 72), 1)
    col = torch.rand(72) + 0.5
    padded = torch.nn.functional.pad((w.float() / col), (0, 8, 0, 8))
    sd = {f"l.weight{k}": v for k, v in ck_state("nvfp4", padded).items()}
    sd["l.comfy_quant"] = torch.tensor(list(json.dumps({"format": "nvfp4", "orig_shape": [40, 72]}).encode()),
                                       dtype=torch.uint8)
    sd["l.pre_quant_scale"] = col
    save_file(sd, tmp_path / "q.safetensors")
    lora = kohya_lora(tmp_path / "l.safetensors", {"l": (40, 72)})
    merged = plain_merge(run_ckpt, tmp_path / "q.safetensors", lora, tmp_path)
    code, _, err = run_ckpt("merge-lora", tmp_path / "q.safetensors", lora, "--keep-format", "-o", tmp_path / "o.safetensors",
                            "--report", tmp_path / "r.json", "-q")
    assert code == 0, err
    got = load_file(tmp_path / "o.safetensors")
    want = ck_state("nvfp4", torch.nn.functional.pad(merged["l.weight"] / col, (0, 8, 0, 8)))
    for suffix, t in want.items():
        assert same_bytes(got[f"l.weight{suffix}"], t.to(sd[f"l.weight{suffix}"].dtype)), suffix
    assert same_bytes(got["l.pre_quant_scale"], col) and same_bytes(got["l.comfy_quant"], sd["l.comfy_quant"])
    code, _, err = run_ckpt("convert", tmp_path / "o.safetensors", "--to", "fp32", "-o", tmp_path / "d.safetensors", "-q")
    assert code == 0, err
    dec = load_file(tmp_path / "d.safetensors")["l.weight"]
    assert reported(tmp_path / "r.json")["l.weight"] == pytest.approx(rel_rms(dec, merged["l.weight"]), rel=1e-6)


# ---- ComfyUI legacy scaled fp8 ----------------------------------------------------------------------------

def one_step_apart(a: torch.Tensor, b: torch.Tensor, most: float) -> int:
    """How many fp8 codes of a and b differ, asserting each such pair is one step apart (same sign, adjacent
    bytes) and that at most a `most` share of the codes differ."""
    x, y = a.reshape(-1).view(torch.uint8).to(torch.int32), b.reshape(-1).view(torch.uint8).to(torch.int32)
    d = x != y
    assert bool(((x[d] >> 7) == (y[d] >> 7)).all()) and bool(((x[d] - y[d]).abs() == 1).all())
    assert int(d.sum()) <= most * x.numel()
    return int(d.sum())


@pytest.mark.parametrize("dt", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_comfy_legacy_scaled_fp8(tmp_path, run_ckpt, dt):
    p = "model.diffusion_model."
    sd = {f"{p}scaled_fp8": torch.empty(0, dtype=dt)}
    for i, name in enumerate(("blocks.0.a", "blocks.0.b", "blocks.1.a")):
        w = weight((32, 64), 10 + i).float()
        s = w.abs().max() / torch.finfo(dt).max
        sd[f"{p}{name}.weight"] = (w / s).to(dt)
        sd[f"{p}{name}.scale_weight"] = s.reshape(())
        sd[f"{p}{name}.scale_input"] = torch.tensor(1.0)
    sd[f"{p}norm.weight"] = torch.ones(64, dtype=torch.bfloat16)
    sd[f"{p}hp.weight"] = weight((16, 64), 3)  # a high-precision layer with a dummy scale
    sd[f"{p}hp.scale_weight"] = torch.tensor(1.0)
    save_file(sd, tmp_path / "s.safetensors", metadata={"title": "legacy"})
    changed = ["blocks.0.a", "blocks.0.b", "hp"]
    lora = kohya_lora(tmp_path / "l.safetensors", {n: (16 if n == "hp" else 32, 64) for n in changed}, seed=2)
    merged = plain_merge(run_ckpt, tmp_path / "s.safetensors", lora, tmp_path)
    code, out, err = run_ckpt("merge-lora", tmp_path / "s.safetensors", lora, "--keep-format", "-o", tmp_path / "o.safetensors",
                              "--report", tmp_path / "r.json")
    assert code == 0, err
    got = load_file(tmp_path / "o.safetensors")
    assert sorted(got) == sorted(sd)
    if dt == torch.float8_e4m3fn:  # the layout's writer on the plain merge
        code, _, err = run_ckpt("convert", tmp_path / "plain.safetensors", "--to", "fp8_e4m3fn", "--scaled", "-o",
                                tmp_path / "enc.safetensors", "-q")
        assert code == 0, err
        enc = load_file(tmp_path / "enc.safetensors")
    rep = reported(tmp_path / "r.json")
    for name in ("blocks.0.a", "blocks.0.b"):
        w, s = got[f"{p}{name}.weight"], got[f"{p}{name}.scale_weight"]
        if dt == torch.float8_e4m3fn:
            assert same_bytes(w, enc[f"{p}{name}.weight"]) and same_bytes(s, enc[f"{p}{name}.scale_weight"])
        ck = ck_state("float8_e4m3fn" if dt == torch.float8_e4m3fn else "float8_e5m2", merged[f"{p}{name}.weight"])
        assert same_bytes(s, ck["_scale"])  # comfy-kitchen: the same scale,
        one_step_apart(w, ck[""], 1e-3)  # and its codes but where x * (1 / s) and x / s round apart
        dec = w.float() * s  # ComfyUI's scaled-fp8 decode
        assert rep[f"{p}{name}.weight"] == pytest.approx(rel_rms(dec, merged[f"{p}{name}.weight"]), rel=1e-9)
    assert same_bytes(got[f"{p}hp.weight"], merged[f"{p}hp.weight"].to(torch.bfloat16))
    for key in sd:
        if not any(key.startswith(f"{p}{n}.weight") or key == f"{p}{n}.scale_weight" for n in changed):
            assert same_bytes(got[key], sd[key]), key  # marker, scale_input, untouched layers
    assert same_bytes(got[f"{p}hp.scale_weight"], sd[f"{p}hp.scale_weight"])


def test_legacy_scaled_fp8_of_a_tiny_weight_is_what_convert_writes(tmp_path, run_ckpt):
    """A merged layer whose amax / 448 is below the smallest normal float32: the scale is clamped to it, as
    `convert --scaled` clamps it (comfy-kitchen's 1 / s would overflow and turn zeros into NaN codes)."""
    w = weight((32, 64), 7).float() * 1e-36
    s = w.abs().max() / 448
    sd = {"scaled_fp8": torch.empty(0, dtype=torch.float8_e4m3fn), "t.weight": (w / s).to(torch.float8_e4m3fn),
          "t.scale_weight": s.reshape(())}
    save_file(sd, tmp_path / "s.safetensors")
    g = torch.Generator().manual_seed(3)
    save_file({"lora_unet_t.lora_down.weight": torch.randn(4, 64, generator=g) * 1e-19,
               "lora_unet_t.lora_up.weight": torch.randn(32, 4, generator=g) * 1e-19,
               "lora_unet_t.alpha": torch.tensor(4.0)}, tmp_path / "l.safetensors")
    merged = plain_merge(run_ckpt, tmp_path / "s.safetensors", tmp_path / "l.safetensors", tmp_path)
    assert 0 < float(merged["t.weight"].abs().max()) / 448 < torch.finfo(torch.float32).tiny
    code, _, err = run_ckpt("merge-lora", tmp_path / "s.safetensors", tmp_path / "l.safetensors", "--keep-format",
                            "-o", tmp_path / "o.safetensors", "-q")
    assert code == 0, err
    code, _, err = run_ckpt("convert", tmp_path / "plain.safetensors", "--to", "fp8_e4m3fn", "--scaled", "-o",
                            tmp_path / "enc.safetensors", "-q")
    assert code == 0, err
    got, enc = load_file(tmp_path / "o.safetensors"), load_file(tmp_path / "enc.safetensors")
    assert same_bytes(got["t.weight"], enc["t.weight"]) and same_bytes(got["t.scale_weight"], enc["t.scale_weight"])
    assert float(got["t.scale_weight"]) == torch.finfo(torch.float32).tiny
    assert not bool(torch.isnan(got["t.weight"].float()).any())


PLANTED = "single_blocks.1.linear2.weight"


def _e4m3(y: torch.Tensor) -> torch.Tensor:
    return y.to(torch.float8_e4m3fn).view(torch.uint8)


def _parting_values(above: float, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(amax, n values) in float32: an amax over `above` and n values under 0.9 amax whose e4m3 codes differ
    between x / s (the legacy writer) and x * (1 / s) (comfy-kitchen), s = amax / 448: the fp32 neighbours of
    the halfway points between e4m3 values, times s. How many there are depends on how far 1 / s is from its
    float32 rounding, so amax is stepped one ulp at a time until there are n."""
    codes = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    mids = ((codes[:-1] + codes[1:]) / 2).reshape(-1, 1)
    ulps = torch.arange(-8, 9, dtype=torch.int32).reshape(1, -1)
    amax = torch.tensor(above, dtype=torch.float32)
    for _ in range(1000):
        amax = (amax.view(torch.int32) + 1).view(torch.float32)
        s = amax / 448
        x = ((mids * s).view(torch.int32) + ulps).view(torch.float32).reshape(-1)
        x = x[x.abs() < 0.9 * amax]
        found = x[_e4m3(x / s) != _e4m3(x * (1.0 / s))]
        if found.numel() >= n:
            return amax, found[torch.linspace(0, found.numel() - 1, n).long()]
    raise AssertionError("no amax with enough parting values")


def test_merge_keep_format_on_a_scaled_fp8_flux_equals_convert_scaled_of_the_plain_merge(tmp_path, run_ckpt):
    """`ckpt merge --keep-format` with a legacy scaled-fp8 reference (a tiny Flux.1 made by `convert --to fp8_e4m3fn
    --scaled`) is, for every tensor, `convert --to fp8_e4m3fn --scaled` of the fp32 merge. Values where the legacy
    writer's W / s and comfy-kitchen's W * (1 / s) round to different codes are planted in `PLANTED` (the tensor
    the two used to part on): 0 in A, 2t in B, so that the 0.5 / 0.5 linear merge is exactly t."""
    from ckpt import families
    from families_util import original_from_pairs, state_dict, tiny_flux1

    torch.manual_seed(0)
    model = tiny_flux1()
    with torch.no_grad():
        for prm in model.parameters():
            prm.normal_(0, 0.05)
    a = original_from_pairs(families.get("flux1"), state_dict(model))
    g = torch.Generator().manual_seed(1)
    b = {k: v + 0.01 * torch.randn(v.shape, generator=g) for k, v in a.items()}
    spots = [(r, 3 * r + 1) for r in range(7)]  # the first holds the tensor's amax
    for r, c in spots:
        a[PLANTED][r, c] = b[PLANTED][r, c] = 0.0
    cfg = tmp_path / "m.yaml"
    cfg.write_text("merge_method: linear\nmodels:\n  - model: {a}\n    parameters: {{weight: 0.5}}\n"
                   "  - model: {b}\n    parameters: {{weight: 0.5}}\ndtype: float32\n".format(
                       a=tmp_path / "aq.safetensors", b=tmp_path / "b.safetensors"))

    def run(*args):
        code, _, err = run_ckpt(*args, "-q")
        assert code == 0, err

    save_file(a, tmp_path / "a.safetensors")
    run("convert", tmp_path / "a.safetensors", "--to", "fp8_e4m3fn", "--scaled", "-o", tmp_path / "aq.safetensors")
    save_file(b, tmp_path / "b.safetensors")
    run("merge", cfg, "-o", tmp_path / "plain0.safetensors", "--to", "fp32")
    amax, parting = _parting_values(float(load_file(tmp_path / "plain0.safetensors")[PLANTED].abs().max()) * 1.5,
                                    len(spots) - 1)
    planted = torch.cat([amax.reshape(1), parting])
    for (r, c), t in zip(spots, planted):
        b[PLANTED][r, c] = 2 * t
    save_file(b, tmp_path / "b.safetensors")

    run("merge", cfg, "-o", tmp_path / "kf.safetensors", "--keep-format")
    run("merge", cfg, "-o", tmp_path / "plain.safetensors", "--to", "fp32")
    run("convert", tmp_path / "plain.safetensors", "--to", "fp8_e4m3fn", "--scaled", "-o", tmp_path / "enc.safetensors")
    got, want, ref = (load_file(tmp_path / f) for f in ("kf.safetensors", "enc.safetensors", "aq.safetensors"))
    assert sorted(got) == sorted(want) == sorted(ref)
    for k in got:
        assert same_bytes(got[k], want[k]), k
    # the planted values are in the merge, and comfy-kitchen's per-tensor fp8 writes them one step apart
    merged = load_file(tmp_path / "plain.safetensors")[PLANTED]
    assert all(float(merged[r, c]) == float(t) for (r, c), t in zip(spots, planted))
    ck = ck_state("float8_e4m3fn", merged)
    assert same_bytes(ck["_scale"], got[PLANTED.replace("weight", "scale_weight")])
    assert one_step_apart(got[PLANTED], ck[""], 1.0) >= len(spots) - 1


# ---- kohya / musubi-tuner fp8_scaled ----------------------------------------------------------------------

def musubi_quantize(w: torch.Tensor, mode: str, block: int = 64, two_level: bool = False, dt=torch.float8_e4m3fn):
    """musubi-tuner's `quantize_weight` (modules/fp8_optimization_utils.py), restated on fp32 values: returns
    (codes, scale as stored, tensor scale or None)."""
    top = torch.finfo(dt).max
    out, inn = w.shape
    x = w.float()
    ts = None
    if mode == "tensor":
        s = torch.clamp(x.abs().max() / top, min=1e-8).reshape(1)
        total = s
    elif mode == "channel":
        s = torch.clamp(x.abs().amax(dim=1, keepdim=True) / top, min=1e-8)
        total = s
    else:
        x = x.reshape(out, inn // block, block)
        s = x.abs().amax(dim=2, keepdim=True) / top
        if two_level:
            ts = torch.clamp(s.max(), min=1e-8)
            s = torch.clamp(s / ts, min=1e-8)
            total = torch.clamp(s * ts, min=1e-8)
        else:
            s = torch.clamp(s, min=1e-8)
            total = s
    codes = torch.clamp(torch.nan_to_num(x / total), -top, top).to(dt).reshape(out, inn)
    return codes, s, ts


@pytest.mark.parametrize("mode,two_level", [("tensor", False), ("channel", False), ("block", False), ("block", True)])
def test_kohya_fp8_scaled(tmp_path, run_ckpt, mode, two_level):
    sd = {}
    for i, name in enumerate(("blocks.0.a", "blocks.1.a")):
        codes, s, ts = musubi_quantize(weight((32, 128), 20 + i).float(), mode, two_level=two_level)
        sd[f"{name}.weight"], sd[f"{name}.scale_weight"] = codes, s
        if ts is not None:
            sd[f"{name}.scale_weight_tensor"] = ts.reshape(1)
        sd[f"{name}.bias"] = torch.zeros(32)
    save_file(sd, tmp_path / "k.safetensors")
    lora = kohya_lora(tmp_path / "l.safetensors", {"blocks.0.a": (32, 128)}, seed=4)
    merged = plain_merge(run_ckpt, tmp_path / "k.safetensors", lora, tmp_path)
    code, out, err = run_ckpt("merge-lora", tmp_path / "k.safetensors", lora, "--keep-format", "-o", tmp_path / "o.safetensors",
                              "--report", tmp_path / "r.json", "-q")
    assert code == 0, err
    got = load_file(tmp_path / "o.safetensors")
    codes, s, ts = musubi_quantize(merged["blocks.0.a.weight"], mode, two_level=two_level)
    assert same_bytes(got["blocks.0.a.weight"], codes)
    assert same_bytes(got["blocks.0.a.scale_weight"], s)
    if ts is not None:
        assert same_bytes(got["blocks.0.a.scale_weight_tensor"], ts.reshape(1))
    for key in sd:
        if key.startswith("blocks.1.") or key.endswith("bias"):
            assert same_bytes(got[key], sd[key]), key
    total = got["blocks.0.a.scale_weight"] * (got["blocks.0.a.scale_weight_tensor"] if ts is not None else 1)
    dec = (got["blocks.0.a.weight"].float().reshape(32, -1, 64 if mode == "block" else 128) *
           (total if mode == "block" else total.reshape(-1, 1, 1) if mode == "channel" else total)).reshape(32, 128)
    assert reported(tmp_path / "r.json")["blocks.0.a.weight"] == pytest.approx(rel_rms(dec, merged["blocks.0.a.weight"]),
                                                                              rel=1e-9)
    assert math.isfinite(reported(tmp_path / "r.json")["blocks.0.a.weight"])


# ---- bad input ---------------------------------------------------------------------------------------------

def test_nvfp4_layer_that_cannot_be_reencoded_is_refused(tmp_path, run_ckpt):
    """An nvfp4 weight of 20 rows (not a multiple of 16, no orig_shape): decodable, not writable again."""
    sd = {f"l.weight{k}": v for k, v in ck_state("nvfp4", weight((32, 64), 0)).items()}
    sd["l.weight"] = sd["l.weight"][:20].clone()
    sd["l.comfy_quant"] = conf("nvfp4")
    save_file(sd, tmp_path / "q.safetensors")
    lora = kohya_lora(tmp_path / "l.safetensors", {"l": (20, 64)})
    before = sorted(p.name for p in tmp_path.iterdir())
    code, out, err = run_ckpt("merge-lora", tmp_path / "q.safetensors", lora, "--keep-format")
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --keep-format: l.weight (comfy_quant nvfp4) cannot be re-encoded")
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_sharded_base_keeps_its_shards_index_and_sidecars(tmp_path, run_ckpt):
    """A weight in one shard and its scale in the other: each re-encoded key stays in its own shard; the
    index, config.json (quantization_config included) and other files are as they were."""
    folder = tmp_path / "base"
    folder.mkdir()
    w = weight((32, 64), 1).float()
    s = w.abs().max() / 448
    shard1 = {"scaled_fp8": torch.empty(0, dtype=torch.float8_e4m3fn), "a.weight": (w / s).to(torch.float8_e4m3fn),
              "b.weight": weight((32, 64), 2)}
    shard2 = {"a.scale_weight": s.reshape(()), "a.bias": torch.zeros(32)}
    save_file(shard1, folder / "model-00001-of-00002.safetensors", metadata={"format": "pt"})
    save_file(shard2, folder / "model-00002-of-00002.safetensors", metadata={"format": "pt"})
    wm = {k: "model-00001-of-00002.safetensors" for k in shard1} | {k: "model-00002-of-00002.safetensors" for k in shard2}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": 0}, "weight_map": wm}))
    cfg = {"architectures": ["X"], "quantization_config": {"quant_method": "fp8"}, "torch_dtype": "bfloat16"}
    (folder / "config.json").write_text(json.dumps(cfg))
    (folder / "README.md").write_text("hi")
    lora = kohya_lora(tmp_path / "l.safetensors", {"a": (32, 64), "b": (32, 64)})
    merged = plain_merge(run_ckpt, folder, lora, tmp_path, name="plain")
    code, _, err = run_ckpt("merge-lora", folder, lora, "--keep-format", "-o", tmp_path / "out", "-q")
    assert code == 0, err
    out = tmp_path / "out"
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in folder.iterdir())
    assert json.loads((out / "model.safetensors.index.json").read_text())["weight_map"] == wm
    assert (out / "config.json").read_bytes() == (folder / "config.json").read_bytes()
    got1, got2 = load_file(out / "model-00001-of-00002.safetensors"), load_file(out / "model-00002-of-00002.safetensors")
    assert sorted(got1) == sorted(shard1) and sorted(got2) == sorted(shard2)
    want = ck_state("float8_e4m3fn", merged["a.weight"])
    assert same_bytes(got1["a.weight"], want[""]) and same_bytes(got2["a.scale_weight"], want["_scale"])
    assert same_bytes(got1["b.weight"], merged["b.weight"].to(torch.bfloat16))
    assert same_bytes(got1["scaled_fp8"], shard1["scaled_fp8"]) and same_bytes(got2["a.bias"], shard2["a.bias"])


def test_dry_run_says_what_would_be_reencoded(tmp_path, run_ckpt):
    sd = {f"l.weight{k}": v for k, v in ck_state("mxfp8", weight((32, 64), 0)).items()}
    sd["l.comfy_quant"] = conf("mxfp8")
    save_file(sd, tmp_path / "q.safetensors")
    lora = kohya_lora(tmp_path / "l.safetensors", {"l": (32, 64)})
    code, out, err = run_ckpt("merge-lora", tmp_path / "q.safetensors", lora, "--keep-format", "--dry-run")
    assert code == 0, err
    assert "re-encoded 1 changed tensor in the base's format (comfy_quant mxfp8 1)" in out
    assert "requantization error" not in out and "would write" in out
    assert not (tmp_path / "q-merged.safetensors").exists()
