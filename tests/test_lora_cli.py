"""Usage errors of every `ckpt lora` subcommand: one line `error: ...`, exit 2, nothing written (not
click's multi-line usage text); `ckpt lora` alone prints its help like `ckpt` alone."""

from __future__ import annotations

import pytest
from safetensors.torch import save_file

from lora_helpers import rnd

CASES = [
    ("extract", ["B", "T", "--rank", "0"], "--rank 0"),
    ("extract", ["B"], "Missing argument 'TUNED'"),
    ("extract", ["B", "T"], "--rank"),
    ("extract", ["B", "T", "--rank", "2", "--dynamic", "sv_fro"], "--threshold"),
    ("extract", ["B", "T", "--rank", "x"], "not a valid integer"),
    ("extract", ["B", "T", "--rank", "2", "--device", "tpu"], "--device"),
    ("resize", ["L", "--rank", "0"], "--rank 0"),
    ("resize", ["L", "--rank", "2", "--dynamic", "sv_ratio", "--threshold", "0.5"], "--threshold 0.5"),
    ("resize", [], "Missing argument 'LORA'"),
    ("merge", ["L"], "at least two"),
    ("merge", ["L", "L", "--svd", "--rank", "0"], "--rank 0"),
    ("merge", ["L", "L", "--rank", "2"], "--svd"),
    ("merge", ["L", "L", "--ratio", "1"], "--ratio given 1 time"),
    ("merge", ["L", "L", "--ratio", "x"], "not a valid float"),
    ("convert", ["L"], "Missing option '--format'"),
    ("convert", ["L", "--format", "onnx"], "--format"),
    ("convert", ["L", "--format", "kohya", "--to-lora", "0"], "--to-lora 0"),
    ("frob", [], "No such command"),
]


@pytest.mark.parametrize("command,args,says", CASES, ids=[f"{c}-{i}" for i, (c, _, _) in enumerate(CASES)])
def test_usage_errors_are_one_line_exit_2(tmp_path, run_ckpt, command, args, says):
    lora = {"lora_unet_x.lora_down.weight": rnd(2, 8), "lora_unet_x.lora_up.weight": rnd(8, 2)}
    save_file(lora, tmp_path / "L")
    save_file({"x.weight": rnd(8, 8)}, tmp_path / "B")
    save_file({"x.weight": rnd(8, 8)}, tmp_path / "T")
    before = sorted(p.name for p in tmp_path.iterdir())
    args = [str(tmp_path / a) if a in ("L", "B", "T") else a for a in args]
    code, out, err = run_ckpt("lora", command, *args, "-o", tmp_path / "out")
    assert code == 2, (out, err)
    assert err.startswith("error: ") and len(err.strip().splitlines()) == 1 and says in err, err
    assert "Usage:" not in err and "Traceback" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_lora_alone_prints_help(run_ckpt):
    code, out, err = run_ckpt("lora")
    assert code == 2 and "Usage: ckpt lora" in out + err
    for name in ("convert", "extract", "merge", "resize"):
        assert name in out + err
