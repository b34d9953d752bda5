"""Planning and running a conversion. Also the Python API that `ckpt batch` calls."""

from __future__ import annotations

import fnmatch
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ckpt.convert.cast import Caster
from ckpt.dtypes import TARGETS, is_float, short_name
from ckpt.errors import CkptError
from ckpt.io.checkpoint import open_checkpoint
from ckpt.io.layout import plan_checkpoint
from ckpt.io.output import execute, preflight
from ckpt.io.plan import OutTensor, parse_size
from ckpt.progress import progress_bar
from ckpt.quant import logical_view
from ckpt.report import Report


@dataclass
class ConvertOptions:
    to: str
    keep: list[str] = field(default_factory=list)
    clamp: bool = False
    scaled: bool = False
    max_shard_size: str | None = None
    device: str = "cpu"
    overwrite: bool = False
    quiet: bool = False
    dry_run: bool = False


def default_output(src: str, ckpt_path: Path, suffix: str, folder: bool) -> Path:
    """Where the output goes when -o is not given, named after SRC with `-{suffix}`:
    `x.safetensors` / `x.ckpt` -> `x-fp16.safetensors` beside it (`x-fp16/` when the output is a
    folder); a folder `d` (or an index file in `d`) -> `d-fp16/` beside it; a hub id -> `./name-fp16`
    (`./name-sub-fp16` for a subfolder) in the current folder, never inside the hub cache."""
    p = Path(src).expanduser()
    if not p.exists():  # hub id: name it after the repo (and subfolder), write it here
        from ckpt.io.hub import parse_repo_spec

        repo, _, sub = parse_repo_spec(src)
        if ckpt_path.is_file() and not ckpt_path.name.endswith(".index.json"):
            name = ckpt_path.stem  # `owner/name/model.safetensors` -> ./model-fp16.safetensors
        else:
            name = "-".join([repo.split("/")[1]] + [s for s in (sub or "").split("/") if s])
        base = Path.cwd() / name
    elif p.is_file() and p.name.endswith(".index.json"):
        base = p.parent
    elif p.is_file():
        base = p.parent / p.stem
    else:
        base = p
    if not base.name or base.name == "..":  # "." or "..": name it after the real folder
        base = base.resolve()
    if folder:
        return base.parent / f"{base.name}-{suffix}"
    return base.parent / f"{base.name}-{suffix}.safetensors"


def _human(n: int) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} bytes"


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise CkptError("--device cuda: no CUDA device is available (this torch build: "
                        f"{torch.__version__}); use --device cpu")
    return torch.device(name)


def plan_convert(ckpt, opts: ConvertOptions, report: Report):
    if opts.to not in TARGETS:
        raise CkptError(f"--to {opts.to}: unknown dtype (choose {', '.join(TARGETS)})")
    target = TARGETS[opts.to]
    if opts.scaled and target != torch.float8_e4m3fn:
        raise CkptError("--scaled applies to --to fp8_e4m3fn only")
    caster = Caster(target, report, clamp=opts.clamp)
    views = [logical_view(c) for c in ckpt.components]

    def out_dtype(t):
        if not is_float(t.dtype) or any(fnmatch.fnmatchcase(t.name, pat) for pat in opts.keep):
            return t.natural_dtype if is_float(t.dtype) else t.dtype
        return target

    if opts.scaled:
        from ckpt.convert.fp8_out import scaled_fp8_outputs

        make = scaled_fp8_outputs(report, opts.keep)
    else:
        def make(t):
            dst = out_dtype(t)
            c = caster if dst == target else Caster(dst, report, clamp=opts.clamp)
            return [OutTensor(t.name, dst, t.shape, t, lambda x, b, n=t.name, c=c: c(x, n, b))]

    shard_size = parse_size(opts.max_shard_size) if opts.max_shard_size else None
    op = f"convert --to {opts.to}" + (" --scaled" if opts.scaled else "")
    plan = plan_checkpoint(ckpt, views, make, operation=op, max_shard_size=shard_size,
                           output_dtype=lambda c: target if target in (torch.float16, torch.bfloat16, torch.float32) else None)
    for v in views:
        if v.formats:
            plan.notes.append(f"decoded {', '.join(v.formats)}; {len(v.consumed)} scale/marker keys consumed")
    return plan, views


def convert(src: str, out: str | Path | None, opts: ConvertOptions, report: Report | None = None) -> tuple[Path, Report]:
    """Convert SRC; returns (output path, report). Raises CkptError on bad input (nothing written)."""
    report = report or Report()
    device = resolve_device(opts.device)
    with open_checkpoint(src) as ckpt:
        plan, _ = plan_convert(ckpt, opts, report)
        suffix = opts.to + ("-scaled" if opts.scaled else "")
        derived = default_output(src, ckpt.path, suffix, folder=not plan.single_file)
        out_path = Path(out).expanduser() if out else derived
        if out and plan.single_file and (out_path.is_dir() and not out_path.is_symlink()):
            out_path = out_path / derived.name  # `-o some_folder/` for a file: put the file in it
        elif out and plan.single_file and str(out).endswith(("/", os.sep)):
            raise CkptError(f"{out}: no such folder (the output is one file: name a file or an existing folder)")
        for n in plan.notes:
            report.note(n)
        need = preflight(plan, out_path, inputs=ckpt.inputs, overwrite=opts.overwrite)
        if opts.dry_run:
            n_files = len(plan.files)
            report.note(f"dry run: would write {n_files} safetensors file{'s' * (n_files != 1)}, "
                        f"{len(plan.indexes)} index and {len(plan.copies)} other files, {_human(need)}")
            return out_path, report
        with progress_bar(plan.nbytes, f"convert -> {short_name(TARGETS[opts.to])}", opts.quiet) as bar:
            execute(plan, out_path, inputs=ckpt.inputs, overwrite=opts.overwrite, device=device, progress=bar)
    return out_path, report
