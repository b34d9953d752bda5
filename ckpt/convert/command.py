"""Planning and running a conversion. Also the Python API that `ckpt batch` calls."""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ckpt.dtypes import TARGETS, short_name
from ckpt.errors import CkptError
from ckpt.io.checkpoint import open_checkpoint
from ckpt.io.layout import plan_checkpoint
from ckpt.io.plan import parse_size
from ckpt.quant import logical_view
from ckpt.report import Report
from ckpt.run import cast_outputs, decoded_notes, file_ext, output_format, output_path, write


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
    format: str | None = None  # "safetensors" | "torch"; None: from -o's suffix, else safetensors


def default_output(src: str, ckpt_path: Path, suffix: str, folder: bool, ext: str = ".safetensors") -> Path:
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
    return base.parent / f"{base.name}-{suffix}{ext}"


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise CkptError("--device cuda: no CUDA device is available (this torch build: "
                        f"{torch.__version__}); use --device cpu")
    return torch.device(name)


def plan_convert(ckpt, opts: ConvertOptions, report: Report, file_format: str = "safetensors"):
    if opts.to not in TARGETS:
        raise CkptError(f"--to {opts.to}: unknown dtype (choose {', '.join(TARGETS)})")
    target = TARGETS[opts.to]
    if opts.scaled and target != torch.float8_e4m3fn:
        raise CkptError("--scaled applies to --to fp8_e4m3fn only")
    views = [logical_view(c) for c in ckpt.components]

    def out_dtype(t):
        return t.natural_dtype if any(fnmatch.fnmatchcase(t.name, pat) for pat in opts.keep) else target

    if opts.scaled:
        from ckpt.convert.fp8_out import scaled_fp8_outputs

        make = scaled_fp8_outputs(report, opts.keep)
    else:
        make = cast_outputs(report, out_dtype, clamp=opts.clamp)

    shard_size = parse_size(opts.max_shard_size) if opts.max_shard_size else None
    op = f"convert --to {opts.to}" + (" --scaled" if opts.scaled else "")
    plan = plan_checkpoint(ckpt, views, make, operation=op, max_shard_size=shard_size, file_format=file_format,
                           output_dtype=lambda c: target if target in (torch.float16, torch.bfloat16, torch.float32) else None)
    plan.notes += decoded_notes(ckpt, views)
    return plan, views


def convert(src: str, out: str | Path | None, opts: ConvertOptions, report: Report | None = None) -> tuple[Path, Report]:
    """Convert SRC; returns (output path, report). Raises CkptError on bad input (nothing written)."""
    report = report or Report()
    device = resolve_device(opts.device)
    fmt = output_format(opts.format, out)
    with open_checkpoint(src) as ckpt:
        plan, _ = plan_convert(ckpt, opts, report, fmt)
        suffix = opts.to + ("-scaled" if opts.scaled else "")
        derived = default_output(src, ckpt.path, suffix, folder=not plan.single_file, ext=file_ext(fmt))
        out_path = write(plan, output_path(out, derived, plan), inputs=ckpt.inputs, report=report,
                         desc=f"convert -> {short_name(TARGETS[opts.to])}", device=device,
                         overwrite=opts.overwrite, dry_run=opts.dry_run, quiet=opts.quiet)
    return out_path, report
