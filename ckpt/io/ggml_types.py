"""GGML's tensor types as gguf-py numbers them: which are plain arrays of one dtype, their names, and the bytes a
block-quantized tensor takes. Apart from the GGUF reader (`ckpt.io.gguf`) because every writer (the
safetensors/GGUF region planner in `ckpt.io.writer`, the GGUF writer, the decoders) needs these sizes without
reading a GGUF.

The gguf package can be older than the llama.cpp whose files ckpt writes and reads: gguf 0.19 has no Q2_0 (ggml's
type 42, llama-quantize's Q2_0 file type 41). `gguf_package()` adds what it lacks (`MISSING_TYPES`,
`MISSING_FILE_TYPES`) to its enums and size table the first time it is called, so that its reader opens such files
and every `GGMLQuantizationType[name]` / `LlamaFileType[name]` lookup knows them; a gguf that has them is checked to
agree (a package that numbers them otherwise is a different format: refused)."""

from __future__ import annotations

import math
import threading

from ckpt.lazy import torch

from ckpt.dtypes import ST_TO_TORCH


# ggml.h types the gguf package may lack: name -> (enum ggml_type number, values per block, bytes per block)
MISSING_TYPES = {"Q2_0": (42, 64, 18)}  # block_q2_0: an fp16 scale and 64 2-bit values (ggml-common.h)
# llama.h file types it may lack: name -> enum llama_ftype number
MISSING_FILE_TYPES = {"MOSTLY_Q2_0": 41}

_added = threading.Lock()
_checked = False


def gguf_package():
    """The `gguf` package (gguf-py), imported on first use: it is only needed when a GGUF is read or written. The
    types it lacks are added to it (module docstring)."""
    global _checked
    import gguf

    if not _checked:
        with _added:
            if not _checked:
                for name, (value, blk, size) in MISSING_TYPES.items():
                    t = _enum_member(gguf.GGMLQuantizationType, name, value)
                    if gguf.GGML_QUANT_SIZES.setdefault(t, (blk, size)) != (blk, size):
                        raise RuntimeError(f"gguf {name} blocks are {gguf.GGML_QUANT_SIZES[t]}, not {(blk, size)}")
                for name, value in MISSING_FILE_TYPES.items():
                    _enum_member(gguf.LlamaFileType, name, value)
                _checked = True
    return gguf


def _enum_member(cls, name: str, value: int):
    """cls[name], added to the IntEnum `cls` (as its metaclass would have made it) where the package lacks it."""
    if name in cls.__members__:
        if int(cls[name]) != value:
            raise RuntimeError(f"gguf numbers {cls.__name__}.{name} {int(cls[name])}, llama.cpp {value}")
        return cls[name]
    if value in cls._value2member_map_:
        raise RuntimeError(f"gguf's {cls.__name__} {value} is {cls(value).name}, llama.cpp's is {name}")
    member = int.__new__(cls, value)
    member._name_, member._value_ = name, value
    member.__objclass__ = cls
    type.__setattr__(cls, name, member)
    cls._member_map_[name] = member
    cls._value2member_map_[value] = member
    cls._member_names_.append(name)
    return member


def plain_names() -> dict[int, str]:
    """GGML types that are plain arrays of one dtype, by its safetensors name (reading headers needs no torch)."""
    T = gguf_package().GGMLQuantizationType
    return {T.F32: "F32", T.F16: "F16", T.BF16: "BF16", T.F64: "F64", T.I8: "I8", T.I16: "I16", T.I32: "I32",
            T.I64: "I64"}


def plain_types() -> dict[int, torch.dtype]:
    """GGML types that are plain arrays of one torch dtype."""
    return {k: ST_TO_TORCH[v] for k, v in plain_names().items()}


def type_name(ggml_type: int) -> str:
    T = gguf_package().GGMLQuantizationType
    try:
        return T(ggml_type).name
    except ValueError:
        return f"type {ggml_type}"


def block_size(ggml_type: int) -> tuple[int, int]:
    """(elements per block, bytes per block); plain types are blocks of one element."""
    return gguf_package().GGML_QUANT_SIZES[ggml_type]


def encoded_nbytes(ggml_type: int, shape) -> int:
    blk, size = block_size(ggml_type)
    return math.prod(shape) // blk * size
