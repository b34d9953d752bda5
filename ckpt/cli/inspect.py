"""`ckpt inspect`: the click command over its Python API (imports only click and ckpt's light modules until it
runs)."""

from __future__ import annotations

import click

from ckpt.cli.options import QUIET, OneLineCommand
from ckpt.cli.report import REPORT, record
from ckpt.interrupts import load
from ckpt.io.hub import check_source


@click.command(cls=OneLineCommand)
@click.argument("src")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object (layout: ckpt.inspect.summary).")
@click.option("--scan", is_flag=True, help="Also read every tensor (band by band) and count NaN/Inf.")
@QUIET
@REPORT
def inspect(src, as_json, scan, quiet):
    """Format, model/LoRA family, dtypes, sizes, metadata, and warnings that predict trainer failures."""
    import json

    check_source(src)
    load("ckpt.inspect")
    from ckpt.inspect import inspect as run, render_text

    report = run(src, scan=scan)
    record(inputs=[src], notes=report["notes"], warnings=report["warnings"], inspect=report)
    click.echo(json.dumps(report, indent=1) if as_json else render_text(report, quiet=quiet))
