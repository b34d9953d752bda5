"""Every deterministic mergekit method on Flux-keyed raw safetensors files (BFL names, fp32), the same YAML run by
`mergekit-pytorch` and `ckpt merge`; several bands per tensor (BAND_ELEMS shrunk), so every stats pass spans bands.
Tolerances: 0 where ckpt does mergekit's fp32 operations in its order; 1e-7 absolute (a few fp32 ulps at these
magnitudes) where a whole-tensor statistic is summed over bands in fp64 instead of once in fp32. Parameters are
scalars: mergekit-pytorch knows no layers (every tensor at t = 0), where ckpt numbers the Flux blocks
(tests/test_merge_blocks.py checks gradients over them)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from helpers.merge_oracle import same_yaml_raw

KEYS = {"double_blocks.0.img_attn.qkv.weight": (48, 16), "double_blocks.0.img_mlp.0.weight": (32, 16),
        "double_blocks.1.txt_attn.proj.weight": (16, 16), "single_blocks.0.linear1.weight": (80, 16),
        "single_blocks.0.norm.query_norm.scale": (8,), "img_in.weight": (16, 8), "final_layer.linear.bias": (8,)}

CASES = [  # method, global parameters, per-model parameters (base gets none), base?, tolerance
    ("task_arithmetic", "{lambda: 0.8}", "{weight: 0.5}", True, 0),
    ("ties", "{density: 0.4}", "{weight: 0.6}", True, 0),
    ("breadcrumbs", "{density: 0.6, gamma: 0.05}", "{weight: 0.5}", True, 0),
    ("breadcrumbs_ties", "{density: 0.6}", "{weight: 0.5}", True, 0),
    ("dare_linear", "{density: 1.0}", "{weight: 0.5}", True, 0),
    ("della_linear", "{density: 1.0, epsilon: 0.1}", "{weight: 0.5}", True, 0),
    ("slerp", "{t: 0.3}", None, True, 1e-7),  # a gradient differs on purpose: mergekit-pytorch has no layers (t = 0)
    ("nuslerp", "{}", "{weight: 0.5}", True, 1e-7),
    ("multislerp", "{}", "{weight: 0.5}", True, 2e-7),
    ("karcher", "{}", None, False, 0),
    ("model_stock", "{}", None, True, 1e-7),
    ("sce", "{select_topk: 0.5}", None, True, 1e-7),
    ("nearswap", "{t: 0.01}", None, True, 0),
    ("arcee_fusion", "{}", None, True, 0),
    ("ram", "{}", None, True, 0),
    ("ramplus_tl", "{}", None, True, 0),
    ("linear", "{}", "{weight: 0.3}", False, 0),
]
ONE_OTHER = {"slerp", "nearswap", "arcee_fusion"}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("flux")
    g = torch.Generator().manual_seed(0)
    base = {k: torch.randn(s, generator=g) * 0.05 for k, s in KEYS.items()}
    paths = [root / "base.safetensors"]
    save_file(base, paths[0])
    for i in (1, 2):
        p = root / f"ft{i}.safetensors"
        save_file({k: v + 0.01 * torch.randn(v.shape, generator=g) for k, v in base.items()}, p)
        paths.append(p)
    return paths


@pytest.mark.parametrize("method, params, per_model, with_base, tol", CASES, ids=[c[0] for c in CASES])
def test_method_equals_mergekit_pytorch_on_flux_keys(run_ckpt, tmp_path, files, monkeypatch, method, params,
                                                     per_model, with_base, tol):
    monkeypatch.setattr("ckpt.io.output.BAND_ELEMS", 96)
    others = files[1:2] if method in ONE_OTHER else files[1:]
    lines = [f"merge_method: {method}"] + ([f"base_model: {files[0]}"] if with_base else []) + ["models:"]
    for p in ([] if with_base else files[:1]) + others:
        lines.append(f"  - model: {p}")
        if per_model:
            lines.append(f"    parameters: {per_model}")
    lines += [f"parameters: {params}", "dtype: float32"]
    same_yaml_raw(run_ckpt, tmp_path, "\n".join(lines) + "\n", tol=tol)
