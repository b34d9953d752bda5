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

Reading (`open_split_set`): any part opens the whole set, as one `GGUFHeader` whose metadata is the first
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
import re
import stat
from dataclasses import dataclass, field
from pathlib import Path

from ckpt.errors import CkptError, file_error
from ckpt.io.plan import OutFile, Plan

KEY_NO, KEY_COUNT, KEY_TENSORS = "split.no", "split.count", "split.tensors.count"
SPLIT_KEYS = (KEY_NO, KEY_COUNT, KEY_TENSORS)
PART_RE = re.compile(r"(?P<prefix>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf")
PAD = 32  # GGUF_DEFAULT_ALIGNMENT: gguf-split sizes each tensor padded to it


def part_name(prefix: str, no: int, count: int) -> str:
    """llama_split_path: part `no` (from 0) of `count`."""
    return f"{prefix}-{no + 1:05d}-of-{count:05d}.gguf"


def set_prefix(name: str) -> str | None:
    """`m-00002-of-00003.gguf` -> `m`; None for a name that is not a part's."""
    m = PART_RE.fullmatch(name)
    return m["prefix"] if m else None


# ------------------------------------------------------------------------------------------ reading


def _count(header, key: str, what: str) -> int | None:
    v = header.value(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise file_error(header.path, f"metadata {key!r} is {v!r}, not {what}")
    return v


def split_count(header) -> int:
    """The header's `split.count` (1 when absent)."""
    n = _count(header, KEY_COUNT, "a count of parts")
    return 1 if n is None else n


def open_split_set(header, handles):
    """`header` as read from one file; a part of a split set (`split.count` > 1) becomes the whole set's."""
    count = split_count(header)
    if count <= 1:
        return header
    from ckpt.io.gguf import GGUFHeader, read_gguf_header

    path = Path(header.path)
    no = _count(header, KEY_NO, "a part number")
    if no is None:
        raise file_error(path, f"split GGUF ({KEY_COUNT} {count}) without {KEY_NO}: not a part llama.cpp can load")
    if no >= count:
        raise file_error(path, f"split GGUF part {KEY_NO} {no}, but {KEY_COUNT} is {count} (parts are numbered "
                               f"0..{count - 1})")
    m = PART_RE.fullmatch(path.name)
    if m is None or int(m["count"]) != count:
        raise file_error(path, f"split GGUF part {no + 1} of {count}, but its name is not "
                               f"PREFIX-{no + 1:05d}-of-{count:05d}.gguf (llama.cpp finds the parts by their names); "
                               "rename it")
    if int(m["no"]) != no + 1:
        raise file_error(path, f"{KEY_NO} is {no}, but its name says part {m['no']} of {count} "
                               f"({KEY_NO} {int(m['no']) - 1})")
    names = [part_name(m["prefix"], i, count) for i in range(count)]
    paths = [path.with_name(n) for n in names]
    missing = [n for p, n in zip(paths, names) if p != path and not p.is_file()]
    if missing:
        raise file_error(path, f"part {missing[0]} of this split GGUF ({count} parts) is missing"
                               + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    first_name = names[0]
    headers = [header if p == path else read_gguf_header(p, handles, first_name, whole_set=False) for p in paths]
    first = headers[0]
    total = _count(first, KEY_TENSORS, "a count of tensors")
    arch = first.value("general.architecture")
    tensors, where = {}, {}
    for i, (h, p) in enumerate(zip(headers, paths)):
        other = split_count(h)
        if other != count:
            raise file_error(p, f"part of another split set: {KEY_COUNT} is {other}, {first_name} says {count}")
        if _count(h, KEY_NO, "a part number") != i:
            raise file_error(p, f"{KEY_NO} is {h.value(KEY_NO)!r}, but its name says part {i + 1:05d} of {count} "
                                f"({KEY_NO} {i})")
        n = _count(h, KEY_TENSORS, "a count of tensors")
        if n != total:
            raise file_error(p, f"part of another split set: {KEY_TENSORS} is {n}, {first_name} says {total}")
        a = h.value("general.architecture")
        if i and a is not None and a != arch:
            raise file_error(p, f"part of another model: general.architecture is {a!r}, {first_name} says {arch!r}")
        for name, t in h.tensors.items():
            if name in tensors:
                raise file_error(p, f"tensor {name!r} is also in {where[name]}: a split GGUF holds each tensor once")
            t.home = first_name  # the set is one weight file, named by its first part; `t.info.path` is its part
            tensors[name], where[name] = t, p.name
    if total is None:
        raise file_error(paths[0], f"split GGUF without {KEY_TENSORS}")
    if len(tensors) != total:
        raise file_error(paths[0], f"split GGUF of {count} parts holds {len(tensors)} tensors, but "
                                   f"{KEY_TENSORS} says {total} (a part is truncated or of another model)")
    fields = {k: f for k, f in first.fields.items() if k not in SPLIT_KEYS}
    return GGUFHeader(first.path, first.version, first.alignment, first.data_start, tensors, fields, parts=paths)


def split_note(header) -> str | None:
    """The note a reader of a split set gets."""
    if not header.parts:
        return None
    return (f"{header.parts[0].name} .. {header.parts[-1].name}: split GGUF of {len(header.parts)} parts, "
            "read as one model")


# ------------------------------------------------------------------------------------------ writing


@dataclass
class SplitPlan(Plan):
    """A GGUF written as parts beside OUT (`files` in order): OUT `m.gguf` names the set, whose files are
    `m-00001-of-0000N.gguf` ... (`part_paths`). `single_file` stays True: OUT is a file name, not a folder."""

    def part_paths(self, out: Path) -> list[Path]:
        return part_paths(out, len(self.files))


def _set_stem(out: Path) -> str:
    """The PREFIX of the set an output named `out` is (`m.gguf` and `m-00001-of-00002.gguf` -> `m`)."""
    name = Path(out).name
    stem = name[: -len(".gguf")] if name.endswith(".gguf") else name
    return set_prefix(stem + ".gguf") or stem


def part_paths(out: Path, count: int) -> list[Path]:
    """The parts of a set named OUT (`m.gguf`; a part's own name `m-00001-of-00002.gguf` names its set too)."""
    out = Path(out)
    return [out.with_name(part_name(_set_stem(out), i, count)) for i in range(count)]


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


def set_member(out: Path):
    """A test on file names: the parts of any split set of the GGUF output named `out` (`m-NNNNN-of-MMMMM.gguf`
    for `m.gguf`); None for an output that is not a GGUF file name."""
    if not Path(out).name.endswith(".gguf"):
        return None
    stem = _set_stem(out)

    def member(name: str) -> bool:
        m = PART_RE.fullmatch(name)
        return m is not None and m["prefix"] == stem

    return member


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
    from ckpt.io.gguf import read_gguf_header
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
