"""`ckpt merge --device cuda` against `--device cpu` for every merge method (skipped without a GPU).

The same YAML on the same tiny Llamas, merged in fp32 on both devices in several bands per tensor. Measured on an
H200 (torch 2.11): every method whose per-tensor statistics ckpt sums in fp64 (or has none) gives the CPU's bytes;
nuslerp and model_stock sum norms and cosines in fp32 in another order on the GPU (within 1.8e-7 of the tensor's
largest value); karcher iterates until its step is below `tol` (1e-5), so the two devices stop on slightly
different means (1.4e-5); arcee_fusion compares each element's importance (a softmax over its row) with a
quantile, so a few elements at the threshold fall the other way (10 of 41,248: each is the base's or the
fine-tune's value, as the method defines).
"""

from __future__ import annotations

import json

import pytest
import torch

from helpers.merge_oracle import tensors, variants

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

DELTA = {"weight": 1.0, "density": 0.5}
# (method, base, models with their parameters, shared parameters, tolerance: 0 = the same bytes, a float = the
# largest |cpu - cuda| / the tensor's largest value, FLIPS = the share of elements that may differ)
FLIPS = "flips"
CASES = [
    ("linear", None, {"m1": {"weight": 0.6}, "m2": {"weight": 0.4}}, None, 0),
    ("task_arithmetic", "m0", {"m1": {"weight": 1.0}, "m2": {"weight": 0.5}}, None, 0),
    ("ties", "m0", {"m1": DELTA, "m2": DELTA, "m3": DELTA}, None, 0),
    ("dare_ties", "m0", {"m1": DELTA, "m2": DELTA}, None, 0),
    ("dare_linear", "m0", {"m1": DELTA, "m2": DELTA}, None, 0),
    ("della", "m0", {"m1": {**DELTA, "epsilon": 0.1}, "m2": {**DELTA, "epsilon": 0.1}}, None, 0),
    ("della_linear", "m0", {"m1": {**DELTA, "epsilon": 0.1}, "m2": {**DELTA, "epsilon": 0.1}}, None, 0),
    ("breadcrumbs", "m0", {"m1": {**DELTA, "gamma": 0.05}, "m2": {**DELTA, "gamma": 0.05}}, None, 0),
    ("breadcrumbs_ties", "m0", {"m1": {**DELTA, "gamma": 0.05}, "m2": {**DELTA, "gamma": 0.05}}, None, 0),
    ("slerp", "m0", {"m1": {}}, {"t": 0.3}, 0),
    ("nuslerp", None, {"m1": {"weight": 0.7}, "m2": {"weight": 0.3}}, None, 1e-6),
    ("multislerp", None, {"m1": {"weight": 1.0}, "m2": {"weight": 1.0}, "m3": {"weight": 2.0}}, None, 0),
    ("karcher", None, {"m1": {}, "m2": {}, "m3": {}}, None, 1e-4),
    ("model_stock", "m0", {"m1": {}, "m2": {}, "m3": {}}, None, 1e-6),
    ("sce", "m0", {"m1": {}, "m2": {}, "m3": {}}, {"select_topk": 0.3}, 0),
    ("nearswap", "m0", {"m1": {}}, {"t": 0.004}, 0),
    ("arcee_fusion", "m0", {"m1": {}}, None, FLIPS),
    ("ram", "m0", {"m1": {}, "m2": {}}, {"epsilon": 0.005}, 0),
    ("ramplus_tl", "m0", {"m1": {}, "m2": {}}, None, 0),
]
CLASSICS = [("weighted_sum", ["m0", "m1"]), ("add_difference", ["m0", "m1", "m2"]),
            ("train_difference", ["m0", "m1", "m2"]), ("add_perpendicular", ["m0", "m1", "m2"])]
MOST_FLIPS = 1e-3  # arcee_fusion: at most this share of the elements chosen the other way


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("cuda-merge")
    return {f"m{i}": p for i, p in enumerate(variants(root, 4))}


def _yaml(method, base, per_model, shared, models) -> str:
    lines = [f"merge_method: {method}"] + ([f"base_model: {models[base]}"] if base else []) + ["models:"]
    for name, params in per_model.items():
        lines.append(f"  - model: {models[name]}")
        if params:
            lines.append(f"    parameters: {json.dumps(params)}")
    if shared:
        lines.append(f"parameters: {json.dumps(shared)}")
    return "\n".join(lines + ["dtype: float32", ""])


def _diff(a: dict, b: dict) -> tuple[int, float]:
    """(elements that differ, worst |a - b| / max |a| over the tensors): reduction-order noise moves every
    element by a few ulps of the tensor's scale, not of its own magnitude."""
    n, rel = 0, 0.0
    for k, x in a.items():
        y = b[k]
        n += int((x.view(torch.int32) != y.view(torch.int32)).sum())
        rel = max(rel, float((x - y).abs().max() / x.abs().max().clamp_min(1e-30)))
    return n, rel


def _both(run_ckpt, tmp_path, monkeypatch, text, method):
    import ckpt.io.output

    monkeypatch.setattr(ckpt.io.output, "BAND_ELEMS", 256)
    cfg = tmp_path / f"{method}.yaml"
    cfg.write_text(text)
    outs = {}
    for device in ("cpu", "cuda"):
        out = tmp_path / f"{method}-{device}"
        code, _, err = run_ckpt("merge", cfg, "-o", out, "--device", device, "-q")
        assert code == 0, (device, err)
        outs[device] = tensors(out)
    assert outs["cpu"].keys() == outs["cuda"].keys()
    n, rel = _diff(outs["cpu"], outs["cuda"])
    total = sum(t.numel() for t in outs["cpu"].values())
    print(f"CUDA-MERGE {method}: {n} of {total} elements differ, at most {rel:.3g} of the tensor's largest value")
    return n, total, rel


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_cuda_merge_matches_cpu(run_ckpt, tmp_path, monkeypatch, models, case):
    method, base, per_model, shared, tol = case
    n, total, rel = _both(run_ckpt, tmp_path, monkeypatch, _yaml(method, base, per_model, shared, models), method)
    if tol == FLIPS:
        assert n <= MOST_FLIPS * total
    else:
        assert (n == 0) if tol == 0 else (rel <= tol)


@pytest.mark.parametrize("case", CLASSICS, ids=[c[0] for c in CLASSICS])
def test_cuda_classic_merge_matches_cpu(run_ckpt, tmp_path, monkeypatch, models, case):
    method, names = case
    text = f"merge_method: {method}\nmodels: [{', '.join(str(models[n]) for n in names)}]\ndtype: float32\n"
    n, _, _ = _both(run_ckpt, tmp_path, monkeypatch, text, method)
    assert n == 0
