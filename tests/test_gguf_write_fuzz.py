"""Fuzzing GGUF writing (issue 31): seeded random small safetensors models (a Flux model's names plus extra tensors of
random shapes: dims of 0, odd dims, scalars, 1-D, 3-D to 5-D; dtypes fp32/fp16/bf16/fp8/int8/int32, and uint8/bool that
GGUF has no type for; values of every scale with NaN/Inf and rows too large for a block's fp16 scale) converted to a
sample of `gguf-*` types through the CLI. Each run either

- exits 0 with a GGUF that gguf's GGUFReader reads, every tensor there with its source shape, its bytes those of the
  reference (gguf's quantize for the legacy types, llama.cpp's ggml-quants.c as its release builds compile it for the
  K-quants, torch's cast for the plain types), ckpt's own decoding of it equal to gguf's dequantize of its bytes, and
  every finite value that decodes as NaN/Inf counted, per tensor, in a warning (`--report` holds the counts); or
- exits 2 with one `error:` line, nothing written.

CI runs `CASES` cases; CKPT_FUZZ_CASES=N runs N (CKPT_FUZZ_SEED picks another seed).
"""

from __future__ import annotations

import json
import os
import random

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from safetensors.torch import load_file, save_file

from helpers.flux_names import tiny_flux

CASES = int(os.environ.get("CKPT_FUZZ_CASES", "12"))
SEED = int(os.environ.get("CKPT_FUZZ_SEED", "31"))
TYPES = ["gguf-q8_0", "gguf-q6_k", "gguf-q5_k_m", "gguf-q4_k_s", "gguf-q3_k_m", "gguf-q2_k", "gguf-q5_1", "gguf-q5_0",
         "gguf-q4_1", "gguf-q4_0", "gguf-bf16", "gguf-f16", "gguf-f32"]
SHAPES = [(256, 0), (0, 256), (0,), (3, 0, 5), (), (1,), (37,), (1000,), (7, 33), (5, 96), (2, 8, 64),
          (2, 3, 4, 32), (1, 2, 2, 2, 32), (1, 256), (300, 4)]
QUANTIZED = [(8, 256), (4, 512), (40, 64), (64, 32), (12, 96), (6, 768)]  # 2-D weights of > 1024 values: quantized
FLOATS = [torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn]
INTS = [torch.int8, torch.int32]
REFUSED = [torch.uint8, torch.bool]  # GGUF has no type for them
BIG = [1e7, 3e38, -3e38, -1e5, 7e4, 6e4]
LEGACY = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")
K_TYPES = {"Q2_K": "q2_K", "Q3_K": "q3_K", "Q4_K": "q4_K", "Q5_K": "q5_K", "Q6_K": "q6_K"}
PLAIN = {T.F32: torch.float32, T.F16: torch.float16, T.BF16: torch.bfloat16, T.I8: torch.int8, T.I32: torch.int32}


def values(rnd: random.Random, shape, dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(rnd.randrange(1 << 30))
    if dtype in INTS or dtype in REFUSED:
        return torch.randint(-100, 100, shape, generator=g).to(dtype) if dtype != torch.bool else \
            torch.randint(0, 2, shape, generator=g).bool()
    x = torch.randn(shape, generator=g) * rnd.choice([0.02, 1.0, 300.0])
    if x.numel():
        flat = x.view(-1)
        for _ in range(rnd.choice([0, 0, 1, 3])):
            flat[rnd.randrange(flat.numel())] = rnd.choice([float("nan"), float("inf"), float("-inf")])
        if x.dim() >= 2 and rnd.random() < 0.6:
            rows = x.reshape(-1, x.shape[-1])
            r = rnd.randrange(rows.shape[0])
            a = rnd.randrange(rows.shape[1])
            rows[r, a:] = rnd.choice(BIG)
    if dtype == torch.float8_e4m3fn:
        x = x.clamp(-448, 448).nan_to_num(posinf=448, neginf=-448)  # e4m3fn has no Inf
    return x.to(dtype)


def make_case(i: int):
    """(source tensors, --to) of case `i`: every fifth case holds something refused."""
    rnd = random.Random(SEED * 100_003 + i)
    base = rnd.choice(FLOATS[:3])
    sd = tiny_flux(base)
    for j in range(rnd.randrange(1, 5)):
        shape = rnd.choice(QUANTIZED if rnd.random() < 0.5 else SHAPES)
        dtype = rnd.choice(FLOATS + FLOATS + INTS)
        sd[f"double_blocks.0.img_attn.fz{j}.{rnd.choice(['weight', 'weight', 'bias'])}"] = values(rnd, shape, dtype)
    to = rnd.choice(TYPES)
    if i % 5 == 4:
        if rnd.random() < 0.5:
            sd["double_blocks.0.img_attn.bad.weight"] = values(rnd, rnd.choice(SHAPES), rnd.choice(REFUSED))
        else:
            to = rnd.choice(["gguf-iq4_nl", "gguf-iq4_xs"])  # ComfyUI-GGUF refuses IQ types for image models
    return sd, to


def as_float(x: torch.Tensor) -> np.ndarray:
    return x.to(torch.float64).numpy() if x.dtype.is_floating_point else x.numpy()


def reference_bytes(x: np.ndarray, t) -> bytes:
    from helpers import ggml_ref

    name = t.name
    rows = x.reshape(-1, x.shape[-1]) if x.ndim else x.reshape(1, 1)
    if name in LEGACY:
        with np.errstate(all="ignore"):
            return np.ascontiguousarray(gguf.quants.quantize(rows, t)).tobytes()
    # ckpt's K-quant encoder: a NaN as 0, an Inf as the largest finite float32 (ggml's C math is undefined for them)
    big = np.finfo(np.float32).max
    return ggml_ref.quantize(K_TYPES[name], np.nan_to_num(rows, nan=0.0, posinf=big, neginf=-big), release=True)


def check_written(tmp_path, run_ckpt, sd: dict, err: str) -> None:
    r = gguf.GGUFReader(tmp_path / "o.gguf")
    tensors = {t.name: t for t in r.tensors}
    assert set(tensors) == set(sd)
    counts = json.loads((tmp_path / "r.json").read_text())["counts"]
    code, _, back_err = run_ckpt("convert", tmp_path / "o.gguf", "--to", "fp32", "-q", "-o",
                                 tmp_path / "back.safetensors")
    assert code == 0, back_err
    back = load_file(tmp_path / "back.safetensors")
    produced = 0
    for name, t in tensors.items():
        src = sd[name]
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        assert shape == tuple(src.shape), (name, shape, tuple(src.shape))
        data = np.asarray(t.data)
        x32 = src.float().numpy() if src.dtype.is_floating_point else src.numpy()
        if t.tensor_type in PLAIN:
            want = src.to(PLAIN[t.tensor_type])
            got = torch.from_numpy(data.copy()).view(PLAIN[t.tensor_type]).reshape(want.shape) \
                if t.tensor_type == T.BF16 else torch.from_numpy(data.copy()).reshape(want.shape)
            assert np.array_equal(as_float(got), as_float(want), equal_nan=src.dtype.is_floating_point), name
            decoded = as_float(got)
        else:
            assert data.tobytes() == reference_bytes(x32, t.tensor_type), (name, t.tensor_type.name)
            with np.errstate(all="ignore"):
                decoded = gguf.quants.dequantize(data, t.tensor_type).reshape(src.shape)
        # ckpt's own decoding of its file is gguf's
        assert np.array_equal(as_float(back[name]), np.asarray(decoded, dtype=np.float64),
                              equal_nan=src.dtype.is_floating_point), name
        if not src.dtype.is_floating_point:
            continue
        finite = np.isfinite(x32)
        bad_in = int((~finite).sum())
        made = int((finite & ~np.isfinite(np.asarray(decoded, dtype=np.float64))).sum())
        said = counts.get("nonfinite_decoded", {}).get(name, 0) + counts.get("overflow", {}).get(name, 0)
        assert said == made, (name, t.tensor_type.name, said, made)
        produced += made
        seen_in = counts.get("nonfinite_input", {}).get(name, 0)
        if t.tensor_type in PLAIN and PLAIN[t.tensor_type] == src.dtype:
            assert seen_in in (0, bad_in), name  # a tensor copied byte for byte is not read (the summary says so)
        else:
            assert seen_in == bad_in, (name, t.tensor_type.name, seen_in, bad_in)
    if produced:
        assert "finite values decode as NaN/Inf" in err or "finite value decodes as NaN/Inf" in err \
            or "overflowed to inf" in err, err


@pytest.mark.parametrize("case", range(CASES))
def test_seeded_models_convert_to_gguf_or_are_refused_in_one_line(tmp_path, run_ckpt, ggml_lib, case):
    sd, to = make_case(case)
    save_file(sd, tmp_path / "m.safetensors")
    before = sorted(p.name for p in tmp_path.iterdir())
    code, out, err = run_ckpt("convert", tmp_path / "m.safetensors", "--to", to, "-o", tmp_path / "o.gguf",
                              "--report", tmp_path / "r.json")
    assert "Traceback" not in err, err
    if code == 2:
        assert err.count("\n") == 1 and err.startswith("error: "), err
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted(before + ["r.json"])  # the report says why
        assert not (tmp_path / "o.gguf").exists()
        return
    assert code == 0, (code, err)
    check_written(tmp_path, run_ckpt, sd, err)
