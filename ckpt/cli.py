"""The `ckpt` command line. Each command is a thin wrapper over its Python API; errors print one
line and exit 2, warnings are printed and counted, and nothing partial is left behind."""

from __future__ import annotations

import signal
import sys

import click

from ckpt import __version__
from ckpt.errors import CkptError, ReportNotWritten
from ckpt.interrupts import load
from ckpt.io.hub import check_lora, check_source
from ckpt.report import Report

from ckpt.cli_report import REPORT, finish as finish_report, record, reset as reset_report
from ckpt.cli_options import (ALLOW_UNMATCHED, CONVERT_OR_GGUF, CONVERT_TO_HELP, DEQUANT_TO, DEVICE, DRY_RUN, FORMAT,
                              MAX_SHARD_SIZE, MERGE_TO, OVERWRITE, QTYPE, QUIET, SHAPES_FROM, OneLineGroup,
                              check_output, check_source_option)


def print_report(report: Report, quiet: bool) -> None:
    if not quiet:
        for n in report.notes:
            click.echo(f"note: {n}", err=True)
    for w in report.warnings():
        click.echo(w, err=True)


@click.group(cls=OneLineGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="ckpt")
def cli():
    """Convert, decode and merge checkpoints tensor by tensor, with bounded memory."""


@cli.command()
@click.argument("src")
@click.option("-o", "--output", "out", callback=check_output,
              help="Output file or folder (default: derived from SRC, e.g. x-fp16.safetensors).")
@click.option("--to", "to", type=CONVERT_OR_GGUF,
              help=CONVERT_OR_GGUF.help + " Optional with --layout (then each tensor keeps its dtype).")
@click.option("--layout", type=click.Choice(["diffusers", "original"]),
              help="Rename to the model family's diffusers layout (a model folder with config.json) or its "
                   "original layout (one file with the reference keys).")
@click.option("--config", "config", metavar="REF", callback=check_source_option,
              help="With --layout diffusers: the config.json to write (a file, a model folder or a hub id) "
                   "instead of the one derived from the shapes.")
@click.option("--keep", multiple=True, metavar="PATTERN", help="Glob on tensor names to leave in their dtype (repeatable).")
@click.option("--clamp", is_flag=True, help="Saturate values that overflow the target instead of making them inf.")
@click.option("--scaled", is_flag=True, help="With --to fp8_e4m3fn: per-tensor scales, ComfyUI scaled-fp8 layout.")
@MAX_SHARD_SIZE
@FORMAT
@DRY_RUN
@DEVICE
@OVERWRITE
@QUIET
@REPORT
def convert(src, out, to, layout, config, keep, clamp, scaled, max_shard_size, fmt, dry_run, device, overwrite, quiet):
    """Cast a checkpoint to fp32/fp16/bf16 (decoding every quantized layout ckpt reads), to fp8, to
    ComfyUI's nvfp4/mxfp8/int8 or to a ComfyUI-GGUF file, and/or rename it to its family's diffusers or
    original layout."""
    check_source(src)  # before torch: a mistyped path is refused in milliseconds
    load("ckpt.convert.command")
    from ckpt.convert import ConvertOptions, convert as run

    opts = ConvertOptions(to=to, keep=list(keep), clamp=clamp, scaled=scaled, max_shard_size=max_shard_size,
                          device=device, overwrite=overwrite, quiet=quiet, dry_run=dry_run, format=fmt,
                          layout=layout, config=config)
    path, report = run(src, out, opts)
    record(report, inputs=[src], output=path, status="dry-run" if dry_run else "ok")
    print_report(report, quiet)
    click.echo(f"{'would write' if dry_run else 'wrote'} {path}")


@cli.command()
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
    """optimum-quanto, bitsandbytes, ComfyUI comfy_quant and FP8-scaled checkpoints back to plain X.weight
    tensors."""
    check_source(src)
    load("ckpt.quant.dequant")
    from ckpt.quant.dequant import DequantOptions, dequant as run

    opts = DequantOptions(to=to, shapes_from=shapes_from, qtype=qtype, max_shard_size=max_shard_size, device=device,
                          overwrite=overwrite, quiet=quiet, dry_run=dry_run)
    path, report = run(src, out, opts)
    record(report, inputs=[src], output=path, status="nothing-to-do" if path is None else "dry-run" if dry_run else "ok")
    print_report(report, quiet)
    if path is None:
        click.echo("nothing to dequantize; nothing written")
    else:
        click.echo(f"{'would write' if dry_run else 'wrote'} {path}")


@cli.command()
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


@cli.command("merge-lora")
@click.argument("base")
@click.argument("loras", nargs=-1)
@click.option("-o", "--output", "out", callback=check_output,
              help="Output file or folder (default: BASE-merged beside BASE).")
@click.option("--ratio", "ratios", type=float, multiple=True, metavar="R",
              help="Strength of each LoRA, once per LoRA in order (default 1.0 each).")
@click.option("--alpha", "alphas", type=float, multiple=True, metavar="A",
              help="Alpha of modules whose LoRA gives none (no alpha key, adapter_config.json or "
                   "lora_adapter_metadata): once for all LoRAs or once per LoRA. Without it alpha = rank "
                   "(scale 1) is assumed, with a warning.")
@MERGE_TO
@ALLOW_UNMATCHED
@FORMAT
@click.option("--keep-format", is_flag=True,
              help="Write the base's own format: changed tensors re-encoded in its quantization (GGUF, ComfyUI "
                   "scaled fp8 / comfy_quant, kohya fp8_scaled, optimum-quanto), everything else copied as stored.")
@click.option("--dry-run", is_flag=True, help="Print the matching report only; write nothing.")
@DEVICE
@OVERWRITE
@QUIET
@REPORT
def merge_lora(base, loras, out, ratios, alphas, to, allow_unmatched, fmt, keep_format, dry_run, device, overwrite,
               quiet):
    """Bake LoRA / LyCORIS / PEFT adapters (in order) into BASE, tensor by tensor.

    A LitGPT finetune folder alone (BASE = the folder holding lit_model.pth.lora) merges into the base
    its hyperparameters.yaml names and writes a LitGPT checkpoint folder."""
    check_source(base)
    for spec in loras:
        check_lora(spec)
    load("ckpt.merge.command")
    from ckpt.merge.command import MergeError, MergeOptions, merge_lora as run

    opts = MergeOptions(ratios=list(ratios), alphas=list(alphas), to=to, device=device,
                        allow_unmatched=allow_unmatched, dry_run=dry_run, overwrite=overwrite, quiet=quiet,
                        format=fmt, keep_format=keep_format)
    try:
        path, report = run(base, list(loras), out, opts)
    except MergeError as e:
        for line in e.report.summary:
            click.echo(line)
        raise
    record(report, inputs=[base, *loras], output=path, status="dry-run" if dry_run else "ok")
    for line in report.summary:
        click.echo(line)
    print_report(report, quiet)
    click.echo(f"{'would write' if dry_run else 'wrote'} {path}")


from ckpt.batch.cli import batch  # noqa: E402  (the `ckpt batch ...` group; imports only click here)

cli.add_command(batch)

from ckpt.lora.cli import lora  # noqa: E402  (the `ckpt lora ...` group; imports only click here)

cli.add_command(lora)


class _Signals:
    """SIGINT/SIGTERM become one KeyboardInterrupt while a command runs (the writer then removes its temp
    output); any later one is only recorded. `seen` is set either way, so an interrupt that a library
    turned into another exception (numpy's ImportError during start-up) still reads as an interrupt."""

    def __init__(self):
        self.active, self.seen = True, False

    def __call__(self, signum, frame):
        self.seen = True
        if self.active:
            self.active = False  # at most once: a second signal never interrupts the cleanup of the first
            raise KeyboardInterrupt


def _published(since: int) -> list:
    """What the output writer published since `since` (ckpt.io.publish is loaded only by writing commands)."""
    publish = sys.modules.get("ckpt.io.publish")
    return publish.PUBLISHED[since:] if publish is not None else []


def _interrupted(since: int) -> None:
    done = _published(since)
    if done:
        click.echo(f"interrupted after writing {', '.join(str(p) for p in done)} (complete)", err=True)
    else:
        click.echo("interrupted: nothing was written", err=True)
    sys.exit(130)


def _dispatch(argv, handler: _Signals, since: int) -> None:
    reset_report(argv)
    try:
        cli.main(args=argv, prog_name="ckpt", standalone_mode=False)
        handler.active = False
        finish_report(0)  # --report FILE.json (a failure to write it is the CkptError below)
    except CkptError as e:
        if not isinstance(e, ReportNotWritten):  # else the command succeeded and only its report failed
            try:
                finish_report(e.exit_code, str(e), getattr(e, "report", None))
            except CkptError:  # the command's own error is the one line to print
                pass
        click.echo(f"error: {e}", err=True)
        sys.exit(e.exit_code)
    except (click.exceptions.Abort, KeyboardInterrupt):
        _interrupted(since)
    except click.ClickException as e:
        e.show()
        sys.exit(2)
    except click.exceptions.Exit as e:
        sys.exit(e.exit_code)
    except Exception:
        if handler.seen:  # the interrupt came back as another exception (an import failing half-way)
            _interrupted(since)
        raise
    if handler.seen:  # arrived after the command finished: all of it is done, and we were asked to stop
        _interrupted(since)


def main(argv=None):
    """The console script (argv None: the process ends when this returns), or an in-process call."""
    handler = _Signals()
    old = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
    since = len(_published(0))
    try:
        try:
            _dispatch(argv, handler, since)
        except KeyboardInterrupt:  # the one interrupt landed inside one of _dispatch's own handlers
            _interrupted(since)
    finally:
        handler.active = False
        if argv is None:  # exiting: a late signal must not kill the interpreter's shutdown without a word
            for s in old:
                signal.signal(s, signal.SIG_IGN)
        else:
            for s, h in old.items():
                signal.signal(s, h)


if __name__ == "__main__":
    main()
