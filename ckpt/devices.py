"""Where the math runs: `--device cpu|cuda|auto`, and exact fp32 on a GPU.

`--device auto` picks CUDA only where it helps: when a CUDA device is available and the command does math
beyond a dtype cast (decoding or encoding quantized weights, merging adapters, SVD). A plain cast or a
layout rename stays on the CPU: its cost is reading and writing the file, and a GPU adds two PCIe copies
and the CUDA start-up (1-2 s) to it while the CPU cast already outruns the disk.

fp32 math on CUDA never silently uses TF32 (10 mantissa bits instead of 23): `exact_fp32` turns it off
around ckpt's own work and gives the caller's setting back afterwards.
"""

from __future__ import annotations

import contextlib
import os

from ckpt.errors import CkptError
from ckpt.lazy import torch

TF32_OVERRIDE = "TORCH_ALLOW_TF32_CUBLAS_OVERRIDE"  # makes cuBLAS use TF32 whatever the flags say


def resolve_device(name: str, heavy: bool = True) -> torch.device:
    """The device of `--device NAME`; `heavy`: whether the run does math a GPU speeds up (for `auto`)."""
    if name == "auto":
        name = "cuda" if heavy and torch.cuda.is_available() else "cpu"
    if name.startswith("cuda"):
        if not torch.cuda.is_available():
            raise CkptError("--device cuda: no CUDA device is available (this torch build: "
                            f"{torch.version.__version__}); use --device cpu")
        if os.environ.get(TF32_OVERRIDE, "0") not in ("", "0"):
            raise CkptError(f"--device cuda: {TF32_OVERRIDE} is set, which makes every fp32 matmul use TF32 "
                            "(about 3 significant digits); unset it or use --device cpu")
    return torch.device(name)


def _tf32_state():
    """(legacy flags or None where the caller mixed the legacy and the new API, the new API's values)."""
    m, c = torch.backends.cuda.matmul, torch.backends.cudnn
    try:  # the legacy getters raise on a mix
        legacy = (m.allow_tf32, c.allow_tf32, torch.get_float32_matmul_precision())
    except RuntimeError:
        legacy = None
    return legacy, (m.fp32_precision, c.conv.fp32_precision)


def _set_tf32_state(legacy, new) -> None:
    m, c = torch.backends.cuda.matmul, torch.backends.cudnn
    if legacy is not None:  # the legacy setters write the legacy and the new flags consistently
        m.allow_tf32, c.allow_tf32 = legacy[0], legacy[1]
        torch.set_float32_matmul_precision(legacy[2])
    if new is not None:  # then the new API's own values ("none" = inherit) exactly as they were
        m.fp32_precision, c.conv.fp32_precision = new


@contextlib.contextmanager
def exact_fp32():
    """fp32 matmuls, convolutions and SVDs in full fp32 on CUDA (no TF32), whatever the caller set;
    the caller's setting is back afterwards. Harmless on the CPU (the flags only steer CUDA kernels)."""
    saved = _tf32_state()
    _set_tf32_state((False, False, "highest"), None)
    try:
        yield
    finally:
        _set_tf32_state(*saved)
