"""Malformed optimum-quanto files, index files, damaged zips and Lightning hyperparameter pickles: each is
one line `error: ...`, exit 2, nothing written (or, for harmless hyperparameters, read without running
anything). Pickles are fabricated here with stand-in classes under the real module names, so omegaconf
and Lightning need not be installed, and each stand-in trips a canary if anything ever constructs it.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import struct
import sys
import types

import pytest
import torch
from safetensors.torch import load_file, save_file

from helpers.refusals import assert_refused


# ---- optimum-quanto shapes and legacy strings (checked while planning) ----

def _q8(scale_shape, data_shape=(4, 6)):
    return {"a.weight._data": torch.ones(data_shape, dtype=torch.int8),
            "a.weight._scale": torch.ones(scale_shape, dtype=torch.float16), "a.bias": torch.zeros(4)}


@pytest.mark.parametrize("scale_shape", [(5, 1), (2, 1), (4, 7), (4, 1, 1), (6,)], ids=str)
@pytest.mark.parametrize("command", ["dequant", "convert"])
def test_quanto_scale_that_does_not_fit_the_data(tmp_path, run_ckpt, scale_shape, command):
    src = tmp_path / "q.safetensors"
    save_file(_q8(scale_shape), src)
    args = [command, src] + (["--to", "fp16"] if command == "convert" else [])
    assert_refused(run_ckpt, tmp_path, args, f"{src}:", "does not fit 'a.weight._data'")


@pytest.mark.parametrize("scale_shape", [(), (1,), (4, 1), (4,), (1, 6), (4, 6)], ids=str)
def test_quanto_scale_shapes_quanto_writes_are_accepted(tmp_path, run_ckpt, scale_shape):
    src = tmp_path / "q.safetensors"
    save_file(_q8(scale_shape), src)
    code, _, err = run_ckpt("dequant", src, "-q")
    assert code == 0, err
    assert load_file(tmp_path / "q-dequant.safetensors")["a.weight"].shape == (4, 6)


def _q4(scale_shape=(8, 1), shift_shape=(8, 1), scale_dtype=torch.float16):
    # 8 rows of 16 values, 4 bits: 4 packed rows
    return {"a.weight._data._data": torch.zeros(4, 16, dtype=torch.uint8),
            "a.weight._scale": torch.ones(scale_shape, dtype=scale_dtype),
            "a.weight._shift": torch.zeros(shift_shape, dtype=torch.float16)}


@pytest.mark.parametrize("case,problem", [
    ((dict(scale_shape=(8, 2))), "'a.weight._scale' [8, 2] does not fit"),
    ((dict(shift_shape=(8, 2))), "'a.weight._shift' [8, 2] does not fit"),
    ((dict(shift_shape=(4, 1))), "'a.weight._shift' [4, 1] does not fit"),
    ((dict(scale_dtype=torch.int32)), "expected a float scale"),
    ((dict(scale_shape=(8,))), "'a.weight._scale' [8] does not fit"),
], ids=["scale-2-cols", "shift-2-cols", "shift-half-rows", "int-scale", "scale-1d"])
def test_packed_quanto_scale_and_shift_shapes(tmp_path, run_ckpt, case, problem):
    src = tmp_path / "q.safetensors"
    save_file(_q4(**case), src)
    assert_refused(run_ckpt, tmp_path, ["dequant", src, "--qtype", "qint4"], f"{src}:", problem)


@pytest.mark.parametrize("size,problem", [
    ("(", "is not a shape"), ("[1, 2", "is not a shape"), ("'abc'", "is not a shape"),
    ("[[[[" * 400, "is not a shape"), ("9" * 5000, "is not a shape"), ("[32, x]", "is not a shape"),
    ("__import__('os').system('true')", "is not a shape"), ("{}", "is not a shape"),
    ("[" + "1," * 100 + "1]", "quantized values do not fill the shape"),  # well formed, wrong size
    ("[99999999999999999, 99999999999999999]", "quantized values do not fill the shape"),
])
def test_legacy_quanto_size_string_is_never_evaluated(tmp_path, run_ckpt, size, problem):
    sd = {"lin.weight._data._data": torch.zeros(16, 256, dtype=torch.uint8),
          "lin.weight._scale": torch.ones(32, 1, dtype=torch.float16),
          "lin.weight._zeropoint": torch.zeros(32, 1, dtype=torch.float16),
          "lin.weight.qtype": "qint4", "lin.weight.size": size}
    src = tmp_path / "old.pt"
    torch.save(sd, src)
    assert_refused(run_ckpt, tmp_path, ["dequant", src], f"{tmp_path}", problem)


# ---- index files and damaged zips ----

def test_index_weight_map_value_not_a_file_name(tmp_path, run_ckpt):
    d = tmp_path / "m"
    d.mkdir()
    save_file({"a": torch.ones(2)}, d / "model-00001-of-00001.safetensors")
    (d / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {"a": ["model-00001-of-00001.safetensors"]}}))
    assert_refused(run_ckpt, tmp_path, ["convert", d, "--to", "fp16"], f"{d / 'model.safetensors.index.json'}:",
                   "which is not a shard file name")


def test_zip_with_odd_zip64_locator(tmp_path, run_ckpt):
    """zipfile.is_zipfile raises BadZipFile (not OSError) when the zip64 locator says "several disks"."""
    src = tmp_path / "m.pt"
    torch.save({"w": torch.ones(3)}, src)
    raw = bytearray(src.read_bytes())
    loc = raw.rfind(struct.pack("<I", 0x07064B50))
    assert loc > 0
    raw[loc + 16:loc + 20] = struct.pack("<I", 2)  # total number of disks
    src.write_bytes(bytes(raw))
    for command in (["convert", src, "--to", "fp16"], ["inspect", src]):
        assert_refused(run_ckpt, tmp_path, command, f"{src}:", "damaged zip")


# ---- Lightning checkpoints: harmless hyperparameter globals become inert placeholders ----

CANARY: list[str] = []


def _fake_module(name: str, classes: dict) -> types.ModuleType:
    mod = types.ModuleType(name)
    for cls_name, cls in classes.items():
        cls.__module__, cls.__qualname__, cls.__name__ = name, cls_name, cls_name
        setattr(mod, cls_name, cls)
    return mod


def _canary_class(label: str, base=object):
    """A class whose every construction path trips the canary: the loader must never call it."""

    def new(cls, *a, **k):
        CANARY.append(label)
        return base.__new__(cls) if base is not dict else dict.__new__(cls)

    def setstate(self, state):
        CANARY.append(label + ".__setstate__")

    def init(self, *a, **k):
        CANARY.append(label + ".__init__")

    return type(label, (base,), {"__new__": new, "__setstate__": setstate, "__init__": init})


@pytest.fixture
def lightning_like(monkeypatch):
    """Modules named like omegaconf's and Lightning's, holding canary classes, present while pickling
    AND while loading (so a loader that imported the real names would construct them)."""
    CANARY.clear()
    dc = _canary_class("DictConfig")
    meta = _canary_class("ContainerMetadata")
    node = _canary_class("AnyNode")
    attr = _canary_class("AttributeDict", dict)
    mods = {
        "omegaconf": _fake_module("omegaconf", {}),
        "omegaconf.dictconfig": _fake_module("omegaconf.dictconfig", {"DictConfig": dc}),
        "omegaconf.base": _fake_module("omegaconf.base", {"ContainerMetadata": meta}),
        "omegaconf.nodes": _fake_module("omegaconf.nodes", {"AnyNode": node}),
        "pytorch_lightning": _fake_module("pytorch_lightning", {}),
        "pytorch_lightning.utilities": _fake_module("pytorch_lightning.utilities", {}),
        "pytorch_lightning.utilities.parsing": _fake_module("pytorch_lightning.utilities.parsing",
                                                            {"AttributeDict": attr}),
    }
    for name, mod in mods.items():
        monkeypatch.setitem(sys.modules, name, mod)
    return dc, meta, node, attr


def _omegaconf_like(dc, meta, node):
    """What an omegaconf DictConfig pickles as: object.__new__ + a state dict of internals (metadata with
    type references such as typing.Any and dict, and value nodes)."""
    import typing

    cfg = object.__new__(dc)
    m = object.__new__(meta)
    m.__dict__.update({"ref_type": typing.Any, "object_type": dict, "key_type": typing.Any, "flags": {}})
    lr = object.__new__(node)
    lr.__dict__.update({"_val": 0.1, "_parent": cfg})
    cfg.__dict__.update({"_metadata": m, "_parent": None, "_content": {"lr": lr}})
    del dc.__setstate__, meta.__setstate__, node.__setstate__  # pickled through __dict__, as plain objects
    return cfg


def test_lightning_ckpt_with_harmless_hyperparameters_is_read_without_running_anything(
        tmp_path, run_ckpt, lightning_like):
    dc, meta, node, attr = lightning_like
    w = torch.randn(4, 3)
    hp = attr()
    hp["cfg"] = _omegaconf_like(dc, meta, node)
    hp["args"] = argparse.Namespace(lr=0.1, data=pathlib.PurePosixPath("/data/train"))
    hp["out"] = pathlib.PosixPath("/runs/1")
    CANARY.clear()
    src = tmp_path / "epoch=3.ckpt"
    torch.save({"state_dict": {"model.w": w}, "hyper_parameters": hp, "epoch": 3,
                "pytorch-lightning_version": "1.9.0"}, src)
    assert CANARY == []
    # torch alone refuses it (these globals are outside its safe set)
    with pytest.raises(Exception, match="Unsupported global"):
        torch.load(src, weights_only=True)
    code, out, err = run_ckpt("convert", src, "--to", "fp16")
    assert code == 0, err
    assert CANARY == []  # not one stand-in class was constructed or given its state
    got = load_file(tmp_path / "epoch=3-fp16.safetensors")
    assert list(got) == ["model.w"] and torch.equal(got["model.w"], w.half())
    assert "inert placeholders" in err and "argparse.Namespace" in err and "omegaconf.dictconfig.DictConfig" in err
    code, out, err = run_ckpt("inspect", src)
    assert code == 0 and CANARY == [], err


def test_legacy_non_zip_lightning_ckpt(tmp_path, run_ckpt):
    src = tmp_path / "old.ckpt"
    torch.save({"state_dict": {"w": torch.ones(2)}, "hparams": argparse.Namespace(a=1)}, src,
               _use_new_zipfile_serialization=False)
    code, _, err = run_ckpt("convert", src, "--to", "bf16", "-q")
    assert code == 0, err
    assert torch.equal(load_file(tmp_path / "old-bf16.safetensors")["w"], torch.ones(2, dtype=torch.bfloat16))


class _Payload:
    def __init__(self, call, args):
        self.call, self.args = call, args

    def __reduce__(self):
        return self.call, self.args


@pytest.mark.parametrize("zip_format", [True, False], ids=["zip", "legacy"])
@pytest.mark.parametrize("gadget", ["os.system", "pathlib.Path.write_text", "builtins.eval"])
def test_malicious_pickle_beside_harmless_ones_stays_refused(tmp_path, run_ckpt, gadget, zip_format):
    canary = tmp_path / "pwned"
    if gadget == "os.system":
        import os

        payload = _Payload(os.system, (f"touch {canary}",))
    elif gadget == "pathlib.Path.write_text":
        payload = _Payload(pathlib.Path.write_text, (pathlib.Path(canary), "x"))
    else:
        payload = _Payload(eval, (f"open({str(canary)!r}, 'w')",))
    src = tmp_path / "evil.ckpt"
    torch.save({"state_dict": {"w": torch.ones(2)}, "hyper_parameters": argparse.Namespace(x=payload)}, src,
               _use_new_zipfile_serialization=zip_format)
    assert not canary.exists()
    # pickle spells Path.write_text as getattr(PosixPath, "write_text"): getattr is what is refused
    name = {"os.system": "system", "pathlib.Path.write_text": "getattr", "builtins.eval": "eval"}[gadget]
    before = sorted(p.name for p in tmp_path.iterdir())
    code, out, err = run_ckpt("convert", src, "--to", "fp16")
    assert code == 2 and err.count("\n") == 1 and "refusing to unpickle" in err and name in err, err
    assert "argparse" not in err  # the harmless global is not what is named
    assert not canary.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_qfloat8_converted_to_another_dtype(tmp_path, run_ckpt):
    """The decoder's fp8 upcast and the cast after it used one scratch buffer (overlapping memory)."""
    data = torch.randn(3, 5).to(torch.float8_e4m3fn)
    scale = torch.tensor([[0.5], [2.0], [4.0]])
    save_file({"w.weight._data": data, "w.weight._scale": scale}, tmp_path / "q.safetensors")
    code, _, err = run_ckpt("convert", tmp_path / "q.safetensors", "--to", "bf16", "-q")
    assert code == 0, err
    got = load_file(tmp_path / "q-bf16.safetensors")["w.weight"]
    assert torch.equal(got, (scale * data.to(torch.float32)).to(torch.bfloat16))
