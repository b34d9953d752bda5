"""Torch pickles (.ckpt/.pt/.pth/.bin), loaded safely.

Always `weights_only=True` (never a custom pickle_module: that silently turns it off); a file that
needs other globals is refused with their names, found by torch without running anything. `mmap=True`
keeps tensor data on disk where the zip format allows it.

Lightning `.ckpt` files keep their hyperparameters beside the weights: `argparse.Namespace`, `pathlib`
paths, omegaconf `DictConfig`/`ListConfig` and their nodes, Lightning's `AttributeDict`, numpy scalars.
Those globals (and only those, by exact name: `HARMLESS`) are given to torch's weights-only unpickler as
inert stand-ins: a placeholder class that stores the arguments and state the pickle hands it and runs
none of the real class's code (the real modules are never imported). Every other global is still
refused by name, before anything runs.
"""

from __future__ import annotations

import pickle
import re
import struct
import warnings
import zipfile
from pathlib import Path

from ckpt.lazy import torch

from ckpt.errors import file_error
from ckpt.report import plural

NESTED = ("state_dict", "model", "module", "model_state_dict")


class Inert:
    """An object of a known-harmless class, as the pickle described it: its constructor arguments and
    its state, stored and never interpreted. Subclassed once per global name (`HARMLESS`)."""

    global_name = "?"

    def __new__(cls, *args, **kwargs):
        _SEEN.add(cls.global_name)
        return super().__new__(cls)

    def __init__(self, *args, **kwargs):
        self.args, self.kwargs, self.state = args, kwargs, None

    def __setstate__(self, state):
        self.state = state

    def __repr__(self):
        return f"<inert {self.global_name}>"


class InertMapping(Inert):
    """A dict subclass or factory (`collections.defaultdict`, Lightning's `AttributeDict`): torch's
    unpickler fills only plain dicts, so the stand-in *is* a plain dict (its items are what we keep)."""

    def __new__(cls, *args, **kwargs):
        _SEEN.add(cls.global_name)
        return {}


_SEEN: set[str] = set()  # global names of the placeholders made by the load in progress


_PATHS = ("Path", "PosixPath", "WindowsPath", "PurePath", "PurePosixPath", "PureWindowsPath")
_OMEGACONF = {"omegaconf.dictconfig": ("DictConfig",), "omegaconf.listconfig": ("ListConfig",),
              "omegaconf.base": ("ContainerMetadata", "Metadata", "SCMode"),
              "omegaconf.nodes": ("AnyNode", "StringNode", "IntegerNode", "FloatNode", "BooleanNode", "EnumNode",
                                  "BytesNode", "PathNode", "InterpolationResultNode", "ValueNode")}
# Global name -> placeholder kind. Type references (builtins, typing) appear as annotations inside
# omegaconf metadata; they become placeholders too, never the real callables.
HARMLESS: dict[str, type] = {
    "argparse.Namespace": Inert,
    **{f"{m}.{c}": Inert for m in ("pathlib", "pathlib._local") for c in _PATHS},
    **{f"{m}.{c}": Inert for m, cs in _OMEGACONF.items() for c in cs},
    **{f"typing.{n}": Inert for n in ("Any", "Union", "Optional", "Dict", "List", "Tuple")},
    **{f"builtins.{n}": Inert for n in ("dict", "list", "tuple", "int", "float", "str", "bool", "bytes", "object")},
    "collections.defaultdict": InertMapping,
    "pytorch_lightning.utilities.parsing.AttributeDict": InertMapping,
    "lightning_fabric.utilities.data.AttributeDict": InertMapping,
    "lightning.fabric.utilities.data.AttributeDict": InertMapping,
    **{f"{m}.{n}": Inert for m in ("numpy.core.multiarray", "numpy._core.multiarray") for n in ("scalar", "_reconstruct")},
    "numpy.dtype": Inert,
    "numpy.ndarray": Inert,
}


def _stand_ins() -> list[tuple[type, str]]:
    return [(type(name.rsplit(".", 1)[1], (kind,), {"global_name": name, "__module__": __name__}), name)
            for name, kind in HARMLESS.items()]


_STAND_INS = _stand_ins()


def is_zip(path: Path) -> bool:
    """zipfile.is_zipfile, which raises BadZipFile (not OSError) on an odd zip64 locator: then it is a
    damaged zip, reported as such."""
    try:
        return zipfile.is_zipfile(path)
    except (zipfile.BadZipFile, ValueError, struct.error) as e:
        raise file_error(path, f"not a loadable torch pickle (damaged zip: {e})") from None


def load_pickle_state_dict(path: Path) -> tuple[dict[str, torch.Tensor], str | None, bool]:
    """Returns (flat name -> tensor, a note on what was left out or None, whether the tensors are
    memory-mapped from the file: the zip format is, legacy pickles are in memory)."""
    zipped = is_zip(path)
    _SEEN.clear()
    obj = load(path, zipped)
    note = None if zipped else (f"{path.name}: legacy (non-zip) torch pickle, read into memory whole "
                                "(the zip format is memory-mapped)")
    if _SEEN:
        inert = (f"{path.name}: read {', '.join(sorted(_SEEN))} (hyperparameters, not weights) as inert "
                 "placeholders; none of their code ran")
        note = f"{note}; {inert}" if note else inert
    if isinstance(obj, dict):
        for key in NESTED:
            inner = obj.get(key)
            if isinstance(inner, dict) and _has_tensors(inner):
                others = [k for k in obj if k != key]
                nested = f"{path.name}: using the nested {key!r} ({plural(len(inner), 'entry')})" + (
                    f"; not weights, left out: {', '.join(map(str, others[:8]))}" if others else "")
                note = f"{note}; {nested}" if note else nested
                obj = inner
                break
    if not isinstance(obj, dict):
        raise file_error(path, f"holds a {type(obj).__name__}, not a state dict of tensors")
    flat = flatten(obj, path)
    grouped = [k for k, v in flat.items() if k not in obj and isinstance(v, torch.Tensor)]
    if grouped:
        nested = (f"{path.name}: {plural(len(grouped), 'tensor')} stored in nested dicts, named with dots as a "
                  f"state dict names them ({', '.join(grouped[:3])}{', ...' if len(grouped) > 3 else ''})")
        note = f"{note}; {nested}" if note else nested
    obj = flat
    tensors = {str(k): v for k, v in obj.items() if isinstance(v, torch.Tensor)}
    other = [str(k) for k, v in obj.items() if not isinstance(v, torch.Tensor)]
    if not tensors:
        raise file_error(path, "holds no tensors")
    if other:
        extra = f"{plural(len(other), 'non-tensor entry')} left out: {', '.join(other[:8])}"
        note = f"{note}; {extra}" if note else f"{path.name}: {extra}"
    meta = [k for k, v in tensors.items() if v.is_meta]
    if meta:
        raise file_error(path, f"{plural(len(meta), 'tensor')} {'has' if len(meta) == 1 else 'have'} no data (meta device): "
                               f"{', '.join(meta[:8])}")
    return tensors, note, zipped


def _has_tensors(d: dict) -> bool:
    """Whether a dict holds tensors, directly or in nested dicts with string keys (what `flatten` reads)."""
    return any(isinstance(v, torch.Tensor) or (isinstance(v, dict) and _groupable(v) and _has_tensors(v))
               for v in d.values())


def _groupable(d: dict) -> bool:
    return bool(d) and all(isinstance(k, str) for k in d)


def flatten(obj: dict, path: Path) -> dict:
    """{"lin.weight": {"_data": t, "_scale": s}} -> {"lin.weight._data": t, "lin.weight._scale": s}.

    Some savers group a module's tensors in nested dicts (a legacy optimum-quanto weight as a dict of its
    parts); leaving such an entry out as "not a tensor" dropped the weight from the state dict and made
    inspect count only what stayed flat. A nested dict with string keys holding tensors is read as the
    state dict it spells, its keys joined with dots (its non-tensor leaves too: legacy quanto strings).
    Dicts with other keys (an optimizer's {0: {...}}), lists and other values stay single entries. Two
    spellings of one name are refused."""
    out: dict = {}

    def put(name, v):
        if name in out:
            raise file_error(path, f"holds {name!r} twice (once flat, once in nested dicts)")
        out[name] = v

    def walk(prefix, d):
        for k, v in d.items():
            name = f"{prefix}{k}"
            if isinstance(v, dict) and _groupable(v) and _has_tensors(v):
                walk(name + ".", v)
            else:
                put(name if prefix else k, v)

    walk("", obj)
    return out


def load(path: Path, zipped: bool | None = None):
    """torch.load with weights_only=True (mmap for the zip format), the HARMLESS globals read as inert
    placeholders; every failure is a CkptError."""
    if zipped is None:
        zipped = is_zip(path)
    try:
        with warnings.catch_warnings(), torch.serialization.safe_globals(_STAND_INS):
            # torch's protocol-4 UserWarning would precede our own one-line error
            warnings.filterwarnings("ignore", message="Detected pickle protocol", category=UserWarning)
            return torch.load(path, map_location="cpu", weights_only=True, mmap=zipped)
    except pickle.UnpicklingError as e:
        unsafe = _unsafe_globals(path) if zipped else re.findall(r"(?i)unsupported (?:global: )?GLOBAL ([\w.]+)", str(e))
        unsafe = [g for g in unsafe if g not in HARMLESS]
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
