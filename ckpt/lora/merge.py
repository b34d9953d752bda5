"""`ckpt lora merge A B [C ...] [--ratio R ...] [--concat | --svd --rank R]`: one LoRA equal to
applying A, B, ... in order with their ratios.

Modules are matched by their stored name across the inputs (same naming; modules only one input has
are kept). `--concat` (the default) is exact: the factors are stacked, rank r_A + r_B, each input's
ratio x scale folded into its up factor, alpha = the stacked rank (scale 1). `--svd` is kohya's
svd_merge_lora: each module's summed delta sum_i ratio_i scale_i dW_i is re-factorised to rank R
(or a --dynamic rank), alpha = R; sums of plain LoRAs are decomposed from their stacked factors
without forming the product, LoHa / LoKr / full modules through their delta. A module only one input
has, with ratio 1, is passed through unchanged in --concat mode. DoRA, (IA)^3, GLoRA and replacement
modules cannot be combined with anything: refused by name. A rank-0 module adds nothing and is left out
(warned); one with NaN/Inf that must be stacked or summed is refused by name, or left out with
--skip-nonfinite.

The output keeps the first input's naming and alpha placement; with --format F every input is
converted to F first (`ckpt.lora.reformat`), which also merges inputs written in different namings.
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
from ckpt.lora.operations import lora_merge_operation
from ckpt.lora.store import FactorStore
from ckpt.adapters.checks import alphas as check_alphas, ratios as check_ratios
from ckpt.progress import progress_bar
from ckpt.report import plural
from ckpt.run import default_output, output_path, write

MODES = ("concat", "svd")


def merge(specs: list[str], out: str | Path | None, opts: LoraOptions, *, ratios: list[float] = (),
          mode: str = "concat", report: LoraReport | None = None, base: str | None = None,
          operation: str | None = None) -> tuple[Path, LoraReport]:
    """Merge LORAS into one; returns (output path, report). Raises CkptError on bad input (nothing
    written). `operation`: the `ckpt_operation` to record where it is not this call's own
    (`ckpt.lora.reformat` merges converted copies for the command the user ran)."""
    report = report or LoraReport()
    if len(specs) < 2:
        raise CkptError("lora merge: give at least two LoRAs")
    if mode not in MODES:
        raise CkptError(f"lora merge: mode {mode!r}: choose --concat or --svd")
    if mode == "svd":
        opts.check()
    else:
        if opts.rank is not None or opts.dynamic is not None or opts.clamp_quantile is not None:
            raise CkptError("--rank, --dynamic and --clamp-quantile re-factorise: they go with --svd "
                            "(--concat stacks the factors exactly)")
        opts.check(rank_required=False)
    if opts.lowrank:
        raise CkptError("--lowrank: merge decomposes stacked factors exactly; nothing to speed up")
    ratios = check_ratios(ratios, len(specs))
    alphas = check_alphas(opts.alphas, len(specs))
    operation = operation or lora_merge_operation(specs, ratios, mode, opts, base)
    if opts.format is not None:  # every input converted first, then merged in that naming
        from ckpt.lora.reformat import with_format

        return with_format(list(specs), out, opts, "merge", "merged", base,
                           lambda ss, o, op, r: merge(ss, o, op, ratios=ratios, mode=mode, report=r,
                                                      operation=operation), report)
    device = resolve_device(opts.device, heavy=mode == "svd")  # --concat stacks factors
    with contextlib.ExitStack() as stack:
        files = []
        for spec, alpha in zip(specs, alphas):
            f = open_lora(spec, alpha, report)
            stack.callback(f.close)
            if f.unknown:
                raise CkptError(f"{spec}: {plural(len(f.unknown), 'key')} {'is' if len(f.unknown) == 1 else 'are'} no "
                                f"adapter part (e.g. {f.unknown[0]!r}); "
                                "lora merge combines adapter modules only")
            files.append(f)
        layout = _common_layout(files)
        folder = layout.container == "folder"
        derived = default_output(specs[0], Path(specs[0]).expanduser(), "merged", folder=folder)
        out_path = output_path(out, derived, Plan(single_file=not folder, files=[]))
        inputs = [p for f in files for p in f.inputs]
        early_target_check(out_path, inputs, opts.overwrite, not folder, opts.dry_run)
        groups: dict[str, list[tuple[object, float, str]]] = {}
        for f, ratio in zip(files, ratios):
            for m in f.modules.values():
                groups.setdefault(m.name, []).append((m, ratio, f.spec))
        if opts.dry_run:
            shared = sum(len(g) > 1 for g in groups.values())
            report.summary.append(f"would merge {plural(len(groups), 'module')} ({shared} in several inputs) by {mode}")
            return out_path, report
        store = stack.enter_context(FactorStore(out_path))
        modules = _merge_modules(groups, mode, opts, layout, device, store, report)
        nothing_left(specs[0], modules, report)
        report.finish("merged")
        meta = {"ss_network_dim": "Dynamic", "ss_network_alpha": "Dynamic"} if "ss_network_dim" in layout.metadata else {}
        plan = plan_lora(modules, layout, lambda x: x.dtype, operation, meta, report)
        write(plan, out_path, inputs=inputs, report=report, desc="lora merge", device=torch.device("cpu"),
              overwrite=opts.overwrite, dry_run=False, quiet=opts.quiet)
    return out_path, report


def _common_layout(files) -> Layout:
    layouts = [Layout.like(f) for f in files]
    first = layouts[0]
    for f, lay in zip(files[1:], layouts[1:]):
        if (lay.container, lay.suffixes) != (first.container, first.suffixes):
            raise CkptError(f"{f.spec} is written in another naming than {files[0].spec} "
                            f"({_describe(lay)} vs {_describe(first)}); pass --format kohya|peft|diffusers|comfy "
                            "to convert them to one naming first")
    return first


def _describe(lay: Layout) -> str:
    kind = "PEFT adapter folder" if lay.container == "folder" else "file"
    return f"{lay.suffixes[0].split('.')[0]}/{lay.suffixes[1].split('.')[0]} {kind}"


def _merge_modules(groups, mode, opts: LoraOptions, layout: Layout, device, store, report) -> list[OutModule]:
    out: list[OutModule] = []
    dtype = opts.dtype
    total = sum(t.source_bytes for g in groups.values() for m, _, _ in g for t in m.parts.values())
    with progress_bar(total, f"lora merge ({mode})", opts.quiet) as bar, exact_fp32(), torch.no_grad():
        for name, group in groups.items():
            bar.update(sum(t.source_bytes for m, _, _ in group for t in m.parts.values()))
            srcs = []
            for m, ratio, spec in group:
                s = Source(m, device)
                if is_noop(s):  # rank 0: adds nothing to the stack or the sum
                    report.noop.append(f"{name} ({m.source})")
                else:
                    srcs.append((s, ratio, spec))
            if not srcs:
                continue
            if mode == "concat" and len(srcs) == 1 and srcs[0][1] == 1.0:
                s = srcs[0][0]
                report.kept.append(name)
                out.append(as_stored(s.module, layout, store, s if s.kind == "lora" else None))
                continue
            _check_combinable(name, srcs, mode)
            if not all([usable(s, name, opts, report) for s, _, _ in srcs]):  # every input's NaN/Inf counted
                for s, _, _ in srcs:
                    s.release()
                continue
            first = srcs[0][0]
            rows, cols = first.shape2d
            tail = first.weight_tail()
            if mode == "concat" or all(s.plain_lora for s, _, _ in srcs):
                left = torch.cat([s.factors()[0] * (ratio * s.scale) for s, ratio, _ in srcs], dim=1)
                right = torch.cat([s.factors()[1] for s, _, _ in srcs], dim=0)
                total_rank = left.shape[1]
                if mode == "concat":
                    up, down, k = left.to(dtype), right.to(dtype), total_rank
                    err, norm = S.error_of_product(left, right, up.float(), down.float())
                else:
                    U, sv, Vh = S.svd_product(left, right)
                    k, up, down, err, norm = _cut(sv, lambda k: S.truncate(U, sv, Vh, k), opts, first, rows, cols,
                                                  dtype, report, name,
                                                  lambda u, d: S.error_of_product(left, right, u, d))
            else:
                d = sum(s.delta() * ratio for s, ratio, _ in srcs)
                total_rank = None
                U, sv, Vh = S.svd(d, min(rows, cols), S.SvdOptions())
                k, up, down, err, norm = _cut(sv, lambda k: S.factors(d, U, sv, Vh, k), opts, first, rows, cols,
                                              dtype, report, name,
                                              lambda u, dn: S.error_of_whole(d, u, dn))
            upt, downt = to_layout(up, down, tail, first.transposed)
            keys = {role: first.roles[r] for role, r in (("down", "down"), ("up", "up"), ("down", "emb_A"),
                                                         ("up", "emb_B"), ("alpha", "alpha")) if r in first.roles}
            extra = _bias(name, srcs, store, dtype)
            out.append(OutModule(name, store.put(name + ".up", upt), store.put(name + ".down", downt),
                                 layout.alpha_for(1.0, k), keys, extra))
            note = f"{len(srcs)} inputs" if len(srcs) > 1 else ""
            report.modules.append(ModuleResult(name, (rows, cols), k, min(rows, cols), S.rel(err, norm), norm,
                                               from_rank=total_rank, note=note))
            for s, _, _ in srcs:
                s.release()
    return out


def _check_combinable(name, srcs, mode) -> None:
    first = srcs[0][0]
    for s, _, spec in srcs:
        if s.kind not in ("lora", "loha", "lokr", "full") or (s.kind == "lora" and not s.plain_lora):
            kind = "DoRA" if s.kind == "lora" else s.kind
            raise CkptError(f"{spec}: module {name!r} is {kind}: its change depends on the base weight and "
                            "cannot be combined with another LoRA's")
        if mode == "concat" and not s.plain_lora:
            raise CkptError(f"{spec}: module {name!r} is {s.kind}: --concat stacks LoRA factors; "
                            "use --svd to re-factorise the summed delta")
        if s.shape2d != first.shape2d or s.transposed != first.transposed:
            raise CkptError(f"{spec}: module {name!r} changes a [{s.shape2d[0]}, {s.shape2d[1]}] weight but "
                            f"{srcs[0][2]}'s changes [{first.shape2d[0]}, {first.shape2d[1]}]: not the same model")
        if s.kind == "full" and s.adapter.bias_rows is not None:
            raise CkptError(f"{spec}: module {name!r} carries a bias delta (diff_b), which a LoRA cannot hold")


def _cut(sv, cut, opts, first, rows, cols, dtype, report, name, measure):
    cap = min(rows, cols)
    rule = opts.rule(first.conv(), cap)
    k = rule.choose(sv, cap)
    if rule.method is None and rule.rank > cap:
        report.capped.append(f"{name} ({cap})")
    up, down = cut(k)
    if opts.clamp_quantile is not None:
        S.clamp_quantile(up, down, opts.clamp_quantile)
    up, down = up.to(dtype), down.to(dtype)
    err, norm = measure(up.float(), down.float())
    return k, up, down, err, norm


def _bias(name, srcs, store, dtype) -> dict:
    """PEFT `lora_B.bias` deltas: summed with each input's ratio x scale (the factors' scale is 1)."""
    with_bias = [(s, r) for s, r, _ in srcs if "up_bias" in s.roles]
    if not with_bias:
        return {}
    total = sum(s.adapter.part("up_bias") * (r * s.scale) for s, r in with_bias)
    key = with_bias[0][0].roles["up_bias"]
    return {key: store.put(key, total.to(dtype))}
