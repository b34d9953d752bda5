"""Planning and running a conversion. Also the Python API that `ckpt batch` calls."""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ckpt.devices import resolve_device
from ckpt.dtypes import TARGETS, short_name
from ckpt.errors import CkptError
from ckpt.io.checkpoint import open_checkpoint
from ckpt.io.layout import plan_checkpoint
from ckpt.io.plan import parse_size
from ckpt.quant import logical_view
from ckpt.report import Report
from ckpt.run import (cast_outputs, decoded_notes, default_output, file_ext, output_format, output_path,
                     write)


@dataclass
class ConvertOptions:
    to: str | None  # None: keep each tensor's dtype (only with layout)
    keep: list[str] = field(default_factory=list)
    clamp: bool = False
    scaled: bool = False
    max_shard_size: str | None = None
    device: str = "cpu"
    overwrite: bool = False
    quiet: bool = False
    dry_run: bool = False
    format: str | None = None  # "safetensors" | "torch"; None: from -o's suffix, else safetensors
    layout: str | None = None  # "diffusers" | "original": rename to that layout (ckpt.convert.layout)
    config: str | None = None  # --config REF: the diffusers config.json for --layout diffusers


def _encodes(to: str | None) -> bool:
    from ckpt.convert.comfy_quant_out import TARGETS as QUANT_TARGETS

    return to in QUANT_TARGETS


def is_gguf_target(to: str | None) -> bool:
    return bool(to) and to.startswith("gguf-")


def plan_convert(ckpt, opts: ConvertOptions, report: Report, file_format: str = "safetensors"):
    from ckpt.convert.comfy_quant_out import TARGETS as QUANT_TARGETS

    if opts.to is None and opts.layout is None:
        raise CkptError("convert: give --to DTYPE, --layout diffusers|original, or both")
    if is_gguf_target(opts.to):
        return _plan_gguf(ckpt, opts, report)
    if opts.to is not None and opts.to not in TARGETS and opts.to not in QUANT_TARGETS:
        raise CkptError(f"--to {opts.to}: unknown target (choose {', '.join([*TARGETS, *QUANT_TARGETS])})")
    if opts.config and opts.layout != "diffusers":
        raise CkptError("--config applies to --layout diffusers only")
    target = TARGETS.get(opts.to) if opts.to else None
    if opts.scaled and target != torch.float8_e4m3fn:
        raise CkptError("--scaled applies to --to fp8_e4m3fn only")
    if opts.clamp and opts.to in QUANT_TARGETS:
        raise CkptError(f"--clamp applies to dtype targets; --to {opts.to} saturates by design")
    views = [logical_view(c) for c in ckpt.components]
    finish = None

    def out_dtype(t):
        keep = target is None or any(fnmatch.fnmatchcase(t.name, pat) for pat in opts.keep)
        return t.natural_dtype if keep else target

    if opts.to in QUANT_TARGETS:
        from ckpt.convert.comfy_quant_out import comfy_quant_outputs

        make, finish = comfy_quant_outputs(QUANT_TARGETS[opts.to], report, opts.keep, views, opts.layout)
    elif opts.scaled:
        from ckpt.convert.fp8_out import scaled_fp8_outputs

        make = scaled_fp8_outputs(report, opts.keep)
    else:
        make = cast_outputs(report, out_dtype, clamp=opts.clamp)

    shard_size = parse_size(opts.max_shard_size) if opts.max_shard_size else None
    op = "convert" + (f" --layout {opts.layout}" if opts.layout else "") + (f" --to {opts.to}" if opts.to else "") \
        + (" --scaled" if opts.scaled else "")
    if opts.layout is not None:
        from ckpt.convert.layout import plan_layout

        plan = plan_layout(ckpt, views, make, layout=opts.layout, operation=op, config_ref=opts.config,
                           max_shard_size=shard_size, file_format=file_format)
    else:
        plan = plan_checkpoint(ckpt, views, make, operation=op, max_shard_size=shard_size, file_format=file_format,
                               output_dtype=lambda c: target if target in (torch.float16, torch.bfloat16, torch.float32)
                               else None)
    if finish is not None:
        finish(plan)
    plan.notes += decoded_notes(ckpt, views)
    return plan, views


def _plan_gguf(ckpt, opts: ConvertOptions, report: Report):
    from ckpt.convert.gguf_out import ggml_type_of, plan_gguf

    ggml_type_of(opts.to)  # refuses K-quants and unknown types before anything else
    for flag, given in (("--keep", opts.keep), ("--scaled", opts.scaled), ("--clamp", opts.clamp),
                        ("--max-shard-size", opts.max_shard_size), ("--config", opts.config)):
        if given:
            raise CkptError(f"{flag} does not apply to --to {opts.to} (GGUF types follow ComfyUI-GGUF's rules)")
    if opts.layout is not None:
        raise CkptError(f"--layout with --to {opts.to}: convert the layout first (ComfyUI-GGUF files hold the "
                        "original layout)")
    views = [logical_view(c) for c in ckpt.components]
    plan = plan_gguf(ckpt, views, opts.to, report)
    plan.notes += decoded_notes(ckpt, views)
    return plan, views


def _output_format(opts: ConvertOptions, out) -> str:
    """safetensors / torch from --format and -o; GGUF only from --to gguf-*, never from a suffix alone."""
    suffix = Path(out).suffix if out else ""
    if is_gguf_target(opts.to):
        if opts.format is not None:
            raise CkptError(f"--format does not apply to --to {opts.to} (it writes a .gguf file)")
        if suffix not in ("", ".gguf") and not Path(out).is_dir():
            raise CkptError(f"-o {out}: --to {opts.to} writes a GGUF file; name it .gguf")
        return "gguf"
    if suffix == ".gguf":
        raise CkptError(f"-o {out}: GGUF is written by --to gguf-q8_0|gguf-q4_0|...|gguf-bf16|gguf-f16, "
                        f"not --to {opts.to}")
    return output_format(opts.format, out)


def convert(src: str, out: str | Path | None, opts: ConvertOptions, report: Report | None = None) -> tuple[Path, Report]:
    """Convert SRC; returns (output path, report). Raises CkptError on bad input (nothing written)."""
    report = report or Report()
    device = resolve_device(opts.device, heavy=False)  # refuses --device cuda without one before reading
    fmt = _output_format(opts, out)
    with open_checkpoint(src) as ckpt:
        plan, views = plan_convert(ckpt, opts, report, fmt)
        if opts.device == "auto":  # a GPU only where there is math: decoding or encoding quantized weights
            # (GGUF quantization runs in the gguf package on the CPU whatever the device)
            device = resolve_device("auto", heavy=fmt != "gguf" and (opts.scaled or any(v.formats for v in views)
                                                                      or _encodes(opts.to)))
        if fmt == "gguf":
            from ckpt.convert.gguf_out import default_suffix

            derived = default_output(src, ckpt.path, default_suffix(opts.to), folder=False, ext=".gguf")
            out_path = write(plan, output_path(out, derived, plan), inputs=ckpt.inputs, report=report,
                             desc=f"convert -> {default_suffix(opts.to)}", device=device, overwrite=opts.overwrite,
                             dry_run=opts.dry_run, quiet=opts.quiet)
            return out_path, report
        suffix = "-".join(x for x in (opts.layout, opts.to) if x) + ("-scaled" if opts.scaled else "")
        derived = default_output(src, ckpt.path, suffix, folder=not plan.single_file, ext=file_ext(fmt))
        shown = short_name(TARGETS[opts.to]) if opts.to in TARGETS else opts.to
        desc = "convert -> " + " ".join(x for x in (opts.layout, shown) if x)
        out_path = write(plan, output_path(out, derived, plan), inputs=ckpt.inputs, report=report, desc=desc, device=device,
                         overwrite=opts.overwrite, dry_run=opts.dry_run, quiet=opts.quiet)
    return out_path, report
