"""`ckpt dequant`: the click command over its Python API (imports only click and ckpt's light modules until it
runs)."""

from __future__ import annotations

import click

from ckpt.cli.options import (DEQUANT_TO, DEVICE, DRY_RUN, MAX_SHARD_SIZE, OVERWRITE, QTYPE, QUIET, SHAPES_FROM,
                              OneLineCommand, check_output)
from ckpt.cli.report import REPORT, print_report, record
from ckpt.interrupts import load
from ckpt.io.hub import check_source


@click.command(cls=OneLineCommand)
@click.argument("src")
@click.option("-o", "--output", "out", callback=check_output,
              help="Output file or folder (default: derived from SRC, e.g. x-dequant.safetensors).")
@DEQUANT_TO
@SHAPES_FROM
@QTYPE
@MAX_SHARD_SIZE
@DRY_RUN
@DEVICE
@OVERWRITE
@QUIET
@REPORT
def dequant(src, out, to, shapes_from, qtype, max_shard_size, dry_run, device, overwrite, quiet):
    """Quantized checkpoints back to plain tensors that load strictly: every format `ckpt inspect` names (GGUF,
    FP8 layouts, comfy_quant, quanto, bitsandbytes, GPTQ, AWQ, compressed-tensors, ModelOpt, MXFP4, HQQ, torchao)."""
    check_source(src)
    load("ckpt.dequant.command")
    from ckpt.dequant.command import DequantOptions, dequant as run

    opts = DequantOptions(to=to, shapes_from=shapes_from, qtype=qtype, max_shard_size=max_shard_size, device=device,
                          overwrite=overwrite, quiet=quiet, dry_run=dry_run)
    path, report = run(src, out, opts)
    record(report, inputs=[src], output=path, status="nothing-to-do" if path is None else "dry-run" if dry_run else "ok")
    print_report(report, quiet)
    if path is None:
        click.echo("nothing to dequantize; nothing written")
    else:
        click.echo(f"{'would write' if dry_run else 'wrote'} {path}")
