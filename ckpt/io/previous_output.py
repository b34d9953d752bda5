"""Recognising what an earlier ckpt run wrote, so that `-o EXISTING_FOLDER` has one meaning and
`--overwrite` never deletes a file ckpt did not write.

The rule (docs/commands.md "Output paths"), the same for every command:

- `-o` naming an existing folder that is not a previous output of this kind receives the output inside
  it, under the default name (a file output always does; a folder output does when the folder is empty
  or holds someone else's files).
- A folder that is a previous ckpt output (`is_previous_output`: its safetensors/GGUF files all carry
  ckpt's own metadata or are rewritten by the new output, and there is at least one such file) is the
  output itself: it exists, so it needs --overwrite, and --overwrite replaces it only when every file in it is ckpt's or one the new
  output rewrites (`foreign_files`); anything else is refused by name, never deleted.

ckpt marks what it writes: safetensors files carry `ckpt_version` in their metadata, GGUF files the
`ckpt.version` key. A torch zip has no place for a mark; its files are recognised by name (the new output
rewrites them).
"""

from __future__ import annotations

import os
from pathlib import Path

from ckpt.errors import CkptError
from ckpt.io.side_files import head

MAX_LISTED = 5  # foreign files named in the refusal
_MAX_WALK = 100_000  # entries looked at before a folder counts as someone else's (-o $HOME)
_GGUF_MARK = b"ckpt.version"
_GGUF_HEAD = 1 << 20  # the key-value section comes first; ckpt's keys are in it
_MARKABLE = (".safetensors", ".gguf")  # weight files that carry ckpt's mark when ckpt wrote them


def planned_relpaths(plan) -> set[str]:
    """Every file (POSIX relpath) the plan writes into its output folder."""
    if plan is None:
        return set()
    rels = {f.relpath for f in plan.files} | set(plan.indexes) | set(plan.generated)
    return rels | {rel for _, rel in plan.copies}


def written_by_ckpt(path: Path) -> bool:
    """A regular weight file whose own metadata says ckpt wrote it."""
    name = path.name
    try:
        if name.endswith(".safetensors"):
            from ckpt.io.header import read_header

            return "ckpt_version" in read_header(path).metadata
        if name.endswith(".gguf"):
            return _GGUF_MARK in head(path, _GGUF_HEAD)
    except (OSError, CkptError):  # unreadable or not what its name says: not ours
        return False
    return False


def _files(folder: Path):
    """(relpath, path, is a regular file) of everything under `folder`, links not followed."""
    seen = 0
    for root, dirs, files in os.walk(folder, followlinks=False):
        r = Path(root)
        for n in files + [d for d in dirs if (r / d).is_symlink()]:
            seen += 1
            if seen > _MAX_WALK:
                return
            p = r / n
            yield p.relative_to(folder).as_posix(), p, p.is_file() and not p.is_symlink()


def is_previous_output(folder: Path, planned: set[str]) -> bool:
    """`folder` holds what an earlier run of ckpt wrote: some file in it is ckpt's or one the new output
    writes, and none of its markable weight files (safetensors, GGUF) is someone else's. A models folder
    that merely holds one file ckpt once wrote beside others is a folder to write into, not an output."""
    evidence = False
    for rel, p, regular in _files(folder):
        if rel in planned:
            evidence = True
        elif rel.endswith(_MARKABLE):
            if not (regular and written_by_ckpt(p)):
                return False
            evidence = True
    return evidence


def foreign_files(folder: Path, planned: set[str]) -> list[str]:
    """Files in `folder` that --overwrite must not delete: not ckpt's, and not rewritten by the new output.
    An `*.index.json` counts as ckpt's when every file its weight_map names is."""
    foreign, ours, indexes = [], set(), []
    for rel, p, regular in _files(folder):
        if rel in planned:
            continue
        if regular and rel.endswith(".index.json"):
            indexes.append((rel, p))
        elif regular and written_by_ckpt(p):
            ours.add(rel)
        else:
            foreign.append(rel)
    for rel, p in indexes:
        if not _index_of(p, folder, ours | planned):
            foreign.append(rel)
    return sorted(foreign)


def _index_of(index: Path, folder: Path, ours: set[str]) -> bool:
    from ckpt.io.small_inputs import load_json

    try:
        files = set(load_json(index)["weight_map"].values())
    except (CkptError, KeyError, TypeError, AttributeError):  # unreadable, too large, or no index: not ours
        return False
    base = index.parent.relative_to(folder)
    return bool(files) and all(isinstance(f, str) and (base / f).as_posix() in ours for f in files)
