"""`ckpt lora resize LORA --rank R | --dynamic METHOD --threshold X`: lower a LoRA's rank.

Each LoRA module's product up @ down is decomposed without being formed (QR of both factors, SVD of
the r x r core, `ckpt.lora.svd.svd_product`) and cut to its new rank; alpha becomes scale x new rank
(scale x sqrt(new rank) under rsLoRA), so the effective scale is kept, as kohya's resize_lora does.
A module whose new rank would not be lower than its rank is passed through unchanged. LoHa and LoKr
modules are formed into their delta first and leave as plain LoRA modules (kohya lora_down/lora_up
keys under the same module name); a DoRA module keeps its magnitude vector and has its low-rank part
resized. (IA)^3, GLoRA, full-weight (`diff`) and replacement modules have no rank and pass through. A module of
rank 0 (or with an empty factor) changes nothing and is left out with a warning (kohya-style loaders divide
by its rank); one with NaN/Inf in what is decomposed is refused by name, or left out with --skip-nonfinite
(`ckpt.lora.common.usable`). Modules passed through keep their values; NaN/Inf among them are counted.

The output keeps the input's naming, module names, alpha placement and container
(`ckpt.lora.formats.Layout.like`), unless --format F is given: the input is then converted to F
first (`ckpt.lora.reformat`) and F's modules are resized.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

from ckpt.lazy import torch

from ckpt.devices import exact_fp32, resolve_device
from ckpt.errors import CkptError
from ckpt.io.plan import Plan
from ckpt.lora import svd as S
from ckpt.lora.common import (LoraOptions, LoraReport, ModuleResult, early_target_check, is_noop, nothing_left,
                              usable)
from ckpt.lora.formats import Layout, OutModule, plan_lora
from ckpt.lora.modules import Source, as_stored, open_lora, to_layout
from ckpt.lora.operations import lora_resize_operation
from ckpt.lora.store import FactorStore
from ckpt.adapters.checks import alphas as check_alphas
from ckpt.progress import progress_bar
from ckpt.report import plural
from ckpt.run import default_output, output_path, write

RESIZABLE = ("lora", "loha", "lokr")


def resize(spec: str, out: str | Path | None, opts: LoraOptions, report: LoraReport | None = None, *,
           base: str | None = None, operation: str | None = None) -> tuple[Path, LoraReport]:
    """Resize LORA; returns (output path, report). Raises CkptError on bad input (nothing written).
    `operation`: the `ckpt_operation` to record where it is not this call's own (`ckpt.lora.reformat`
    resizes a converted copy for the command the user ran)."""
    report = report or LoraReport()
    opts.check()
    alpha = check_alphas(opts.alphas, 1)[0]
    if opts.lowrank:
        raise CkptError("--lowrank: resize decomposes each module exactly from its r x r core; nothing to speed up")
    operation = operation or lora_resize_operation(spec, opts, base)
    if opts.format is not None:  # convert first, then resize the converted modules
        from ckpt.lora.reformat import with_format

        return with_format([spec], out, opts, "resize", "resized", base,
                           lambda specs, o, op, r: resize(specs[0], o, op, r, operation=operation), report)
    device = resolve_device(opts.device)
    with contextlib.ExitStack() as stack:
        f = open_lora(spec, alpha, report)
        stack.callback(f.close)
        if f.unknown:
            report.note(f"{spec}: {plural(len(f.unknown), 'key')} {'is' if len(f.unknown) == 1 else 'are'} no adapter part; "
                        "passed through unchanged "
                        f"(e.g. {f.unknown[0]!r})")
        layout = Layout.like(f)
        folder = layout.container == "folder"
        derived = default_output(spec, Path(spec).expanduser(), "resized", folder=folder)
        out_path = output_path(out, derived, Plan(single_file=not folder, files=[]))
        early_target_check(out_path, f.inputs, opts.overwrite, not folder, opts.dry_run)
        if opts.dry_run:
            report.summary.append(f"would resize the {sum(m.kind in RESIZABLE for m in f.modules.values())} "
                                  f"LoRA/LoHa/LoKr modules of {spec}; ranks and errors are known after the SVDs")
            return out_path, report
        store = stack.enter_context(FactorStore(out_path))
        modules = _resize_modules(f, opts, layout, device, store, report)
        nothing_left(spec, modules, report)
        for key in f.unknown:
            modules.append(OutModule(key, extra={key: f.ckpt.components[0].tensors[key]}))
        report.finish("resized")
        meta = {}
        if "ss_network_dim" in layout.metadata:
            dim = "Dynamic" if opts.dynamic else str(opts.rank)
            meta = {"ss_network_dim": dim, "ss_network_alpha": "Dynamic"}
        plan = plan_lora(modules, layout, lambda x: x.dtype, operation, meta, report)
        write(plan, out_path, inputs=f.inputs, report=report, desc="lora resize", device=torch.device("cpu"),
              overwrite=opts.overwrite, dry_run=False, quiet=opts.quiet)
    return out_path, report


def _resize_modules(f, opts: LoraOptions, layout: Layout, device, store: FactorStore,
                    report: LoraReport) -> list[OutModule]:
    out: list[OutModule] = []
    dtype = opts.dtype
    total = sum(t.source_bytes for m in f.modules.values() for t in m.parts.values())
    with progress_bar(total, "lora resize (SVD)", opts.quiet) as bar, exact_fp32(), torch.no_grad():
        for m in f.modules.values():
            bar.update(sum(t.source_bytes for t in m.parts.values()))
            if m.kind not in RESIZABLE:
                out.append(_passed(m, layout, report, store))
                continue
            src = Source(m, device)
            if is_noop(src):
                report.noop.append(m.name)
                src.release()
                continue
            rows, cols = src.shape2d
            cap = min(rows, cols)
            rule = opts.rule(src.conv(), cap)
            if src.lora_like:
                left, right = src.factors()
                r = left.shape[1]
                if rule.method is None and min(rule.rank, cap) >= r:
                    out.append(_passed(m, layout, report, store, src))
                    src.release()
                    continue
                if not usable(src, m.name, opts, report):
                    src.release()
                    continue
                U, sv, Vh = S.svd_product(left, right)
                k = rule.choose(sv, min(cap, r))
                if k >= r:
                    out.append(_passed(m, layout, report, store, src))
                    src.release()
                    continue
                up, down = S.truncate(U, sv, Vh, k)
                up, down = up.to(dtype), down.to(dtype)
                err, norm = S.error_of_product(left, right, up.float(), down.float())
                scale = src.scale
                if not layout.stores_alpha:  # no alpha in the output: the scale goes into up
                    up, scale = (up.float() * scale).to(dtype), 1.0
            else:  # LoHa / LoKr: the delta itself (scale included), then plain LoRA factors
                if not usable(src, m.name, opts, report):
                    src.release()
                    continue
                d = src.delta()
                r = None
                U, sv, Vh = S.svd(d, cap, S.SvdOptions())
                k = rule.choose(sv, cap)
                up, down = S.factors(d, U, sv, Vh, k)
                up, down = up.to(dtype), down.to(dtype)
                err, norm = S.error_of_whole(d, up.float(), down.float())
                scale = 1.0
            upt, downt = to_layout(up, down, src.weight_tail(), src.transposed)
            keys = {"down": src.roles.get("down") or src.roles.get("emb_A") if src.lora_like else None,
                    "up": src.roles.get("up") or src.roles.get("emb_B") if src.lora_like else None,
                    "alpha": src.roles.get("alpha")}
            keys = {role: key for role, key in keys.items() if key}
            extra = {key: m.parts[role] for role, key in src.roles.items()
                     if role in ("magnitude", "dora_scale", "up_bias")}
            out.append(OutModule(m.name, store.put(m.name + ".up", upt), store.put(m.name + ".down", downt),
                                 layout.alpha_for(scale, k), keys, extra))
            report.modules.append(ModuleResult(m.name, (rows, cols), k, cap, S.rel(err, norm), norm, from_rank=r,
                                               note="" if src.lora_like else f"{m.kind} -> lora"))
            src.release()
    return out


def _passed(m, layout: Layout, report: LoraReport, store, src: Source | None = None) -> OutModule:
    """A module written as stored (rank already at or below the target, or no rank at all)."""
    report.kept.append(m.name)
    return as_stored(m, layout, store, src)
