"""The `ckpt_operation` each `ckpt lora` command records in its output's metadata
(`ckpt.io.checkpoint_plan.provenance`, through `ckpt.lora.formats.plan_lora`): the one spelling of it.

As for convert, dequant, merge and merge-lora (`*_operation`), the string is how a later run (batch's
resume, `ckpt.batch.discover.made_by_ckpt`) tells whether an existing output was made by the same command:
the inputs' file names, then every option that changes what is written (in one fixed order, each only
where it differs from its default: `--device`, `--quiet`, `--overwrite` do not change the output). With
`--format` the output is made from converted scratch copies of the inputs (`ckpt.lora.reformat`), but it
records the command that was run, with the user's inputs.
"""

from __future__ import annotations

from pathlib import Path

from ckpt.lora.common import SAVE_DTYPES, LoraOptions

DEFAULT_DTYPE = next(iter(SAVE_DTYPES))  # fp32


def _num(x: float) -> str:
    """A number as short as it prints without losing its value (`0.9`, `1e-07`, `0.99999999`)."""
    short = f"{x:g}"
    return short if float(short) == float(x) else repr(float(x))


def _flag(flag: str, value) -> str:
    if value is None or value is False:
        return ""
    if value is True:
        return f" {flag}"
    return f" {flag} {_num(value) if isinstance(value, float) else value}"


def _options(opts: LoraOptions, *, base: str | None = None) -> str:
    """The options every lora command shares, where they differ from their defaults."""
    out = (_flag("--rank", opts.rank) + _flag("--conv-rank", opts.conv_rank) + _flag("--dynamic", opts.dynamic)
           + _flag("--threshold", opts.threshold) + _flag("--clamp-quantile", opts.clamp_quantile)
           + _flag("--lowrank", opts.lowrank) + (_flag("--niter", opts.niter) if opts.lowrank else "")
           + (_flag("--save-dtype", opts.save_dtype) if opts.save_dtype != DEFAULT_DTYPE else "")
           + _flag("--format", opts.format) + _flag("--base", Path(base).name if base else None))
    out += "".join(_flag("--alpha", float(a)) for a in opts.alphas)
    return out + _flag("--skip-nonfinite", opts.skip_nonfinite)


def lora_extract_operation(base: str, tuned: str, opts: LoraOptions, min_diff: float = 0.0,
                           exclude: list[str] | tuple[str, ...] = ()) -> str:
    return (f"lora extract {Path(base).name} {Path(tuned).name}" + _options(opts)
            + (_flag("--min-diff", float(min_diff)) if min_diff else "") + "".join(f" --exclude {g}" for g in exclude))


def lora_resize_operation(spec: str, opts: LoraOptions, base: str | None = None) -> str:
    return f"lora resize {Path(spec).name}" + _options(opts, base=base)


def lora_merge_operation(specs: list[str], ratios: list[float], mode: str, opts: LoraOptions,
                         base: str | None = None) -> str:
    names = " ".join(f"{Path(s).name}@{_num(r)}" for s, r in zip(specs, ratios))
    return f"lora merge {names} --{mode}" + _options(opts, base=base)


def lora_convert_operation(spec: str, opts: LoraOptions, base: str | None = None, to_lora: int | None = None) -> str:
    return f"lora convert {Path(spec).name}" + _options(opts, base=base) + _flag("--to-lora", to_lora)
