"""Executing a plan: atomic output (temp on the same filesystem, then rename) with bounded memory.

Nothing appears at OUT until everything is written and fsynced; an exception, Ctrl-C (KeyboardInterrupt,
and SIGTERM which the CLI turns into one), a full disk or a vanished temp folder removes the temp output.
How the temp output is made, checked and published (atomically, never over an output that appeared
meanwhile unless --overwrite) is `ckpt.io.publish`. Inputs are never written: an OUT that is, contains,
or lies inside an input is refused. A split GGUF (`ckpt.io.gguf_split.SplitPlan`) is several files beside
OUT: each is checked as OUT is, written to its own temp file, and all are published as one set.
"""

from __future__ import annotations

import copy
import errno
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ckpt.errors import CkptError
from ckpt.io.gguf_split import check_partial_sets
from ckpt.io.fds import close_fd
from ckpt.io.plan import COPY_FORMATS, OutTensor, Plan, name_single_file
from ckpt.io.previous_output import MAX_LISTED, foreign_files, planned_relpaths
from ckpt.io.publish import OTHER_WRITES, Staging, missing_parents, publish_set, temp_name
from ckpt.io.side_files import check_not_input, unwritable
from ckpt.io.tensors import Tensor, read_ranges, row_bands, sub_ranges
from ckpt.io.writer import BlockLayout, SafetensorsWriter
from ckpt.lazy import torch
from ckpt.report import listed, plural

if TYPE_CHECKING:
    from ckpt.io.write_stages import WriteStages

HEADROOM = 64 << 20  # free-space margin for filesystem overhead

BAND_ELEMS = 8 << 20  # elements per band: bounds every per-band buffer (32 MiB at fp32; ckpt.io.write_stages.DEPTH sets in flight)
# Tensors whose output bytes are stored byte ranges (`OutTensor.copy_ranges`) are copied by the kernel
# (`ckpt.io.byte_copy`); False reads and writes them like any other tensor (tests compare the two: same bytes).
BYTE_COPY = True
# Files with a computed tensor are written with O_DIRECT where the filesystem allows (`ckpt.io.direct`: the page
# cache's writeback throttled the writer; `_direct`); False writes them through the page cache (tests compare:
# same bytes).
DIRECT = True
# Set (to anything but 0), a safetensors file is never laid out for a filesystem that shares extents (header
# padded, copies in their input's order: `_block_layout`): the bytes safetensors' own writer would write, on
# every filesystem (the copied blocks are then copied, not shared).
NO_PADDING = "CKPT_NO_BLOCK_PADDING"


def _exists(out: Path) -> bool:
    return out.exists() or out.is_symlink()


NAME_MAX = 255  # bytes of one name where the filesystem does not say (ext4, xfs, btrfs, tmpfs: 255)
# What the hidden temp name an output is written under (`ckpt.io.publish.temp_name`) adds to its name: ".",
# ".ckpt-tmp-", a process id (at most 7 digits on Linux), "-" and 8 hex digits.
TEMP_EXTRA = len(temp_name("")) - len(str(os.getpid())) + 7


def _name_max(out: Path) -> int:
    folder = next((p for p in Path(os.path.abspath(out)).parents if os.path.isdir(p)), Path("/"))
    try:
        return os.pathconf(folder, "PC_NAME_MAX")
    except (OSError, ValueError):
        return NAME_MAX


def short_path(path: Path, keep: int = 60) -> str:
    """`path` for an error line: a name longer than `keep` characters is cut (`name...`)."""
    parts = [p if len(p) <= keep else p[:keep] + "..." for p in Path(path).parts]
    return str(Path(*parts)) if parts else str(path)


def check_name(out: Path) -> None:
    """Refuse an OUT with a name no file can have here (more bytes than the filesystem's NAME_MAX, the last
    one with its temp name's `TEMP_EXTRA`: it is first written under that) in one line, before any look at
    it: a `stat` of such a name is an OSError, not an answer. A default output name grows its input's
    (`x.pt` -> `x-fp16.safetensors`), so an input of a legal name may still give one."""
    out = Path(out)
    limit = _name_max(out)
    for part in out.parts:
        if len(os.fsencode(part)) > limit:
            raise CkptError(f"{short_path(out)}: name too long ({len(os.fsencode(part))} bytes in one name; "
                            f"at most {limit})")
    size = len(os.fsencode(out.name))
    if size + TEMP_EXTRA > limit:
        raise CkptError(f"{short_path(out)}: name too long ({size} bytes; at most {limit - TEMP_EXTRA}, for the "
                        f"temporary name it is written under first)")


def check_target(out: Path, inputs: list[Path], overwrite: bool, single_file: bool | None = None,
                 dry_run: bool = False, planned: set[str] | None = None, fmt: str | None = None) -> None:
    """Refuse an OUT that is, contains or replaces an input, or lies inside an input folder; that is or
    holds another file this run writes (the --report file, `ckpt.io.publish.OTHER_WRITES`); that exists
    (without --overwrite; a dry run only reports it, see `target_state`); that is a folder a single file
    would replace, or a folder holding files ckpt did not write and the new output (`planned` relpaths)
    does not rewrite (`ckpt.io.previous_output`); or whose nearest existing parent is not a writable
    folder; or whose name is too long (`check_name`); or whose suffix names another container than the one
    written (`check_container`; `fmt` the plan's format, else a file of safetensors or a folder as `single_file`
    says). Missing parent folders are fine: `execute` creates them."""
    check_name(out)
    check_container(out, fmt or ("folder" if single_file is False else "safetensors"))
    out_r = out.resolve()
    check_not_input(out, str(out), inputs)
    for p, what in list(OTHER_WRITES.items()):
        p_r = p.resolve()
        if p_r == out_r or out_r in p_r.parents:
            del OTHER_WRITES[p]  # refused: it is not written either (the --report file is written only if listed)
            raise CkptError(f"{out}: would replace {what} ({p}); name another output or report")
    if _exists(out):
        if not overwrite and not dry_run:
            raise CkptError(f"{out}: already exists (pass --overwrite to replace it)")
        if single_file and out.is_dir() and not out.is_symlink():
            raise CkptError(f"{out}: is a folder; refusing to replace it with a single file (name a file)")
        if not single_file and out.is_dir() and not out.is_symlink():
            foreign = foreign_files(out, planned or set())
            if foreign:
                raise CkptError(f"{out}: holds {plural(len(foreign), 'file')} ckpt did not write and the new "
                                f"output does not replace ({listed(foreign, MAX_LISTED)}); refusing to delete "
                                f"{'it' if len(foreign) == 1 else 'them'} (move them, or name another -o)")
    missing = missing_parents(out)
    home = missing[0].parent if missing else out.absolute().parent
    if not home.is_dir():
        raise CkptError(f"{out}: {home} is not a folder")
    why = unwritable(home)
    if why:
        raise CkptError(f"{out}: cannot write in {home} ({why})")


GGUF_SUFFIX = ".gguf"


def check_container(out: Path, fmt: str | None, label: str | None = None, fix: str | None = None) -> None:
    """The suffix of -o picks the container, or is refused: one rule for every writing command. An OUT named
    `.gguf` is a GGUF file, which only a GGUF target writes (`--to gguf-TYPE`, or `--keep-format` on a GGUF
    input); with any other output (`fmt`: "safetensors", "torch", "folder", or None where it is not planned
    yet) it is refused before anything is written, rather than a file being written under a name ckpt itself
    then refuses to read. The other direction, a GGUF output named otherwise, is refused by the GGUF targets
    (`ckpt.run.check_gguf_output`). `label`: how the message names OUT (default `-o OUT`); `fix`: what to
    do instead of adding --to gguf-TYPE (default: the name to give)."""
    out = Path(out)
    if fmt == "gguf" or out.suffix.lower() != GGUF_SUFFIX:
        return
    command, how = running_command()
    what = {None: "safetensors", "folder": "a folder"}.get(fmt, fmt)
    fix = fix or {"folder": "name a folder", "torch": f"name it {out.stem}.pth"}.get(
        fmt, f"name it {out.stem}.safetensors")
    label = label or f"-o {out}"
    if how:
        raise CkptError(f"{label}: names a GGUF file, but {command} writes {what} here; add {how} to write GGUF, "
                        f"or {fix}")
    raise CkptError(f"{label}: names a GGUF file, but {command} writes {what}, never GGUF; {fix}")


def running_command() -> tuple[str, str | None]:
    """(the running command's name, how it writes GGUF or None where it never does): what the command line
    that runs declares (`writes_gguf` on its click command, set in `ckpt.cli.main`), so that the refusal
    names what the user can do. A Python caller (no command line) hears of --to gguf-TYPE."""
    import click

    ctx = click.get_current_context(silent=True)
    if ctx is None:
        return "this command", "--to gguf-TYPE (convert, merge-lora)"
    return ctx.command_path, getattr(ctx.command, "writes_gguf", None)


def published_paths(plan: Plan, out: Path) -> list[Path]:
    """The paths the plan publishes: OUT, or the parts of a split GGUF beside it (`ckpt.io.gguf_split`)."""
    parts = getattr(plan, "part_paths", None)
    return parts(Path(out)) if parts is not None else [Path(out)]


def target_state(out: Path, overwrite: bool) -> str:
    """What publishing would do to OUT, in words a dry run prints."""
    if _exists(out):
        return "would overwrite it" if overwrite else "exists: needs --overwrite"
    missing = missing_parents(out)
    return f"would create folder {missing[0]}" if missing else "new"


def preflight(plan: Plan, out: Path, *, inputs: list[Path], overwrite: bool = False, dry_run: bool = False) -> int:
    """Every check `execute` makes before writing (also what --dry-run runs); returns bytes needed."""
    out = Path(out)
    formats = {f.format for f in plan.files}
    fmt = "gguf" if "gguf" in formats else "folder" if not plan.single_file else next(iter(formats), "safetensors")
    name_single_file(plan, out)
    inputs = list(inputs) + [Path(src) for src, _ in plan.copies]
    check_partial_sets(plan, out, overwrite, dry_run)  # a split GGUF of OUT's name a stopped run left
    for target in published_paths(plan, out):
        check_target(target, inputs, overwrite, plan.single_file, dry_run, planned_relpaths(plan), fmt)
    need = plan.nbytes + sum(Path(src).stat().st_size for src, _ in plan.copies)
    missing = missing_parents(out)
    free = shutil.disk_usage(missing[0].parent if missing else out.absolute().parent).free
    if need + HEADROOM > free:
        raise CkptError(f"{out}: not enough free space ({(need + HEADROOM) / 1e9:.2f} GB needed, "
                        f"{free / 1e9:.2f} GB free)")
    return need


def bands(t: Tensor, band_elems: int | None = None):
    """`t`'s row bands (`ckpt.io.tensors.row_bands`) at the writer's band size, `BAND_ELEMS` unless given, or
    smaller where the tensor asks (`Tensor.band_elems`)."""
    band_elems = band_elems or min(BAND_ELEMS, t.band_elems or BAND_ELEMS)  # looked up at call time: tests shrink it
    return row_bands(t.rows, t.row_numel, t.row_align, band_elems)


def execute(plan: Plan, out: Path, *, inputs: list[Path], overwrite: bool = False,
            device: torch.device | None = None, progress=None, shares=None) -> None:
    """Write `plan` to `out` atomically. `device` None is the CPU (named only where a tensor is computed: a
    plan of byte copies never imports torch). `shares`: the tensors are written by other processes
    (`ckpt.io.shares`): each file is only created at its full size with its header (`stage_file`), then
    `shares(staged, progress)` (staged: a `StagedFile` per file, in plan order) must fill every tensor region or raise;
    publishing, and removing the temp output on any failure or interrupt, stay here."""
    out = Path(out)
    preflight(plan, out, inputs=inputs, overwrite=overwrite)
    replaced = check_partial_sets(plan, out, overwrite) if overwrite else []  # removed once OUT is published
    staged = None if shares is None else []
    if hasattr(plan, "part_paths"):
        _execute_parts(plan, out, overwrite, device, progress, shares)
        return _remove_partial_sets(replaced, plan, out)
    stage = Staging(out, plan.single_file)
    try:
        stage.open()
        if plan.single_file:
            _write_or_stage(stage.tmp, plan.files[0], device, progress, stage.file(), plan.busy_stage, staged)
        else:
            for f in plan.files:
                _write_or_stage(stage.tmp / f.relpath, f, device, progress, stage.create(f.relpath), plan.busy_stage,
                                staged)
            for rel, index in {**plan.indexes, **plan.generated}.items():
                text = index if isinstance(index, str) else json.dumps(index, indent=2, sort_keys=True) + "\n"
                stage.write_bytes(rel, text.encode())
            for src, rel in plan.copies:
                _copy_sidecar(Path(src), rel, plan.json_edits.get(rel), stage)
        if shares is not None:
            shares(staged, progress)
        stage.publish(overwrite)
    except OSError as e:
        if e.errno == errno.ENOENT and stage.lock_fd >= 0:  # a folder of the temp output vanished
            raise CkptError(f"{out}: the temporary output was removed during the run; nothing written") from None
        raise CkptError(f"{out}: write failed, nothing written ({e.strerror or e})") from None
    finally:
        stage.close()
    _remove_partial_sets(replaced, plan, out)


def _remove_partial_sets(replaced: list, plan: Plan, out: Path) -> None:
    for s in replaced:
        s.remove(keep=published_paths(plan, out))


def _execute_parts(plan: Plan, out: Path, overwrite: bool, device, progress, shares=None) -> None:
    """A split GGUF: each part written to a temp file beside its name, then all published as a set
    (`ckpt.io.publish.publish_set`); on any failure or interrupt every temp file is removed."""
    stages = [Staging(p, True) for p in plan.part_paths(out)]
    staged = None if shares is None else []
    try:
        for stage, f in zip(stages, plan.files):
            stage.open()
            _write_or_stage(stage.tmp, f, device, progress, stage.file(), plan.busy_stage, staged)
        if shares is not None:
            shares(staged, progress)
        publish_set(stages, overwrite)
    except OSError as e:
        if e.errno == errno.ENOENT and any(s.lock_fd >= 0 for s in stages):
            raise CkptError(f"{out}: the temporary output was removed during the run; nothing written") from None
        raise CkptError(f"{out}: write failed, nothing written ({e.strerror or e})") from None
    finally:
        for stage in reversed(stages):  # the first part's staging made OUT's missing folders: it goes last
            stage.close()


def _copy_sidecar(src: Path, rel: str, edit, stage: Staging) -> None:
    """Copy byte for byte, unless `edit` really changes the JSON (then it is rewritten, indented)."""
    if edit is not None:
        original = json.loads(src.read_text())
        edited = edit(copy.deepcopy(original))
        if edited != original:
            stage.write_bytes(rel, (json.dumps(edited, indent=2, ensure_ascii=False) + "\n").encode())
            return
    stage.copy_file(src, rel)


def _open_writer(path: Path, f, fd: int, copies: dict | None = None):
    """The writer of the file's format; both take the whole plan up front and then bands in order.
    `fd` is the new file, already created by the staging; the writer owns it. `copies` (tensor -> stored
    ranges the kernel copies): on a filesystem that shares extents, a safetensors file is laid out (data order,
    header padding) so that most of them keep their block alignment (`ckpt.io.writer.block_layout`)."""
    entries = [t.entry for t in f.tensors]
    if f.format == "gguf":
        from ckpt.io.gguf_writer import GGUFFileWriter
        from ckpt.io.fds import close_fd

        close_fd(fd)  # the GGUF writer opens its (already created) temp file by name
        return GGUFFileWriter(path, entries, f.fields, direct=_direct(path, f, copies))
    if f.format == "torch":
        from ckpt.io.torchzip import TorchZipWriter

        return TorchZipWriter(path, entries, f.archive, fd=fd)
    block = _block_layout(path, entries, f.metadata, copies)
    if block is None:
        return SafetensorsWriter(path, entries, f.metadata, fd=fd, direct=_direct(path, f, copies))
    return SafetensorsWriter(path, entries, f.metadata, fd=fd, pad=block.pad,
                             first=block.first(entries, copies))


def _direct(path: Path, f, copies: dict) -> bool:
    """Whether the file is written with O_DIRECT (`ckpt.io.direct`): wherever a tensor is computed, its copied
    tensors then read straight into the direct writer's buffer. A file of copies alone goes through the page
    cache with copy_file_range instead (no torch; on a filesystem that shares extents, shared blocks: that
    case is decided before, by `_block_layout`). Measured on the 2-core VM, 4.1 GB: a merge-lora of an
    attention-only LoRA (78% of the bytes copies) 5.1 s through the page cache, 4.0 s direct; a convert that
    only copies 3.7 s with copy_file_range, 4.7 s direct; a fp8 -> bf16 convert whose bf16 biases alone were
    copies was throttled by the page cache's writeback."""
    return DIRECT and len(copies) < len(f.tensors)


def _block_layout(path: Path, entries, metadata, copies: dict | None):
    """The layout (`ckpt.io.writer.BlockLayout`: header padding, data order) that lets a filesystem share the
    copied tensors' blocks, or None, safetensors' own layout, unless the output is on a filesystem that shares
    extents, copied ranges come from files on that same filesystem and some of them can keep their blocks
    aligned. A file so laid out is never written with O_DIRECT: its copies would be read into the direct
    writer's buffer, never shared."""
    if not copies or os.environ.get(NO_PADDING, "") not in ("", "0"):
        return None
    from ckpt.io.byte_copy import shares_extents
    from ckpt.io.writer import block_layout

    try:
        dev = os.stat(path.parent).st_dev
        same = {n: rs for n, rs in copies.items() if all(os.stat(r.path).st_dev == dev for r in rs)}
    except OSError:
        return None
    if not same or not shares_extents(path.parent):
        return None
    return block_layout(entries, metadata, copies, same)


@dataclass(frozen=True)
class StagedFile:
    """A temp output file created at its full size with its header (`stage_file`), its tensor regions still to be
    written by the shares (`ckpt.io.shares`): the plan's file `index`, its temp `path`, the `layout` (header
    padding, data order: `ckpt.io.writer.BlockLayout`) it was laid out with."""

    index: int
    path: Path
    layout: BlockLayout = BlockLayout()


def _write_or_stage(path: Path, f, device, progress, fd: int, busy_stage, staged: list | None) -> None:
    if staged is None:
        _write_file(path, f, device, progress, fd, busy_stage)
    else:
        staged.append(StagedFile(len(staged), Path(path), stage_file(path, f, fd)))


def stage_file(path: Path, f, fd: int) -> BlockLayout:
    """Create `f`'s file at `path` (`fd`, already created by the staging; closed here) as its writer would, header
    written and size set (sparse), but no tensor: other processes write the regions (`ckpt.io.shares`). Returns
    the layout chosen (`_block_layout`), which they must lay the file out with. Never O_DIRECT: several
    writers share the file, and direct I/O rewrites whole blocks."""
    if f.format not in COPY_FORMATS:
        close_fd(fd)
        raise CkptError(f"{f.relpath or path.name}: a {f.format} file is written in order by one process "
                        "(its running CRC); it cannot be split into shares")
    copies = f.byte_copies() if BYTE_COPY else {}
    entries = [t.entry for t in f.tensors]
    if f.format == "gguf":
        from ckpt.io.gguf_writer import GGUFFileWriter

        close_fd(fd)
        _durable_header(GGUFFileWriter(path, entries, f.fields))
        return BlockLayout()
    block = _block_layout(path, entries, f.metadata, copies) or BlockLayout()
    _durable_header(SafetensorsWriter(path, entries, f.metadata, fd=fd, pad=block.pad,
                                      first=block.first(entries, copies)))
    return block


def _durable_header(w) -> None:
    """The header a writer wrote on creation, fsynced (each share fsyncs its own regions); then closed."""
    try:
        os.fsync(w.fd)
    finally:
        w.abort()


def write_tensors(w, tensors: list[OutTensor], copies: dict, device, progress=None,
                  busy_stage: str | None = None) -> None:
    """Write `tensors` through the opened writer `w` (every one of them: `copies` holds those the kernel copies),
    in file-offset order, then close it (its regions checked full, fsynced); on any failure `w` is aborted. What
    `_write_file` does for a whole file, and a share (`ckpt.io.shares`) for its part of one."""
    pipe = early = None
    try:
        # Produce tensors in file-offset order: sequential writes let the kernel write back as we go.
        order = sorted(tensors, key=lambda t: w.regions[t.name][0])
        if len(copies) == len(order):  # nothing is computed: no stages, no torch
            for t in order:
                for chunk in copy_chunks(copies[t.name]):
                    w.copy(t.name, chunk)
                    if progress is not None:
                        progress.update(sum(r.length for r in chunk))
        else:
            # the copies' interiors first, on a thread of their own: they run while torch is imported and beside the
            # computed tensors (ckpt.io.early_copies)
            from ckpt.io.early_copies import EarlyCopies

            early = EarlyCopies(w, copies, progress)
            from ckpt.io.write_stages import WriteStages

            host = host_casts(order, copies, device)
            if host is None:
                device = torch.device("cpu") if device is None else device
            pipe = WriteStages(w, None if host is not None else device, progress, busy_stage=busy_stage)
            for t in order:
                if t.name in copies:
                    early.check()
                    _stream_copy(t.name, copies[t.name], early.parts.get(t.name), pipe)
                else:
                    _stream_tensor(t, pipe, device, host and host[t.name])
            pipe.finish()
            early.finish()
        w.close()
    except BaseException:
        if early is not None:
            early.abort()
        if pipe is not None:
            pipe.abort()
        w.abort()
        raise


def _write_file(path: Path, f, device, progress, fd: int, busy_stage: str | None = None) -> None:
    copies = f.byte_copies() if BYTE_COPY else {}
    write_tensors(_open_writer(path, f, fd, copies), f.tensors, copies, device, progress, busy_stage)


def copy_chunks(ranges):
    """`ranges` in pieces of at most `ckpt.io.byte_copy.CHUNK` bytes: the progress bar moves and an interrupt
    is seen between them."""
    from ckpt.io.byte_copy import CHUNK

    total = sum(r.length for r in ranges)
    for a in range(0, total, CHUNK):
        yield sub_ranges(ranges, a, min(total, a + CHUNK))


def _stream_copy(name: str, ranges, interior: tuple[int, int] | None, pipe: WriteStages) -> None:
    """A copied tensor through the write stages: all of it, or (`interior`: the bytes [a, b) of it an
    `EarlyCopies` thread writes) its two ends, the interior stepped over."""
    total = sum(r.length for r in ranges)
    a, b = interior or (total, total)
    for chunk in copy_chunks(sub_ranges(ranges, 0, a)):
        pipe.copy(name, chunk)
    if b > a:
        pipe.skip(name, b - a)
    for chunk in copy_chunks(sub_ranges(ranges, b, total)):
        pipe.copy(name, chunk)


def host_casts(order: list[OutTensor], copies: dict, device) -> dict | None:
    """Name -> `OutTensor.stored_cast()` of every tensor not copied, where each has one and the device is the CPU:
    then the file is written without torch (numpy bands, `ckpt.cast_cpu`'s kernels); else None."""
    if device is not None and getattr(device, "type", device) != "cpu":
        return None
    out = {}
    for t in order:
        if t.name not in copies:
            out[t.name] = t.stored_cast()
            if out[t.name] is None:
                return None
    return out


# values per band of a cast without torch: the same speed as BAND_ELEMS and ~90 MB less peak RSS (2 GB bf16 -> fp16,
# 2-core VM: 2.7-2.9 s with 1 M or 8 M values a band, peak 212 MB against 298 MB)
HOST_BAND_ELEMS = 1 << 20


def _stream_stored_cast(t: OutTensor, ranges, fn, pipe: WriteStages) -> None:
    """A cast of stored bytes without torch (`host_casts`): `HOST_BAND_ELEMS` values at a time read into a slot's
    host buffer, cast by `fn` on the compute stage."""
    from ckpt.dtypes import ST_ITEMSIZE

    total = sum(r.length for r in ranges)
    step = min(BAND_ELEMS, HOST_BAND_ELEMS) * ST_ITEMSIZE[t.source.dtype_name]
    for a in range(0, total, step):
        b = min(total, a + step)
        slot = pipe.band()
        buf = slot.host("raw", b - a)
        read_ranges(sub_ranges(ranges, a, b), buf)
        pipe.submit(slot, t.name, t.dtype, buf, fn)


def _stream_tensor(t: OutTensor, pipe: WriteStages, device, stored=None) -> None:
    """Read `t`'s bands on this thread (see ckpt.io.write_stages for why reads stay here) and hand each to
    the write stages; a stateless cast runs on its compute stage, any other one here. `stored`: its
    `OutTensor.stored_cast()`, where the file is written without torch."""
    if stored is not None:
        return _stream_stored_cast(t, *stored, pipe)
    src = t.source
    for a, b in bands(src):
        slot = pipe.band()
        cast = t.band_cast(a)
        with pipe.reading():
            x = src.read(a, b, device, slot)
            if cast is not None and not t.stateless:
                x = cast(x, slot)
        pipe.submit(slot, t.name, t.torch_dtype, x, cast if t.stateless else None)
