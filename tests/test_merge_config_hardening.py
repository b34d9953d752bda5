"""`ckpt merge` configuration input that used to read without end, hang, print megabytes, crash with a traceback or
write a model of NaN (issue #31, items 1, 2 and 10): each is refused through the CLI in one line, exit 2, nothing
written and the inputs unchanged. Where the refusal names a remedy (`normalize: false`), the remedy is run against
mergekit. Merges whose inputs already hold NaN/Inf still run and say so; NaN/Inf a merge makes from finite inputs
is refused rather than blamed on the inputs."""

from __future__ import annotations

import hashlib
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from helpers.merge_oracle import same_yaml, variants
from helpers.refusals import assert_refused


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return variants(tmp_path_factory.mktemp("models"), 3)


def _digest(paths) -> str:
    h = hashlib.sha256()
    for root in paths:
        for p in sorted(root.rglob("*")) if root.is_dir() else [root]:
            if p.is_file():
                h.update(p.name.encode() + p.read_bytes())
    return h.hexdigest()


@pytest.fixture
def unchanged(models):
    """The models are byte for byte what they were after the test."""
    before = _digest(models)
    yield
    assert _digest(models) == before


def _cfg(tmp_path, text, name="c.yaml"):
    p = tmp_path / name
    p.write_text(text)
    return p


def _refused(run_ckpt, tmp_path, cfg, culprit, problem):
    small = cfg.is_file() and not cfg.is_symlink() and cfg.stat().st_size < (1 << 20)
    text = cfg.read_bytes() if small else None
    assert_refused(run_ckpt, tmp_path, ["merge", cfg, "-o", tmp_path / "out"], culprit, problem)
    if text is not None:
        assert cfg.read_bytes() == text


def _linear(models, w0="1", w1="1", extra=""):
    return (f"merge_method: linear\nmodels:\n  - model: {models[0]}\n    parameters: {{weight: {w0}}}\n"
            f"  - model: {models[1]}\n    parameters: {{weight: {w1}}}\n{extra}")


# 1. a config that is no regular file, or too large a one, is refused before a byte is read --------------------------


def test_a_config_that_is_a_device_a_fifo_or_huge_is_refused_before_reading(run_ckpt, tmp_path, unchanged):
    urandom = tmp_path / "c.yaml"
    urandom.symlink_to("/dev/urandom")
    _refused(run_ckpt, tmp_path, urandom, str(urandom), "is a character device, not a file ckpt can read")
    urandom.unlink()
    fifo = tmp_path / "f.yaml"
    os.mkfifo(fifo)
    _refused(run_ckpt, tmp_path, fifo, str(fifo), "is a FIFO (named pipe)")
    fifo.unlink()
    big = tmp_path / "big.yaml"
    with open(big, "wb") as f:  # 50 MB that reads as zeros: refused on its size alone
        f.truncate(50 << 20)
    _refused(run_ckpt, tmp_path, big, str(big), "50.0 MiB is more than such a file can be (at most 4 MiB)")


# 2. weights that sum to 0 and are divided by their sum ---------------------------------------------------------------


def test_linear_weights_that_sum_to_zero_are_refused_with_the_remedy(run_ckpt, tmp_path, models, unchanged):
    cfg = _cfg(tmp_path, _linear(models, "0", "0"))
    _refused(run_ckpt, tmp_path, cfg, str(cfg), "linear's weights sum to 0 for")
    assert "normalize: false" in run_ckpt("merge", cfg, "-o", tmp_path / "out")[2]
    # on the command line, --weight 1,-1 with the default normalize
    assert_refused(run_ckpt, tmp_path, ["merge", models[0], models[1], "--method", "linear", "--weight", "1,-1",
                                        "-o", tmp_path / "out"], "merge: linear's weights sum to 0", "normalize")
    # only where a filter makes them cancel: the tensor is named
    cfg = _cfg(tmp_path, _linear(models, "[{filter: mlp, value: -1}, {value: 1}]", "1"))
    _refused(run_ckpt, tmp_path, cfg, str(cfg), "linear's weights sum to 0 for model.layers.0.mlp.")


def test_the_remedy_normalize_false_equals_mergekit(run_ckpt, tmp_path, models):
    same_yaml(run_ckpt, tmp_path, _linear(models, "1", "-1", "parameters: {normalize: false}\ndtype: float32\n"))


def test_multislerp_weights_that_sum_to_zero_are_refused_before_anything_is_written(run_ckpt, tmp_path, models,
                                                                                   unchanged):
    cfg = _cfg(tmp_path, f"merge_method: multislerp\nmodels:\n  - model: {models[1]}\n    parameters: {{weight: 1}}\n"
                         f"  - model: {models[2]}\n    parameters: {{weight: -1}}\n")
    _refused(run_ckpt, tmp_path, cfg, str(cfg), "multislerp's weights sum to 0 for")
    assert_refused(run_ckpt, tmp_path, ["merge", models[1], models[2], "--method", "multislerp", "--weight", "1,-1",
                                        "--param", "eps=0", "-o", tmp_path / "out"], "merge: parameters.eps",
                   "eps must be > 0, got 0")


# 10. YAML that expands without bound, values of the wrong type or range, models that are no file ----------------------


def _bomb(models, levels=9) -> str:
    lines = ["merge_method: linear", "l0: &l0 [1, 1, 1, 1, 1, 1, 1, 1, 1, 1]"]
    lines += [f"l{i}: &l{i} [" + ", ".join([f"*l{i - 1}"] * 10) + "]" for i in range(1, levels)]
    return "\n".join(lines) + f"\nmodels:\n  - model: {models[0]}\n    parameters: {{weight: *l{levels - 1}}}\n"


VALUE_CASES = [
    ("alias-bomb", lambda m: _bomb(m), "", "holds more than 100,000 values once its aliases are expanded"),
    ("alias-text", lambda m: "merge_method: linear\ns: &s " + "x" * 3_000_000 + "\n" + _linear(
        m, "[{filter: *s, value: 1}, {filter: *s, value: 1}]", "1").split("\n", 1)[1],
     "", "holds more than 4 MiB of text once its aliases are expanded"),
    ("alias-self", lambda m: f"merge_method: linear\nmodels: &m\n  - model: {m[0]}\n    parameters: {{weight: *m}}\n",
     "", "the alias *m is inside the node it names"),
    ("deep-lists", lambda m: _linear(m, "[" * 1000 + "1" + "]" * 1000), "", "nested more than 32 levels deep"),
    ("deep-maps", lambda m: _linear(m, "{a: " * 1000 + "1" + "}" * 1000), "", "nested more than 32 levels deep"),
    ("nul", lambda m: _linear(m).replace(f"model: {m[0]}", f'model: "{m[0]}\\0x"'), "models[0]",
     "a model's path or hub id holds no control characters"),
    ("newline", lambda m: _linear(m).replace(f"model: {m[0]}", f'model: "{m[0]}\\nx"'), "models[0]",
     "holds no control characters"),
    ("no-user", lambda m: _linear(m).replace(f"model: {m[0]}", "model: ~nosuchuser/m"), "models[0]",
     "'nosuchuser' is no user of this machine"),
    ("weight-true", lambda m: _linear(m, "true"), "models[0].parameters.weight", "weight is a number, not true"),
    ("weight-1e39", lambda m: _linear(m, "1.0e+39"), "models[0].parameters.weight",
     "weight must be in [-1e+06, 1e+06], got 1e+39"),
    ("weight-nan", lambda m: _linear(m, ".nan"), "models[0].parameters.weight", "weight must be a finite number"),
    ("weight-huge-int", lambda m: _linear(m, "1" + "0" * 400), "models[0].parameters.weight",
     "weight must be in [-1e+06, 1e+06], got 1000000000"),
    ("weight-digits", lambda m: _linear(m, "9" * 5000), "", "not valid YAML (a value it cannot hold"),
    ("control-character", lambda m: _linear(m, "1\x18"), "", "not valid YAML (character #x0018 at position"),
    ("weight-date", lambda m: _linear(m, "2001-02-30"), "", "not valid YAML (a value it cannot hold"),
    ("weight-long-list", lambda m: _linear(m, "['1', " + ", ".join(["1"] * 10_000) + "]"),
     "models[0].parameters.weight", "a gradient of numbers, got ['1', 1, 1, 1, ... (10,001 entries)]"),
    ("lambda-1e7", lambda m: f"merge_method: task_arithmetic\nbase_model: {m[0]}\nmodels:\n  - model: {m[1]}\n"
                             "    parameters: {weight: 1}\nparameters: {lambda: 1.0e+7}\n",
     "parameters.lambda", "lambda must be in [-1e+06, 1e+06]"),
    ("karcher-endless", lambda m: f"merge_method: karcher\nmodels:\n  - model: {m[0]}\n  - model: {m[1]}\n"
                                  "parameters: {max_iter: 1000000000000, tol: 0}\n",
     "parameters.max_iter", "max_iter must be in [0, 1000], got 1000000000000"),
    ("karcher-huge-int", lambda m: f"merge_method: karcher\nmodels:\n  - model: {m[0]}\n  - model: {m[1]}\n"
                                   f"parameters: {{max_iter: 1{'0' * 400}}}\n",
     "parameters.max_iter", "max_iter must be in [0, 1000], got 1000000000"),
    ("layer-range", lambda m: f"merge_method: passthrough\nslices:\n  - sources:\n      - model: {m[0]}\n"
                              "        layer_range: [0, 1000000000000]\n", "slices[0].sources[0]",
     "0 <= START < END <= 10,000"),
]


@pytest.mark.parametrize("name, text, culprit, problem", VALUE_CASES, ids=[c[0] for c in VALUE_CASES])
def test_config_values_are_checked_in_one_short_line(run_ckpt, tmp_path, models, unchanged, name, text, culprit,
                                                    problem):
    cfg = _cfg(tmp_path, text(models))
    _refused(run_ckpt, tmp_path, cfg, f"{cfg}: {culprit}".rstrip(), problem)
    assert len(run_ckpt("merge", cfg, "-o", tmp_path / "out")[2]) < 400


@pytest.mark.parametrize("kind", ["fifo", "/dev/zero", "link-to-/dev/zero", "fifo-as-lora"])
def test_a_model_that_is_a_fifo_or_a_device_is_refused(run_ckpt, tmp_path, models, unchanged, kind):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    link = tmp_path / "zero"
    link.symlink_to("/dev/zero")
    spec, what = {"fifo": (fifo, "is a FIFO (named pipe)"), "/dev/zero": ("/dev/zero", "is a character device"),
                  "link-to-/dev/zero": (link, "is a character device"),
                  "fifo-as-lora": (f"{models[0]}+{fifo}", "is a FIFO (named pipe)")}[kind]
    cfg = _cfg(tmp_path, _linear(models).replace(f"model: {models[0]}", f"model: {spec}"))
    _refused(run_ckpt, tmp_path, cfg, f"{cfg}: models[0]:", what)
    assert_refused(run_ckpt, tmp_path, ["merge", str(spec), models[1], "-o", tmp_path / "out"], "merge: models[0]:",
                   what)


FLAG_CASES = [
    (["--method", "linear", "--weight", "1e39,1"], "merge: models[0].parameters.weight", "in [-1e+06, 1e+06]"),
    (["--method", "linear", "--weight", "true,1"], "merge: models[0].parameters.weight", "is a number, not true"),
    (["--method", "linear", "--weight", "nan,1"], "merge: models[0].parameters.weight", "must be a finite number"),
    (["--alpha", "inf"], "merge: parameters.alpha", "must be a finite number"),
    (["--alpha", "2e6"], "merge: parameters.alpha", "alpha must be in [-1e+06, 1e+06], got 2000000.0"),
    (["--method", "karcher", "--param", "max_iter=1e12", "--param", "tol=0"], "merge: parameters.max_iter",
     "max_iter must be in [0, 1000]"),
    (["--method", "linear", "--weight", "1," * 5000 + "1"], "--weight 1,1,1", "give one value or one per model"),
    (["--seed", "9" * 5000], "--seed 9999", "a whole number from -2**63 to 2**64 - 1"),
]


@pytest.mark.parametrize("args, culprit, problem", FLAG_CASES,
                         ids=["weight-1e39", "weight-true", "weight-nan", "alpha-inf", "alpha-2e6", "karcher-endless",
                              "5001-weights", "seed-5000-digits"])
def test_flags_go_through_the_same_checks(run_ckpt, tmp_path, models, unchanged, args, culprit, problem):
    assert_refused(run_ckpt, tmp_path, ["merge", models[0], models[1], *args, "-o", tmp_path / "out"], culprit,
                   problem)
    assert len(run_ckpt("merge", models[0], models[1], *args, "-o", tmp_path / "out")[2]) < 400


# NaN/Inf: blamed on the inputs only where they were in them ----------------------------------------------------------


def _pair(tmp_path, a, b):
    paths = []
    for name, v in (("a", a), ("b", b)):
        p = tmp_path / f"{name}.safetensors"
        save_file({"x.weight": v.clone(), "y.weight": torch.ones(4, 4)}, p)
        paths.append(p)
    return paths


def test_nan_made_from_finite_inputs_is_refused(run_ckpt, tmp_path):
    big = torch.full((4, 4), 3.0e38)
    a, b = _pair(tmp_path, big, big)  # finite, but their sum is not in fp32
    cfg = _cfg(tmp_path, _linear([a, b], extra="parameters: {normalize: false}\n"))
    _refused(run_ckpt, tmp_path, cfg, str(cfg), "linear made 16 NaN/Inf values in x.weight from finite inputs")
    assert torch.equal(load_file(a)["x.weight"], big)


def test_nan_already_in_an_input_is_merged_and_said(run_ckpt, tmp_path):
    x = torch.ones(4, 4)
    x[1, 2] = float("nan")
    a, b = _pair(tmp_path, x, torch.ones(4, 4))
    code, out, err = run_ckpt("merge", a, b, "--alpha", "0.5", "-o", tmp_path / "out.safetensors")
    assert code == 0, err
    assert "1 NaN/Inf value was already in the input" in out + err
    merged = load_file(tmp_path / "out.safetensors")["x.weight"]
    assert torch.isnan(merged[1, 2]) and int(torch.isnan(merged).sum()) == 1  # torch.lerp, as sd-mecha computes it


def test_the_zero_sum_check_is_torchs_sum_decided_without_torch_where_sure():
    """`sums_to_zero` (planning, before torch is imported) against what the merge divides by, `weight_sum` (a torch
    tensor of the compute dtype, summed): equal on weights that cancel exactly, cancel only after rounding to fp32,
    cancel in one summing order but not another, overflow fp32, are NaN or inf, and on seeded random ones."""
    import random

    import torch

    from ckpt.merge.methods.linear import sums_to_zero, weight_sum

    cases = [[0, 0], [1, -1], [0.5, -0.25, -0.25], [1e20, 1, -1e20], [1, 1e20, -1e20], [0.1, 0.2, -0.3],
             [1e-30, -1e-30], [3.4e38, 3.4e38, -3.4e38, -3.4e38], [1e39, -1e39], [float("nan"), 1],
             [float("inf"), -float("inf")], [1 + 2 ** -30, -1], [1 + 2 ** -60, -1], [2 ** -149, -(2 ** -149)],
             [1e-46, 0], [0.3, 0.7], [-0.0, 0.0]]
    rng = random.Random(5)
    for _ in range(300):
        n = rng.randint(1, 6)
        ws = [rng.choice([rng.uniform(-2, 2), rng.choice([-1, 1]) * 10.0 ** rng.randint(-40, 40), 0.0])
              for _ in range(n - 1)]
        cases.append(ws + [-sum(ws) * rng.choice([1, 1, 1 + 1e-9])])
    for dtype in (torch.float32, torch.float64, "F32", "F64", torch.bfloat16, "F16"):
        for ws in cases:
            assert sums_to_zero(ws, dtype) == bool(weight_sum(ws, dtype) == 0), (dtype, ws)
