"""`ckpt convert`: the click command over its Python API (imports only click and ckpt's light modules until it
runs)."""

from __future__ import annotations

import click

from ckpt.cli.options import (CONVERT_OR_GGUF, DEVICE, DRY_RUN, FORMAT, LAYOUT, MAX_SHARD_SIZE, OVERWRITE, PURE,
                              QUIET, OneLineCommand, check_output, check_source_option)
from ckpt.cli.report import REPORT, print_report, record
from ckpt.interrupts import load
from ckpt.io.hub import check_source


@click.command(cls=OneLineCommand)
@click.argument("src")
@click.option("-o", "--output", "out", callback=check_output,
              help="Output file or folder (default: derived from SRC, e.g. x-fp16.safetensors).")
@click.option("--to", "to", type=CONVERT_OR_GGUF,
              help=CONVERT_OR_GGUF.help + " Optional with --layout (then each tensor keeps its dtype).")
@LAYOUT
@click.option("--config", "config", metavar="REF", callback=check_source_option,
              help="With --layout diffusers: the config.json to write (a file, a model folder or a hub id) "
                   "instead of the one derived from the shapes.")
@click.option("--keep", multiple=True, metavar="PATTERN", help="Glob on tensor names to leave in their dtype (repeatable).")
@click.option("--clamp", is_flag=True, help="Saturate values that overflow the target instead of making them inf.")
@click.option("--scaled", is_flag=True, help="With --to fp8_e4m3fn: per-tensor scales, ComfyUI scaled-fp8 layout.")
@PURE
@MAX_SHARD_SIZE
@FORMAT
@DRY_RUN
@DEVICE
@OVERWRITE
@QUIET
@REPORT
def convert(src, out, to, layout, config, keep, clamp, scaled, pure, max_shard_size, fmt, dry_run, device, overwrite, quiet):
    """Cast a checkpoint to fp32/fp16/bf16 (decoding every quantized layout ckpt reads), to fp8, to
    ComfyUI's nvfp4/mxfp8/int8 or to GGUF (ComfyUI-GGUF for diffusion models, llama.cpp for HF LLMs: the
    llama-quantize types, K-quants included), and/or rename it to its family's diffusers or
    original layout."""
    check_source(src)  # before torch: a mistyped path is refused in milliseconds
    load("ckpt.convert.command")
    from ckpt.convert import ConvertOptions, convert as run

    opts = ConvertOptions(to=to, keep=list(keep), clamp=clamp, scaled=scaled, pure=pure, max_shard_size=max_shard_size,
                          device=device, overwrite=overwrite, quiet=quiet, dry_run=dry_run, format=fmt,
                          layout=layout, config=config)
    path, report = run(src, out, opts)
    record(report, inputs=[src], output=path, status="dry-run" if dry_run else "ok")
    print_report(report, quiet)
    click.echo(f"{'would write' if dry_run else 'wrote'} {path}")
