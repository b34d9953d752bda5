"""safetensors dtype names, torch dtypes and the facts about them the planner needs.

What reading and inspecting headers needs (sizes, which names are floating or FP8, short names) is plain
data keyed by the safetensors name, so that it never imports torch. The tables of torch dtypes are built on
first use (`LazyTable`), by code that does tensor math and imports torch anyway."""

from __future__ import annotations

from ckpt.lazy import torch

# safetensors header name -> torch.<attribute> (the names safetensors itself accepts) and element size.
ST_TORCH_NAMES: dict[str, str] = {
    "BOOL": "bool", "U8": "uint8", "I8": "int8", "I16": "int16", "U16": "uint16", "I32": "int32", "U32": "uint32",
    "I64": "int64", "U64": "uint64", "F16": "float16", "BF16": "bfloat16", "F32": "float32", "F64": "float64",
    "C64": "complex64", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "F8_E4M3FNUZ": "float8_e4m3fnuz",
    "F8_E5M2FNUZ": "float8_e5m2fnuz", "F8_E8M0": "float8_e8m0fnu",
}
ST_ITEMSIZE: dict[str, int] = {
    "BOOL": 1, "U8": 1, "I8": 1, "I16": 2, "U16": 2, "I32": 4, "U32": 4, "I64": 8, "U64": 8, "F16": 2, "BF16": 2,
    "F32": 4, "F64": 8, "C64": 8, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E4M3FNUZ": 1, "F8_E5M2FNUZ": 1, "F8_E8M0": 1,
}
ST_FP8 = ("F8_E4M3", "F8_E5M2", "F8_E4M3FNUZ", "F8_E5M2FNUZ")
# the names `is_float` is true for (floating point, fp8 included; e8m0 is a scale format)
ST_FLOAT = frozenset({"F16", "BF16", "F32", "F64", *ST_FP8})


class LazyTable:
    """A table of torch dtypes built on first use: `in`, iteration, `[]`, `.get`/`.items`... of the dict or
    tuple `build()` returns. Importing this module (or reading headers) therefore never imports torch."""

    def __init__(self, build):
        self._build, self._value = build, None

    def _table(self):
        if self._value is None:
            self._value = self._build()
        return self._value

    def __contains__(self, x):
        return x in self._table()

    def __iter__(self):
        return iter(self._table())

    def __len__(self):
        return len(self._table())

    def __getitem__(self, k):
        return self._table()[k]

    def __getattr__(self, attr):
        if attr.startswith("_"):
            raise AttributeError(attr)
        return getattr(self._table(), attr)


ST_TO_TORCH: dict[str, torch.dtype] = LazyTable(lambda: {k: getattr(torch, v) for k, v in ST_TORCH_NAMES.items()})
TORCH_TO_ST: dict[torch.dtype, str] = LazyTable(lambda: {v: k for k, v in ST_TO_TORCH.items()})

# Valid safetensors names whose packed sub-byte layouts ckpt does not decode.
ST_UNSUPPORTED = {"F4": "packed fp4", "F6_E2M3": "packed fp6", "F6_E3M2": "packed fp6"}

FP8: tuple[torch.dtype, ...] = LazyTable(lambda: tuple(ST_TO_TORCH[n] for n in ST_FP8))

# short names of the floating dtypes, by safetensors name; any other dtype is its safetensors name, lowercase
ST_SHORT: dict[str, str] = {
    "F32": "fp32", "F16": "fp16", "BF16": "bf16", "F64": "fp64", "F8_E4M3": "fp8_e4m3fn", "F8_E5M2": "fp8_e5m2",
    "F8_E4M3FNUZ": "fp8_e4m3fnuz", "F8_E5M2FNUZ": "fp8_e5m2fnuz", "F8_E8M0": "fp8_e8m0",
}
SHORT: dict[torch.dtype, str] = LazyTable(lambda: {ST_TO_TORCH[k]: v for k, v in ST_SHORT.items()})


# config.json `torch_dtype` / `dtype` values (transformers and diffusers spell them this way), by safetensors name
# (a plan made without torch writes them) and by torch dtype.
ST_CONFIG_NAMES: dict[str, str] = {"F16": "float16", "BF16": "bfloat16", "F32": "float32"}
CONFIG_NAMES: dict[torch.dtype, str] = LazyTable(lambda: {ST_TO_TORCH[k]: v for k, v in ST_CONFIG_NAMES.items()})
CONFIG_KEYS = ("torch_dtype", "dtype")


def config_dtype(cfg: dict | None) -> torch.dtype | None:
    """The model dtype a config.json declares (`"bfloat16"`, `"torch.float16"`, `"bf16"`...), or None."""
    names = {**{v: k for k, v in CONFIG_NAMES.items()}, **{SHORT[d]: d for d in CONFIG_NAMES}}
    for key in CONFIG_KEYS:
        d = names.get(str((cfg or {}).get(key, "")).replace("torch.", ""))
        if d is not None:
            return d
    return None


def is_float(dtype) -> bool:
    """True for dtypes that `convert` casts (floating point, fp8 included; e8m0 is a scale format); `dtype` a torch
    dtype or its safetensors name (planning without torch)."""
    if isinstance(dtype, str):
        return dtype in ST_FLOAT
    return dtype.is_floating_point and dtype != torch.float8_e8m0fnu


def short_name(dtype) -> str:
    """"bf16", "fp8_e4m3fn", "i32"... of a torch dtype or its safetensors name."""
    if isinstance(dtype, str):
        return st_short_name(dtype)
    return SHORT.get(dtype) or TORCH_TO_ST.get(dtype, str(dtype)).lower()


def st_short_name(name: str) -> str:
    """`short_name` of the dtype a safetensors name stands for (without torch)."""
    return ST_SHORT.get(name) or name.lower()


def st_name(dtype) -> str:
    """The safetensors name of `dtype`: a torch dtype, or already its name (a plan that only copies stored
    bytes names dtypes so, because it never imports torch)."""
    return dtype if isinstance(dtype, str) else TORCH_TO_ST[dtype]


def as_torch(dtype) -> torch.dtype:
    """`dtype` as a torch dtype (from its safetensors name where a plan gave that)."""
    return ST_TO_TORCH[dtype] if isinstance(dtype, str) else dtype


def itemsize(dtype) -> int:
    """Bytes per element of a torch dtype or a safetensors name."""
    return ST_ITEMSIZE[dtype] if isinstance(dtype, str) else dtype.itemsize


def nbytes(dtype, shape) -> int:
    """Bytes of a tensor of `shape` in `dtype` (a torch dtype or its safetensors name)."""
    n = itemsize(dtype)
    for d in shape:
        n *= d
    return n
