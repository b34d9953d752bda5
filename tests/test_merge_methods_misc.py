"""`ckpt merge` sce, model_stock, nearswap, arcee_fusion, ram and ramplus_tl against mergekit (the same YAML run
by both on tiny Llamas, `dtype: float32` so mergekit computes in fp32), streamed in many bands per tensor, and
their refusals."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from helpers.merge_oracle import same_yaml, variants
from helpers.refusals import assert_refused


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """m0 (the base) and m1..m3 with independent dense deltas; s1..s3: deltas sharing a common part, each
    present on a random half of the elements (so elements changed by no model, by one, and by several)."""
    root = tmp_path_factory.mktemp("models")
    ms = variants(root, 4)
    sd = load_file(ms[0] / "model.safetensors")
    g = torch.Generator().manual_seed(7)
    common = {k: 0.01 * torch.randn(v.shape, generator=g) for k, v in sd.items()}
    out = {f"m{i}": m for i, m in enumerate(ms)}
    for i in range(1, 4):
        d = root / f"s{i}"
        d.mkdir()
        tensors = {}
        for k, v in sd.items():
            keep = torch.rand(v.shape, generator=g) < 0.5
            delta = common[k] + 0.01 * torch.randn(v.shape, generator=g)
            tensors[k] = torch.where(keep, v + delta, v)
        save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})
        (d / "config.json").write_text((ms[0] / "config.json").read_text())
        out[f"s{i}"] = d
    return out


def _yaml(method, models, names, base="m0", params=None):
    lines = [f"merge_method: {method}", f"base_model: {models[base]}", "models:"]
    lines += [f"  - model: {models[n]}" for n in names]
    if params:
        lines.append(f"parameters: {json.dumps(params)}")
    lines.append("dtype: float32")
    return "\n".join(lines) + "\n"


@pytest.fixture
def bands(monkeypatch):
    """Small bands: `bands(n)` makes the writer (and `job.passes()`) read n elements a band."""
    import ckpt.io.output

    return lambda n: monkeypatch.setattr(ckpt.io.output, "BAND_ELEMS", n)


# The tiny models' values are below 0.125 in magnitude, where an fp32 ulp is 2**-27 (7.5e-9).
ULP = 2.0 ** -27
CASES = [
    # (id, method, models, params, band elements, tol). 256 elements: a 2-D tensor of the tiny Llama is 4 to 8
    # bands (1-D ones: one); 16: every tensor is several (a row of 32 or 64 elements is a band of its own).
    # Bitwise (tol 0): the elementwise methods, computed band by band with mergekit's own operations; ramplus_tl,
    # whose statistics are exact integer counts; arcee_fusion, whose quantiles are exact values of the same
    # importances; model_stock per row (1-D tensors excepted, below).
    ("nearswap", "nearswap", ["m1"], {"t": 0.004}, 256, 0.0),
    ("ram", "ram", ["s1", "s2", "s3"], {"epsilon": 0.005}, 256, 0.0),  # a quarter of the changes are smaller
    ("ramplus_tl", "ramplus_tl", ["s1", "s2", "s3"], {"r": 0.5, "alpha": 5}, 64, 0.0),  # rho about 3: unclamped
    ("ramplus_tl_defaults", "ramplus_tl", ["s1", "s2"], None, 256, 0.0),
    ("arcee_fusion", "arcee_fusion", ["s1"], None, 256, 0.0),
    ("arcee_fusion_dense", "arcee_fusion", ["m1"], None, 256, 0.0),
    # model_stock's cosine over a whole tensor (every tensor; the 1-D ones with filter_wise) is summed in fp64
    # across bands, mergekit's in fp32 over the tensor: t differs in its last bits, the result by 1-2 ulps.
    ("model_stock", "model_stock", ["s1", "s2", "s3"], None, 16, 4 * ULP),
    ("model_stock_filter_wise", "model_stock", ["m1", "m2"], {"filter_wise": True}, 256, 4 * ULP),
    # sce's weights are means of squares over the tensor: fp64 across bands here, fp32 in mergekit, so they
    # differ in the last bits, the result by an ulp; the variance selection itself is bitwise mergekit's.
    ("sce", "sce", ["s1", "s2", "s3"], {"select_topk": 0.3}, 256, 4 * ULP),
    ("sce_all", "sce", ["m1", "m2", "m3"], None, 256, 4 * ULP),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_equals_mergekit_in_bands(run_ckpt, tmp_path, models, bands, case):
    _, method, names, params, band, tol = case
    bands(band)
    same_yaml(run_ckpt, tmp_path, _yaml(method, models, names, params=params), tol=tol)


def test_model_stock_keeps_the_base_where_the_fine_tunes_oppose(run_ckpt, tmp_path, models, bands):
    """Two fine-tunes with opposite offsets: cos = -1, 1 + (N - 1) cos = 0, t = 0: the base, per tensor and per
    row, as mergekit's."""
    bands(256)
    sd = load_file(models["m0"] / "model.safetensors")
    ft = load_file(models["m1"] / "model.safetensors")
    d = tmp_path / "opposite"
    d.mkdir()
    save_file({k: 2 * v - ft[k] for k, v in sd.items()}, d / "model.safetensors", metadata={"format": "pt"})
    (d / "config.json").write_text((models["m0"] / "config.json").read_text())
    for filter_wise in (False, True):
        run = tmp_path / f"fw{int(filter_wise)}"
        run.mkdir()
        _, out = same_yaml(run_ckpt, run, _yaml("model_stock", dict(models, opposite=d), ["m1", "opposite"],
                                                params={"filter_wise": filter_wise}))
        assert all(torch.equal(out[k], v) for k, v in sd.items())


def _slices(models, pairs, params):
    lines = ["merge_method: nearswap", f"base_model: {models['m0']}", "slices:"]
    for (a, b), other in pairs:
        lines += ["  - sources:"] + [f"      - model: {models[m]}\n        layer_range: [{a}, {b}]"
                                     for m in ("m0",) + other]
    return "\n".join(lines + [f"parameters: {json.dumps(params)}", "dtype: float32"]) + "\n"


def test_nearswap_per_slice_each_with_its_own_model(run_ckpt, tmp_path, models):
    """Two inputs per slice (the base and one other), three in all: each slice's group is what mergekit counts."""
    same_yaml(run_ckpt, tmp_path, _slices(models, [((0, 2), ("m1",)), ((2, 4), ("m2",))], {"t": 0.004}))


def test_nearswap_refuses_a_slice_of_three(run_ckpt, tmp_path, models):
    cfg = tmp_path / "config.yaml"
    cfg.write_text(_slices(models, [((0, 2), ("m1",)), ((2, 4), ("m1", "m2"))], {"t": 0.004}))
    assert_refused(run_ckpt, tmp_path, ["merge", cfg, "-o", tmp_path / "out"], f"{cfg}: slices[1]: ",
                   "nearswap merges exactly 1 model besides the base, got 2")


REFUSED = [
    # (id, method, models, base, params, problem)
    ("no_base", "sce", ["m1", "m2"], None, None, "sce needs a base_model"),
    ("nearswap_three", "nearswap", ["m1", "m2"], "m0", {"t": 0.01},
     "nearswap merges exactly 1 model besides the base, got 2"),
    ("arcee_three", "arcee_fusion", ["m1", "m2"], "m0", None,
     "arcee_fusion merges exactly 1 model besides the base, got 2"),
    ("model_stock_one", "model_stock", ["m1"], "m0", None, "model_stock merges at least 3 models"),
    ("ram_no_base", "ram", ["m1", "m2"], None, None, "ram needs a base_model"),
    ("select_topk", "sce", ["m1", "m2"], "m0", {"select_topk": 1.5}, "select_topk must be in (0, 1], got 1.5"),
    ("nearswap_t", "nearswap", ["m1"], "m0", {"t": -0.1}, "t must be >= 0, got -0.1"),
    ("ramplus_epsilon", "ramplus_tl", ["m1", "m2"], "m0", {"epsilon": 0}, "epsilon must be > 0, got 0"),
    ("ramplus_alpha", "ramplus_tl", ["m1", "m2"], "m0", {"alpha": -1}, "alpha must be >= 0, got -1"),
    ("ram_epsilon", "ram", ["m1", "m2"], "m0", {"epsilon": -1e-5}, "epsilon must be >= 0"),
]


@pytest.mark.parametrize("case", REFUSED, ids=[c[0] for c in REFUSED])
def test_refuses_bad_inputs(run_ckpt, tmp_path, models, case):
    _, method, names, base, params, problem = case
    lines = [f"merge_method: {method}"] + ([f"base_model: {models[base]}"] if base else []) + ["models:"]
    lines += [f"  - model: {models[n]}" for n in names] + ([f"parameters: {json.dumps(params)}"] if params else [])
    cfg = tmp_path / "config.yaml"
    cfg.write_text("\n".join(lines) + "\n")
    assert_refused(run_ckpt, tmp_path, ["merge", cfg, "-o", tmp_path / "out"], f"{cfg}: ", problem)


def test_nearswap_needs_t(run_ckpt, tmp_path, models):
    cfg = tmp_path / "config.yaml"
    cfg.write_text(_yaml("nearswap", models, ["m1"]))
    assert_refused(run_ckpt, tmp_path, ["merge", cfg, "-o", tmp_path / "out"], f"{cfg}: ",
                   "nearswap needs parameter t")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_arcee_fusion_quantiles_are_sorted_values_over_bands(dtype):
    """The radix selection behind arcee_fusion's quantiles gives torch.sort's values at any positions, for signed
    scores with ties, both zeros, infinities and NaN (last, as sort puts it), read in bands of any size."""
    from ckpt.merge.methods.arcee_fusion import values_at

    g = torch.Generator().manual_seed(3)
    x = torch.randn(997, generator=g, dtype=dtype) * torch.logspace(-30, 30, 997, dtype=dtype)
    x[::7] = x[5]
    x[1::50], x[2::50], x[3], x[4], x[6] = 0.0, -0.0, float("inf"), -float("inf"), float("nan")
    ordered = torch.sort(x).values
    positions = [0, 1, 248, 498, 747, 995, 996]
    for band in (1, 37, 997):
        got = values_at(lambda: (x[a:a + band] for a in range(0, len(x), band)), positions, dtype)
        want = [ordered[p].item() for p in positions]
        assert all(a == b or (a != a and b != b) for a, b in zip(got, want)), (band, got, want)  # -0 == 0
