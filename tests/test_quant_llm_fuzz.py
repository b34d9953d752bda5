"""Seeded mutants of the quantized LLM folders people download (GPTQ, AWQ, compressed-tensors int and NVFP4,
ModelOpt NVFP4, gpt-oss MXFP4, HQQ, torchao), each first written by the format's own library (their cases in
tests/helpers/format_cases.py), then broken one way: a `quantization_config` entry set to a wrong type or out-of-range value,
dropped, or naming another format; config.json truncated or not an object; a stored tensor dropped, reshaped,
retyped or given NaN/Inf.

`ckpt dequant FOLDER -o OUT` of each mutant must either
- refuse it: exit 2, exactly one `error: ...` line, nothing written, the folder unchanged; or
- decode it: exit 0, an output whose tensors are the intact folder's decode by name and shape (a plain tensor
  the mutant reshaped aside, which is written as stored; never a leftover
  stored part such as `qweight` or `weight_scale` passed through as a weight, never a weight silently left
  out, except the one plain tensor a mutant dropped), every NaN/Inf in it counted in the run's warning; and a
  mutant that only changes the config (not its tensors) must decode to the intact folder's values exactly,
  unless its change is to a setting that legitimately changes them (`VALUE_KEYS`): a config that contradicts
  the tensors is refused, never decoded another way in silence.

CI runs `CASES` mutants per format (seeded: the same every run); `CKPT_FUZZ_CASES=N` runs N per format,
`CKPT_FUZZ_SEED=S` another sequence.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

CASES = int(os.environ.get("CKPT_FUZZ_CASES", "10"))
SEED = int(os.environ.get("CKPT_FUZZ_SEED", "31"))
BAD_VALUES = [None, -1, 0, 3, 7, 10 ** 9, 2.5, float("nan"), "x", "", [], {}, True, False, [4], {"a": 1}]
FORMATS = ("gptq", "awq", "awq", "ct-int4", "ct-nvfp4", "modelopt", "mxfp4", "hqq", "torchao")
# Settings whose change is meant to change the decoded values (the config says how to read the same codes).
VALUE_KEYS = {"checkpoint_format"}


def _build(name: str, folder: Path) -> Path:
    """The format's folder, made under `folder` by its conformance case (tests/helpers/format_cases.py)."""
    from helpers import format_cases as fc

    builders = {"gptq": fc.gptq_4bit, "awq": fc.awq_gemm, "ct-int4": fc.ct_int4, "ct-nvfp4": fc.ct_nvfp4,
                "modelopt": fc.modelopt_nvfp4, "mxfp4": fc.mxfp4_gptoss, "hqq": fc.hqq_4bit, "torchao": fc.torchao_int4}
    return builders[name](folder).path


@pytest.fixture(scope="module")
def intact(tmp_path_factory):
    """format -> (folder, its decoded tensors), each built and decoded once."""
    from ckpt.cli import main

    made = {}

    def get(name):
        if name not in made:
            root = tmp_path_factory.mktemp(name)
            folder = _build(name, root / "intact")
            try:
                main(["dequant", str(folder), "-o", str(root / "out"), "-q"])
            except SystemExit as e:
                assert not e.code, f"the intact {name} folder does not decode"
            made[name] = (folder, _tensors(root / "out"))
        return made[name]

    return get


def _tensors(out: Path) -> dict[str, torch.Tensor]:
    files = [out] if out.is_file() else sorted(out.glob("*.safetensors"))
    sd = {}
    for f in files:
        sd.update(load_file(f))
    return sd


def _snapshot(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def _copy(src: Path, dst: Path) -> None:
    dst.mkdir(parents=True)
    for p in src.iterdir():
        if p.is_file():
            (dst / p.name).write_bytes(p.read_bytes())


def _config_file(folder: Path) -> tuple[Path, dict, str | None]:
    """(the file holding the quantization settings, its JSON, the key of the settings object in it)."""
    cfg = json.loads((folder / "config.json").read_text())
    if "quantization_config" in cfg:
        return folder / "config.json", cfg, "quantization_config"
    path = folder / "hf_quant_config.json"
    return path, json.loads(path.read_text()), "quantization"


def _leaves(d, path=()):
    if isinstance(d, dict):
        for k, v in d.items():
            yield from _leaves(v, path + (k,))
    yield path


def mutate(folder: Path, rng: random.Random) -> tuple[str, set[str]]:
    """Break `folder` one way; returns (what was done, the stored keys it touched)."""
    kind = rng.choice(["config-value", "config-value", "config-drop", "config-method", "config-file",
                       "tensor-drop", "tensor-shape", "tensor-dtype", "tensor-nonfinite"])
    if kind.startswith("config") and kind != "config-file":
        path, cfg, key = _config_file(folder)
        qc = cfg[key]
        leaves = [p for p in _leaves(qc) if p]
        where = rng.choice(leaves)
        parent = qc
        for k in where[:-1]:
            parent = parent[k]
        if kind == "config-method":
            where, parent = ("quant_method",), qc
            value = rng.choice(["gptq", "awq", "compressed-tensors", "modelopt", "mxfp4", "hqq", "torchao", "fp8",
                                "bitsandbytes", "nonesuch"])
            parent["quant_method"] = value
        elif kind == "config-drop":
            del parent[where[-1]]
            value = "(dropped)"
        else:
            value = rng.choice(BAD_VALUES)
            parent[where[-1]] = value
        path.write_text(json.dumps(cfg))
        return f"{kind} {'.'.join(map(str, where))} = {value!r}"[:200], set()
    if kind == "config-file":
        text = (folder / "config.json").read_text()
        how = rng.choice(["truncate", "list", "binary"])
        (folder / "config.json").write_bytes({"truncate": text[: len(text) // 2].encode(), "list": b"[1, 2]",
                                              "binary": bytes(rng.randrange(256) for _ in range(64))}[how])
        return f"config.json {how}", set()
    sd = load_file(folder / "model.safetensors")
    name = rng.choice(sorted(sd))
    t = sd[name]
    if kind == "tensor-drop":
        del sd[name]
    elif kind == "tensor-shape":
        flat = t.reshape(-1)
        how = rng.choice(["flat", "extra-dim", "one-less", "twice"])
        sd[name] = {"flat": flat, "extra-dim": t.unsqueeze(0), "one-less": flat[:-1] if flat.numel() else flat,
                    "twice": torch.cat([flat, flat])}[how].contiguous()
        kind += f" {how}"
    elif kind == "tensor-dtype":
        to = rng.choice([torch.float32, torch.float16, torch.int32, torch.uint8, torch.int8])
        sd[name] = t.to(to) if not t.dtype.is_floating_point or to.is_floating_point else t.float().to(to)
        kind += f" {to}"
    else:
        if not t.dtype.is_floating_point or t.dtype.itemsize == 1 or not t.numel():
            return mutate_nonfinite_fallback(folder, sd, rng)
        t = t.clone()
        t.view(-1)[rng.randrange(t.numel())] = rng.choice([float("nan"), float("inf"), -float("inf")])
        sd[name] = t
    save_file(sd, folder / "model.safetensors", metadata={"format": "pt"})
    return f"{kind} {name}", {name}


def mutate_nonfinite_fallback(folder, sd, rng) -> tuple[str, set[str]]:
    """A NaN in some float tensor of at least 16 bits (codes and fp8 scales have no room for one this way)."""
    names = [k for k, v in sorted(sd.items()) if v.dtype.is_floating_point and v.dtype.itemsize > 1 and v.numel()]
    name = rng.choice(names)
    t = sd[name].clone()
    t.view(-1)[rng.randrange(t.numel())] = float("nan")
    sd[name] = t
    save_file(sd, folder / "model.safetensors", metadata={"format": "pt"})
    return f"tensor-nonfinite {name}", {name}


@pytest.mark.parametrize("fmt", sorted(set(FORMATS)))
def test_mutants_are_refused_in_one_line_or_decoded_consistently(tmp_path, run_ckpt, capsys, intact, fmt):
    folder, want = intact(fmt)
    capsys.readouterr()  # what the format's own library printed while building the folder
    rng = random.Random(f"{SEED}-{fmt}")
    failures = []
    for i in range(CASES):
        case = tmp_path / f"m{i}"
        _copy(folder, case)
        what, touched = mutate(case, rng)
        before = _snapshot(case)
        out = tmp_path / f"out{i}"
        code, stdout, err = run_ckpt("dequant", case, "-o", out, "-q")
        problem = _check(code, err, case, out, want, what, touched)
        if _snapshot(case) != before:
            problem = "the input folder changed"
        if problem:
            failures.append(f"{fmt} #{i} {what}: {problem}")
    assert not failures, "\n".join(failures)


def _check(code, err, case: Path, out: Path, want: dict, what: str, touched: set[str]) -> str | None:
    lines = err.strip().splitlines()
    if code == 2:
        if len(lines) != 1 or not lines[0].startswith("error: "):
            return f"exit 2 but stderr is not one error line: {err[-400:]!r}"
        if out.exists():
            return "exit 2 but the output exists"
        return None
    if code != 0:
        return f"exit {code}: {err[-600:]!r}"
    if not out.exists():
        return f"exit 0 and nothing written: {err.strip()[-300:]!r}"
    got = _tensors(out)
    extra = sorted(set(got) - set(want))
    if extra:
        return f"decoded with keys the intact folder's decode lacks (parts passed through?): {extra[:3]}"
    missing = set(want) - set(got)
    if missing and not (what.startswith("tensor-drop") and missing <= touched):
        return f"decoded without {sorted(missing)[:3]}"
    for k, v in got.items():
        # a plain tensor is written as stored: ckpt checks the parts of a quantized weight against each other,
        # not the shapes of plain tensors against the model's config
        if tuple(v.shape) != tuple(want[k].shape) and k not in touched:
            return f"{k}: shape {list(v.shape)}, the intact decode's {list(want[k].shape)}"
    # a plain tensor written as it is stored is copied by the kernel, unread: its NaN/Inf are the input's own
    stored = load_file(case / "model.safetensors") if (case / "model.safetensors").exists() else {}
    nonfinite = sum(int((~torch.isfinite(v)).sum()) for k, v in got.items() if v.dtype.is_floating_point
                    and not (k in stored and stored[k].dtype == v.dtype and torch.equal(
                        stored[k].reshape(-1).view(torch.uint8), v.reshape(-1).view(torch.uint8))))
    if nonfinite and "NaN/Inf" not in err:
        return f"{nonfinite} NaN/Inf values in the output and no warning"
    if what.startswith("config") and not any(f" {k}" in what.split("=")[0] for k in VALUE_KEYS):
        changed = [k for k, v in got.items() if v.dtype != want[k].dtype or not torch.equal(
            v.reshape(-1).view(torch.uint8), want[k].reshape(-1).view(torch.uint8))]
        if changed:
            return f"a config change decoded other values in silence: {changed[:3]}"
    return None
