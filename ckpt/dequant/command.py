"""`ckpt dequant`: quantized checkpoints (every format of `ckpt.quant.formats`) back to plain state dicts that load
into the unquantized model class with `strict=True`.

Decoding is the shared logical view (`ckpt.quant.logical_view`), so there is one decode layer for every command;
the output is planned by the output side as every writing command plans it (`ckpt.targets`): each dequantized
weight keeps its natural dtype (the scale's dtype for quanto: the model's original dtype) unless `--to` names
another target (a dtype, or any format convert writes: dequant to GGUF is convert's decode and encode).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from ckpt import targets
from ckpt.devices import resolve_device
from ckpt.dtypes import short_name
from ckpt.errors import CkptError
from ckpt.io.checkpoint import open_checkpoint
from ckpt.options import WriteOptions
from ckpt.quant.view import logical_view
from ckpt.quant.formats import labels
from ckpt.quant.quanto import canonical_qtype, shapes_from
from ckpt.report import Report, plural
from ckpt.run import default_output, file_ext, output_path, write
from ckpt.targets.casts import KEEP


@dataclass
class DequantOptions(WriteOptions):
    """The writing options (`to` None: each weight's natural dtype, the quanto scale's dtype) and the decoders'."""

    shapes_from: str | None = None  # local checkpoint or hub id whose headers give original shapes
    qtype: str | None = None  # weights qtype when neither quanto_qmap.json nor quantization_config says


def dequant_operation(opts: DequantOptions) -> str:
    """The `ckpt_operation` dequant records in its outputs' metadata; batch's resume compares with this."""
    return "dequant" + (f" --to {targets.canonical(opts.to)}" if opts.to else "")


def plan_dequant(ckpt, opts: DequantOptions, report: Report, file_format: str = "safetensors"):
    """(plan, views), or (None, views) when nothing in the checkpoint is quantized."""
    target = _target(opts)
    options = {}
    if opts.qtype:
        options["qtype"] = canonical_qtype(opts.qtype)
    if opts.shapes_from:
        options["shape_of"] = shapes_from(opts.shapes_from)
    views = [logical_view(c, options) for c in ckpt.components]
    if not any(v.formats for v in views):
        return None, views
    return targets.plan_output(target, ckpt, views, opts, report, file_format, dequant_operation(opts)), views


def _target(opts: DequantOptions):
    """--to any target (a dtype, fp8, comfy_quant, GGUF: decoded and written as convert writes it), else each weight
    in its natural dtype (the quanto scale's dtype: the model's original)."""
    if opts.keep_format:
        raise CkptError("--keep-format: dequant writes plain tensors; it keeps no encoding")
    return targets.choose(opts, KEEP)


def describe_contents(ckpt) -> list[str]:
    """What a checkpoint holds, for the 'nothing to dequantize' report."""
    lines = []
    for c in ckpt.components:
        where = f"{c.subdir}/" if c.subdir else ""
        dtypes = Counter(short_name(t.dtype) for t in c.tensors.values())
        kinds = ", ".join(f"{n} {d}" for d, n in dtypes.most_common())
        files = ", ".join(where + f.relpath for f in c.files[:3]) + (", ..." if len(c.files) > 3 else "")
        lora = any(("lora_" in k or ".lora." in k or "hada_" in k or "lokr_" in k) for k in c.tensors)
        lines.append(f"{files}: {plural(len(c.tensors), 'tensor')} ({kinds})" + (", LoRA/adapter weights" if lora else ""))
        lines += c.notes  # e.g. trainer state found beside the weights
    if ckpt.copies:
        shown = ", ".join(ckpt.copies[:6]) + (f" and {len(ckpt.copies) - 6} more" if len(ckpt.copies) > 6 else "")
        lines.append(f"other files: {shown}")
    return lines


def dequant(src: str, out: str | Path | None, opts: DequantOptions,
            report: Report | None = None) -> tuple[Path | None, Report]:
    """Dequantize SRC; returns (output path, report), or (None, report) when nothing is quantized (then
    nothing is written and the report says what SRC holds). Raises CkptError on bad input."""
    report = report or Report()
    device = resolve_device(opts.device)
    target = _target(opts)
    fmt = target.output_format(opts, out)  # before the input is opened, as convert decides it
    with open_checkpoint(src) as ckpt:
        plan, _ = plan_dequant(ckpt, opts, report, fmt)
        if plan is None:
            report.note(f"{src}: nothing to dequantize (no weights of {', '.join(labels())}); nothing written")
            for line in describe_contents(ckpt):
                report.note(f"  {line}")
            return None, report
        suffix = "dequant" + (f"-{target.suffix}" if opts.to else "")
        derived = default_output(src, ckpt.path, suffix, folder=not plan.single_file, ext=target.ext or file_ext(fmt))
        out_path = write(plan, output_path(out, derived, plan), inputs=ckpt.inputs, report=report, desc="dequant",
                         device=device, overwrite=opts.overwrite, dry_run=opts.dry_run, quiet=opts.quiet)
    return out_path, report
