"""`ckpt lora extract|resize|merge|convert`: the click commands. Each builds `LoraOptions` and calls its
Python API; usage errors (a bad value, a missing argument) are one `error: ...` line with exit 2 like
every other bad input, not click's usage text."""

from __future__ import annotations

import click

from ckpt.cli.options import DEVICE, DRY_RUN, OVERWRITE, QUIET, OneLineGroup
from ckpt.cli.report import REPORT, print_report, record
from ckpt.io.hub import check_lora, check_source


def _rank_options(f):
    f = click.option("--save-dtype", type=click.Choice(["fp32", "fp16", "bf16"]), default="fp32", show_default=True,
                     help="dtype of the written factors (fp16 costs about 2e-4 relative error).")(f)
    f = click.option("--threshold", type=float, metavar="X",
                     help="Parameter of --dynamic: sv_ratio keeps S > max(S)/X; sv_fro / sv_cumulative keep the "
                          "smallest rank reaching fraction X of the Frobenius norm / of sum(S).")(f)
    f = click.option("--dynamic", type=click.Choice(["sv_ratio", "sv_fro", "sv_cumulative"]),
                     help="Choose each module's rank from its singular values (kohya's methods); --rank caps it.")(f)
    f = click.option("--conv-rank", type=int, metavar="R2", help="Rank of 3x3 (kernel > 1) conv layers (default: --rank).")(f)
    return f


CLAMP = click.option("--clamp-quantile", type=float, metavar="Q",
                     help="Clamp factor values at their Q-quantile, as kohya does by default (0.99); off unless "
                          "given: clamping breaks the best-rank property.")


def _reformat(f):
    f = click.option("--base", help="With --format: the model the LoRA was made for, where its names alone "
                                    "cannot say (as for lora convert).")(f)
    f = click.option("--format", "fmt", type=click.Choice(["kohya", "peft", "diffusers", "comfy"]),
                     help="Write this naming (inputs converted first, as lora convert does); default: the "
                          "input's own.")(f)
    return f


SKIP_NONFINITE = click.option("--skip-nonfinite", is_flag=True,
                              help="Leave out (and count, as a warning) modules whose values or alpha hold NaN/Inf "
                                   "where they must be computed with; default: refuse them, naming the tensor.")


def _alpha(f):
    return click.option("--alpha", "alphas", type=float, multiple=True, metavar="A",
                        help="Alpha of modules whose LoRA gives none (no alpha key, adapter_config.json or "
                             "lora_adapter_metadata); without it alpha = rank (scale 1) is assumed, with a "
                             "warning. lora merge: once for all inputs or once per input.")(f)


def _common(f):
    f = REPORT(f)
    f = QUIET(f)
    f = OVERWRITE(f)
    f = DEVICE(f)
    f = DRY_RUN(f)
    return f


def _options(**kw):
    from ckpt.lora.common import LoraOptions

    return LoraOptions(**kw)


def _show(report, path, quiet, dry_run):
    record(report, output=path, status="dry-run" if dry_run else "ok", summary=list(report.summary))
    if not quiet:
        for line in report.module_lines():
            click.echo(line)
    for line in report.summary:
        click.echo(line)
    print_report(report, quiet)
    click.echo(f"{'would write' if dry_run else 'wrote'} {path}")


@click.group("lora", cls=OneLineGroup, context_settings={"help_option_names": ["-h", "--help"]})
def lora():
    """LoRA operations: extract from a fine-tune, resize, merge several into one, convert namings."""


@lora.command()
@click.argument("base")
@click.argument("tuned")
@click.option("-o", "--output", "out", help="Output file (PEFT: folder) (default: TUNED-lora beside TUNED).")
@click.option("--rank", "-r", type=int, help="Rank of every module (the cap with --dynamic).")
@_rank_options
@CLAMP
@click.option("--min-diff", type=float, default=0.0, show_default=True, metavar="D",
              help="Skip (and list) weights whose delta has max |dW| <= D.")
@click.option("--format", "fmt", type=click.Choice(["kohya", "peft", "diffusers"]),
              help="Naming of the output (default: peft for a transformers model folder, kohya otherwise).")
@click.option("--exclude", multiple=True, metavar="GLOB", help="Base tensor names to leave out (repeatable).")
@click.option("--lowrank", is_flag=True, help="torch.svd_lowrank instead of the full SVD (faster; the measured "
                                              "error is reported per module).")
@click.option("--niter", type=int, default=2, show_default=True, help="Power iterations of --lowrank.")
@SKIP_NONFINITE
@_common
def extract(base, tuned, out, rank, conv_rank, dynamic, threshold, clamp_quantile, save_dtype, min_diff, fmt,
            exclude, lowrank, niter, skip_nonfinite, dry_run, device, overwrite, quiet):
    """A LoRA approximating TUNED - BASE (truncated SVD of each weight's delta, one weight at a time)."""
    for spec in (base, tuned):  # refused before torch is imported
        check_source(spec)
    from ckpt.lora.extract import extract as run

    opts = _options(rank=rank, conv_rank=conv_rank, dynamic=dynamic, threshold=threshold,
                    clamp_quantile=clamp_quantile, save_dtype=save_dtype, format=fmt, lowrank=lowrank, niter=niter,
                    device=device, dry_run=dry_run, overwrite=overwrite, quiet=quiet, skip_nonfinite=skip_nonfinite)
    path, report = run(base, tuned, out, opts, min_diff=min_diff, exclude=list(exclude))
    _show(report, path, quiet, dry_run)


@lora.command()
@click.argument("lora_file", metavar="LORA")
@click.option("-o", "--output", "out", help="Output file or folder (default: LORA-resized beside LORA).")
@click.option("--rank", "-r", type=int, help="New rank (the cap with --dynamic; default cap: each module's rank).")
@_rank_options
@_reformat
@_alpha
@SKIP_NONFINITE
@_common
def resize(lora_file, out, rank, conv_rank, dynamic, threshold, save_dtype, fmt, base, alphas, skip_nonfinite, dry_run,
           device, overwrite, quiet):
    """Lower a LoRA's rank by SVD of each module's up @ down, keeping its effective scale."""
    check_lora(lora_file)
    from ckpt.lora.resize import resize as run

    opts = _options(rank=rank, conv_rank=conv_rank, dynamic=dynamic, threshold=threshold, save_dtype=save_dtype,
                    format=fmt, device=device, dry_run=dry_run, overwrite=overwrite, quiet=quiet,
                    alphas=tuple(alphas), skip_nonfinite=skip_nonfinite)
    path, report = run(lora_file, out, opts, base=base)
    _show(report, path, quiet, dry_run)


@lora.command()
@click.argument("loras", nargs=-1, metavar="A B [C ...]")
@click.option("-o", "--output", "out", help="Output file or folder (default: A-merged beside A).")
@click.option("--ratio", "ratios", type=float, multiple=True, metavar="R",
              help="Strength of each LoRA, once per LoRA in order (default 1.0 each).")
@click.option("--concat", "mode", flag_value="concat", default=True,
              help="Stack the factors (exact; rank = sum of ranks). The default.")
@click.option("--svd", "mode", flag_value="svd", help="Re-factorise each module's summed delta to --rank.")
@click.option("--rank", "-r", type=int, help="With --svd: the new rank (the cap with --dynamic).")
@_rank_options
@CLAMP
@_reformat
@_alpha
@SKIP_NONFINITE
@_common
def merge(loras, out, ratios, mode, rank, conv_rank, dynamic, threshold, clamp_quantile, save_dtype, fmt, base,
          alphas, skip_nonfinite, dry_run, device, overwrite, quiet):
    """One LoRA equal to applying A, B, ... in order (with their ratios)."""
    for spec in loras:
        check_lora(spec)
    from ckpt.lora.merge import merge as run

    opts = _options(rank=rank, conv_rank=conv_rank, dynamic=dynamic, threshold=threshold,
                    clamp_quantile=clamp_quantile, save_dtype=save_dtype, format=fmt, device=device,
                    dry_run=dry_run, overwrite=overwrite, quiet=quiet, alphas=tuple(alphas),
                    skip_nonfinite=skip_nonfinite)
    path, report = run(list(loras), out, opts, ratios=list(ratios), mode=mode, base=base)
    _show(report, path, quiet, dry_run)


@lora.command()
@click.argument("lora_file", metavar="LORA")
@click.option("--format", "fmt", required=True, type=click.Choice(["kohya", "peft", "diffusers", "comfy", "gguf"]),
              help="Naming to write: kohya (lora_unet_..., .alpha), peft (adapter folder), diffusers (one file, "
                   "alpha in lora_adapter_metadata), comfy (diffusion_model.<original names>), gguf (llama.cpp's "
                   "LoRA adapter, as convert_lora_to_gguf.py writes it; needs --base).")
@click.option("--base", help="The model the LoRA was made for: decides names the LoRA's keys alone cannot "
                             "(default: recognised from the LoRA's own names); with --format gguf, its Hugging Face "
                             "folder (required).")
@click.option("-o", "--output", "out", help="Output file or folder (default: LORA-FORMAT beside LORA).")
@click.option("--to-lora", type=int, metavar="RANK",
              help="Turn LoHa/LoKr/full modules the target naming has no form for into plain LoRA by SVD.")
@click.option("--save-dtype", type=click.Choice(["fp32", "fp16", "bf16"]), default="fp32", show_default=True,
              help="dtype of factors that are recut (split, fused, folded); renamed modules keep theirs. With "
                   "--format gguf: the type of every tensor (convert_lora_to_gguf.py --outtype f32|f16|bf16).")
@_alpha
@SKIP_NONFINITE
@_common
def convert(lora_file, fmt, base, out, to_lora, save_dtype, alphas, skip_nonfinite, dry_run, device, overwrite, quiet):
    """The same LoRA in another naming (kohya, PEFT, diffusers, ComfyUI, llama.cpp GGUF): fused <-> split q/k/v,
    alpha placed."""
    check_lora(lora_file)
    from ckpt.lora.convert import convert as run

    opts = _options(format=fmt, save_dtype=save_dtype, device=device, dry_run=dry_run, overwrite=overwrite,
                    quiet=quiet, alphas=tuple(alphas), skip_nonfinite=skip_nonfinite)
    path, report = run(lora_file, out, opts, base=base, to_lora=to_lora)
    _show(report, path, quiet, dry_run)
