"""Planning and running `ckpt merge-lora`; also the Python API (`merge_lora`).

The base is read through the same machinery as `convert` (open_checkpoint -> logical_view, which
decodes FP8 layouts), LoRA modules are matched to base tensors with the key map built from the base's
own keys, matched tensors become `MergedTensor`s, and `plan_checkpoint` + `execute` write the result
with the input's layout, metadata and per-tensor dtypes. Every problem with the inputs (unmatched or
ambiguous keys, shapes that do not fit) is found while planning, before any output exists.

Matching and its report are the same for every run; how the output is planned and named is one strategy
chosen once after the inputs are open (`ckpt.merge_lora.strategies`: plain, --keep-format, LitGPT around either).
Matched patches are kept per component under the base tensor's view key (`ckpt.adapters.matching`).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from pathlib import Path

from ckpt import targets
from ckpt.adapters import litgpt
from ckpt.adapters.checks import alphas as check_alphas, ratios as check_ratios, settle_alphas
from ckpt.adapters.loading import LoraFile, load_lora
from ckpt.adapters.matching import MatchReport, match_loras, swapped_hint
from ckpt.devices import resolve_device
from ckpt.errors import CkptError
from ckpt.io.checkpoint import open_checkpoint
from ckpt.merge_lora.strategies import Strategy, choose
from ckpt.options import WriteOptions
from ckpt.quant import logical_view
from ckpt.run import output_path, write


def merge_targets() -> list[str]:
    """What --to may name: a dtype, or a GGUF type of `ckpt convert` (merged and quantized in one pass)."""
    return ["fp16", "bf16", "fp32"] + [t.name for t in targets.all_targets() if t.fmt == "gguf"]


@dataclass
class MergeLoraOptions(WriteOptions):
    """The writing options (`format` None: from -o, else torch for LitGPT, else safetensors) and the LoRAs'."""

    ratios: list[float] = field(default_factory=list)  # one per LoRA; empty = all 1.0
    alphas: list[float] = field(default_factory=list)  # --alpha: once, or one per LoRA; for modules without one
    allow_unmatched: bool = False


@dataclass
class MergeLoraReport(MatchReport):
    """The matching report plus what --keep-format measures."""

    meters: list = field(default_factory=list)  # --keep-format: one ErrorMeter per re-encoded tensor
    requantization: dict = field(default_factory=dict)  # --keep-format: mean and per-tensor relative RMS

    def facts(self) -> dict:
        """merge-lora's part of `--report FILE.json` (ckpt.cli.report): every unmatched key, not the first few;
        with --keep-format, the requantization error of every re-encoded tensor."""
        return {"summary": self.summary, "matched": self.matched, "changed": self.changed, "unmatched": self.unmatched,
                "zero_delta": self.zero, "requantization": self.requantization or None}


def merge_operation(lora_names: list[str], ratios: list[float], opts: MergeLoraOptions) -> str:
    """The `ckpt_operation` merge-lora records in its output's metadata (GGUF: `ckpt.operation`): each LoRA's
    file name with its ratio, and --to or --keep-format. Batch's resume compares with this same string."""
    return ("merge-lora " + " ".join(f"{n}@{r:g}" for n, r in zip(lora_names, ratios))
            + (f" --to {targets.canonical(opts.to)}" if opts.to else "") + (" --keep-format" if opts.keep_format else ""))


def merge_lora(base: str, loras: list[str], out: str | Path | None, opts: MergeLoraOptions,
               report: MergeLoraReport | None = None) -> tuple[Path, MergeLoraReport]:
    """Merge LORAS (in order) into BASE; returns (output path, report). Raises CkptError on bad input
    (nothing written)."""
    report = report or MergeLoraReport()
    base, loras, finetune_dir = litgpt.finetune_inputs(base, list(loras))
    if not loras:
        raise CkptError("merge-lora: give at least one LoRA (or a LitGPT finetune folder holding "
                        f"{litgpt.LORA_FILE})")
    ratios = check_ratios(opts.ratios, len(loras))
    alphas = check_alphas(opts.alphas, len(loras))
    if opts.to is not None and opts.to not in merge_targets():
        raise CkptError(f"--to {opts.to}: merge-lora writes {', '.join(merge_targets())}")
    if opts.keep_format and opts.to is not None:
        raise CkptError(f"--to {opts.to} and --keep-format: choose one (--keep-format writes every tensor in the "
                        "base's own stored dtype or quantized format)")
    device = resolve_device(opts.device)
    with contextlib.ExitStack() as stack:
        ckpt = stack.enter_context(open_checkpoint(base))
        base_dir = ckpt.path if ckpt.path.is_dir() else ckpt.path.parent
        files: list[LoraFile] = []
        for spec, alpha in zip(loras, alphas):
            try:
                f = load_lora(spec, base_dir)
            except CkptError as e:  # `ckpt merge-lora lora.safetensors model.safetensors`: say so
                hint = swapped_hint(ckpt)
                if hint:
                    raise CkptError(f"{e}{hint}") from None
                raise
            stack.callback(f.close)
            settle_alphas(f, alpha, report)
            files.append(f)
        strategy = choose(opts, files, finetune_dir, base_dir)
        fmt = strategy.output_format(ckpt, out)
        plan = _plan(ckpt, files, ratios, opts, report, strategy, fmt)
        derived = strategy.default_output(base, ckpt, plan, fmt, out, report)
        inputs = ckpt.inputs + [p for f in files for p in f.inputs]
        out_path = write(plan, output_path(out, derived, plan), inputs=inputs, report=report, desc="merge-lora",
                         device=device, overwrite=opts.overwrite, dry_run=opts.dry_run, quiet=opts.quiet)
    strategy.finish(report, opts.dry_run)
    return out_path, report


def _plan(ckpt, files: list[LoraFile], ratios: list[float], opts: MergeLoraOptions, report: MergeLoraReport,
          strategy: Strategy, file_format: str):
    """Match every LoRA to the base (the same for every strategy), report on it, refuse what does not fit,
    and let the strategy plan the output from the matched patches."""
    views = [logical_view(c) for c in ckpt.components]
    notes = strategy.prepare(ckpt, views)
    patches = match_loras(ckpt, views, files, ratios, report, opts.allow_unmatched)
    names = [Path(f.spec).name for f in files]
    return strategy.plan(ckpt, views, patches, report, merge_operation(names, ratios, opts), file_format, notes)


