"""Every `ckpt lora` subcommand records its `ckpt_operation`, made by one `lora_*_operation` function
(`ckpt.lora.operations`), as convert, dequant and merge-lora do (tests/test_operation_strings.py): the string a
rerun reads back (`ckpt.batch.discover.made_by_ckpt`, what batch's resume compares) to tell whether an existing
output was made by the same command. Checked: what each command writes (a file or a PEFT folder) is that
function's string for the options given; options that change the output give another string; with `--format`
(the inputs converted to scratch copies first) the output still names the user's inputs."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from lora_helpers import low_rank, rnd
from ckpt.batch.discover import made_by_ckpt
from ckpt.lora import operations
from ckpt.lora.common import LoraOptions

SHAPES = {"blocks.0.mlp.fc1.weight": (32, 8), "blocks.0.mlp.fc2.weight": (8, 32)}


def _models(tmp_path):
    base = {k: rnd(*s) for k, s in SHAPES.items()}
    save_file(base, tmp_path / "base.safetensors")
    save_file({k: v + low_rank(v.shape, 3) for k, v in base.items()}, tmp_path / "tuned.safetensors")
    return tmp_path / "base.safetensors", tmp_path / "tuned.safetensors"


def _kohya(path, rank=4):
    sd = {}
    for key, (out, cols) in SHAPES.items():
        name = "lora_unet_" + key[: -len(".weight")].replace(".", "_")
        sd[f"{name}.lora_down.weight"] = rnd(rank, cols)
        sd[f"{name}.lora_up.weight"] = rnd(out, rank)
        sd[f"{name}.alpha"] = torch.tensor(rank / 2)
    save_file(sd, path)
    return path


def _recorded(run_ckpt, args, out) -> str:
    code, _, err = run_ckpt("lora", *args, "-o", out, "-q")
    assert code == 0, err
    written = made_by_ckpt(out)
    assert written
    return written


def _check(results: list[tuple[str, str]]) -> None:
    """Each output recorded its function's string, and no two different commands recorded the same one."""
    for written, want in results:
        assert written == want
    assert len({w for w, _ in results}) == len(results), results


def test_every_lora_command_has_its_operation_function():
    from ckpt.cli.lora import lora

    assert set(lora.commands) == {"extract", "resize", "merge", "convert"}
    for name in lora.commands:
        assert callable(getattr(operations, f"lora_{name}_operation"))


def test_extract_records_its_operation(tmp_path, run_ckpt):
    base, tuned = _models(tmp_path)
    runs = [([], dict(rank=4), {}),
            (["--conv-rank", 2], dict(rank=4, conv_rank=2), {}),
            (["--save-dtype", "bf16"], dict(rank=4, save_dtype="bf16"), {}),
            (["--dynamic", "sv_fro", "--threshold", 0.9999999],
             dict(rank=4, dynamic="sv_fro", threshold=0.9999999), {}),
            (["--lowrank", "--niter", 3], dict(rank=4, lowrank=True, niter=3), {}),
            (["--clamp-quantile", 0.99], dict(rank=4, clamp_quantile=0.99), {}),
            (["--min-diff", 1e-9, "--exclude", "*fc2*"], dict(rank=4), dict(min_diff=1e-9, exclude=["*fc2*"])),
            (["--format", "peft"], dict(rank=4, format="peft"), {})]
    results = []
    for i, (args, opts, extra) in enumerate(runs):
        out = tmp_path / (f"o{i}" if "peft" in args else f"o{i}.safetensors")
        written = _recorded(run_ckpt, ["extract", base, tuned, "--rank", 4, *args], out)
        results.append((written, operations.lora_extract_operation(str(base), str(tuned), LoraOptions(**opts),
                                                                    **extra)))
    _check(results)
    assert results[0][0] == "lora extract base.safetensors tuned.safetensors --rank 4"
    assert "0.9999999" in results[3][0]  # a threshold is recorded as given, not rounded to 1


def test_resize_records_its_operation_and_the_users_input_with_format(tmp_path, run_ckpt):
    lora = _kohya(tmp_path / "style.safetensors")
    base, _ = _models(tmp_path)
    runs = [(["--rank", 2], dict(rank=2), None),
            (["--rank", 3], dict(rank=3), None),
            (["--rank", 2, "--save-dtype", "fp16"], dict(rank=2, save_dtype="fp16"), None),
            (["--rank", 2, "--alpha", 3], dict(rank=2, alphas=(3.0,)), None),
            (["--rank", 2, "--format", "peft", "--base", base], dict(rank=2, format="peft"), str(base))]
    results = []
    for i, (args, opts, b) in enumerate(runs):
        out = tmp_path / (f"o{i}" if "peft" in args else f"o{i}.safetensors")
        written = _recorded(run_ckpt, ["resize", lora, *args], out)
        results.append((written, operations.lora_resize_operation(str(lora), LoraOptions(**opts), b)))
    _check(results)
    assert results[-1][0].startswith("lora resize style.safetensors --rank 2") and "--format peft" in results[-1][0]


def test_merge_records_its_operation_and_the_users_inputs_with_format(tmp_path, run_ckpt):
    a, b = _kohya(tmp_path / "a.safetensors"), _kohya(tmp_path / "b.safetensors", rank=2)
    base, _ = _models(tmp_path)
    runs = [([], [1.0, 1.0], "concat", {}, None),
            (["--ratio", 0.5, "--ratio", 1], [0.5, 1.0], "concat", {}, None),
            (["--svd", "--rank", 3], [1.0, 1.0], "svd", dict(rank=3), None),
            (["--svd", "--rank", 3, "--clamp-quantile", 0.99], [1.0, 1.0], "svd", dict(rank=3, clamp_quantile=0.99),
             None),
            (["--format", "peft", "--base", base], [1.0, 1.0], "concat", dict(format="peft"), str(base))]
    results = []
    for i, (args, ratios, mode, opts, bs) in enumerate(runs):
        out = tmp_path / (f"o{i}" if "peft" in args else f"o{i}.safetensors")
        written = _recorded(run_ckpt, ["merge", a, b, *args], out)
        results.append((written, operations.lora_merge_operation([str(a), str(b)], ratios, mode, LoraOptions(**opts),
                                                                 bs)))
    _check(results)
    assert results[1][0].startswith("lora merge a.safetensors@0.5 b.safetensors@1 --concat")
    assert "0-peft" not in results[-1][0] and "a.safetensors@1 b.safetensors@1" in results[-1][0]


def test_convert_records_its_operation(tmp_path, run_ckpt):
    lora = _kohya(tmp_path / "style.safetensors")
    base, _ = _models(tmp_path)
    runs = [(["--format", "comfy", "--base", base], dict(format="comfy"), str(base), None),
            (["--format", "kohya", "--base", base], dict(format="kohya"), str(base), None),
            (["--format", "peft", "--base", base], dict(format="peft"), str(base), None),
            (["--format", "peft", "--base", base, "--save-dtype", "bf16", "--skip-nonfinite"],
             dict(format="peft", save_dtype="bf16", skip_nonfinite=True), str(base), None),
            (["--format", "kohya", "--base", base, "--to-lora", 4], dict(format="kohya"), str(base), 4)]
    results = []
    for i, (args, opts, b, to_lora) in enumerate(runs):
        out = tmp_path / (f"o{i}" if "peft" in args else f"o{i}.safetensors")
        written = _recorded(run_ckpt, ["convert", lora, *args], out)
        results.append((written, operations.lora_convert_operation(str(lora), LoraOptions(**opts), b, to_lora)))
    _check(results)


@pytest.mark.parametrize("x", [0.5, 1.0, 1e4, 1e-7, 0.9999999, 1 / 3])
def test_numbers_are_recorded_without_losing_their_value(x):
    op = operations.lora_resize_operation("l.safetensors", LoraOptions(alphas=(x,)))
    assert float(op.rsplit(" ", 1)[1]) == x
