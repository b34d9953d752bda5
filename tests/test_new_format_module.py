"""A quantized format is one module (issue 32): dropping a module that declares `FORMAT` into `ckpt.quant`'s path
makes every command read it: `dequant` decodes it, `inspect` names it with its settings, `convert` and
`merge-lora` take it as input, and its leftover keys are refused by its own declaration. Run in a fresh
interpreter with the fake module's folder added to the package's path, as the targets test does
(tests/test_convert_targets.py)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

FAKE = '''
"""A test's format: int8 codes `X.weight_q8` and one fp32 step `X.weight_step`; W = codes * step."""
import re

from ckpt.lazy import torch

from ckpt.io.wrapper import Wrapper
from ckpt.quant.common import Decoded
from ckpt.quant.formats import Format


class StepTensor(Wrapper):
    def __init__(self, codes, step, name):
        self.base, self.step, self.name, self.home = codes, step, name, codes.home
        self.shape, self.row_align = tuple(codes.shape), codes.row_align
        self.dtype, self.natural = torch.float32, torch.float16

    def read(self, start, stop, device, scratch=None):
        return self.base.read(start, stop, device).to(torch.float32) * self.step.read_all(device).to(torch.float32)


def decode(ctx):
    keys = [k for k in ctx.remaining if k.endswith(".weight_q8") and k[:-3] + "_step" in ctx.remaining]
    if not keys:
        return None
    tensors, consumed = {}, {}
    for k in keys:
        name, step = k[: -len("_q8")], k[: -len("_q8")] + "_step"
        tensors[name] = StepTensor(ctx.remaining[k], ctx.remaining[step], name)
        consumed[k], consumed[step] = f"codes of {name}", f"step of {name}"
    return Decoded("fake-step", tensors, consumed)


FORMAT = Format("fakestep", "FAKE-STEP", 95, (decode,), weights=(StepTensor,),
                settings=lambda w, config: {"format": "FAKE-STEP", "bits": 8, "step": float(w.step.read_all(torch.device("cpu")))},
                refusals={"fakestep": (re.compile(r"\\.weight_q8$"), "int8 codes without their step (FAKE-STEP)")})
'''

PROBE = textwrap.dedent("""
    import sys
    import ckpt.quant as q
    q.__path__.append(sys.argv[1])  # the fake module's folder, as if it were in the package
    from ckpt.cli import main
    main(sys.argv[2:])
""")


def _run(folder, *args, cwd=None):
    p = subprocess.run([sys.executable, "-c", PROBE, str(folder), *map(str, args)], capture_output=True, text=True,
                       cwd=cwd)
    return p.returncode, p.stdout, p.stderr


@pytest.fixture
def fake(tmp_path):
    folder = tmp_path / "more_formats"
    folder.mkdir()
    (folder / "fakestep.py").write_text(FAKE)
    return folder


def test_a_new_format_is_a_new_module(tmp_path, fake):
    import torch
    from safetensors.torch import load_file, save_file

    codes = torch.randint(-127, 128, (8, 16), dtype=torch.int8)
    step = torch.tensor(0.125)
    bias = torch.randn(8)
    src = tmp_path / "m.safetensors"
    save_file({"layer.weight_q8": codes, "layer.weight_step": step, "layer.bias": bias}, src)
    expected = codes.float() * step

    rc, out, err = _run(fake, "dequant", src, "-o", tmp_path / "d.safetensors", "-q")
    assert rc == 0, err
    got = load_file(tmp_path / "d.safetensors")
    assert sorted(got) == ["layer.bias", "layer.weight"]
    assert got["layer.weight"].dtype == torch.float16  # the format's natural dtype is the default output
    assert torch.equal(got["layer.weight"], expected.half()) and torch.equal(got["layer.bias"], bias)

    rc, out, err = _run(fake, "convert", src, "--to", "fp32", "-o", tmp_path / "c.safetensors", "-q")
    assert rc == 0, err
    assert torch.equal(load_file(tmp_path / "c.safetensors")["layer.weight"], expected)

    rc, out, err = _run(fake, "inspect", src, "--json")
    assert rc == 0, err
    assert "FAKE-STEP" in out or "fake-step" in out, out
    assert '"step": 0.125' in out, out

    # its refusal, declared by the format itself: codes left without their step
    lone = tmp_path / "lone.safetensors"
    save_file({"layer.weight_q8": codes}, lone)
    rc, out, err = _run(fake, "dequant", lone, "-o", tmp_path / "x.safetensors")
    assert rc == 2 and len(err.strip().splitlines()) == 1 and "without their step (FAKE-STEP)" in err, err
    assert not (tmp_path / "x.safetensors").exists()

    # without the module, the same file is not this format (nothing registered claims it)
    rc, out, err = _run(tmp_path / "empty", "inspect", src, "--json")
    assert rc == 0 and "FAKE-STEP" not in out and "fake-step" not in out
