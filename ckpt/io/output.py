"""Executing a plan: atomic output (temp on the same filesystem, then rename) with bounded memory.

Nothing appears at OUT until everything is written and fsynced; an exception, Ctrl-C (KeyboardInterrupt,
and SIGTERM which the CLI turns into one) or a full disk removes the temp path. Inputs are never
written: an OUT that is, or contains, an input is refused.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path

import torch

from ckpt.errors import CkptError
from ckpt.io.buffers import Buffers
from ckpt.io.plan import OutTensor, Plan
from ckpt.io.writer import SafetensorsWriter

HEADROOM = 64 << 20  # free-space margin for filesystem overhead

BAND_ELEMS = 16 << 20  # elements per band: bounds every per-band buffer (64 MiB at fp32)


def check_target(out: Path, inputs: list[Path], overwrite: bool) -> None:
    out_r = out.resolve()
    for p in inputs:
        p_r = p.resolve()
        if p_r == out_r or out_r in p_r.parents:
            raise CkptError(f"{out}: refusing to write over an input ({p})")
    if out.exists() or out.is_symlink():
        if not overwrite:
            raise CkptError(f"{out}: already exists (pass --overwrite to replace it)")
    if not out_r.parent.is_dir():
        raise CkptError(f"{out}: parent folder {out_r.parent} does not exist")


def bands(t, band_elems: int = BAND_ELEMS):
    rows = t.rows
    if t.row_align is None or not t.shape or rows == 0:
        yield 0, rows
        return
    per_row = max(1, t.numel // rows) if rows else 1
    step = max(t.row_align, (band_elems // per_row) // t.row_align * t.row_align)
    for a in range(0, rows, step):
        yield a, min(rows, a + step)


def execute(plan: Plan, out: Path, *, inputs: list[Path], overwrite: bool = False,
            device: torch.device = torch.device("cpu"), progress=None) -> None:
    out = Path(out)
    check_target(out, inputs, overwrite)
    need = plan.nbytes + sum(Path(src).stat().st_size for src, _ in plan.copies) + HEADROOM
    free = shutil.disk_usage(out.resolve().parent).free
    if need > free:
        raise CkptError(f"{out}: not enough free space ({need / 1e9:.2f} GB needed, {free / 1e9:.2f} GB free)")
    tmp = out.resolve().parent / f".{out.name}.ckpt-tmp-{uuid.uuid4().hex[:8]}"
    try:
        if plan.single_file:
            _write_file(tmp, plan.files[0], device, progress)
        else:
            tmp.mkdir()
            for f in plan.files:
                dst = tmp / f.relpath
                dst.parent.mkdir(parents=True, exist_ok=True)
                _write_file(dst, f, device, progress)
            for rel, index in plan.indexes.items():
                (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
                (tmp / rel).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
            for src, rel in plan.copies:
                dst = tmp / rel
                dst.parent.mkdir(parents=True, exist_ok=True)
                edit = plan.json_edits.get(rel)
                if edit is not None:
                    dst.write_text(json.dumps(edit(json.loads(Path(src).read_text())), indent=2) + "\n")
                else:
                    shutil.copyfile(src, dst)
        _replace(tmp, out)
    except OSError as e:
        _remove(tmp)
        raise CkptError(f"{out}: write failed, nothing written ({e.strerror or e})") from None
    except BaseException:
        _remove(tmp)
        raise


def _write_file(path: Path, f, device, progress) -> None:
    w = SafetensorsWriter(path, [t.entry for t in f.tensors], f.metadata)
    buffers = Buffers()
    try:
        for t in f.tensors:
            _stream_tensor(t, w, device, buffers, progress)
        w.close()
    except BaseException:
        w.abort()
        raise


def _stream_tensor(t: OutTensor, w: SafetensorsWriter, device, buffers, progress) -> None:
    src = t.source
    for a, b in bands(src):
        x = src.read(a, b, device, out=buffers.get("read", (b - a) * max(1, src.numel // max(1, src.rows)) * src.dtype.itemsize))
        y = t.cast(x, buffers)
        if y.dtype != t.dtype:
            raise RuntimeError(f"{t.name}: produced {y.dtype}, planned {t.dtype}")
        if y.device.type != "cpu":
            y = y.cpu()
        w.write(t.name, y.contiguous())
        if progress is not None:
            progress.update(y.numel() * y.element_size())


def _replace(tmp: Path, out: Path) -> None:
    if out.is_dir() and not out.is_symlink():
        trash = out.parent / f".{out.name}.ckpt-old-{uuid.uuid4().hex[:8]}"
        os.rename(out, trash)
        try:
            os.rename(tmp, out)
        except BaseException:
            os.rename(trash, out)
            raise
        shutil.rmtree(trash, ignore_errors=True)
    else:
        if tmp.is_dir() and out.exists():
            out.unlink()
        os.replace(tmp, out)


def _remove(tmp: Path) -> None:
    if tmp.is_dir():
        shutil.rmtree(tmp, ignore_errors=True)
    elif tmp.exists():
        tmp.unlink()
