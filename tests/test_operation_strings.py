"""The `ckpt_operation` a command writes into its output's metadata is the string batch's resume compares
with: both come from the command's own `*_operation` function. A killed batch run recognises its finished
outputs only by that string, so a spelling that drifted on either side would redo (or wrongly keep) work."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from helpers.batch import st
from ckpt.batch.discover import Found, made_by_ckpt
from ckpt.batch.operations import make_operation


def _found(path: Path) -> Found:
    return Found(path, path.name, path.is_dir())


@pytest.mark.parametrize("params", [{"to": "fp16"}, {"to": "bf16", "keep": ["b"]}, {"to": "fp8_e4m3fn", "scaled": True},
                                    {"to": "fp16", "max_shard_size": "1KB"}])
def test_convert_writes_what_batch_compares(tmp_path, params):
    from ckpt.convert import ConvertOptions, convert

    src = tmp_path / "m.safetensors"
    st(src, 1, **{"w": (64, 16), "b": (16,)})
    op = make_operation("convert", params)
    out, _ = convert(str(src), tmp_path / "out" / ("o" if params.get("max_shard_size") else "o.safetensors"),
                     ConvertOptions(**params, quiet=True))
    written = made_by_ckpt(out)
    assert written == op.provenance(_found(src)) and op.owns(written, _found(src))
    assert not make_operation("convert", {"to": "fp32"}).owns(written, _found(src))


@pytest.mark.parametrize("to", [None, "bf16"])
def test_dequant_writes_what_batch_compares(tmp_path, to):
    quanto = pytest.importorskip("optimum.quanto")
    from ckpt.dequant.command import DequantOptions, dequant

    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(16, 8))
    quanto.quantize(m, weights=quanto.qint8)
    quanto.freeze(m)
    src = tmp_path / "model"
    src.mkdir()
    save_file(m.state_dict(), src / "diffusion_pytorch_model.safetensors")
    (src / "quanto_qmap.json").write_text(json.dumps(quanto.quantization_map(m)))
    (src / "config.json").write_text(json.dumps({"_class_name": "Tiny"}))
    params = {"to": to} if to else {}
    op = make_operation("dequant", params)
    out, _ = dequant(str(src), tmp_path / "out", DequantOptions(**params, quiet=True))
    written = made_by_ckpt(out)
    assert written == op.provenance(_found(src)) and op.owns(written, _found(src))


def _peft_lora(path: Path, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({"base_model.model.lin.lora_A.weight": torch.randn(2, 4, generator=g),
               "base_model.model.lin.lora_B.weight": torch.randn(8, 2, generator=g)}, path)


@pytest.mark.parametrize("extra", [{}, {"ratios": [0.5]}, {"to": "bf16"}])
def test_merge_lora_writes_what_batch_compares_for_either_fixed_side(tmp_path, extra):
    from ckpt.merge_lora.command import MergeLoraOptions, merge_lora

    base, lora = tmp_path / "base.safetensors", tmp_path / "loras" / "style.safetensors"
    st(base, 1, **{"lin.weight": (8, 4)})
    _peft_lora(lora, 2)
    out, _ = merge_lora(str(base), [str(lora)], tmp_path / "out.safetensors", MergeLoraOptions(**extra, quiet=True))
    written = made_by_ckpt(out)
    one_lora = make_operation("merge-lora", {"lora": str(lora), **extra})  # the LoRA fixed, bases discovered
    assert written == one_lora.provenance(_found(base)) and one_lora.owns(written, _found(base))
    one_base = make_operation("merge-lora", {"base": str(base), **extra})  # the base fixed, LoRAs discovered
    assert written == one_base.provenance(_found(lora)) and one_base.owns(written, _found(lora))
    _peft_lora(tmp_path / "loras" / "other.safetensors", 3)
    assert not one_base.owns(written, _found(tmp_path / "loras" / "other.safetensors"))
