"""Split GGUF files: llama.cpp's `gguf-split` layout, read as one model and written by `--max-shard-size`.

The layout (llama.cpp's tools/gguf-split/gguf-split.cpp, and gguf-py's `GGUFWriter(split_max_size=...)`
that convert_hf_to_gguf.py uses): parts `PREFIX-00001-of-0000N.gguf` ... (`llama_split_path`,
"%s-%05d-of-%05d.gguf", numbered from 1) side by side. Every part is a complete GGUF file holding its own
tensors (their offsets relative to its own data section) and three keys: `split.no` (UINT16, from 0),
`split.count` (UINT16) and `split.tensors.count` (INT32, the tensors of all parts). The first part also
holds all the model's metadata, the split keys after it; the others hold only the split keys. Tensors
keep the model's order across the parts; a new part starts when the next tensor's data (padded to 32
bytes) would take the part's tensor data past the size (headers are not counted); a tensor larger than
the size gets a part of its own.

Reading (`ckpt.io.gguf.open_split_set`, the names in `ckpt.io.gguf_parts`): any part opens the whole set, as one `GGUFHeader` whose metadata is the first
part's (split keys left out: they describe files, not the model) and whose tensors are every part's,
each read from its own file at its own offset. What llama.cpp's loader checks is checked (each part's
`split.no`, no tensor in two parts, the total against `split.tensors.count`), and more, each a one-line
error: a missing part (named), a part whose name, `split.count` or `split.tensors.count` disagrees, a
part of another model (its `general.architecture` differs). A file with `split.count` 1 is just a file.

Writing (`split_gguf_plan`): a one-file GGUF plan becomes a `SplitPlan` of parts in that layout; one part
only is the plain file without split keys, as gguf-py's writer does. The parts are siblings, not a folder:
`ckpt.io.output` writes each to a temp name beside it and publishes them as a set (`ckpt.io.publish.publish_set`).

What a stopped run leaves (a SIGKILL or a power loss cannot be deferred; the publish renames part after part, in
order): the parts published so far, and a temp file for each of the others. A GGUF output named OUT (`m.gguf`) is
the set `m-NNNNN-of-MMMMM.gguf` of any count too (`set_member`), so the next run writing OUT removes the set's
stale temps as it removes OUT's own (`ckpt.io.publish.remove_stale_temps`), and recognises the parts of a set a ckpt
run published but not all (`partial_sets`: the first part carries ckpt's mark, every part there holds the split
keys ckpt writes for its place and nothing else, and a part is missing). Such a set is an existing output of OUT:
without --overwrite the run is refused (`check_partial_sets`), with it the set is replaced: after the new output is
published, its parts that the new one did not overwrite are removed (`PartialSet.remove`, each checked to be the
file that was recognised). Parts of a set that is not recognised as ckpt's are never removed.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass, field
from pathlib import Path

from ckpt.errors import CkptError
from ckpt.io.gguf import read_gguf_header
from ckpt.io.gguf_parts import KEY_COUNT, KEY_NO, KEY_TENSORS, PART_RE, SPLIT_KEYS, part_paths, set_member
from ckpt.io.plan import OutFile, Plan

# ------------------------------------------------------------------------------------------ writing


@dataclass
class SplitPlan(Plan):
    """A GGUF written as parts beside OUT (`files` in order): OUT `m.gguf` names the set, whose files are
    `m-00001-of-0000N.gguf` ... (`part_paths`). `single_file` stays True: OUT is a file name, not a folder."""

    def part_paths(self, out: Path) -> list[Path]:
        return part_paths(out, len(self.files))


PAD = 32  # GGUF_DEFAULT_ALIGNMENT: gguf-split sizes each tensor padded to it


def _padded(n: int) -> int:
    return -(-n // PAD) * PAD


def split_gguf_plan(plan: Plan, max_bytes: int) -> Plan:
    """A one-file GGUF plan as parts of at most `max_bytes` of tensor data each (gguf-split's rule, module
    docstring); the plan itself when everything fits in one part (one plain file, as gguf-py writes it)."""
    from ckpt.io.gguf_writer import Field

    if len(plan.files) != 1 or plan.files[0].format != "gguf" or not plan.single_file:
        raise ValueError("split_gguf_plan takes a plan of one GGUF file")
    f = plan.files[0]
    groups: list[list] = [[]]
    size = 0
    for t in f.tensors:
        n = _padded(t.entry.nbytes)
        if groups[-1] and size + n > max_bytes:
            groups.append([])
            size = 0
        groups[-1].append(t)
        size += n
    if len(groups) == 1:
        return plan
    import gguf

    V = gguf.GGUFValueType
    count = len(groups)
    base = [x for x in f.fields if x.key not in SPLIT_KEYS]
    files = []
    for i, ts in enumerate(groups):
        keys = [Field(KEY_NO, i, V.UINT16), Field(KEY_COUNT, count, V.UINT16),
                Field(KEY_TENSORS, len(f.tensors), V.INT32)]
        files.append(OutFile("", {}, ts, "gguf", archive=f.archive, fields=(base if i == 0 else []) + keys))
    return SplitPlan(single_file=True, files=files, indexes=dict(plan.indexes), copies=list(plan.copies),
                     json_edits=dict(plan.json_edits), generated=dict(plan.generated), notes=list(plan.notes),
                     busy_stage=plan.busy_stage)


# ------------------------------------------------------------------------------- what stopped runs left


@dataclass
class PartialSet:
    """The parts of a split GGUF named OUT that a ckpt run published but not all (`partial_sets`)."""

    count: int
    parts: dict[Path, tuple[int, int]] = field(default_factory=dict)  # the parts there -> (device, inode)

    def describe(self) -> str:
        return (f"part of a split GGUF that a stopped ckpt run published incompletely ({len(self.parts)} of its "
                f"{self.count} parts are here)")

    def remove(self, keep) -> None:
        """Delete the parts that are still the files recognised (`ckpt.io.publish.remove_checked`), but those in
        `keep` (the new output's own names, which the publish replaced); each is recorded in `CLEANED`."""
        from ckpt.io.publish import CLEANED, remove_checked

        keep = {Path(k).absolute() for k in keep}
        for path, ident in self.parts.items():
            if path.absolute() not in keep and remove_checked(path, ident):
                CLEANED.append(("part", path))


_MAX_LISTED = 100_000  # entries of OUT's folder looked at (-o in a huge folder)


def _kv_count(header) -> int:
    return sum(1 for k in header.fields if not k.startswith("GGUF."))


def _ours(paths: dict[int, Path], count: int) -> dict[Path, tuple[int, int]] | None:
    """(path -> identity) of parts `paths` (number from 1 -> path) if they are a ckpt run's parts of a set of
    `count`, else None: the first is there and carries ckpt's mark, and every part there is a regular file whose
    split keys are those ckpt writes for its place (the first part's model metadata, the others nothing else)."""
    from ckpt.io.previous_output import written_by_ckpt
    from ckpt.io.tensors import FileHandles

    if 1 not in paths or not written_by_ckpt(paths[1]):
        return None
    out, total = {}, None
    handles = FileHandles()
    try:
        for no, p in sorted(paths.items()):
            try:
                st = os.lstat(p)
                if not stat.S_ISREG(st.st_mode):
                    return None
                h = read_gguf_header(p, handles, p.name, whole_set=False)
                keys = (h.value(KEY_NO), h.value(KEY_COUNT), h.value(KEY_TENSORS))
            except (OSError, CkptError):
                return None
            if keys[:2] != (no - 1, count) or not isinstance(keys[2], int) or (no > 1 and _kv_count(h) != 3):
                return None
            if total is None:
                total = keys[2]
            elif keys[2] != total:
                return None
            out[p] = (st.st_dev, st.st_ino)
    finally:
        handles.close()
    return out


def partial_sets(out: Path) -> list[PartialSet]:
    """The split sets of the GGUF output named `out` (any count) whose parts a ckpt run published but not all: what
    a run stopped during its publish (SIGKILL, power loss) left, recognised as the module docstring says."""
    member = set_member(out)
    if member is None:
        return []
    folder = Path(out).absolute().parent
    found: dict[int, dict[int, Path]] = {}
    try:
        with os.scandir(folder) as it:
            for i, entry in enumerate(it):
                if i >= _MAX_LISTED:
                    break
                if member(entry.name):
                    m = PART_RE.fullmatch(entry.name)
                    found.setdefault(int(m["count"]), {})[int(m["no"])] = folder / entry.name
    except OSError:
        return []
    sets = []
    for count, paths in sorted(found.items()):
        if count < 2 or len(paths) >= count or any(not 1 <= no <= count for no in paths):
            continue
        ours = _ours(paths, count)
        if ours:
            sets.append(PartialSet(count, ours))
    return sets


def check_partial_sets(plan, out: Path, overwrite: bool, dry_run: bool = False) -> list[PartialSet]:
    """The partial sets (`partial_sets`) of a GGUF output named `out`: an existing output of OUT, so without
    --overwrite the run is refused (a dry run is not, as for any existing output); with it they are returned, to
    remove once the new output is published. Outputs that are no GGUF file have none."""
    if not (plan.single_file and plan.files and plan.files[0].format == "gguf"):
        return []
    sets = partial_sets(out)
    if sets and not overwrite and not dry_run:
        s = sets[0]
        raise CkptError(f"{next(iter(s.parts))}: already exists: {s.describe()}; pass --overwrite to replace it")
    return sets
