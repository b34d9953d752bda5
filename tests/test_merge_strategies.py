"""merge-lora's output strategy is chosen once from the options and the loaded LoRAs (plain, --keep-format,
LitGPT around either), and matched patches travel on the tensors a plan is made from, not in a table keyed
by object identity."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import torch

from ckpt.io.tensors import Tensor
from ckpt.adapters.merged import MergedTensor, Patch, Patched
from ckpt.merge_lora.strategies import KeepFormat, LitGPT, Plain, choose


def _opts(**kw):
    return SimpleNamespace(**{"keep_format": False, "to": None, "format": None, **kw})


def test_plain_without_a_litgpt_lora():
    s = choose(_opts(to="bf16"), [SimpleNamespace(litgpt=None)], None, Path("."))
    assert type(s) is Plain and s.to == "bf16" and s.container == "safetensors" and s.dtype is None


def test_keep_format():
    assert type(choose(_opts(keep_format=True), [SimpleNamespace(litgpt=None)], None, Path("."))) is KeepFormat


def test_litgpt_wraps_plain_with_the_loras_dtype_and_torch():
    lit = SimpleNamespace(litgpt=object(), dtype=torch.bfloat16)
    s = choose(_opts(), [SimpleNamespace(litgpt=None), lit], Path("ft"), Path("."))
    assert type(s) is LitGPT and s.settings is lit.litgpt and s.finetune_dir == Path("ft")
    assert type(s.inner) is Plain and s.inner.container == "torch" and s.inner.dtype == torch.bfloat16


def test_litgpt_wraps_keep_format():
    s = choose(_opts(keep_format=True), [SimpleNamespace(litgpt=object(), dtype=torch.float16)], None, Path("."))
    assert type(s) is LitGPT and type(s.inner) is KeepFormat


class _Base(Tensor):
    def __init__(self):
        self.name, self.dtype, self.shape, self.home = "w", torch.float16, (4, 3), "model.safetensors"


def test_patched_stands_for_its_base():
    base = _Base()
    patches = [Patch(adapter=SimpleNamespace(row_local=True), ratio=1.0)]
    p = Patched(base, patches)
    assert (p.name, p.dtype, p.shape, p.home, p.natural_dtype) == ("w", torch.float16, (4, 3), "model.safetensors",
                                                                  torch.float16)
    m = p.merged()
    assert isinstance(m, MergedTensor) and m.base is base and m.patches is patches
