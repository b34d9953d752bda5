"""`ckpt batch OPERATION FOLDER ...`: the click commands; each builds an Operation and hands it to the runner.

The operation options mirror the single commands' own (same names, same meaning); the batch options
(--glob, -o, --jobs, --dry-run, --overwrite, -q) are shared by all of them.
"""

from __future__ import annotations

import sys
from pathlib import Path

import click

from ckpt.cli_options import ALLOW_UNMATCHED, CONVERT_TARGETS, CONVERT_TO_HELP, DEQUANT_TO, DEVICE, MERGE_TO, QTYPE, SHAPES_FROM
from ckpt.errors import CkptError
from ckpt.interrupts import load


def _batch_options(f):
    f = click.option("--quiet", "-q", is_flag=True, help="No progress bar; summary counts and failures only.")(f)
    f = click.option("--overwrite", is_flag=True,
                     help="Replace outputs that exist but are not recorded in the manifest.")(f)
    f = click.option("--dry-run", is_flag=True, help="List what would run, skip and be ignored; write nothing.")(f)
    f = click.option("--jobs", "-j", type=int, default=1, show_default=True,
                     help="Parallel worker processes (refused when their estimated peak memory exceeds free RAM).")(f)
    f = click.option("--glob", "pattern", metavar="PATTERN",
                     help='Only checkpoints whose name, or a folder above them, matches (e.g. "checkpoint-*").')(f)
    f = click.argument("folder", type=click.Path(path_type=Path))(f)
    return f


OUTDIR = click.option("-o", "--output", "outdir", type=click.Path(path_type=Path),
                      help="Output folder mirroring FOLDER's tree (default: beside each input, default names). "
                           "Holds the manifest ckpt-batch.jsonl.")


def _run(op_name: str, params: dict, folder, outdir, pattern, jobs, dry_run, overwrite, quiet, csv=None):
    load("ckpt.batch.runner")
    from ckpt.batch.operations import make_operation
    from ckpt.batch.runner import BatchFailed, run_batch, summary_lines, write_csv

    op = make_operation(op_name, params)
    log = (lambda line: click.echo(f"note: {line}", err=True)) if not quiet else None
    result = run_batch(op, folder, outdir, pattern=pattern, jobs=jobs, dry_run=dry_run, overwrite=overwrite,
                       quiet=quiet, log=log)
    if csv is not None and not dry_run:
        write_csv(result, csv, op.COLUMNS)
    for line in summary_lines(result, quiet):
        click.echo(line)
    if csv is not None and not dry_run:
        click.echo(f"wrote {csv}")
    if result.interrupted:
        click.echo("interrupted: finished outputs are kept and recorded, unfinished ones left nothing behind; "
                   "run the same command again to resume", err=True)
        sys.exit(130)
    failed = result.of("failed")
    if failed:
        raise BatchFailed(f"{len(failed)} of {len(result.outcomes) - len(result.of('skipped'))} checkpoints failed; "
                          "run the same command again to retry them")
    if not result.outcomes and not result.todo:
        click.echo(f"note: no checkpoints found under {folder}", err=True)


@click.group()
def batch():
    """Run one operation over every checkpoint under FOLDER (resumable: see the manifest)."""


@batch.command("convert")
@_batch_options
@OUTDIR
@click.option("--to", "to", required=True, type=CONVERT_TARGETS, help=CONVERT_TO_HELP)
@click.option("--keep", multiple=True, metavar="PATTERN", help="Glob on tensor names to leave in their dtype.")
@click.option("--clamp", is_flag=True, help="Saturate values that overflow the target instead of making them inf.")
@click.option("--scaled", is_flag=True, help="With --to fp8_e4m3fn: per-tensor scales, ComfyUI scaled-fp8 layout.")
@click.option("--max-shard-size", help='Shard each output, e.g. "5GB".')
@DEVICE
def convert_cmd(folder, pattern, jobs, dry_run, overwrite, quiet, outdir, to, keep, clamp, scaled, max_shard_size,
                device):
    """`ckpt convert` on every checkpoint under FOLDER."""
    params = dict(to=to, keep=list(keep), clamp=clamp, scaled=scaled, max_shard_size=max_shard_size, device=device)
    _run("convert", params, folder, outdir, pattern, jobs, dry_run, overwrite, quiet)


@batch.command("inspect")
@_batch_options
@click.option("--csv", "csv", type=click.Path(path_type=Path), help="Write one row per checkpoint to this CSV file.")
@click.option("--scan", is_flag=True, help="Also read every value and count NaN/Inf (slower).")
def inspect_cmd(folder, pattern, jobs, dry_run, overwrite, quiet, csv, scan):
    """`ckpt inspect` on every checkpoint under FOLDER; a summary table, or a CSV with --csv."""
    if csv is not None and csv.exists() and csv.is_dir():
        raise CkptError(f"--csv {csv}: is a folder")
    _run("inspect", {"scan": scan}, folder, None, pattern, jobs, dry_run, overwrite, quiet, csv=csv)


@batch.command("dequant")
@_batch_options
@OUTDIR
@DEQUANT_TO
@SHAPES_FROM
@QTYPE
@click.option("--max-shard-size", help='Shard each output, e.g. "5GB".')
@DEVICE
def dequant_cmd(folder, pattern, jobs, dry_run, overwrite, quiet, outdir, to, shapes_from, qtype, max_shard_size,
                device):
    """`ckpt dequant` on every checkpoint under FOLDER (those with nothing quantized are reported, not written)."""
    params = dict(to=to, shapes_from=shapes_from, qtype=qtype, max_shard_size=max_shard_size, device=device)
    _run("dequant", params, folder, outdir, pattern, jobs, dry_run, overwrite, quiet)


@batch.command("merge-lora")
@_batch_options
@OUTDIR
@click.option("--lora", type=click.Path(path_type=Path), help="Merge this LoRA into every base under FOLDER.")
@click.option("--base", type=click.Path(path_type=Path), help="Merge every LoRA under FOLDER into this base.")
@click.option("--ratio", type=float, default=None, help="Strength of the LoRA (default 1.0).")
@MERGE_TO
@ALLOW_UNMATCHED
@DEVICE
def merge_lora_cmd(folder, pattern, jobs, dry_run, overwrite, quiet, outdir, lora, base, ratio, to, allow_unmatched,
                   device):
    """`ckpt merge-lora` over FOLDER: one LoRA into many bases (--lora), or many LoRAs into one base (--base)."""
    if (lora is None) == (base is None):
        raise CkptError("batch merge-lora: give exactly one of --lora (into every base under FOLDER) "
                        "or --base (every LoRA under FOLDER into it)")
    params = dict(lora=str(lora) if lora else None, base=str(base) if base else None,
                  ratios=[ratio] if ratio is not None else [], to=to, allow_unmatched=allow_unmatched, device=device)
    _run("merge-lora", params, folder, outdir, pattern, jobs, dry_run, overwrite, quiet)
