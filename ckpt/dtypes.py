"""safetensors dtype names, torch dtypes and the facts about them the planner needs."""

from __future__ import annotations

import torch

# safetensors header name -> torch dtype (the names safetensors itself accepts).
ST_TO_TORCH: dict[str, torch.dtype] = {
    "BOOL": torch.bool,
    "U8": torch.uint8,
    "I8": torch.int8,
    "I16": torch.int16,
    "U16": torch.uint16,
    "I32": torch.int32,
    "U32": torch.uint32,
    "I64": torch.int64,
    "U64": torch.uint64,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F32": torch.float32,
    "F64": torch.float64,
    "C64": torch.complex64,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "F8_E4M3FNUZ": torch.float8_e4m3fnuz,
    "F8_E5M2FNUZ": torch.float8_e5m2fnuz,
    "F8_E8M0": torch.float8_e8m0fnu,
}
TORCH_TO_ST: dict[torch.dtype, str] = {v: k for k, v in ST_TO_TORCH.items()}

# Valid safetensors names whose packed sub-byte layouts ckpt does not decode.
ST_UNSUPPORTED = {"F4": "packed fp4", "F6_E2M3": "packed fp6", "F6_E3M2": "packed fp6"}

FP8 = (torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz)

# Names accepted on the command line for --to.
TARGETS: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "fp16": torch.float16,
    "bf16": torch.bfloat16,
    "fp8_e4m3fn": torch.float8_e4m3fn,
}

SHORT: dict[torch.dtype, str] = {
    torch.float32: "fp32",
    torch.float16: "fp16",
    torch.bfloat16: "bf16",
    torch.float64: "fp64",
    torch.float8_e4m3fn: "fp8_e4m3fn",
    torch.float8_e5m2: "fp8_e5m2",
    torch.float8_e4m3fnuz: "fp8_e4m3fnuz",
    torch.float8_e5m2fnuz: "fp8_e5m2fnuz",
    torch.float8_e8m0fnu: "fp8_e8m0",
}


# config.json `torch_dtype` / `dtype` values (transformers and diffusers spell them this way).
CONFIG_NAMES: dict[torch.dtype, str] = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32"}
CONFIG_KEYS = ("torch_dtype", "dtype")


def config_dtype(cfg: dict | None) -> torch.dtype | None:
    """The model dtype a config.json declares (`"bfloat16"`, `"torch.float16"`, `"bf16"`...), or None."""
    names = {**{v: k for k, v in CONFIG_NAMES.items()}, **{SHORT[d]: d for d in CONFIG_NAMES}}
    for key in CONFIG_KEYS:
        d = names.get(str((cfg or {}).get(key, "")).replace("torch.", ""))
        if d is not None:
            return d
    return None


def is_float(dtype: torch.dtype) -> bool:
    """True for dtypes that `convert` casts (floating point, fp8 included; e8m0 is a scale format)."""
    return dtype.is_floating_point and dtype != torch.float8_e8m0fnu


def short_name(dtype: torch.dtype) -> str:
    return SHORT.get(dtype) or TORCH_TO_ST.get(dtype, str(dtype)).lower()


def nbytes(dtype: torch.dtype, shape) -> int:
    n = dtype.itemsize
    for d in shape:
        n *= d
    return n
