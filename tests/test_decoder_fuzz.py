"""Seeded mutants of tiny real quantized checkpoints, for every quantized-format decoder.

Each checkpoint is made by the format's own library (bitsandbytes, comfy-kitchen, optimum-quanto) or,
for the FP8 scaled layouts no installed library writes (kohya fp8_scaled, HF block FP8, weight_scale FP8,
ComfyUI legacy scaled_fp8), from the layout definition in docs/format-facts.md. A mutant drops one stored key,
reshapes it (same values in another shape, one value less, the values twice), retypes it (a value cast, as
`.float()` would) or puts NaN/Inf into it. `ckpt convert --to fp32` of each mutant must either

- refuse it: exit 2, exactly one `error: <file>: ...` line, nothing written, the input unchanged; or
- decode it to the oracle's values (the library's own dequantize of the mutated tensors, or the layout's
  formula), bit for bit (NaN payloads and the sign of zero aside), with exactly the keys of the plain
  model, and every NaN/Inf the oracle gives counted in the run's NaN/Inf warning, as convert reports it.

A mutant the oracle itself cannot decode must be refused. CI runs `CASES` mutants per checkpoint (seeded:
the same cases every run); `CKPT_FUZZ_CASES=N` runs N per checkpoint, `CKPT_FUZZ_SEED=S` another sequence.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re

import pytest
import torch
from helpers.decoder_models import MODELS, Model
from safetensors.torch import load_file, save_file

CASES = int(os.environ.get("CKPT_FUZZ_CASES", "16"))
SEED = int(os.environ.get("CKPT_FUZZ_SEED", "20"))
E4 = torch.float8_e4m3fn


# ---------------------------------------------------------------------------------------------------
# mutations

RETYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.uint8, torch.int8, E4]


def _retype(t: torch.Tensor, dt: torch.dtype) -> torch.Tensor:
    """A value cast, as a careless `.to(dtype)` / `.float()` writes it."""
    if dt == E4 or t.dtype in (E4, torch.float8_e5m2, torch.float8_e8m0fnu):
        return t.float().to(dt)
    return t.to(dt)


def _nonfinite(t: torch.Tensor, rng: random.Random) -> torch.Tensor:
    t = t.clone()
    flat = t.view(-1)
    for _ in range(rng.randint(1, 3)):
        i = rng.randrange(flat.numel())
        if t.dtype == E4:
            flat.view(torch.uint8)[i] = 0x7F  # e4m3fn has NaN only
        elif t.dtype == torch.float8_e8m0fnu:
            flat.view(torch.uint8)[i] = 0xFF  # e8m0's NaN
        else:
            flat[i] = rng.choice([float("nan"), float("inf"), float("-inf")])
    return t


def _reshape(t: torch.Tensor, rng: random.Random) -> torch.Tensor:
    flat = t.reshape(-1)
    n = flat.numel()
    options = [("flat", lambda: flat.clone()), ("lead-1", lambda: t.reshape(1, *t.shape).clone()),
               ("twice", lambda: torch.cat([flat, flat])), ("trail-1", lambda: t.reshape(*t.shape, 1).clone())]
    if n > 1:
        options.append(("one-less", lambda: flat[:-1].clone()))
    if n % 2 == 0 and n > 2:
        options.append(("halves", lambda: flat.reshape(2, n // 2).clone()))
    _, make = rng.choice(options)
    return make()


def mutate(sd: dict, rng: random.Random) -> tuple[dict, str]:
    key = rng.choice(sorted(sd))
    t = sd[key]
    ops = ["drop", "reshape", "retype"] + (["nonfinite"] * 2 if (t.dtype.is_floating_point and t.numel()) else [])
    op = rng.choice(ops)
    out = dict(sd)
    if op == "drop":
        del out[key]
        return out, f"drop {key}"
    if op == "reshape":
        out[key] = _reshape(t, rng)
        return out, f"reshape {key} {list(t.shape)} -> {list(out[key].shape)}"
    if op == "retype":
        dt = rng.choice([d for d in RETYPES if d != t.dtype])
        out[key] = _retype(t, dt)
        return out, f"retype {key} {t.dtype} -> {dt}"
    out[key] = _nonfinite(t, rng)
    return out, f"NaN/Inf in {key}"


# ---------------------------------------------------------------------------------------------------
# the property


def _digest(folder) -> dict:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def _same(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Bit for bit, NaN == NaN whatever its payload, +0 == -0 (bitsandbytes' CPU paths differ there)."""
    if got.shape != want.shape:
        return False
    g, w = got.float() + 0.0, want.float() + 0.0
    both_nan = torch.isnan(g) & torch.isnan(w)
    g, w = torch.where(both_nan, 0.0, g), torch.where(both_nan, 0.0, w)
    return bool(torch.equal(g.view(torch.int32), w.view(torch.int32)))


NONFINITE = re.compile(r"warning: ([\d,]+) NaN/Inf values? (?:was|were) already in the input")


def check_case(tmp_path, run_ckpt, m: Model, sd: dict, what: str) -> str:
    src_dir = tmp_path / "in"
    src_dir.mkdir()
    save_file({k: v.contiguous() for k, v in sd.items()}, src_dir / "model.safetensors", metadata=m.metadata)
    if m.config is not None:
        (src_dir / "config.json").write_text(json.dumps(m.config))
    src = src_dir if m.config is not None else src_dir / "model.safetensors"
    before = _digest(src_dir)
    out = tmp_path / "out.safetensors" if m.config is None else tmp_path / "out"
    code, stdout, err = run_ckpt("convert", src, "--to", "fp32", "-o", out)
    assert _digest(src_dir) == before, f"{what}: the input changed"
    try:
        want = m.oracle(sd)
    except Exception as e:  # the format (its library, its definition) gives no values for this mutant
        want, why = None, f"{type(e).__name__}: {e}"
    if code == 2:
        assert err.startswith(f"error: {src_dir}") and err.count("\n") == 1, f"{what}: {err!r}"
        assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["in"], f"{what}: output written"
        return "refused"
    assert code == 0, f"{what}: exit {code}: {err}"
    assert want is not None, f"{what}: decoded with exit 0, but the oracle cannot decode it ({why}); {err}"
    got = load_file(out / "model.safetensors" if out.is_dir() else out)
    expected_keys = set(m.weights) | (m.plain & set(sd))
    assert set(got) == expected_keys, f"{what}: wrote {sorted(got)}, expected {sorted(expected_keys)}"
    for k in m.plain & set(sd):  # written as stored, cast exactly
        assert _same(got[k], sd[k]), f"{what}: {k} is not what was stored"
    bad = 0
    for k in m.weights:
        assert _same(got[k], want[k]), f"{what}: {k} differs from the oracle"
        bad += int((~torch.isfinite(want[k].float())).sum())
    # plain tensors already fp32 are copied unread by the kernel (ckpt.io.byte_copy), the others cast and counted
    bad += sum(int((~torch.isfinite(sd[k].float())).sum()) for k in m.plain & set(sd)
               if sd[k].dtype.is_floating_point and sd[k].dtype != torch.float32)
    reported = sum(int(n.replace(",", "")) for n in NONFINITE.findall(err))
    assert reported == bad, f"{what}: {bad} NaN/Inf decoded, {reported} reported: {err}"
    return "decoded"


def _cases(name: str, m: Model) -> list[tuple[dict, str]]:
    rng = random.Random(f"{SEED}-{name}")
    return [mutate(m.sd, rng) for _ in range(CASES)]


@pytest.mark.parametrize("name", sorted(MODELS))
def test_mutants_are_refused_or_decoded_to_the_oracle(tmp_path, run_ckpt, name):
    m = MODELS[name]()
    # the unmutated checkpoint decodes to the oracle's values: the oracle and the builder agree with ckpt
    (tmp_path / "orig").mkdir()
    assert check_case(tmp_path / "orig", run_ckpt, m, m.sd, f"{name} as made") == "decoded"
    for i, (sd, what) in enumerate(_cases(name, m)):
        case = tmp_path / f"case{i}"
        case.mkdir()
        check_case(case, run_ckpt, m, sd, f"{name} case {i} ({what})")
