"""Every registered quantized format (`ckpt.quant.formats`) holds to the same contract, checked on the cases of
tests/helpers/format_cases.py (tiny checkpoints made by each format's own library, with that library's decoding
as the oracle):

- every registered format has a case (a new format cannot land without one);
- `ckpt dequant` gives the oracle's values bit for bit (NaN payloads and the sign of zero aside, as
  tests/test_decoder_fuzz.py compares), every other tensor as stored, and no stored part of the encoding: every
  stored key is a plain output tensor or consumed by the logical view with a reason; an HF LLM folder's output
  loads strictly with transformers, has no quantization config left, and `ckpt convert --to <the model's dtype>`
  gives the oracle's values too (and every other `--to` those values cast once, where ckpt decodes in the
  library's dtype);
- a decoded tensor read in row bands equals one whole read of it;
- the checkpoint without one key the view consumed (a scale, a zero point, ...) is refused in one line with exit 2,
  nothing written and the input unchanged, or, where the format documents that key as optional, decodes to the
  oracle all the same.

The per-format test modules keep what is particular to a format: their variant matrices (bits, group sizes,
versions, layouts ...) and their tables of bad inputs.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import shutil

import pytest
import torch
from helpers.format_cases import CASES, SLOW, assert_bands_equal_the_whole, same
from helpers.llm import load_strict
from helpers.refusals import assert_refused
from safetensors import safe_open
from safetensors.torch import load_file, save_file

SHORT = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
PARAMS = [pytest.param(fmt, b, id=f"{fmt}-{b.__name__}", marks=[pytest.mark.slow] if b in SLOW else [])
          for fmt, builders in CASES.items() for b in builders]


def test_every_registered_format_has_a_case():
    from ckpt.quant.formats import formats

    assert set(CASES) == {f.name for f in formats()}
    assert all(CASES.values())


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """builder -> its Case, each checkpoint made once per module (the tests copy it before breaking it). What the
    libraries print while making one (progress bars) is kept out of the output the tests read."""
    cache = {}

    def get(builder):
        if builder not in cache:
            with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
                cache[builder] = builder(tmp_path_factory.mktemp(builder.__name__) / "made")
        return cache[builder]

    return get


def _digest(path) -> dict:
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    return {str(p): hashlib.sha256(p.read_bytes()).hexdigest() for p in files}


def _tensors(path) -> dict[str, torch.Tensor]:
    """Every tensor of a safetensors file, or of the safetensors files of a folder (none of a GGUF file)."""
    files = [path] if path.is_file() and path.suffix != ".gguf" else sorted(path.glob("*.safetensors"))
    return {k: v for f in files for k, v in load_file(f).items()}


def _view(path):
    """(stored keys, the logical view) of the checkpoint's one component."""
    from ckpt.io.checkpoint import open_checkpoint
    from ckpt.quant.view import logical_view

    with open_checkpoint(str(path)) as ck:
        (component,) = ck.components
        return set(component.tensors), logical_view(component)


def _dtype(case) -> torch.dtype:
    (dtype,) = {v.dtype for v in case.oracle.values()}
    return dtype


def _dequant(run_ckpt, case, src, out):
    """`ckpt dequant` of `src` (the case's checkpoint or a copy): its tensors, equal to the oracle's, and every
    tensor the oracle does not decode as it is stored."""
    code, _, err = run_ckpt("dequant", src, "-o", out, "-q", *(("--to", case.dequant_to) if case.dequant_to else ()))
    assert code == 0, err
    got = _tensors(out)
    for name, want in case.oracle.items():
        assert name in got, name
        assert same(got[name], want), (name, got[name].dtype, want.dtype)
    stored = _tensors(src)
    for name in set(got) - set(case.oracle):  # plain tensors: as stored (cast exactly where --to asks)
        assert name in stored, f"{name}: neither decoded by the oracle nor stored"
        assert same(got[name], stored[name].to(got[name].dtype)), name
    return got


@pytest.mark.parametrize("fmt,builder", PARAMS)
def test_dequant_equals_the_oracle_and_keeps_no_stored_part(built, tmp_path, run_ckpt, fmt, builder):
    case = built(builder)
    before = _digest(case.path)
    got = _dequant(run_ckpt, case, case.path, tmp_path / "out")
    assert _digest(case.path) == before
    _, view = _view(case.path)
    assert set(got) == set(view.tensors) and not set(got) & set(view.consumed)  # no part of the encoding is left
    if not case.llm:
        return
    out = tmp_path / "out"
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config
    assert not {"hf_quant_config.json", "quantize_config.json", "quant_config.json"} & {p.name for p in out.iterdir()}
    import transformers

    dtype = _dtype(case)
    assert config.get("torch_dtype", config.get("dtype")) in (None, str(dtype).removeprefix("torch."))  # the model's
    model = load_strict(out, transformers.AutoModelForCausalLM, dtype=dtype)
    assert not getattr(model, "is_quantized", False)
    for name, want in case.oracle.items():
        assert same(model.get_parameter(name).data, want), name
    code, _, err = run_ckpt("convert", case.path, "--to", SHORT[dtype], "-o", tmp_path / "converted", "-q")
    assert code == 0, err
    converted = _tensors(tmp_path / "converted")
    for name, want in case.oracle.items():
        assert same(converted[name], want), name
    if not case.to_casts_oracle:
        return
    for to in sorted(set(SHORT.values()) - {SHORT[dtype]}):  # the library's values, cast once
        code, _, err = run_ckpt("convert", case.path, "--to", to, "-o", tmp_path / to, "-q")
        assert code == 0, err
        c = _tensors(tmp_path / to)
        bad = [name for name, want in case.oracle.items() if not same(c[name], want.to(c[name].dtype))]
        assert not bad, (to, bad[:3])


@pytest.mark.parametrize("fmt,builder", PARAMS)
def test_every_stored_key_is_output_or_consumed_with_a_reason(built, fmt, builder):
    from ckpt.quant.formats import format_of

    case = built(builder)
    stored, view = _view(case.path)
    assert stored <= set(view.tensors) | set(view.consumed), sorted(stored - set(view.tensors) - set(view.consumed))
    assert all(isinstance(why, str) and why.strip() for why in view.consumed.values()), view.consumed
    mine = [n for n, t in view.tensors.items() if (f := format_of(t)) is not None and f.name == fmt]
    assert mine and set(case.bands) <= set(mine)  # the band checks read tensors this format decoded
    assert set(case.oracle) <= set(view.tensors)


@pytest.mark.parametrize("fmt,builder", PARAMS)
def test_bands_equal_the_whole(built, fmt, builder):
    case = built(builder)
    assert_bands_equal_the_whole(case.path, case.bands)


def _drop(path, key: str) -> None:
    """`key` removed from the safetensors file holding it (its metadata kept)."""
    for f in [path] if path.is_file() else sorted(path.glob("*.safetensors")):
        with safe_open(f, "pt") as sf:
            if key not in sf.keys():
                continue
            meta = sf.metadata()
        sd = load_file(f)
        del sd[key]
        save_file(sd, f, metadata=meta)
        return
    raise AssertionError(f"{key} is not stored in {path}")


@pytest.mark.parametrize("fmt,builder", PARAMS)
def test_a_consumed_key_dropped_is_refused_or_optional(built, tmp_path, run_ckpt, fmt, builder):
    case = built(builder)
    _, view = _view(case.path)
    if case.drop:
        assert case.drop in view.consumed, (case.drop, sorted(view.consumed)[:8])
    else:  # the format consumes nothing (GGUF blocks carry their scales): its case breaks the file another way
        assert not view.consumed and case.without is not None
    (tmp_path / "in").mkdir()
    src = tmp_path / "in" / case.path.name
    (shutil.copytree if case.path.is_dir() else shutil.copy)(case.path, src)
    (case.without or _drop)(src, case.drop)
    if case.refusal is None:  # documented optional: decoded all the same
        assert case.optional, "a case whose dropped key is optional says why"
        _dequant(run_ckpt, case, src, tmp_path / "out")
        return
    before = _digest(src)
    assert_refused(run_ckpt, tmp_path, ("dequant", src, "-o", tmp_path / "out", "-q"), str(src), case.refusal)
    assert _digest(src) == before
