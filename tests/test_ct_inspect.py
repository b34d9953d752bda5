"""`ckpt inspect` of the compressed-tensors folders `ckpt convert LLM --to ct-*` writes (llm-compressor's FP8_DYNAMIC,
FP8_BLOCK, W4A16, W8A16 and NVFP4A16 presets, byte for byte: tests/serve/test_ct_write.py): one "quantized" row
naming the scheme with its parameters (weight type, strategy, group or block structure, sym, and the activation
scheme where the preset quantizes activations), one "unquantized" row with the matrices the `ignore` list and the
non-Linear modules leave plain, in text and in --json, asserted against the written config.json as the
compressed-tensors package parses it (`QuantizationConfig`)."""

from __future__ import annotations

import json

import pytest
from safetensors import safe_open

pytest.importorskip("compressed_tensors", reason="compressed-tensors is not installed (the oracle)")
pytest.importorskip("loguru")

from helpers.hf_llm import model_folder  # noqa: E402

PRESETS = ("ct-fp8-dynamic", "ct-fp8-block", "ct-w4a16", "ct-w8a16", "ct-nvfp4a16")


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A tiny Mistral with its SentencePiece tokenizer (inputs 256 and 512 wide: every preset's groups divide them)."""
    return model_folder(tmp_path_factory.mktemp("ct_inspect") / "base", "mistral")


def _rows(lines: list[str], key: str) -> list[str]:
    """The text rows of one field: its first row ("  quantized   ...") and the continuation rows under it, with
    runs of spaces made one."""
    out, inside = [], False
    for line in lines:
        if line.startswith(f"  {key:<11} "):
            inside = True
        elif not line.startswith("  " + " " * 12):
            inside = False
        if inside:
            out.append(" ".join(line[14:].split()))
    return out


def _value(v):
    return getattr(v, "value", v)


def _scheme(folder):
    """(the one config group's scheme as compressed-tensors parses config.json, the ignore list)."""
    from compressed_tensors.quantization import QuantizationConfig

    qc = QuantizationConfig.model_validate(json.loads((folder / "config.json").read_text())["quantization_config"])
    (scheme,) = qc.config_groups.values()
    return scheme, qc.ignore


def _expected(scheme) -> tuple[str, dict]:
    """(label, settings) inspect must give the scheme's Linears, from the parsed config group."""
    w, a = scheme.weights, scheme.input_activations
    typ, strategy = _value(w.type), _value(w.strategy)
    if typ == "float" and w.num_bits == 4:  # NVFP4: symmetric e2m1 in groups of 16 with a global scale, by definition
        parts = ["compressed-tensors nvfp4", f"group {w.group_size}"]
        settings = {"type": "nvfp4", "bits": 4, "group_size": w.group_size, "packing": _value(scheme.format)}
    else:
        name = "fp8" if typ == "float" else f"int{w.num_bits}"
        parts = [f"compressed-tensors {name}" + ("" if typ == "float" else f" {_value(scheme.format)}")]
        parts += [] if strategy == "group" else [f"{strategy} strategy"]
        parts += [f"group {w.group_size}"] if strategy == "group" else []
        parts += ["block " + "x".join(map(str, w.block_structure))] if strategy == "block" else []
        parts.append("sym" if w.symmetric else "asym")
        settings = {"type": name, "bits": w.num_bits, "strategy": strategy, "sym": w.symmetric,
                    "packing": _value(scheme.format)}
        settings |= {"group_size": w.group_size} if strategy == "group" else {}
        settings |= {"block": list(w.block_structure)} if strategy == "block" else {}
    if a is not None:
        act = {"type": ("fp" if _value(a.type) == "float" else "int") + str(a.num_bits), "dynamic": a.dynamic,
               "strategy": _value(a.strategy)}
        act |= {"group_size": a.group_size} if act["strategy"] == "group" else {}
        per = act["strategy"] + (f" {a.group_size}" if act["strategy"] == "group" else "")
        parts.append(f"activations {act['type']} {'dynamic' if a.dynamic is True else 'static'} per {per}")
        settings["activations"] = act
    return ", ".join(parts), {"format": "compressed-tensors"} | settings


@pytest.mark.parametrize("target", PRESETS)
def test_inspect_names_the_scheme_and_its_parameters(tmp_path, run_ckpt, base, target):
    out = tmp_path / "q"
    code, _, err = run_ckpt("convert", base, "--to", target, "-o", out, "-q")
    assert code == 0, err
    scheme, ignore = _scheme(out)
    assert ignore == ["lm_head"] and scheme.targets == ["Linear"]
    label, settings = _expected(scheme)
    with safe_open(out / "model.safetensors", "pt") as f:
        keys = list(f.keys())
        dims = {k: len(f.get_slice(k).get_shape()) for k in keys}
    layers = [k[: -len(".weight_scale")] for k in keys if k.endswith(".weight_scale")]  # each quantized Linear
    assert layers and "lm_head" not in layers
    plain = [k for k in keys if k.rsplit(".", 1)[0] not in layers]
    matrices = [k for k in plain if dims[k] >= 2]
    assert {"lm_head.weight", "model.embed_tokens.weight"} <= set(matrices)

    code, text, err = run_ckpt("inspect", out)
    assert code == 0, err
    lines = text.splitlines()
    assert _rows(lines, "quantized") == [f"{len(layers)} tensors {label}"], text
    assert _rows(lines, "unquantized") == [f"{len(plain)} tensors {len(matrices)} matrices: "
                                           + ", ".join(sorted(matrices)[:4]) + (", ..." if len(matrices) > 4 else "")]
    if scheme.weights.num_bits == 8 and _value(scheme.weights.type) == "float":  # the codes are fp8 weights
        assert f"{len(layers)} tensors stored as fp8_e4m3fn: trainers cannot compute with fp8 weights" in text

    code, js, err = run_ckpt("inspect", out, "--json")
    assert code == 0, err
    (comp,) = json.loads(js)["components"]
    q = comp["quantization"]
    assert [(x["label"], x["tensors"]) for x in q["layers"]] == [(label, len(layers))]
    assert q["layers"][0]["settings"] == settings
    assert q["unquantized"] == {"tensors": len(plain), "matrices": matrices}
