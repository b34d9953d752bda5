"""Planning and running a conversion. Also the Python API that `ckpt batch` calls."""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ckpt.convert.cast import Caster
from ckpt.dtypes import TARGETS, is_float, short_name
from ckpt.errors import CkptError
from ckpt.io.checkpoint import open_checkpoint
from ckpt.io.layout import plan_checkpoint
from ckpt.io.output import execute
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
    """`x.safetensors` -> `x-fp16.safetensors` beside it; a folder `d` -> `d-fp16`; hub ids -> ./name-fp16."""
    p = Path(src)
    if not p.exists():  # hub id
        return Path.cwd() / f"{src.split('@')[0].split('/')[1]}-{suffix}"
    if p.is_dir() or folder:
        base = p.with_suffix("") if p.is_file() else p
        return base.parent / f"{base.name}-{suffix}"
    return p.parent / f"{p.stem}-{suffix}.safetensors"


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
        out_path = Path(out) if out else default_output(src, ckpt.path, suffix, folder=not plan.single_file)
        for n in plan.notes:
            report.note(n)
        if opts.dry_run:
            return out_path, report
        with progress_bar(plan.nbytes, f"convert -> {short_name(TARGETS[opts.to])}", opts.quiet) as bar:
            execute(plan, out_path, inputs=ckpt.inputs, overwrite=opts.overwrite, device=device, progress=bar)
    return out_path, report
