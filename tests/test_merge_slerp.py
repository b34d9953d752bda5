"""`ckpt merge` slerp, nuslerp, multislerp and karcher against mergekit (the same YAML run by both, every tensor
compared), their edge cases (colinear, antipodal, zero tensors), the statistics pass across many bands, and the
configurations they refuse.

Tolerances (absolute; merged values stay below about 0.3, where an fp32 ulp is at most 3e-8):
- slerp, nuslerp: 1e-7. The angle comes from whole-tensor (or whole-column) sums that ckpt accumulates in fp64
  over its bands and mergekit in the compute dtype over its chunks, so cos(theta) differs by fp32 rounding and
  the coefficients by a few ulp. nuslerp's row vectors (`nuslerp_flatten: false`) are computed band by band with
  mergekit's own operations: those tensors agree bit for bit (checked).
- multislerp: 2e-7. The norms, the mean's norm and the dots are fp64 sums over bands (mergekit: fp32 reductions);
  with `normalize_weights: false` the result is scaled by the unnormalized weights (up to ~2x).
- karcher: 0. It is kind "whole": the same tensor operations in the same order on the whole tensor.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from helpers.merge_oracle import same_yaml, variants
from helpers.refusals import assert_refused

TOL_SLERP = 1e-7
TOL_MULTI = 2e-7


@pytest.fixture(scope="module")
def ms(tmp_path_factory):
    """m0 (the base) and fine-tunes m1..m3: tiny GQA Llamas (4 heads, 2 KV heads) with an lm_head."""
    return variants(tmp_path_factory.mktemp("models"), 4)


@pytest.fixture(scope="module")
def tied(tmp_path_factory):
    """The same with tied embeddings (no lm_head)."""
    return variants(tmp_path_factory.mktemp("tied"), 3, tied=True)


@pytest.fixture(scope="module")
def edge(ms, tmp_path_factory):
    """Models made from m0 and m1 for the edge cases: `double` = 2 m0 (colinear with m0), `neg` = -m0, `zero` and
    `zero2` = 0 (no direction); `r0` (m0 on a grid of 2^-12) with `rplus`/`rminus` = r0 +- d (d = m1 - m0 on a
    grid of 2^-16), whose task vectors are exactly antipodal, and `rcopy` = r0 (a zero task vector)."""
    root = tmp_path_factory.mktemp("edge")
    m0, m1 = load_file(ms[0] / "model.safetensors"), load_file(ms[1] / "model.safetensors")
    cfg = (ms[0] / "config.json").read_text()
    r0 = {k: torch.round(v * 2**12) / 2**12 for k, v in m0.items()}
    dd = {k: torch.round((m1[k] - v) * 2**16) / 2**16 for k, v in m0.items()}
    made = {"double": {k: 2 * v for k, v in m0.items()}, "neg": {k: -v for k, v in m0.items()},
            "zero": {k: torch.zeros_like(v) for k, v in m0.items()},
            "zero2": {k: torch.zeros_like(v) for k, v in m0.items()}, "r0": r0, "rcopy": dict(r0),
            "rplus": {k: v + dd[k] for k, v in r0.items()}, "rminus": {k: v - dd[k] for k, v in r0.items()}}
    out = {}
    for name, sd in made.items():
        d = root / name
        d.mkdir()
        save_file(sd, d / "model.safetensors", metadata={"format": "pt"})
        (d / "config.json").write_text(cfg)
        out[name] = d
    return out


@pytest.fixture
def small_bands(monkeypatch):
    """64 elements per band (a [32, 32] projection is 16 bands, the [64, 32] embedding 32); counts the bands of
    every statistics pass, so a test can check it really passed over several."""
    import ckpt.merge.tensor as mt

    monkeypatch.setattr("ckpt.io.output.BAND_ELEMS", 64)
    seen = []
    real = mt.row_bands

    def counting(*a, **kw):
        bands = list(real(*a, **kw))
        seen.append(len(bands))
        return iter(bands)

    monkeypatch.setattr(mt, "row_bands", counting)
    return seen


def model_list(*entries) -> str:
    out = []
    for m, params in entries:
        out.append(f"  - model: {m}" + (f"\n    parameters: {params}" if params else ""))
    return "\n".join(out)


# slerp ------------------------------------------------------------------------------------------------------------


def test_slerp_gradient_and_filters_equal_mergekit(run_ckpt, tmp_path, ms, small_bands):
    # many bands per tensor (the other slerp tests run at the default band size: one band per tensor)
    # the base listed second: ckpt's inputs keep the listed order (base index 1), mergekit puts the base first
    same_yaml(run_ckpt, tmp_path, f"""merge_method: slerp
base_model: {ms[0]}
models:
{model_list((ms[1], None), (ms[0], None))}
parameters:
  t:
    - filter: self_attn
      value: [0, 0.5, 1]
    - filter: mlp
      value: 0.3
    - value: [0.9, 0.2]
dtype: float32
""", tol=TOL_SLERP)
    assert max(small_bands) >= 16, small_bands  # the stats pass ran over many bands


def test_slerp_tied_embeddings_base_not_listed(run_ckpt, tmp_path, tied):
    same_yaml(run_ckpt, tmp_path, f"""merge_method: slerp
base_model: {tied[0]}
models:
  - model: {tied[2]}
parameters:
  t: [0, 0.5, 1]
dtype: float32
""", tol=TOL_SLERP)


def test_slerp_colinear_antipodal_and_zero_tensors(run_ckpt, tmp_path, ms, edge):
    # 2 m0 is colinear with m0 and -m0 antipodal (|cos| > 0.9995: linear interpolation); a zero base has norm 0
    # (taken as 1): cos 0, theta pi/2
    outs = []
    for i, (base, other) in enumerate(((ms[0], edge["double"]), (ms[0], edge["neg"]), (edge["zero"], ms[1]))):
        d = tmp_path / str(i)
        d.mkdir()
        outs.append(same_yaml(run_ckpt, d, f"""merge_method: slerp
base_model: {base}
models:
  - model: {base}
  - model: {other}
parameters:
  t: 0.3
dtype: float32
""", tol=TOL_SLERP)[1])
    m0, m1 = load_file(ms[0] / "model.safetensors"), load_file(ms[1] / "model.safetensors")
    name = "model.layers.1.mlp.up_proj.weight"
    assert torch.allclose(outs[0][name], 1.3 * m0[name], rtol=1e-6, atol=0)  # (1 - t) m0 + t (2 m0)
    assert torch.allclose(outs[1][name], 0.4 * m0[name], rtol=1e-6, atol=0)  # (1 - t) m0 + t (-m0)
    assert torch.allclose(outs[2][name], torch.sin(torch.tensor(0.3 * torch.pi / 2)) * m1[name], rtol=1e-6, atol=0)


def test_slerp_slices_with_a_model_per_slice(run_ckpt, tmp_path, ms):
    # three models in all, two per slice (the base and one other): counted per slice, as mergekit counts them
    same_yaml(run_ckpt, tmp_path, f"""merge_method: slerp
base_model: {ms[0]}
slices:
  - sources:
      - model: {ms[0]}
        layer_range: [0, 2]
      - model: {ms[1]}
        layer_range: [0, 2]
  - sources:
      - model: {ms[0]}
        layer_range: [2, 4]
      - model: {ms[2]}
        layer_range: [1, 3]
parameters:
  t:
    - filter: self_attn
      value: [0, 0.5, 1]
    - value: 0.4
dtype: float32
""", tol=TOL_SLERP)


def test_slerp_extrapolates_past_one(run_ckpt, tmp_path, ms):
    same_yaml(run_ckpt, tmp_path, f"""merge_method: slerp
base_model: {ms[0]}
models:
  - model: {ms[2]}
parameters:
  t: [-0.5, 1.5]
dtype: float32
""", tol=TOL_SLERP)


# nuslerp ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("flatten,row_wise,with_base",
                         [(True, False, True), (False, False, False), (False, True, True)])
def test_nuslerp_equals_mergekit(run_ckpt, tmp_path, ms, small_bands, flatten, row_wise, with_base):
    a, b = same_yaml(run_ckpt, tmp_path, f"""merge_method: nuslerp
{f"base_model: {ms[0]}" if with_base else ""}
models:
{model_list((ms[1], "{weight: [0.2, 1.0, 0.5]}"),
            (ms[2], "{weight: [{filter: mlp, value: 0.9}, {value: 0.4}]}"))}
parameters:
  nuslerp_flatten: {str(flatten).lower()}
  nuslerp_row_wise: {str(row_wise).lower()}
dtype: float32
""", tol=TOL_SLERP)
    if not flatten and not row_wise:  # rows along the last dimension: band by band, mergekit's own operations
        assert all(torch.equal(a[k], b[k]) for k in a if a[k].dim() == 2)
    if flatten or row_wise:
        assert max(small_bands) >= 16, small_bands


def test_nuslerp_tied_zero_weights_and_colinear(run_ckpt, tmp_path, tied, ms, edge):
    # weights summing to 0: t = 0.5
    same_yaml(run_ckpt, tmp_path, f"""merge_method: nuslerp
models:
{model_list((tied[1], "{weight: 0.5}"), (tied[2], "{weight: -0.5}"))}
dtype: float32
""", tol=TOL_SLERP)
    # no base, m0 and 2 m0: colinear up to rounding (cos within an ulp of 1: linear interpolation, or slerp over an
    # angle of ~3e-4, which differs from it by ~1e-8 relative)
    d = tmp_path / "colinear"
    d.mkdir()
    same_yaml(run_ckpt, d, f"""merge_method: nuslerp
models:
{model_list((ms[0], "{weight: 0.3}"), (edge["double"], "{weight: 0.7}"))}
parameters:
  nuslerp_flatten: false
dtype: float32
""", tol=TOL_SLERP)


# multislerp -------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("with_base,normalize", [(True, True), (False, False)])
def test_multislerp_equals_mergekit(run_ckpt, tmp_path, ms, small_bands, with_base, normalize):
    same_yaml(run_ckpt, tmp_path, f"""merge_method: multislerp
{f"base_model: {ms[0]}" if with_base else ""}
models:
{model_list((ms[1], "{weight: [0.2, 1.0, 0.5]}"), (ms[2], "{weight: 0.6}"),
            (ms[3], "{weight: [{filter: self_attn, value: 0.9}, {value: 0.3}]}"))}
parameters:
  normalize_weights: {str(normalize).lower()}
dtype: float32
""", tol=TOL_MULTI)
    assert max(small_bands) >= 16, small_bands


def test_multislerp_edge_cases_equal_mergekit(run_ckpt, tmp_path, ms, tied, edge):
    cases = {
        # one model besides the base: that model, as it is
        "single": f"base_model: {tied[0]}\nmodels:\n{model_list((tied[1], '{weight: 0.4}'))}\n"
                  "parameters:\n  eps: 1.0e-6",
        # two antipodal task vectors of equal weight: the mean has no direction, linear interpolation
        "antipodal": f"base_model: {edge['r0']}\nmodels:\n"
                     f"{model_list((edge['rplus'], '{weight: 1.0}'), (edge['rminus'], '{weight: 1.0}'))}",
        # a zero task vector (r0 - r0) among others
        "zero": f"base_model: {edge['r0']}\nmodels:\n"
                + model_list((edge['rplus'], '{weight: 1.0}'), (edge['rcopy'], '{weight: 2.0}'),
                             (ms[2], '{weight: 1.0}')),
    }
    for name, body in cases.items():
        d = tmp_path / name
        d.mkdir()
        same_yaml(run_ckpt, d, f"merge_method: multislerp\n{body}\ndtype: float32\n", tol=TOL_MULTI)


# karcher ----------------------------------------------------------------------------------------------------------


def test_karcher_equals_mergekit(run_ckpt, tmp_path, ms, tied, edge):
    cases = {
        # the base is one more model (mergekit ignores its role)
        "base": f"base_model: {ms[0]}\nmodels:\n{model_list((ms[1], None), (ms[2], None), (ms[3], None))}",
        "params": f"models:\n{model_list((tied[1], None), (tied[2], None))}\nparameters:\n  max_iter: "
                  f"[{{filter: mlp, value: 1}}, {{value: 30}}]\n  tol: 1.0e-7",
        # a zero model has no direction (left out of the mean, counted in the norm); 2 m0 has m0's direction
        "edge": f"models:\n{model_list((ms[0], None), (edge['double'], None), (edge['zero'], None))}",
        "all_zero": f"models:\n{model_list((edge['zero'], None), (edge['zero2'], None))}",
    }
    for name, body in cases.items():
        d = tmp_path / name
        d.mkdir()
        same_yaml(run_ckpt, d, f"merge_method: karcher\n{body}\ndtype: float32\n", tol=0.0)


# refusals ---------------------------------------------------------------------------------------------------------


def test_refused_configurations(run_ckpt, tmp_path, ms, edge):
    cases = [
        ("slerp-no-base", f"merge_method: slerp\nmodels:\n{model_list((ms[0], None), (ms[1], None))}\n"
                          "parameters: {t: 0.5}", "needs a base_model"),
        ("slerp-three", f"merge_method: slerp\nbase_model: {ms[0]}\nmodels:\n"
                        f"{model_list((ms[1], None), (ms[2], None))}\nparameters: {{t: 0.5}}", "exactly 2 models"),
        ("slerp-no-t", f"merge_method: slerp\nbase_model: {ms[0]}\nmodels:\n{model_list((ms[1], None))}",
         "slerp needs parameter t"),
        ("slerp-slice-three", f"""merge_method: slerp
base_model: {ms[0]}
slices:
  - sources:
      - model: {ms[1]}
        layer_range: [0, 4]
      - model: {ms[2]}
        layer_range: [0, 4]
parameters: {{t: 0.5}}""", "slices[0]: slerp merges exactly 2 models"),
        ("nuslerp-three", f"merge_method: nuslerp\nmodels:\n"
                          f"{model_list((ms[1], '{weight: 1}'), (ms[2], '{weight: 1}'), (ms[3], '{weight: 1}'))}",
         "exactly 2 models besides the base"),
        ("nuslerp-one", f"merge_method: nuslerp\nbase_model: {ms[0]}\nmodels:\n{model_list((ms[1], '{weight: 1}'))}",
         "exactly 2 models besides the base"),
        ("nuslerp-no-weight", f"merge_method: nuslerp\nmodels:\n{model_list((ms[1], '{weight: 1}'), (ms[2], None))}",
         "nuslerp needs parameter weight for"),
        ("multislerp-base-only", f"merge_method: multislerp\nbase_model: {ms[0]}\nmodels:\n{model_list((ms[0], None))}",
         "at least 1 model besides the base, got 0"),
        ("karcher-tol", f"merge_method: karcher\nmodels:\n{model_list((ms[1], None), (ms[2], None))}\n"
                        "parameters: {tol: -1.0e-5}", "tol must be >= 0"),
        # three task vectors whose weighted directions cancel (d, -d, 0): no direction (mergekit: ValueError)
        ("multislerp-antipodal", f"merge_method: multislerp\nbase_model: {edge['r0']}\nmodels:\n"
                                 + model_list((edge['rplus'], '{weight: 1}'), (edge['rminus'], '{weight: 1}'),
                                              (edge['rcopy'], '{weight: 1}')),
         "", "weighted mean of the models' directions is zero"),
        ("multislerp-weights-zero", f"merge_method: multislerp\nmodels:\n"
                                    f"{model_list((ms[1], '{weight: 1}'), (ms[2], '{weight: -1}'))}",
         "", "weights sum to 0"),
    ]
    for name, body, *culprit, problem in cases:
        cfg = tmp_path / f"{name}.yaml"
        cfg.write_text(body + "\ndtype: float32\n")
        culprit = culprit[0] if culprit else str(cfg)
        assert_refused(run_ckpt, tmp_path, ("merge", cfg, "-o", tmp_path / "out"), culprit, problem)


def test_flags_refuse_slerp_without_base(run_ckpt, tmp_path, ms):
    assert_refused(run_ckpt, tmp_path, ("merge", ms[0], ms[1], "--method", "slerp", "--param", "t=0.5", "-o",
                                        tmp_path / "out"), "", "slerp needs a base_model")
