"""`ckpt merge`: the click command over its Python API (imports only click and ckpt's light modules until it
runs)."""

from __future__ import annotations

from pathlib import Path

import click

from ckpt.cli.options import OneLineCommand, check_output, writing_options
from ckpt.cli.report import REPORT, print_report, record
from ckpt.errors import CkptError
from ckpt.interrupts import load


def _is_config(args) -> bool:
    return len(args) == 1 and Path(args[0]).suffix.lower() in (".yaml", ".yml")


def _seed(ctx, param, value):
    """--seed: a whole number torch's generators take (-2**63 to 2**64 - 1); a bad one is a short line (click's
    own message would echo all of it)."""
    if value is None:
        return None
    try:
        seed = int(value, 10) if len(value) <= 24 else None
    except ValueError:
        seed = None
    if seed is None or not -(2 ** 63) <= seed < 2 ** 64:
        from ckpt.merge.shown import cut

        raise CkptError(f"--seed {cut(value)}: a whole number from -2**63 to 2**64 - 1")
    return seed


@click.command("merge", cls=OneLineCommand)
@click.argument("inputs", nargs=-1, metavar="CONFIG.yaml | MODEL...")
@click.option("-o", "--output", "out", callback=check_output,
              help="Output file or folder (default: CONFIG-merged beside the config, else REFERENCE-METHOD beside "
                   "the base or first model).")
@click.option("--method", metavar="NAME", help="Merge method (flag-built merges; default for two models: weighted_sum).")
@click.option("--base", metavar="MODEL", help="The base model (task-arithmetic methods, slerp, linear...).")
@click.option("--alpha", type=float, help="alpha of weighted_sum / add_difference / train_difference / add_perpendicular.")
@click.option("--weight", metavar="W[,W...]", help="weight: one value, or one per model in order.")
@click.option("--density", metavar="D[,D...]", help="density: one value, or one per model in order.")
@click.option("--param", "params", multiple=True, metavar="NAME=VALUE",
              help="Any parameter of the method for all models (VALUE: number, true/false, comma list = gradient).")
@click.option("--dtype", metavar="DTYPE", help="Compute dtype as mergekit's `dtype` (inputs rounded to it).")
@click.option("--tokenizer-source", metavar="MODEL", help="Take the tokenizer from this model (default: the base's).")
@click.option("--seed", metavar="N", callback=_seed,
              help="Seed of the randomized methods (DARE, DELLA); default 0, said in a note.")
@click.option("--print-config", is_flag=True, help="Print the YAML this merge runs, and exit.")
@click.option("--allow-missing", is_flag=True,
              help="Tensors some input lacks are taken from the reference (base, else first model), tensors only "
                   "other inputs have are left out; both counted.")
@writing_options(to_help="Default: the reference's dtypes (config out_dtype, FP8 and LLM-quantization inputs in "
                         "bf16); a GGUF type or a quantized format: merged and encoded in one pass.", keep_format=True)
@REPORT
def merge(inputs, out, method, base, alpha, weight, density, params, dtype, tokenizer_source, seed, print_config,
          allow_missing, write):
    """Merge whole models: a mergekit YAML config as it is (CONFIG.yaml), or MODEL... with flags. Every input
    ckpt reads (safetensors, shards, model folders, hub ids, GGUF, fp8, quantized) is decoded as it streams."""
    from ckpt.merge.flags import recipe_from_flags
    from ckpt.merge.recipe import load_recipe

    inputs = list(inputs)
    config = inputs[0] if _is_config(inputs) else None
    if config is not None:
        flags = {"--method": method, "--base": base, "--alpha": alpha, "--weight": weight, "--density": density,
                 "--param": params or None, "--dtype": dtype, "--tokenizer-source": tokenizer_source}
        given = [k for k, v in flags.items() if v is not None]
        if given:
            raise CkptError(f"{given[0]} with a config: the config says the whole recipe (edit it, or merge with "
                            "flags alone)")
        recipe = load_recipe(config)
    else:
        recipe = recipe_from_flags(inputs, method=method, base=base, alpha=alpha, weight=weight, density=density,
                                   params=list(params), dtype=dtype, tokenizer_source=tokenizer_source)
    if seed is not None:
        recipe.seed = seed
    if print_config:
        click.echo(recipe.to_yaml(), nl=False)
        return
    from ckpt.io.hub import check_source

    for r in recipe.refs:
        check_source(r.spec)
    load("ckpt.merge.command")
    from ckpt.merge.command import ModelMergeOptions, merge_models

    opts = ModelMergeOptions(**write, allow_missing=allow_missing, seed=seed)
    path, report = merge_models(recipe, out, opts, default_from=config)
    record(report, inputs=[config] if config else [r.spec for r in recipe.refs], output=path,
           status="dry-run" if opts.dry_run else "ok")
    for line in report.summary:
        click.echo(line)
    print_report(report, opts.quiet)
    click.echo(f"{'would write' if opts.dry_run else 'wrote'} {path}")
