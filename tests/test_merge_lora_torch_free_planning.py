"""merge-lora plans without torch, so the kernel copies of untouched tensors start while torch imports.

What planning used to read through torch is read from the stored bytes instead: a LoRA's alpha
(`ckpt.io.scalars.first_float`) and whether a factor is all zero (`ckpt.io.stored_scan.all_zero`). Oracle: torch
itself, doing what the old path did (`float(t.float().reshape(-1)[0])`, `x.any()`), on values chosen to hit the
edges (-0.0, subnormals, NaN, Inf, the largest finite values), F32, F16 and BF16; other dtypes are left to torch
(None). Then the command: in a fresh interpreter, with torch's import held back on its prefetch thread
(`ckpt.lazy.prefetch`) until the early copies' thread exists, merge-lora completes with the same bytes as a
run where everything goes through one stream after torch (`early_copies.ENABLED = False`).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import save_file

from ckpt.io.checkpoint import open_checkpoint
from ckpt.io.scalars import first_float
from ckpt.io.stored_scan import all_zero

EDGES = [0.0, -0.0, 1.0, -2.5, 16.0, 0.1, 1e-40, -1e-42, 6e-8, 3.4e38, 65504.0, 1e-5,
         float("inf"), float("-inf"), float("nan")]


def _stored(tmp_path, sd):
    from ckpt.quant.view import logical_view

    save_file(sd, str(tmp_path / "t.safetensors"))
    ckpt = open_checkpoint(str(tmp_path / "t.safetensors"))
    return ckpt, logical_view(ckpt.components[0]).tensors


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_first_float_is_what_torch_reads(tmp_path, dtype):
    sd = {f"a{i}": torch.tensor([v, 7.0], dtype=torch.float32).to(dtype) for i, v in enumerate(EDGES)}
    sd["scalar"] = torch.tensor(0.3, dtype=dtype)  # 0-d: an alpha as kohya stores it
    ckpt, tensors = _stored(tmp_path, sd)
    try:
        for name, x in sd.items():
            want = float(x.float().reshape(-1)[0])
            got = first_float(tensors[name])
            assert got is not None
            assert (got == want or (got != got and want != want)) and str(got) == str(want), name
    finally:
        ckpt.close()


@pytest.mark.parametrize("dtype", [torch.float64, torch.int8, torch.float8_e4m3fn])
def test_other_dtypes_are_left_to_torch(tmp_path, dtype):
    ckpt, tensors = _stored(tmp_path, {"a": torch.ones(3).to(dtype), "z": torch.zeros(3).to(dtype)})
    try:
        assert first_float(tensors["a"]) is None and all_zero(tensors["z"]) is None
    finally:
        ckpt.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_all_zero_is_what_torch_says(tmp_path, dtype):
    cases = {"zeros": torch.zeros(5, 3), "negzeros": -torch.zeros(5, 3), "empty": torch.zeros(0, 3)}
    for i, v in enumerate(EDGES):
        x = torch.zeros(5, 3)
        x[4, 2] = v
        cases[f"one{i}"] = x
    sd = {k: v.to(dtype) for k, v in cases.items()}
    ckpt, tensors = _stored(tmp_path, sd)
    try:
        for name, x in sd.items():
            assert all_zero(tensors[name]) == (not bool(x.any())), name
    finally:
        ckpt.close()


PROBE = """
import json, sys, threading
import ckpt.lazy as lazy
import ckpt.io.early_copies as early_copies

early_copies.MIN_BYTES = 4096
early_copies.ENABLED = sys.argv[1] == "early"
seen = {}
started = threading.Event()
_import, _run = lazy._import_quietly, early_copies.EarlyCopies._run


def run(self):  # the copies' thread
    started.set()
    _run(self)


def held(name):  # torch's import waits for the copies' thread: they cannot need torch to start
    if early_copies.ENABLED and started.wait(20):
        seen["copies_before_torch"] = True
    _import(name)


early_copies.EarlyCopies._run = run
lazy._import_quietly = held
from ckpt.cli import main
try:
    main(sys.argv[2:])
    code = 0
except SystemExit as e:
    code = e.code
print(json.dumps({"code": code, **seen}))
"""


def test_copies_start_before_torch_is_imported(tmp_path):
    g = torch.Generator().manual_seed(0)
    base = {"blocks.0.attn.qkv.weight": torch.randn(96, 64, generator=g).bfloat16(),
            "blocks.0.mlp.fc1.weight": torch.randn(300, 128, generator=g).bfloat16(),  # 77 kB: copied
            "blocks.0.mlp.fc2.weight": torch.randn(128, 300, generator=g).bfloat16()}
    save_file(base, str(tmp_path / "base.safetensors"))
    lora = {"lora_unet_blocks_0_attn_qkv.lora_down.weight": torch.randn(4, 64, generator=g).bfloat16(),
            "lora_unet_blocks_0_attn_qkv.lora_up.weight": torch.randn(96, 4, generator=g).bfloat16(),
            "lora_unet_blocks_0_attn_qkv.alpha": torch.tensor(3.0).bfloat16()}
    save_file(lora, str(tmp_path / "lora.safetensors"))
    outs = {}
    for mode in ("early", "stream"):
        out = tmp_path / f"{mode}.safetensors"
        p = subprocess.run([sys.executable, "-c", PROBE, mode, "merge-lora", tmp_path / "base.safetensors",
                            tmp_path / "lora.safetensors", "-o", out, "-q"], capture_output=True, text=True)
        verdict = json.loads(p.stdout.strip().splitlines()[-1])
        assert verdict["code"] == 0, p.stderr
        if mode == "early":
            assert verdict.get("copies_before_torch"), p.stderr
        outs[mode] = out.read_bytes()
    assert outs["early"] == outs["stream"]
