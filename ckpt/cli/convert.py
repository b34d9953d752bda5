"""`ckpt convert`: the click command over its Python API (imports only click and ckpt's light modules until it
runs)."""

from __future__ import annotations

import click

from ckpt.cli.options import MMPROJ, OneLineCommand, check_output, writing_options
from ckpt.cli.report import REPORT, print_report, record
from ckpt.interrupts import load
from ckpt.io.hub import check_source


@click.command(cls=OneLineCommand)
@click.argument("src")
@click.option("-o", "--output", "out", callback=check_output,
              help="Output file or folder (default: derived from SRC, e.g. x-fp16.safetensors).")
@writing_options(to_help="Optional with --layout (then each tensor keeps its dtype).")
@MMPROJ
@click.option("--executor", type=click.Choice(["local", "ray"]), default="local", show_default=True,
              help="Where the tensors are encoded and written: here, or split over a Ray cluster's workers into the "
                   "same files on a shared filesystem (same bytes; pip install ray: the ckpt-toolkit[ray] extra). "
                   "Safetensors and GGUF outputs only.")
@click.option("--ray-address", metavar="ADDR",
              help="With --executor ray: the cluster (as ray.init takes it; default: RAY_ADDRESS, else a cluster "
                   "started on this machine, else a local instance). Given up on after CKPT_RAY_TIMEOUT seconds "
                   "(default 30) without an answer.")
@REPORT
def convert(src, out, write, mmproj, executor, ray_address):
    """Cast a checkpoint to fp32/fp16/bf16 (decoding every quantized layout ckpt reads), to fp8, to
    ComfyUI's nvfp4/mxfp8/int8 or to GGUF (ComfyUI-GGUF for diffusion models, llama.cpp for HF LLMs: the
    llama-quantize types, K-quants included), and/or rename it to its family's diffusers or
    original layout."""
    check_source(src)  # before torch: a mistyped path is refused in milliseconds
    load("ckpt.convert.command")
    from ckpt.convert import ConvertOptions, convert as run

    opts = ConvertOptions(**write, mmproj=mmproj, executor=executor, ray_address=ray_address)
    cluster = None
    if executor == "ray":
        from ckpt.batch.ray_shares import RayShares as cluster
    path, report = run(src, out, opts, cluster=cluster)
    record(report, inputs=[src], output=path, status="dry-run" if opts.dry_run else "ok")
    print_report(report, opts.quiet)
    click.echo(f"{'would write' if opts.dry_run else 'wrote'} {path}")
