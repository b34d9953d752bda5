"""Planning and running `ckpt merge-lora`; also the Python API (`merge_lora`).

The base is read through the same machinery as `convert` (open_checkpoint -> logical_view, which decodes every
stored encoding), LoRA modules are matched to base tensors with the key map built from the base's own keys
(`ckpt.adapters.matching`), matched tensors become `MergedTensor`s in views made from the decoded ones
(`ckpt.merge_lora.base_values`), and the output side plans the result from those views as every writing command
does (`ckpt.targets`: --to, --keep-format, or merge-lora's default: the base's own dtypes, FP8 and LLM-quantization
bases in bf16, a LitGPT LoRA's model in its dtype inside a LitGPT checkpoint folder). Every problem with the inputs
(unmatched or ambiguous keys, shapes that do not fit) is found while planning, before any output exists.
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
from ckpt.devices import cpu_without_torch, resolve_device
from ckpt.errors import CkptError
from ckpt.io.checkpoint import open_checkpoint
from ckpt.io.file_kinds import WEIGHT_SUFFIXES
from ckpt.merge_lora.base_values import merged_views
from ckpt.options import WriteOptions
from ckpt.quant.view import logical_view
from ckpt.run import default_output, file_ext, output_path, write
from ckpt.targets.casts import Natural
from ckpt.targets.planners.keep_format import refuse_plain
from ckpt.lazy import prefetch, torch


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
    prefetch(torch)  # imported beside the planning and the early copies (ckpt.lazy); planning needs none
    base, loras, finetune_dir = litgpt.finetune_inputs(base, list(loras))
    if not loras:
        raise CkptError("merge-lora: give at least one LoRA (or a LitGPT finetune folder holding "
                        f"{litgpt.LORA_FILE})")
    ratios = check_ratios(opts.ratios, len(loras))
    alphas = check_alphas(opts.alphas, len(loras))
    cpu = cpu_without_torch(opts.device)  # else asked after planning: asking imports torch (ckpt.devices)
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
        lit = next((f for f in files if f.litgpt is not None), None)
        target = _target(opts, lit)
        fmt = target.output_format(opts, out, ckpt, default="torch" if lit is not None else "safetensors")
        plan = _plan(ckpt, files, ratios, opts, report, target, fmt, lit)
        derived = _default_output(base, ckpt, plan, fmt, out, report, opts, target, lit, finetune_dir, base_dir)
        inputs = ckpt.inputs + [p for f in files for p in f.inputs]
        device = None if cpu else resolve_device(opts.device)  # None: the CPU
        out_path = write(plan, output_path(out, derived, plan), inputs=inputs, report=report, desc="merge-lora",
                         device=device, overwrite=opts.overwrite, dry_run=opts.dry_run, quiet=opts.quiet)
    target.finish(report, opts.dry_run)
    return out_path, report


def _target(opts: MergeLoraOptions, lit):
    """--keep-format, --to, or the default: the base's own dtype, FP8 and LLM-quantization bases in bf16, a LitGPT
    LoRA's model in the LoRA's dtype (as litgpt merge_lora writes it)."""
    if lit is not None and opts.to is not None and opts.to.startswith("gguf-"):
        raise CkptError(f"--to {opts.to} with a LitGPT LoRA: merge into the LitGPT checkpoint first, convert its "
                        "HF export to GGUF")
    default = Natural(fp8="BF16", llm="BF16", dtype=lit.dtype if lit is not None else None,
                      dtype_source="the LitGPT LoRA's dtype, as litgpt merge_lora does")
    return targets.choose(opts, default)


def _plan(ckpt, files: list[LoraFile], ratios: list[float], opts: MergeLoraOptions, report: MergeLoraReport,
          target, file_format: str, lit):
    """Match every LoRA to the base (the same for every target), report on it, refuse what does not fit, and plan
    the output from the merged views."""
    views = [logical_view(c) for c in ckpt.components]
    notes = litgpt.current_layout(views, lit.litgpt) if lit is not None else []
    if opts.keep_format:
        refuse_plain(ckpt, views)
    patches = match_loras(ckpt, views, files, ratios, report, opts.allow_unmatched)
    names = [Path(f.spec).name for f in files]
    plan = targets.plan_output(target, ckpt, merged_views(views, patches), opts, report, file_format,
                               merge_operation(names, ratios, opts))
    plan.notes += notes
    return plan


def _default_output(base: str, ckpt, plan, file_format: str, out, report, opts, target, lit, finetune_dir,
                    base_dir) -> Path:
    """BASE-merged[-SUFFIX] beside the base; a LitGPT finetune folder merges into a LitGPT checkpoint folder (or the
    one file -o names)."""
    if lit is not None and finetune_dir is not None:
        if out and Path(out).suffix in WEIGHT_SUFFIXES:
            # `-o merged/lit_model.pth` is that one file (never a folder named lit_model.pth)
            names = [n for _, n in litgpt.sidecars(finetune_dir, base_dir)]
            report.note(f"-o {out} names a file: only the merged weights are written there; a LitGPT checkpoint "
                        f"folder also holds {', '.join(names) or 'its config files'} (-o FOLDER writes them too)")
            return default_output(str(finetune_dir), finetune_dir, "merged", folder=False, ext=file_ext(file_format))
        litgpt.as_folder(plan, "lit_model" + file_ext(file_format), litgpt.sidecars(finetune_dir, base_dir))
        return default_output(str(finetune_dir), finetune_dir, "merged", folder=True)
    tag = "merged" + (f"-{target.suffix}" if opts.to else "")  # `--to bf16` beside a plain merge: no collision
    ext = target.ext or (".gguf" if file_format == "gguf" else file_ext(file_format))
    return default_output(base, ckpt.path, tag, folder=not plan.single_file, ext=ext)
