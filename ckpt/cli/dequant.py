"""`ckpt dequant`: the click command over its Python API (imports only click and ckpt's light modules until it
runs)."""

from __future__ import annotations

import click

from ckpt.cli.options import QTYPE, SHAPES_FROM, OneLineCommand, check_output, writing_options
from ckpt.cli.report import REPORT, print_report, record
from ckpt.interrupts import load
from ckpt.io.hub import check_source


@click.command(cls=OneLineCommand)
@click.argument("src")
@click.option("-o", "--output", "out", callback=check_output,
              help="Output file or folder (default: derived from SRC, e.g. x-dequant.safetensors).")
@writing_options(to_help="Default: each weight in its original dtype (the scale's dtype).")
@SHAPES_FROM
@QTYPE
@REPORT
def dequant(src, out, write, shapes_from, qtype):
    """Quantized checkpoints back to plain tensors that load strictly: every format `ckpt inspect` names (GGUF,
    FP8 layouts, comfy_quant, quanto, bitsandbytes, GPTQ, AWQ, compressed-tensors, ModelOpt, MXFP4, HQQ, torchao)."""
    check_source(src)
    load("ckpt.dequant.command")
    from ckpt.dequant.command import DequantOptions, dequant as run

    opts = DequantOptions(**write, shapes_from=shapes_from, qtype=qtype)
    path, report = run(src, out, opts)
    record(report, inputs=[src], output=path,
           status="nothing-to-do" if path is None else "dry-run" if opts.dry_run else "ok")
    print_report(report, opts.quiet)
    if path is None:
        click.echo("nothing to dequantize; nothing written")
    else:
        click.echo(f"{'would write' if opts.dry_run else 'wrote'} {path}")
