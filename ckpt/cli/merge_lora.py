"""`ckpt merge-lora`: the click command over its Python API (imports only click and ckpt's light modules until it
runs)."""

from __future__ import annotations

import click

from ckpt.cli.options import ALLOW_UNMATCHED, OneLineCommand, check_output, writing_options
from ckpt.cli.report import REPORT, print_report, record
from ckpt.interrupts import load
from ckpt.io.hub import check_lora, check_source


@click.command("merge-lora", cls=OneLineCommand)
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
@ALLOW_UNMATCHED
@writing_options(to_help="Default: each tensor in the base's dtype (FP8 and LLM-quantization bases in bf16); "
                         "a GGUF type: merged and quantized in one pass.", keep_format=True)
@REPORT
def merge_lora(base, loras, out, ratios, alphas, allow_unmatched, write):
    """Bake LoRA / LyCORIS / PEFT adapters (in order) into BASE, tensor by tensor.

    A LitGPT finetune folder alone (BASE = the folder holding lit_model.pth.lora) merges into the base
    its hyperparameters.yaml names and writes a LitGPT checkpoint folder."""
    check_source(base)
    for spec in loras:
        check_lora(spec)
    load("ckpt.merge_lora.command")
    from ckpt.adapters.matching import MatchError
    from ckpt.merge_lora.command import MergeLoraOptions, merge_lora as run

    opts = MergeLoraOptions(**write, ratios=list(ratios), alphas=list(alphas), allow_unmatched=allow_unmatched)
    try:
        path, report = run(base, list(loras), out, opts)
    except MatchError as e:
        for line in e.report.summary:
            click.echo(line)
        raise
    record(report, inputs=[base, *loras], output=path, status="dry-run" if opts.dry_run else "ok")
    for line in report.summary:
        click.echo(line)
    print_report(report, opts.quiet)
    click.echo(f"{'would write' if opts.dry_run else 'wrote'} {path}")
