"""Torch pickles (.ckpt/.pt/.pth/.bin), loaded safely.

Always `weights_only=True` (never a custom pickle_module: that silently turns it off); a file that
needs other globals is refused with their names, found by torch without running anything. `mmap=True`
keeps tensor data on disk where the zip format allows it.
"""

from __future__ import annotations

import pickle
import re
import warnings
import zipfile
from pathlib import Path

import torch

from ckpt.errors import file_error

NESTED = ("state_dict", "model", "module", "model_state_dict")


def load_pickle_state_dict(path: Path) -> tuple[dict[str, torch.Tensor], str | None, bool]:
    """Returns (flat name -> tensor, a note on what was left out or None, whether the tensors are
    memory-mapped from the file: the zip format is, legacy pickles are in memory)."""
    zipped = zipfile.is_zipfile(path)
    obj = _load(path, zipped)
    note = None if zipped else (f"{path.name}: legacy (non-zip) torch pickle, read into memory whole "
                                "(the zip format is memory-mapped)")
    if isinstance(obj, dict):
        for key in NESTED:
            inner = obj.get(key)
            if isinstance(inner, dict) and any(isinstance(v, torch.Tensor) for v in inner.values()):
                others = [k for k in obj if k != key]
                nested = f"{path.name}: using the nested {key!r} ({len(inner)} entries)" + (
                    f"; not weights, left out: {', '.join(map(str, others[:8]))}" if others else "")
                note = f"{note}; {nested}" if note else nested
                obj = inner
                break
    if not isinstance(obj, dict):
        raise file_error(path, f"holds a {type(obj).__name__}, not a state dict of tensors")
    tensors = {str(k): v for k, v in obj.items() if isinstance(v, torch.Tensor)}
    other = [str(k) for k, v in obj.items() if not isinstance(v, torch.Tensor)]
    if not tensors:
        raise file_error(path, "holds no tensors")
    if other:
        extra = f"{len(other)} non-tensor entries left out: {', '.join(other[:8])}"
        note = f"{note}; {extra}" if note else f"{path.name}: {extra}"
    meta = [k for k, v in tensors.items() if v.is_meta]
    if meta:
        raise file_error(path, f"{len(meta)} tensors have no data (meta device): {', '.join(meta[:8])}")
    return tensors, note, zipped


def _load(path: Path, zipped: bool | None = None):
    """torch.load with weights_only=True (mmap for the zip format); every failure is a CkptError."""
    if zipped is None:
        zipped = zipfile.is_zipfile(path)
    try:
        with warnings.catch_warnings():  # torch's protocol-4 UserWarning would precede our own one-line error
            warnings.filterwarnings("ignore", message="Detected pickle protocol", category=UserWarning)
            return torch.load(path, map_location="cpu", weights_only=True, mmap=zipped)
    except pickle.UnpicklingError as e:
        unsafe = _unsafe_globals(path) if zipped else re.findall(r"Unsupported global: GLOBAL ([\w.]+)", str(e))
        if unsafe:
            raise file_error(path, "refusing to unpickle: it needs globals outside torch's safe set "
                             "(nothing was executed): " + ", ".join(dict.fromkeys(unsafe))) from None
        raise file_error(path, f"not a loadable torch pickle ({_reason(e)})") from None
    except Exception as e:  # torch raises many types for damaged files; none of them is a ckpt bug
        raise file_error(path, f"not a loadable torch pickle ({_reason(e)})") from None


def _reason(e: Exception) -> str:
    """One short line out of torch's long load errors: the weights-only unpickler's own complaint if
    there is one, else the first sentence."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(e))
    m = re.search(r"WeightsUnpickler error:\s*([^\n]+)", text)
    if m:
        return m.group(1).strip()
    if not text.strip():
        return f"{type(e).__name__}: file ends early" if isinstance(e, EOFError) else type(e).__name__
    first = text.strip().splitlines()[0]
    return re.split(r"(?<=\.) ", first, maxsplit=1)[0]


def _unsafe_globals(path: Path) -> list[str]:
    try:
        return list(torch.serialization.get_unsafe_globals_in_checkpoint(str(path)))
    except Exception:  # legacy (non-zip) files: torch cannot list them
        return []
