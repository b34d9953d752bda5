"""`ckpt lora resize|merge --format F`: the inputs converted to naming F first, then resized or merged.

Each input goes through `ckpt lora convert` (exact: renames, q/k/v split or re-fused block-
diagonally, alphas placed) into a scratch folder beside the output (`ckpt.lora.store.ScratchDir`),
in fp32; the operation then runs on the converted files, so its output is in naming F and its ranks
are the ranks of F's modules (a kohya `img_attn.qkv` resized to R is rank R, not 3R). LoHa / LoKr /
full modules that F has no form for become plain LoRA modules at full rank (exact) on the way; the
operation's own rank rule then applies. Inputs in different namings are merged this way too.
"""

from __future__ import annotations

import contextlib
import dataclasses
from pathlib import Path

from ckpt.errors import CkptError
from ckpt.io.plan import Plan
from ckpt.io.publish import temp_name
from ckpt.lora.common import LoraOptions, LoraReport, early_target_check
from ckpt.lora.store import ScratchDir
from ckpt.adapters.checks import alphas as check_alphas
from ckpt.report import plural
from ckpt.run import default_output, output_path

FULL_RANK = 1 << 30  # --to-lora for LoHa/LoKr met on the way: the delta's full rank (exact)


def with_format(specs: list[str], out, opts: LoraOptions, verb: str, suffix: str, base: str | None, run,
                report: LoraReport | None) -> tuple[Path, LoraReport]:
    """Convert `specs` to `opts.format`, then `run(converted_specs, out_path, opts_without_format, report)`."""
    from ckpt.lora.convert import FORMATS, convert

    fmt = opts.format
    if fmt not in FORMATS:
        raise CkptError(f"--format {fmt}: choose one of {', '.join(FORMATS)}")
    report = report or LoraReport()
    folder = fmt == "peft"
    derived = default_output(specs[0], Path(specs[0]).expanduser(), suffix, folder=folder)
    out_path = output_path(out, derived, Plan(single_file=not folder, files=[]))
    inputs = [Path(s).expanduser() for s in specs if Path(s).expanduser().exists()]
    early_target_check(out_path, inputs, opts.overwrite, not folder, opts.dry_run)
    alphas = check_alphas(opts.alphas, len(specs))
    inner = dataclasses.replace(opts, format=None, alphas=())  # the converted files carry every alpha

    def copts(alpha):
        return LoraOptions(format=fmt, device=opts.device, quiet=True, dry_run=opts.dry_run,
                           alphas=(alpha,) if alpha is not None else (), skip_nonfinite=opts.skip_nonfinite)

    names = [f"{i}-{fmt}" + ("" if folder else ".safetensors") for i in range(len(specs))]
    if opts.dry_run:  # every input's conversion planned (its errors found), nothing made
        for spec, name, alpha in zip(specs, names, alphas):
            _said(convert(spec, out_path.parent / temp_name(name), copts(alpha), base=base, to_lora=FULL_RANK)[1],
                  report)
        report.summary.append(f"would convert {plural(len(specs), 'input')} to the {fmt} naming, "
                              f"then {verb} {'them' if len(specs) > 1 else 'it'}; ranks and errors are known "
                              "after the SVDs")
        return out_path, report
    with contextlib.ExitStack() as stack:
        scratch = stack.enter_context(ScratchDir(out_path))
        converted = []
        for spec, name, alpha in zip(specs, names, alphas):
            path, creport = convert(spec, scratch.path / name, copts(alpha), base=base, to_lora=FULL_RANK)
            converted.append(str(path))
            _said(creport, report)
        path, report = run(converted, out_path, inner, report)
    report.summary.insert(0, f"inputs converted to the {fmt} naming first (exact)")
    return path, report


def _said(converted: LoraReport, report: LoraReport) -> None:
    """What converting an input found that the user must hear (an assumed alpha, modules left out): the
    conversion's own report is not printed. NaN/Inf kept as stored are counted by the final write."""
    for w in converted.warned:
        report.warn(w)
    report.notes += [n for n in converted.notes if n not in report.notes]
    report.noop += converted.noop
    report.nonfinite += converted.nonfinite
    for key, n in converted.counts.get("nonfinite_skipped", {}).items():
        report.count("nonfinite_skipped", key, n)
