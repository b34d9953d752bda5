"""Which checkpoints a folder holds: each model counted once, and nothing that is not an input.

Rules (docs/batch.md lists them for users):
- A folder with `model_index.json` (a diffusers pipeline), `config.json` or a `*.index.json` is one
  model, with everything below it: shards of one model are one job. Exception: a training output folder
  (config.json and its own unsharded weights, plus `checkpoint-*`-style subfolders that are models of
  their own) is searched like a plain folder, so each run inside it is its own job.
- A training checkpoint folder (named `checkpoint-N`/`checkpoint_N`, or holding trainer state such as
  `optimizer.bin`, `random_states_0.pkl`, `training_state.json`) that has model subfolders is one job,
  like the single command on that folder: `transformer/`, a LoRA file beside it and so on are written
  together (trainer state is never copied), so batch and single outputs have the same layout.
- Any other `*.safetensors`, `*.ckpt`, `*.pt`, `*.pth`, `*.bin` file is one job; optimizer, scheduler,
  scaler and RNG-state pickles are not weights.
- A Hugging Face cache repo (`models--org--name`) contributes the snapshots its refs point at, named
  `org--name` (plus `@ref` when several refs point at different snapshots) for output mirroring.
- Hidden entries (names starting with "."; ckpt's own temp outputs are hidden) are never looked at.
- Outputs of an earlier run are not inputs: anything under the batch's output folder, and (for
  operations that write) safetensors whose `__metadata__` carries `ckpt_operation`, ckpt's provenance.
"""

from __future__ import annotations

import fnmatch
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from ckpt.errors import CkptError
from ckpt.io.file_kinds import NOT_WEIGHTS, PICKLES, SAFETENSORS, is_training_state
from ckpt.io.small_inputs import check_regular, read_text

JOB_SUFFIXES = SAFETENSORS + PICKLES
INDEX = re.compile(r"\.(safetensors|bin|pt|pth)\.index\.json$")


@dataclass(frozen=True)
class Found:
    """One checkpoint: `path` on disk; `rel` its place for output mirroring (POSIX, relative to the
    searched folder; the folder's own name when the searched path is itself the checkpoint)."""

    path: Path
    rel: str
    is_folder: bool


@dataclass
class Discovery:
    found: list[Found] = field(default_factory=list)
    ignored: list[tuple[str, str]] = field(default_factory=list)  # (rel, why)
    # (path, rel, why): checkpoints that cannot be read at all (a FIFO or a device named like a weight file);
    # each is a failed job of its own, never left out without a word
    refused: list[tuple[Path, str, str]] = field(default_factory=list)
    matched: int = 0  # checkpoints --glob matched (found, or ignored as an earlier output)


def is_weight_file(p: Path) -> bool:
    return p.suffix in JOB_SUFFIXES and not p.name.startswith(".") and not NOT_WEIGHTS.search(p.name)


def _entries(d: Path, special: list[Path] | None = None) -> tuple[list[Path], list[Path]]:
    """Visible files and folders of `d`, sorted (symlinked files count: the HF cache is made of them); the
    entries that are neither (a FIFO, a device, a socket, or a link to one) go to `special` when given."""
    files, dirs = [], []
    try:
        children = sorted(d.iterdir())
    except OSError as e:
        why = "permission denied (cannot list it)" if isinstance(e, PermissionError) else \
            f"cannot list folder ({e.strerror or e})"
        raise CkptError(f"{d}: {why}") from None
    for p in children:
        if p.name.startswith("."):
            continue
        try:  # a folder that may be listed but not entered (mode r without x) raises here, not above
            if p.is_dir():
                dirs.append(p)
            elif p.is_file():
                files.append(p)
            elif special is not None and p.exists():  # not a link to nothing: something that is no file
                special.append(p)
        except OSError as e:
            why = "permission denied (cannot enter it)" if isinstance(e, PermissionError) else (e.strerror or str(e))
            raise CkptError(f"{d}: {why}") from None
    return files, dirs


MARKERS = ("config.json", "model_index.json")


def _markers(files: list[Path]) -> set[str]:
    out = set()
    for p in files:
        if p.name in MARKERS:
            out.add(p.name)
        elif INDEX.search(p.name):
            out.add("index")
    return out


def _is_model_folder(d: Path) -> bool:
    files, _ = _entries(d)
    return bool(_markers(files))


TRAINING_CHECKPOINT = re.compile(r"checkpoint[-_]\d+", re.IGNORECASE)


def _is_training_checkpoint(d: Path, files: list[Path], dirs: list[Path]) -> bool:
    """A trainer's `checkpoint-N` folder (by name, or by the trainer state in it) with model subfolders."""
    if not (TRAINING_CHECKPOINT.fullmatch(d.name) or any(is_training_state(f) for f in files)):
        return False
    return any(_is_model_folder(s) and has_weights(s) for s in dirs)


def has_weights(d: Path) -> bool:
    for dirpath, dirnames, filenames in os.walk(d, followlinks=True):
        dirnames[:] = [n for n in dirnames if not n.startswith(".")]
        if any(is_weight_file(Path(dirpath) / n) for n in filenames):
            return True
    return False


def made_by_ckpt(path: Path) -> str | None:
    """The `ckpt_operation` recorded in a safetensors file (or a folder's first one), or the `ckpt.operation`
    of a GGUF file, else None. An unreadable header is not ours: that input will fail with its own clear
    error later."""
    from ckpt.io.header import read_header

    if path.is_dir():
        first = next(iter(sorted(p for p in path.rglob("*.safetensors") if p.is_file())), None)
        if first is None:
            return None
        path = first
    if not path.is_file():  # a FIFO or a device would block the read: not ours, and its job says what it is
        return None
    if path.suffix == ".gguf":
        return _gguf_operation(path)
    if path.suffix != ".safetensors":
        return None
    try:
        return read_header(path).metadata.get("ckpt_operation")
    except (CkptError, OSError):
        return None


def _gguf_operation(path: Path) -> str | None:
    from ckpt.io.gguf import read_gguf_header
    from ckpt.io.tensors import FileHandles

    handles = FileHandles()
    try:
        op = read_gguf_header(path, handles, path.name, whole_set=False).value("ckpt.operation")
    except (CkptError, OSError):
        return None
    finally:
        handles.close()
    return op if isinstance(op, str) else None


def mirror_name(repo_dir: Path) -> str:
    """The name a `models--org--name` cache folder is mirrored as: `org--name`; but the folder's own name
    where what follows `models--` is no name of its own (`models--..`, `models--.`, `models--`): mirrored
    as `..`, an output would land outside the batch's output folder."""
    name = repo_dir.name[len("models--"):]
    return name if safe_part(name) else repo_dir.name


def safe_part(name: str) -> bool:
    """Whether `name` is one path component that stays where it is put: not empty, `.` or `..`, no separator."""
    return name not in ("", ".", "..") and "/" not in name and "\\" not in name and "\0" not in name


def _hf_snapshots(repo_dir: Path) -> list[tuple[Path, str]]:
    """(snapshot folder, mirror name) for a `models--org--name` cache folder: the snapshots its refs
    point at (all of them when refs are missing or point nowhere)."""
    name = mirror_name(repo_dir)
    snaps = {p.name: p for p in _entries(repo_dir / "snapshots")[1]}
    refs: dict[str, str] = {}
    refs_dir = repo_dir / "refs"
    if refs_dir.is_dir():
        for r in sorted(refs_dir.rglob("*")):
            if r.is_file():
                try:
                    sha = read_text(r, limit=4096).strip()
                except CkptError:  # not a ref huggingface_hub wrote: the snapshots alone say what there is
                    continue
                if sha in snaps:
                    refs.setdefault(sha, str(r.relative_to(refs_dir)).replace("/", "-"))
    if not refs:
        refs = {sha: sha[:12] for sha in snaps}
    if len(refs) == 1:
        return [(snaps[sha], name) for sha in refs]
    return [(snaps[sha], f"{name}@{ref}") for sha, ref in sorted(refs.items(), key=lambda kv: kv[1])]


def matches(rel: str, pattern: str | None) -> bool:
    """--glob: a pattern without "/" matches any one path part (the file name or a folder above it);
    with "/" it matches the relative path or one of its leading parts (`*` crosses "/")."""
    if not pattern:
        return True
    parts = rel.split("/")
    if "/" not in pattern.strip("/"):
        return any(fnmatch.fnmatchcase(p, pattern) for p in parts)
    pat = pattern.strip("/")
    return any(fnmatch.fnmatchcase("/".join(parts[:i]), pat) for i in range(1, len(parts) + 1))


def discover(root: Path, *, exclude: list[Path] = (), pattern: str | None = None,
             skip_ckpt_outputs: bool = True) -> Discovery:
    """Checkpoints under `root` (a folder, or a single checkpoint file or folder)."""
    root = Path(root)
    if not root.exists():
        raise CkptError(f"{root}: no such file or directory")
    excluded = {p.resolve() for p in exclude}
    result = Discovery()

    def add(path: Path, rel: str, is_folder: bool):
        if not matches(rel, pattern):
            return
        result.matched += 1
        if skip_ckpt_outputs:
            op = made_by_ckpt(path)
            if op is not None:
                result.ignored.append((rel, f"output of an earlier `ckpt {op}`"))
                return
        result.found.append(Found(path, rel, is_folder))

    seen: set[Path] = set()

    def visit(d: Path, rel: str):
        real = d.resolve()
        if real in excluded:
            result.ignored.append((rel or ".", "the batch's output folder"))
            return
        if real in seen:  # a symlink back into the tree
            return
        seen.add(real)
        special: list[Path] = []
        files, dirs = _entries(d, special)
        if d.name.startswith("models--") and (d / "snapshots").is_dir():
            parent = rel.rsplit("/", 1)[0] if "/" in rel else ""
            for snap, name in _hf_snapshots(d):
                visit(snap, f"{parent}/{name}" if parent else name)
            return
        # a config.json that is a FIFO still says: a model folder (whose job then says why it fails)
        marks = _markers(files + special)
        if not marks and _is_training_checkpoint(d, files, dirs):
            add(d, rel or d.resolve().name, True)
            return
        if marks:
            container = ("model_index.json" not in marks and "index" not in marks
                         and any(_is_model_folder(s) for s in dirs))
            if not container:
                here = rel or d.resolve().name
                if has_weights(d):
                    add(d, here, True)
                else:
                    result.ignored.append((here, "model folder without weight files"))
                return
        for f in special:  # a FIFO or a device named like a weight file: a job of its own that fails, in one line
            here = f"{rel}/{f.name}" if rel else f.name
            if is_weight_file(f) and matches(here, pattern):
                result.matched += 1
                try:
                    check_regular(f)
                except CkptError as e:
                    result.refused.append((f, here, str(e)))
        for f in files:
            if is_weight_file(f):
                add(f, f"{rel}/{f.name}" if rel else f.name, False)
            elif f.suffix in JOB_SUFFIXES:
                result.ignored.append((f"{rel}/{f.name}" if rel else f.name, "training state, not weights"))
        for s in dirs:
            visit(s, f"{rel}/{s.name}" if rel else s.name)

    if not root.is_dir() and not root.is_file():
        check_regular(root)  # a FIFO or a device given as FOLDER: said as what it is
    if root.is_file():
        if root.suffix not in JOB_SUFFIXES:
            raise CkptError(f"{root}: not a checkpoint file (expected {', '.join(JOB_SUFFIXES)}) or a folder")
        add(root, root.name, False)
    else:
        visit(root, "")
    return result


def fingerprint(path: Path) -> tuple[int, int]:
    """(size in bytes, newest mtime in ns) of a file, or of every visible file under a folder: what the
    manifest compares to notice that an input changed since it was processed."""
    if path.is_file():
        st = path.stat()
        return st.st_size, st.st_mtime_ns
    size, mtime = 0, 0
    for dirpath, dirnames, filenames in os.walk(path, followlinks=True):
        dirnames[:] = sorted(n for n in dirnames if not n.startswith("."))
        for n in filenames:
            if n.startswith("."):
                continue
            try:
                st = (Path(dirpath) / n).stat()
            except OSError:  # a dangling link or an unreadable entry: not part of what is read
                continue
            size += st.st_size
            mtime = max(mtime, st.st_mtime_ns)
    return size, mtime
