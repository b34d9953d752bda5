"""Where the math runs: `--device cpu|cuda|auto`, and exact fp32 on a GPU.

`--device auto` picks CUDA only where it helps: when a CUDA device is available and the command does math
beyond a dtype cast (decoding or encoding quantized weights, merging adapters, SVD). A plain cast or a
layout rename stays on the CPU: its cost is reading and writing the file, and a GPU adds two PCIe copies
and the CUDA start-up (1-2 s) to it while the CPU cast already outruns the disk.

fp32 math on CUDA never silently uses TF32 (10 mantissa bits instead of 23): `exact_fp32` turns it off
around ckpt's own work and gives the caller's setting back afterwards.

A command that plans without torch (merge-lora, merge: torch imports on a thread beside the planning,
`ckpt.lazy.prefetch`) asks `cpu_without_torch` first and resolves any other answer after planning: asking CUDA
imports torch, so asked first it would hold the planning (and the early copies, `ckpt.io.early_copies`) back
for the whole import. `auto` on a torch built without CUDA and ROCm is the CPU, and torch's own version file says
so without an import.
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


def cpu_without_torch(name: str, heavy: bool = True) -> bool:
    """Whether `--device NAME` is surely the CPU, known without importing torch: `cpu`, and `auto` for light work
    or where the installed torch is built with neither CUDA nor ROCm (then `torch.cuda.is_available()` is False).
    False: ask `resolve_device` (after planning, where the command plans without torch)."""
    if name == "cpu":
        return True
    return name == "auto" and (not heavy or not torch_has_gpu_backend())


def torch_has_gpu_backend() -> bool:
    """Whether the installed torch is built with CUDA or ROCm, read from its `torch/version.py` (which sets
    `torch.version.cuda` and `torch.version.hip`) without importing torch; True where that file does not tell
    (then the caller asks torch itself)."""
    import importlib.util

    from ckpt.io.small_inputs import read_text

    try:
        spec = importlib.util.find_spec("torch")
    except (ImportError, ValueError):
        return True
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    if not folders:
        return True
    try:
        text = read_text(os.path.join(folders[0], "version.py"), limit=1 << 16)
    except CkptError:
        return True
    return gpu_backend_named(text)


def gpu_backend_named(version_py: str) -> bool:
    """Whether torch's version.py text names a GPU backend: True unless it assigns both `cuda` and `hip` a
    literal None, as a CPU build's does."""
    import ast

    try:
        tree = ast.parse(version_py)
    except (SyntaxError, ValueError):
        return True
    values = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target, value = node.targets[0], node.value
        elif isinstance(node, ast.AnnAssign):
            target, value = node.target, node.value
        else:
            continue
        if isinstance(target, ast.Name) and target.id in ("cuda", "hip"):
            values[target.id] = value
    return not (set(values) == {"cuda", "hip"}
                and all(isinstance(v, ast.Constant) and v.value is None for v in values.values()))


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
