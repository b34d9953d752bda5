"""`ckpt merge` generalized task arithmetic (task_arithmetic, ties, dare_linear, dare_ties, della, della_linear,
breadcrumbs, breadcrumbs_ties): the deterministic methods against mergekit, the randomized ones by their
properties and determinism under --seed (and against mergekit where the randomness cancels), bad input refused.

Tolerances: 0 (bit-equal) where ckpt does mergekit's fp32 operations in mergekit's order (deltas, masks by exact
selection, weights, sign election, divisor, lambda); 1e-7 with the L1 rescale of a magnitude selection, because
ckpt sums the norms in fp64 over bands and mergekit in fp32 over the whole tensor, so the scale factors differ by
a few fp32 ulps and so do the rescaled values (|values| < 0.25, an ulp there is 1.5e-8; 3e-8 seen).
"""

from __future__ import annotations

import pytest
import torch
import yaml

from helpers.merge_oracle import max_diff, mergekit_yaml, same_yaml, tensors, variants
from helpers.refusals import assert_refused


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return variants(tmp_path_factory.mktemp("models"), 4)  # m0 base, m1..m3 fine-tunes


def _config(method, base, entries, base_listed=False, **params) -> str:
    d = {"merge_method": method}
    if base is not None:
        d["base_model"] = str(base)
    d["models"] = ([{"model": str(base)}] if base_listed else []) + [
        {"model": str(m), "parameters": p} if p else {"model": str(m)} for m, p in entries]
    if params:
        d["parameters"] = params
    d["dtype"] = "float32"
    return yaml.safe_dump(d, sort_keys=False)


def _ckpt(run_ckpt, tmp_path, text, name, *extra) -> dict:
    cfg = tmp_path / f"{name}.yaml"
    cfg.write_text(text)
    code, out, err = run_ckpt("merge", cfg, "-o", tmp_path / name, "-q", *extra)
    assert code == 0, (out, err)
    return tensors(tmp_path / name)


def _same(a: dict, b: dict) -> bool:
    return set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


# --- deterministic methods: mergekit's output ----------------------------------------------------------------------

W = [{"weight": 0.5}, {"weight": [0.2, 1.0, 0.3]}, {"weight": -0.3}]  # per model: a scalar, a gradient, a negative


def _with(extra):
    return [dict(w, **e) for w, e in zip(W, extra)]


ORACLE = {
    "task_arithmetic": ("task_arithmetic", W, True, {"lambda": 0.7}, 0.0),
    "task_arithmetic_normalized": ("task_arithmetic", W, False, {"normalize": True}, 0.0),
    "ties": ("ties", _with([{"density": 0.7}, {"density": [0.2, 0.9]}, {"density": 0.5}]), False, {}, 0.0),
    "ties_filters_unnormalized": ("ties", W, True, {"normalize": False, "lambda": 1.3, "density": [
        {"filter": "mlp", "value": 0.3}, {"value": 0.6}]}, 0.0),
    "ties_rescaled": ("ties", W, False, {"density": 0.4, "rescale": True}, 1e-7),
    # model 2's density + gamma > 1: nothing is dropped below (n_bot clamps to 0)
    "breadcrumbs": ("breadcrumbs", _with([{"gamma": 0.05}, {"density": 0.9, "gamma": 0.3}, {}]), False,
                    {"density": 0.6}, 0.0),
    "breadcrumbs_ties": ("breadcrumbs_ties", W, False, {"density": 0.3, "gamma": 0.1, "lambda": 0.5,
                                                        "normalize": True}, 0.0),
    # the randomized methods where the randomness cancels: density 1 keeps every delta (mergekit returns it as is)
    "dare_ties_dense": ("dare_ties", W, False, {"density": 1.0, "normalize": True}, 0.0),
    "della_linear_dense": ("della_linear", W, False, {"density": 1.0, "lambda": 0.8}, 0.0),
}


@pytest.mark.parametrize("case", list(ORACLE))
def test_equals_mergekit(run_ckpt, tmp_path, models, case):
    method, per_model, base_listed, params, tol = ORACLE[case]
    text = _config(method, models[0], list(zip(models[1:], per_model)), base_listed, **params)
    same_yaml(run_ckpt, tmp_path, text, tol=tol)


@pytest.mark.parametrize("method, params", [
    ("breadcrumbs_ties", {"density": 0.5, "gamma": 0.1, "rescale": True}),  # two thresholds, L1 sums over bands
    ("della", {"density": 0.5, "epsilon": 0.2}),  # masks drawn per band, ranks in rows
])
def test_several_bands_per_tensor_give_one_bands_output(run_ckpt, tmp_path, models, monkeypatch, method, params):
    import ckpt.io.output

    text = _config(method, models[0], list(zip(models[1:3], W)), **params)
    one = _ckpt(run_ckpt, tmp_path, text, "one", "--seed", "5")
    monkeypatch.setattr(ckpt.io.output, "BAND_ELEMS", 256)  # 4 to 8 bands per 2-D tensor
    assert _same(one, _ckpt(run_ckpt, tmp_path, text, "banded", "--seed", "5"))


# --- DARE and DELLA: properties ------------------------------------------------------------------------------------

def _binomial_ok(kept: int, n: int, p: float, sds: float = 5.0) -> bool:
    return abs(kept - n * p) <= sds * (n * p * (1 - p)) ** 0.5


def test_dare_keeps_density_of_each_delta_by_its_counter_based_mask(run_ckpt, tmp_path, models):
    from ckpt.merge.rng import uniform

    text = _config("dare_linear", models[0], [(models[1], {"weight": 1.0})], density=0.3, rescale=False)
    out = _ckpt(run_ckpt, tmp_path, text, "dare", "--seed", "11")
    base = tensors(models[0])
    kept = n = 0
    for k, b in base.items():
        keep = out[k] != b  # weight 1, no rescale: a kept element is the model's, a dropped one the base's
        assert torch.equal(keep.reshape(-1), uniform(11, str(models[1]), k, 0, b.numel(), "cpu") < 0.3), k
        kept, n = kept + int(keep.sum()), n + b.numel()
    assert n > 40_000 and _binomial_ok(kept, n, 0.3), (kept, n)


def _ranks(d):
    """|d|'s rank in its row along dim 1 (a 1-D tensor is one row), scaled to [0, 1]; equal ones in flat order."""
    m = d.reshape(1, -1) if d.dim() < 2 else d
    r = torch.argsort(torch.argsort(m.abs(), dim=1, stable=True), dim=1).float()
    return (r / max(1, m.shape[1] - 1)).reshape(d.shape)


def test_della_keep_probability_rises_with_magnitude_rank_in_a_row(run_ckpt, tmp_path, models):
    from ckpt.merge.rng import uniform

    text = _config("della_linear", models[0], [(models[1], {"weight": 1.0})], density=0.5, epsilon=0.4, rescale=False)
    out = _ckpt(run_ckpt, tmp_path, text, "della", "--seed", "2")
    base, ft = tensors(models[0]), tensors(models[1])
    ranks, keeps = [], []
    for k, b in base.items():
        r = _ranks(ft[k] - b).reshape(-1)
        keep = (out[k] != b).reshape(-1)
        # mergekit's keep probability (density - epsilon) + 2 epsilon r, drawn from the counter-based stream
        assert torch.equal(keep, uniform(2, str(models[1]), k, 0, b.numel(), "cpu") < (0.5 - 0.4) + r * 2 * 0.4), k
        ranks.append(r)
        keeps.append(keep)
    ranks, keeps = torch.cat(ranks), torch.cat(keeps)
    assert _binomial_ok(int(keeps.sum()), keeps.numel(), 0.5)
    fractions = []
    for q in range(4):  # keep probability 0.1 + 0.8 r: about 0.2, 0.4, 0.6, 0.8 in the rank quartiles
        sel = (ranks >= q / 4) & ((ranks < (q + 1) / 4) if q < 3 else (ranks <= 1))
        p = float((0.1 + 0.8 * ranks[sel]).mean())
        assert _binomial_ok(int(keeps[sel].sum()), int(sel.sum()), p), (q, p)
        fractions.append(float(keeps[sel].float().mean()))
    assert fractions == sorted(fractions) and fractions[3] - fractions[0] > 0.5, fractions


@pytest.mark.parametrize("method, params", [("dare_linear", {"density": 0.3}),
                                            ("della_linear", {"density": 0.4, "epsilon": 0.3})])
def test_l1_rescale_keeps_each_deltas_l1_norm(run_ckpt, tmp_path, models, method, params):
    base = tensors(models[0])
    for j in (1, 2):
        text = _config(method, models[0], [(models[j], {"weight": 1.0})], **params)  # rescale is their default
        out = _ckpt(run_ckpt, tmp_path, text, f"m{j}", "--seed", "1")
        ft = tensors(models[j])
        for k, b in base.items():
            kept, whole = float((out[k] - b).abs().double().sum()), float((ft[k] - b).abs().double().sum())
            assert (out[k] == b).any() and abs(kept - whole) <= 1e-5 * whole, (k, kept, whole)


def test_dare_ties_sign_election_is_ties_of_the_dropped_deltas(run_ckpt, tmp_path, models):
    """Each model's rescaled DARE delta alone (a dare_linear of it: base + delta) is the same inside dare_ties (the
    mask depends on seed, model and tensor only), so dare_ties equals mergekit's ties at density 1 on those.
    Tolerance 3e-8 (2 ulps at |values| < 0.25): the deltas come back from fp32 models as (base + delta) - base, a
    rounding each, which moves the sums by an ulp (1.5e-8 seen)."""
    weights = [0.5, 0.3, 0.7]
    dropped = []
    for j in (1, 2, 3):
        text = _config("dare_linear", models[0], [(models[j], {"weight": 1.0})], density=0.5)
        _ckpt(run_ckpt, tmp_path, text, f"dropped{j}", "--seed", "7")
        dropped.append(tmp_path / f"dropped{j}")
    text = _config("dare_ties", models[0], [(m, {"weight": w}) for m, w in zip(models[1:], weights)], density=0.5)
    ours = _ckpt(run_ckpt, tmp_path, text, "dare_ties", "--seed", "7")
    ref = mergekit_yaml(_config("ties", models[0], [(m, {"weight": w}) for m, w in zip(dropped, weights)],
                                density=1.0, normalize=False), tmp_path / "ties_mk")
    assert max_diff(tensors(ref), ours) <= 3e-8


def test_seed_decides_the_mask_alone(run_ckpt, tmp_path, models):
    one = [(models[1], {"weight": 1.0})]
    text = _config("dare_ties", models[0], one, density=0.5)
    a = _ckpt(run_ckpt, tmp_path, text, "a", "--seed", "3")
    assert _same(a, _ckpt(run_ckpt, tmp_path, text, "again", "--seed", "3"))
    assert not _same(a, _ckpt(run_ckpt, tmp_path, text, "other", "--seed", "4"))
    # another model in the config (weight 0: it adds nothing) leaves M1's mask, and so the output, as it was
    two = _config("dare_ties", models[0], one + [(models[2], {"weight": 0.0})], density=0.5)
    assert _same(a, _ckpt(run_ckpt, tmp_path, two, "two", "--seed", "3"))


def test_seed_defaults_to_zero_with_a_note(run_ckpt, tmp_path, models):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(_config("dare_linear", models[0], [(models[1], {"weight": 1.0})], density=0.5))
    code, out, err = run_ckpt("merge", cfg, "-o", tmp_path / "o")
    assert code == 0 and "seed 0" in out + err
    assert _same(tensors(tmp_path / "o"), _ckpt(run_ckpt, tmp_path, cfg.read_text(), "seeded", "--seed", "0"))


# --- bad input -----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("method, entry, glob, culprit, problem", [
    ("ties", {"weight": 1.0, "density": 0}, {}, "models[0].parameters.density", "must be in (0, 1]"),
    ("dare_linear", {"weight": 1.0}, {"density": 1.5}, "parameters.density", "must be in (0, 1]"),
    ("della", {"weight": 1.0, "density": 0.1}, {}, "models[0] (M1): della", "density +- epsilon must lie in (0, 1)"),
    ("della_linear", {"weight": 1.0}, {"density": 0.9, "epsilon": 0.1}, "models[0] (M1): della_linear",
     "gives keep probabilities 0.8 to 1"),
    ("ties", {"weight": 1.0, "gamma": 0.1}, {}, "models[0].parameters", "ties has no parameter 'gamma'"),
    ("task_arithmetic", {"weight": 1.0, "density": 0.5}, {}, "models[0].parameters",
     "task_arithmetic has no parameter 'density'"),
    ("ties", {"density": 0.5}, {}, "", "needs a base_model"),
])
def test_bad_config_is_refused_before_reading_models(run_ckpt, tmp_path, models, method, entry, glob, culprit,
                                                     problem):
    base = None if problem == "needs a base_model" else models[0]
    cfg = tmp_path / "c.yaml"
    cfg.write_text(_config(method, base, [(models[1], entry)], **glob))
    culprit = f"{cfg}: " + culprit.replace("M1", str(models[1]))
    assert_refused(run_ckpt, tmp_path, ["merge", cfg, "-o", tmp_path / "o"], culprit.rstrip(": "), problem)


def test_della_epsilon_from_a_gradient_is_refused_per_tensor_before_writing(run_ckpt, tmp_path, models):
    cfg = tmp_path / "c.yaml"  # density 0.5 -> 0.9 over the layers: density + 0.15 reaches 1 in the last ones
    cfg.write_text(_config("della", models[0], [(models[1], {"weight": 1.0, "density": [0.5, 0.9]})]))
    assert_refused(run_ckpt, tmp_path, ["merge", cfg, "-o", tmp_path / "o"], f"parameters ({models[1]}): della on "
                   "model.layers.3.", "gives keep probabilities 0.75 to 1.05")


def test_della_epsilon_is_checked_per_slice_source(run_ckpt, tmp_path, models):
    cfg = tmp_path / "c.yaml"
    src = [{"model": str(m), "layer_range": [0, 2], "parameters": {"weight": 1.0}} for m in models[:2]]
    src[1]["parameters"]["epsilon"] = 0.5
    cfg.write_text(yaml.safe_dump({"merge_method": "della", "base_model": str(models[0]), "dtype": "float32",
                                   "slices": [{"sources": src, "parameters": {"density": 0.6}}]}))
    assert_refused(run_ckpt, tmp_path, ["merge", cfg, "-o", tmp_path / "o"],
                   f"{cfg}: slices[0].sources[1] ({models[1]}): della", "0.1 to 1.1")
