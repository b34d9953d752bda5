"""Executing a plan: atomic output (temp on the same filesystem, then rename) with bounded memory.

Nothing appears at OUT until everything is written and fsynced; an exception, Ctrl-C (KeyboardInterrupt,
and SIGTERM which the CLI turns into one) or a full disk removes the temp path. Inputs are never
written: an OUT that is, or contains, an input is refused.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import shutil
import signal
import threading
import uuid
from pathlib import Path

import torch

from ckpt.errors import CkptError
from ckpt.io.buffers import Buffers
from ckpt.io.plan import OutTensor, Plan, name_single_file
from ckpt.io.writer import SafetensorsWriter

HEADROOM = 64 << 20  # free-space margin for filesystem overhead

BAND_ELEMS = 8 << 20  # elements per band: bounds every per-band buffer (32 MiB at fp32; two sets in flight)


def check_target(out: Path, inputs: list[Path], overwrite: bool, single_file: bool | None = None) -> None:
    """Refuse an OUT that is, contains or replaces an input, that exists (without --overwrite), that
    is a folder a single file would replace, or whose parent folder is missing."""
    out_r = out.resolve()
    for p in inputs:
        p_r = Path(p).resolve()
        if p_r == out_r or out_r in p_r.parents:
            raise CkptError(f"{out}: refusing to write over an input ({p})")
    if out.exists() or out.is_symlink():
        if not overwrite:
            raise CkptError(f"{out}: already exists (pass --overwrite to replace it)")
        if single_file and out.is_dir() and not out.is_symlink():
            raise CkptError(f"{out}: is a folder; refusing to replace it with a single file (name a file)")
    if not out.absolute().parent.is_dir():
        raise CkptError(f"{out}: parent folder {out.absolute().parent} does not exist")


def preflight(plan: Plan, out: Path, *, inputs: list[Path], overwrite: bool = False) -> int:
    """Every check `execute` makes before writing (also what --dry-run runs); returns bytes needed."""
    out = Path(out)
    name_single_file(plan, out)
    inputs = list(inputs) + [Path(src) for src, _ in plan.copies]
    check_target(out, inputs, overwrite, plan.single_file)
    need = plan.nbytes + sum(Path(src).stat().st_size for src, _ in plan.copies)
    free = shutil.disk_usage(out.absolute().parent).free
    if need + HEADROOM > free:
        raise CkptError(f"{out}: not enough free space ({(need + HEADROOM) / 1e9:.2f} GB needed, "
                        f"{free / 1e9:.2f} GB free)")
    return need


def bands(t, band_elems: int | None = None):
    band_elems = band_elems or BAND_ELEMS  # looked up at call time, so tests can shrink it
    rows = t.rows
    if t.row_align is None or not t.shape or rows == 0 or t.numel == 0:  # [2**62, 0]: one empty band, not 2**39
        yield 0, rows
        return
    per_row = max(1, t.numel // rows) if rows else 1
    step = max(t.row_align, (band_elems // per_row) // t.row_align * t.row_align)
    for a in range(0, rows, step):
        yield a, min(rows, a + step)


def execute(plan: Plan, out: Path, *, inputs: list[Path], overwrite: bool = False,
            device: torch.device = torch.device("cpu"), progress=None) -> None:
    out = Path(out)
    preflight(plan, out, inputs=inputs, overwrite=overwrite)
    # Beside OUT itself (not beside a symlink's target): same filesystem, so the rename is atomic.
    tmp = out.absolute().parent / f".{out.name}.ckpt-tmp-{uuid.uuid4().hex[:8]}"
    try:
        if plan.single_file:
            _write_file(tmp, plan.files[0], device, progress)
        else:
            tmp.mkdir()
            for f in plan.files:
                dst = tmp / f.relpath
                dst.parent.mkdir(parents=True, exist_ok=True)
                _write_file(dst, f, device, progress)
            for rel, index in {**plan.indexes, **plan.generated}.items():
                (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
                (tmp / rel).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
            for src, rel in plan.copies:
                dst = tmp / rel
                dst.parent.mkdir(parents=True, exist_ok=True)
                _copy_sidecar(Path(src), dst, plan.json_edits.get(rel))
        _replace(tmp, out)
    except OSError as e:
        _remove(tmp)
        raise CkptError(f"{out}: write failed, nothing written ({e.strerror or e})") from None
    except BaseException:
        _remove(tmp)
        raise
    _fsync_dir(out.absolute().parent)


def _copy_sidecar(src: Path, dst: Path, edit) -> None:
    """Copy byte for byte, unless `edit` really changes the JSON (then it is rewritten, indented)."""
    if edit is not None:
        original = json.loads(src.read_text())
        edited = edit(copy.deepcopy(original))
        if edited != original:
            dst.write_text(json.dumps(edited, indent=2, ensure_ascii=False) + "\n")
            return
    shutil.copyfile(src, dst)


def _open_writer(path: Path, f):
    """The writer of the file's format; both take the whole plan up front and then bands in order."""
    entries = [t.entry for t in f.tensors]
    if f.format == "torch":
        from ckpt.io.torchzip import TorchZipWriter

        return TorchZipWriter(path, entries, f.archive)
    return SafetensorsWriter(path, entries, f.metadata)


def _write_file(path: Path, f, device, progress) -> None:
    w = _open_writer(path, f)
    writer = _BandWriter(w)
    try:
        # Produce tensors in file-offset order: sequential writes let the kernel write back as we go.
        for t in sorted(f.tensors, key=lambda t: w.regions[t.name][0]):
            _stream_tensor(t, writer, device, progress)
        writer.drain()
        w.close()
    except BaseException:
        writer.drain(raise_errors=False)
        w.abort()
        raise


class _BandWriter:
    """Double buffering: band i is written on a background thread while band i+1 is read and cast.

    pread/pwrite and torch kernels release the GIL, so reading, casting and writing overlap on two cores
    (measured: the write is the largest share of a conversion's time). At most one write is in flight;
    bands alternate between two buffer sets, so a set is reused only after its write finished."""

    def __init__(self, w):
        self.w = w
        self.sets = (Buffers(), Buffers())
        self.turn = 0
        self.pending: threading.Thread | None = None
        self.error: BaseException | None = None

    def buffers(self) -> Buffers:
        return self.sets[self.turn]

    def submit(self, name: str, data: torch.Tensor) -> None:
        self.drain()
        self.pending = threading.Thread(target=self._write, args=(name, data), daemon=True)
        self.pending.start()
        self.turn ^= 1

    def _write(self, name, data):
        try:
            self.w.write(name, data)
        except BaseException as e:  # re-raised in the main thread by drain()
            self.error = e

    def drain(self, raise_errors: bool = True) -> None:
        if self.pending is not None:
            self.pending.join()
            self.pending = None
        if self.error is not None and raise_errors:
            err, self.error = self.error, None
            raise err


def _stream_tensor(t: OutTensor, writer: _BandWriter, device, progress) -> None:
    src = t.source
    for a, b in bands(src):
        buffers = writer.buffers()
        x = src.read(a, b, device, buffers)
        y = t.cast(x, buffers)
        if y.dtype != t.dtype:
            raise RuntimeError(f"{t.name}: produced {y.dtype}, planned {t.dtype}")
        if y.device.type != "cpu":
            y = y.cpu()
        writer.submit(t.name, y.contiguous())
        if progress is not None:
            progress.update(y.numel() * y.element_size())


def _replace(tmp: Path, out: Path) -> None:
    """Move the finished temp output to OUT. Replacing an existing folder takes two renames; signals
    wait until both are done so OUT is never left missing."""
    if out.is_dir() and not out.is_symlink():
        with _signals_deferred():
            trash = out.parent / f".{out.name}.ckpt-old-{uuid.uuid4().hex[:8]}"
            os.rename(out, trash)
            try:
                os.rename(tmp, out)
            except BaseException:
                os.rename(trash, out)
                raise
        shutil.rmtree(trash, ignore_errors=True)
    else:
        if tmp.is_dir() and (out.exists() or out.is_symlink()):
            out.unlink()
        os.replace(tmp, out)


def _remove(tmp: Path) -> None:
    """Delete the temp output; a second Ctrl-C / SIGTERM waits until this is done."""
    with _signals_deferred():
        if tmp.is_dir() and not tmp.is_symlink():
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()


@contextlib.contextmanager
def _signals_deferred():
    """Block SIGINT/SIGTERM (main thread only); pending ones are delivered on exit."""
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "pthread_sigmask"):
        yield
        return
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def _fsync_dir(path: Path) -> None:
    """Make the rename itself durable (best effort: not every filesystem allows it)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
