"""`ckpt batch OPERATION FOLDER ...`: the click commands; each builds an Operation and hands it to the runner.

The operation options mirror the single commands' own (same names, same meaning); the batch options
(--glob, -o, --jobs, --dry-run, --overwrite, -q, and where the jobs run: --executor, --ray-address,
--plan-only [--json], --collect) are shared by all of them. `run-job` runs one job of a --plan-only list.
"""

from __future__ import annotations

import sys
from pathlib import Path

import click

from ckpt.cli.options import (ALLOW_UNMATCHED, BATCH_MAX_SHARD_SIZE, CONVERT_OR_GGUF, BATCH_DEQUANT_TO, DEVICE, LAYOUT,
                              BATCH_MERGE_LORA_TO, PURE, QTYPE, SHAPES_FROM, OneLineGroup, check_local_input, check_output)
from ckpt.errors import CkptError
from ckpt.interrupts import load
from ckpt.report import plural


def _remember(ctx, param, value):
    """The executor options reach `_run` through the context, not through every command's signature."""
    ctx.meta[f"ckpt_batch.{param.name}"] = value
    return value


def _executor_options(f):
    f = click.option("--collect", is_flag=True, expose_value=False, callback=_remember,
                     help="ManifestRecord in the manifest the results of jobs that ran from a --plan-only list.")(f)
    f = click.option("--json", "json", is_flag=True, expose_value=False, callback=_remember,
                     help="With --plan-only: one JSON object per job (argv, input, output, memory, device).")(f)
    f = click.option("--plan-only", is_flag=True, expose_value=False, callback=_remember,
                     help="Print one `ckpt batch run-job` command per job for another scheduler (Slurm, "
                          "Kubernetes, GNU parallel) and record them as started; run nothing.")(f)
    f = click.option("--ray-address", metavar="ADDR", expose_value=False, callback=_remember,
                     help="With --executor ray: the cluster (as ray.init takes it; default: RAY_ADDRESS, else "
                          "a cluster started on this machine, else a local instance). Given up on after "
                          "CKPT_RAY_TIMEOUT seconds (default 30) without an answer.")(f)
    f = click.option("--executor", type=click.Choice(["local", "ray"]), default="local", show_default=True,
                     expose_value=False, callback=_remember,
                     help="Where jobs run: worker processes here, or one Ray task each (pip install ray: the ckpt-toolkit[ray] extra).")(f)
    return f


def _batch_options(f):
    f = _executor_options(f)
    f = click.option("--quiet", "-q", is_flag=True, help="No progress bar; summary counts and failures only.")(f)
    f = click.option("--overwrite", is_flag=True,
                     help="Replace outputs that exist but are not recorded in the manifest.")(f)
    f = click.option("--dry-run", is_flag=True, help="List what would run, skip and be ignored; write nothing.")(f)
    f = click.option("--jobs", "-j", type=int, default=None,
                     help="Parallel worker processes, default 1 (refused when their estimated peak memory exceeds "
                          "free RAM); with --executor ray: at most N tasks at once (default: what the cluster holds).")(f)
    f = click.option("--glob", "pattern", metavar="PATTERN",
                     help='Only checkpoints whose name, or a folder above them, matches (e.g. "checkpoint-*").')(f)
    f = click.argument("folder", type=click.Path(path_type=Path), callback=check_local_input)(f)
    return f


OUTDIR = click.option("-o", "--output", "outdir", type=click.Path(path_type=Path), callback=check_output,
                      help="Output folder mirroring FOLDER's tree (default: beside each input, default names). "
                           "Holds the manifest ckpt-batch.jsonl.")


def _run(op_name: str, params: dict, folder, outdir, pattern, jobs, dry_run, overwrite, quiet, csv=None):
    load("ckpt.batch.runner")
    from ckpt.batch.operations import make_operation
    from ckpt.batch.runner import BatchFailed, run_batch, summary_lines, write_csv

    meta = click.get_current_context().meta
    how = {k: meta.get(f"ckpt_batch.{k}") for k in ("executor", "ray_address", "plan_only", "json", "collect")}
    if how["json"] and not how["plan_only"]:
        raise CkptError("--json: only with --plan-only")
    op = make_operation(op_name, params)
    log = (lambda line: click.echo(f"note: {line}", err=True)) if not quiet else None
    result = run_batch(op, folder, outdir, pattern=pattern, jobs=jobs, dry_run=dry_run, overwrite=overwrite,
                       quiet=quiet, log=log, executor=how["executor"] or "local", ray_address=how["ray_address"],
                       plan_only=bool(how["plan_only"]), collect=bool(how["collect"]))
    if result.job_lines is not None:
        from ckpt.batch.joblist import render

        for line in result.job_lines:
            click.echo(render(line, bool(how["json"])))
        if not quiet:
            click.echo(f"note: {plural(len(result.job_lines), 'job')} listed ({len(result.of('skipped'))} done earlier), "
                       f"recorded as started in {result.manifest}; run each, then this command with --collect "
                       "instead of --plan-only", err=True)
        return
    if csv is not None and not dry_run:
        write_csv(result, csv, op.COLUMNS)
    for line in summary_lines(result, quiet):
        click.echo(line)
    if csv is not None and not dry_run:
        click.echo(f"wrote {csv}")
    if result.missing:
        one = len(result.missing) == 1
        raise BatchFailed(f"{plural(len(result.missing), 'job')} {'has' if one else 'have'} not reported a result yet; "
                          f"run {'it' if one else 'them'}, then --collect again")
    if result.interrupted:
        click.echo("interrupted: finished outputs are kept and recorded, unfinished ones left nothing behind; "
                   "run the same command again to resume", err=True)
        sys.exit(130)
    failed = result.of("failed")
    if failed and dry_run:  # refused as planned: a real run would fail them, and run the rest
        total = len(result.outcomes) - len(result.of("skipped")) + len(result.todo)
        raise BatchFailed(f"{len(failed)} of {plural(total, 'checkpoint')} would fail (listed above); "
                          "the others would run")
    if failed:
        ran = len(result.outcomes) - len(result.of('skipped'))
        raise BatchFailed(f"{len(failed)} of {plural(ran, 'checkpoint')} failed; "
                          "run the same command again to retry them")
    if not result.outcomes and not result.todo:
        click.echo(f"note: no checkpoints found under {folder}", err=True)


@click.group(cls=OneLineGroup)
def batch():
    """Run one operation over every checkpoint under FOLDER (resumable: see the manifest)."""


@batch.command("convert")
@_batch_options
@OUTDIR
@click.option("--to", "to", type=CONVERT_OR_GGUF,
              help=CONVERT_OR_GGUF.help + " Optional with --layout (then each tensor keeps its dtype).")
@LAYOUT
@click.option("--keep", multiple=True, metavar="PATTERN", help="Glob on tensor names to leave in their dtype.")
@click.option("--clamp", is_flag=True, help="Saturate values that overflow the target instead of making them inf.")
@click.option("--scaled", is_flag=True, help="With --to fp8_e4m3fn: per-tensor scales, ComfyUI scaled-fp8 layout.")
@PURE
@BATCH_MAX_SHARD_SIZE
@DEVICE
def convert_cmd(folder, pattern, jobs, dry_run, overwrite, quiet, outdir, to, layout, keep, clamp, scaled, pure,
                max_shard_size, device):
    """`ckpt convert` on every checkpoint under FOLDER (every --to, GGUF included, and --layout)."""
    params = dict(to=to, layout=layout, keep=list(keep), clamp=clamp, scaled=scaled, pure=pure,
                  max_shard_size=max_shard_size, device=device)
    _run("convert", params, folder, outdir, pattern, jobs, dry_run, overwrite, quiet)


@batch.command("inspect")
@_batch_options
@click.option("--csv", "csv", type=click.Path(path_type=Path), callback=check_output, help="Write one row per checkpoint to this CSV file.")
@click.option("--scan", is_flag=True, help="Also read every value and count NaN/Inf (slower).")
def inspect_cmd(folder, pattern, jobs, dry_run, overwrite, quiet, csv, scan):
    """`ckpt inspect` on every checkpoint under FOLDER; a summary table, or a CSV with --csv."""
    if csv is not None and csv.exists() and csv.is_dir():
        raise CkptError(f"--csv {csv}: is a folder")
    _run("inspect", {"scan": scan}, folder, None, pattern, jobs, dry_run, overwrite, quiet, csv=csv)


@batch.command("dequant")
@_batch_options
@OUTDIR
@BATCH_DEQUANT_TO
@SHAPES_FROM
@QTYPE
@BATCH_MAX_SHARD_SIZE
@DEVICE
def dequant_cmd(folder, pattern, jobs, dry_run, overwrite, quiet, outdir, to, shapes_from, qtype, max_shard_size,
                device):
    """`ckpt dequant` on every checkpoint under FOLDER (those with nothing quantized are reported, not written)."""
    params = dict(to=to, shapes_from=shapes_from, qtype=qtype, max_shard_size=max_shard_size, device=device)
    _run("dequant", params, folder, outdir, pattern, jobs, dry_run, overwrite, quiet)


@batch.command("merge-lora")
@_batch_options
@OUTDIR
@click.option("--lora", type=click.Path(path_type=Path), callback=check_local_input, help="Merge this LoRA into every base under FOLDER.")
@click.option("--base", type=click.Path(path_type=Path), callback=check_local_input, help="Merge every LoRA under FOLDER into this base.")
@click.option("--ratio", type=float, default=None, help="Strength of the LoRA (default 1.0).")
@BATCH_MERGE_LORA_TO
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


@batch.command("run-job")
@click.argument("spec", required=False)
@click.option("--list", "job_list", type=click.Path(path_type=Path),
              help="A `--plan-only --json` job list: run its line --index (0-based, e.g. $SLURM_ARRAY_TASK_ID).")
@click.option("--index", type=int, help="With --list: which job (0 = the first line).")
def run_job_cmd(spec, job_list, index):
    """Run one job of a `ckpt batch ... --plan-only` list (SPEC: what its argv holds) and write its result
    for `--collect`. Exit 1 when the job failed."""
    load("ckpt.batch.joblist")
    from ckpt.batch.joblist import parse_spec, run_spec_reporting, spec_from_list
    from ckpt.batch.runner import BatchFailed

    if (spec is None) == (job_list is None) or (job_list is None) != (index is None):
        raise CkptError("run-job: give SPEC, or --list FILE --index N")
    job = parse_spec(spec) if spec is not None else spec_from_list(job_list, index)
    res = run_spec_reporting(job)
    for m in res.get("messages") or []:
        click.echo(m, err=True)
    if res["status"] != "ok":
        raise BatchFailed(res["error"])
    click.echo(f"wrote {res['output']}" if res.get("output") else f"ok {job['src']} (nothing written)")
