"""The `ckpt` command line. Each command is a thin wrapper over its Python API; errors print one
line and exit 2, warnings are printed and counted, and nothing partial is left behind."""

from __future__ import annotations

import signal
import sys

import click

from ckpt import __version__
from ckpt.errors import CkptError
from ckpt.report import Report

DEVICE = click.option("--device", type=click.Choice(["cpu", "cuda", "auto"]), default="cpu", show_default=True,
                      help="Where the math runs; every operand of an operation is on this device.")
QUIET = click.option("--quiet", "-q", is_flag=True, help="No progress bar and no notes (warnings still print).")
OVERWRITE = click.option("--overwrite", is_flag=True, help="Replace an existing output (never an input).")


def _print_report(report: Report, quiet: bool) -> None:
    if not quiet:
        for n in report.notes:
            click.echo(f"note: {n}", err=True)
    for w in report.warnings():
        click.echo(w, err=True)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="ckpt")
def cli():
    """Convert, decode and merge checkpoints tensor by tensor, with bounded memory."""


@cli.command()
@click.argument("src")
@click.option("-o", "--output", "out", help="Output file or folder (default: derived from SRC, e.g. x-fp16.safetensors).")
@click.option("--to", "to", required=True, type=click.Choice(["fp32", "fp16", "bf16", "fp8_e4m3fn"]),
              help="Target dtype of floating tensors.")
@click.option("--keep", multiple=True, metavar="PATTERN", help="Glob on tensor names to leave in their dtype (repeatable).")
@click.option("--clamp", is_flag=True, help="Saturate values that overflow the target instead of making them inf.")
@click.option("--scaled", is_flag=True, help="With --to fp8_e4m3fn: per-tensor scales, ComfyUI scaled-fp8 layout.")
@click.option("--max-shard-size", help='Shard the output, e.g. "5GB" (5e9 bytes). Default: keep the input layout.')
@click.option("--dry-run", is_flag=True, help="Plan and report only; write nothing.")
@DEVICE
@OVERWRITE
@QUIET
def convert(src, out, to, keep, clamp, scaled, max_shard_size, dry_run, device, overwrite, quiet):
    """Cast a checkpoint to fp32/fp16/bf16 (decoding every FP8 layout), or to fp8."""
    from ckpt.convert import ConvertOptions, convert as run

    opts = ConvertOptions(to=to, keep=list(keep), clamp=clamp, scaled=scaled, max_shard_size=max_shard_size,
                          device=device, overwrite=overwrite, quiet=quiet, dry_run=dry_run)
    path, report = run(src, out, opts)
    _print_report(report, quiet)
    click.echo(f"{'would write' if dry_run else 'wrote'} {path}")


def _sigterm(signum, frame):
    raise KeyboardInterrupt


def main(argv=None):
    signal.signal(signal.SIGTERM, _sigterm)
    try:
        cli.main(args=argv, prog_name="ckpt", standalone_mode=False)
    except CkptError as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(e.exit_code)
    except click.exceptions.Abort:
        click.echo("interrupted: nothing was written", err=True)
        sys.exit(130)
    except KeyboardInterrupt:
        click.echo("interrupted: nothing was written", err=True)
        sys.exit(130)
    except click.ClickException as e:
        e.show()
        sys.exit(2)
    except click.exceptions.Exit as e:
        sys.exit(e.exit_code)


if __name__ == "__main__":
    main()
