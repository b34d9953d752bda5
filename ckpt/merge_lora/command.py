"""Planning and running `ckpt merge-lora`; also the Python API (`merge_lora`).

The base is read through the same machinery as `convert` (open_checkpoint -> logical_view, which
decodes FP8 layouts), LoRA modules are matched to base tensors with the key map built from the base's
own keys, matched tensors become `MergedTensor`s, and `plan_checkpoint` + `execute` write the result
with the input's layout, metadata and per-tensor dtypes. Every problem with the inputs (unmatched or
ambiguous keys, shapes that do not fit) is found while planning, before any output exists.

Matching and its report are the same for every run; how the output is planned and named is one strategy
chosen once after the inputs are open (`ckpt.merge_lora.strategies`: plain, --keep-format, LitGPT around either).
Matched patches are kept per component under the base tensor's view key.

A matched module whose delta is zero (rank 0, an untrained all-zero lora_B) gets no patch: the summary names
it, and a LoRA made only of such modules is reported as the no-op it is rather than as tensors "changed".
Modules are counted by their stored name (LitGPT's q/k/v pieces of one `attn.qkv` module are one module,
as `ckpt inspect` counts them).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field, replace
from pathlib import Path

from ckpt.devices import resolve_device
from ckpt.errors import CkptError
from ckpt.io.checkpoint import open_checkpoint
from ckpt.merge_lora import litgpt
from ckpt.merge_lora.adapters import make_adapter
from ckpt.merge_lora.adapters.experts import experts_patches
from ckpt.merge_lora.checks import alphas as check_alphas, ratios as check_ratios, settle_alphas
from ckpt.merge_lora.keymap import ExpertBank, build_keymap, family_note
from ckpt.merge_lora.loading import LoraFile, load_lora
from ckpt.merge_lora.merged import Patch
from ckpt.merge_lora.strategies import Patches, Strategy, choose
from ckpt.quant import logical_view
from ckpt.report import Report, listed, plural
from ckpt.run import output_path, write

def merge_targets() -> list[str]:
    """What --to may name: a dtype, or a GGUF type of `ckpt convert` (merged and quantized in one pass)."""
    from ckpt.convert import targets

    return ["fp16", "bf16", "fp32"] + [t.name for t in targets.all_targets() if t.fmt == "gguf"]
SHOW_UNMATCHED = 10  # keys listed in the summary; --report FILE.json holds all of them


@dataclass
class MergeOptions:
    ratios: list[float] = field(default_factory=list)  # one per LoRA; empty = all 1.0
    alphas: list[float] = field(default_factory=list)  # --alpha: once, or one per LoRA; for modules without one
    to: str | None = None
    device: str = "cpu"
    allow_unmatched: bool = False
    dry_run: bool = False
    overwrite: bool = False
    quiet: bool = False
    format: str | None = None  # "safetensors" | "torch"; None: from -o, else torch for LitGPT, else safetensors
    keep_format: bool = False  # write the base's own encoding and container (ckpt.merge_lora.keep_format)


@dataclass
class MergeReport(Report):
    """Report plus the matching summary every run prints (stdout, also with --quiet)."""

    summary: list[str] = field(default_factory=list)
    matched: dict[str, int] = field(default_factory=dict)  # LoRA -> modules matched
    changed: list[str] = field(default_factory=list)  # base tensors changed
    zero: dict[str, list[str]] = field(default_factory=dict)  # LoRA -> matched modules whose delta is zero
    unmatched: dict[str, list[str]] = field(default_factory=dict)  # LoRA -> stored keys that matched nothing
    meters: list = field(default_factory=list)  # --keep-format: one ErrorMeter per re-encoded tensor
    requantization: dict = field(default_factory=dict)  # --keep-format: mean and per-tensor relative RMS

    def facts(self) -> dict:
        """merge-lora's part of `--report FILE.json` (ckpt.cli.report): every unmatched key, not the first few;
        with --keep-format, the requantization error of every re-encoded tensor."""
        return {"summary": self.summary, "matched": self.matched, "changed": self.changed, "unmatched": self.unmatched,
                "zero_delta": self.zero, "requantization": self.requantization or None}


class MergeError(CkptError):
    """A planning failure that still comes with the matching report (unmatched keys)."""

    def __init__(self, message: str, report: MergeReport):
        super().__init__(message)
        self.report = report


def merge_operation(lora_names: list[str], ratios: list[float], opts: MergeOptions) -> str:
    """The `ckpt_operation` merge-lora records in its output's metadata (GGUF: `ckpt.operation`): each LoRA's
    file name with its ratio, and --to or --keep-format. Batch's resume compares with this same string."""
    return ("merge-lora " + " ".join(f"{n}@{r:g}" for n, r in zip(lora_names, ratios))
            + (f" --to {opts.to}" if opts.to else "") + (" --keep-format" if opts.keep_format else ""))


def _build_keymap(shapes: dict[str, tuple[int, ...]], component: str | None):
    return build_keymap(shapes, component=component or None)


def merge_lora(base: str, loras: list[str], out: str | Path | None, opts: MergeOptions,
               report: MergeReport | None = None) -> tuple[Path, MergeReport]:
    """Merge LORAS (in order) into BASE; returns (output path, report). Raises CkptError on bad input
    (nothing written)."""
    report = report or MergeReport()
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
                hint = _swapped_hint(ckpt)
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


def _plan(ckpt, files: list[LoraFile], ratios: list[float], opts: MergeOptions, report: MergeReport,
          strategy: Strategy, file_format: str):
    """Match every LoRA to the base (the same for every strategy), report on it, refuse what does not fit,
    and let the strategy plan the output from the matched patches."""
    views = [logical_view(c) for c in ckpt.components]
    notes = strategy.prepare(ckpt, views)
    patches = match_loras(ckpt, views, files, ratios, report, opts.allow_unmatched)
    names = [Path(f.spec).name for f in files]
    return strategy.plan(ckpt, views, patches, report, merge_operation(names, ratios, opts), file_format, notes)


def match_loras(ckpt, views, files: list[LoraFile], ratios: list[float], report: MergeReport,
                allow_unmatched: bool = False) -> Patches:
    """Every LoRA matched to the base's logical views: per component, view key -> its patches in order. The
    summary lines go to `report`; unmatched keys (unless allowed) and a LoRA that matches nothing are errors.
    Also what `ckpt merge` uses for mergekit's `model: BASE+LORA`. Patches on gpt-oss expert banks (PEFT
    `target_parameters`) come with their `ExpertLoRA` (`experts_patches`), so every caller merges them alike."""
    keymaps = [_build_keymap({n: tuple(t.shape) for n, t in v.tensors.items()}, c.subdir)
               for c, v in zip(ckpt.components, views)]
    where = [c.subdir for c in ckpt.components]
    patches: Patches = [{} for _ in views]  # per component: view key -> patches in order
    for f, ratio in zip(files, ratios):
        _match(f, ratio, views, keymaps, where, patches, report)
    report.changed = sorted(views[c].tensors[k].name for c, ps in enumerate(patches) for k in ps)
    zero = sum(len(z) for z in report.zero.values())
    if zero and not report.changed:
        report.summary.append("base tensors changed: 0 (the merge is a no-op: every matched module's delta is zero)")
        report.warn("the merge changes nothing: every matched LoRA module's delta is zero (the output equals the base)")
    else:
        report.summary.append(f"base tensors changed: {len(report.changed)}")
    swapped = _swapped_hint(ckpt)
    bad = {s: u for s, u in report.unmatched.items() if u}
    if bad and not allow_unmatched:
        s, u = next(iter(bad.items()))
        f = next(f for f in files if f.spec == s)
        raise MergeError(f"{s}: {plural(len(u), 'LoRA key')} match{'es' * (len(u) == 1)} no base tensor (e.g. {u[0]!r}; "
                         f"{family_note(f.modules.values(), keymaps)}){swapped}; nothing was written "
                         "(pass --allow-unmatched to merge the rest)", report)
    if not report.changed and not zero:
        raise MergeError(f"no LoRA module matched the base ({family_note(files[0].modules.values(), keymaps)})"
                         f"{swapped}; nothing to merge", report)
    return experts_patches(patches, views)


def _looks_like_lora(ckpt) -> bool:
    """The base's own keys are mostly LoRA factors (inspect's rule): the arguments were probably swapped."""
    from ckpt.inspect.detect import looks_like_lora

    return looks_like_lora(n for c in ckpt.components for n in c.tensors)


def _swapped_hint(ckpt) -> str:
    if not _looks_like_lora(ckpt):
        return ""
    return f"; BASE {ckpt.spec} is itself a LoRA: swapped? the order is `ckpt merge-lora BASE LORA...`"


def _match(f: LoraFile, ratio: float, views, keymaps, where, patches: Patches, report: MergeReport) -> None:
    """Resolve every module of one LoRA to its base tensors, check shapes, queue its patches, and add
    its lines to the report."""
    unmatched = list(f.unknown)
    matched: set[str] = set()  # stored module names: LitGPT's q/k/v pieces of one attn.qkv module count once
    kinds: dict[str, set[str]] = {}
    zero: set[str] = set()
    nonzero: set[str] = set()  # a LitGPT attn.qkv module is zero only if each of its pieces is
    ordered = sorted(f.modules.values(), key=lambda m: m.family != "replace")  # replacements first
    for m in ordered:
        hit = _resolve(m, keymaps, where, f)
        if hit is None:
            unmatched += m.keys
            continue
        comp, targets = hit
        view = views[comp]
        if m.rows is not None:
            targets = [_narrow(t, m, view.tensors, f) for t in targets]
        try:
            adapter = _fit(m, targets, view.tensors, f)
        except CkptError:
            other = _other_bank(m, targets, view.tensors, f)
            if other is None:
                raise
            targets, adapter = other, _fit(m, other, view.tensors, f)
        kind = adapter.family + ("+dora" if getattr(adapter, "dora", None) is not None else "")
        kinds.setdefault(kind, set()).add(m.name)
        matched.add(m.name)
        if adapter.is_zero():  # rank 0, an untrained lora_B...: no patch, and said so
            zero.add(m.name)
            continue
        nonzero.add(m.name)
        for target in targets:
            offset = target.part[0] if target.part else 0
            if adapter.has_weight:
                patches[comp].setdefault(target.key, []).append(
                    Patch(adapter, ratio, target.rows, target.transform, offset=offset))
            if adapter.bias_rows is not None:
                _check_bias(adapter, target, view.tensors, f)
                patches[comp].setdefault(target.bias_key, []).append(
                    Patch(adapter, ratio, target.rows, target.transform, bias=True, offset=offset))
    n_matched = len(matched)
    zero -= nonzero
    report.matched[f.spec] = n_matched
    report.unmatched[f.spec] = unmatched
    detail = ", ".join(f"{k} {len(v)}" for k, v in sorted(kinds.items()))
    report.summary.append(f"{f.spec}: {plural(n_matched, 'LoRA module')} matched (ratio {ratio:g}"
                          + (f"; {detail})" if detail else ")"))
    if zero:
        names = sorted(zero)
        report.zero[f.spec] = names
        shown = listed(names, SHOW_UNMATCHED)
        every = "all of them: " if len(zero) == n_matched else ""
        one = len(zero) == 1
        report.summary.append(f"{f.spec}: {plural(len(zero), 'module')} {'has' if one else 'have'} a zero delta "
                              f"(rank 0 or an all-zero factor, e.g. an untrained lora_B) and change{'s' * one} "
                              f"nothing: {every}{shown}")
    if unmatched:
        more = len(unmatched) - SHOW_UNMATCHED
        shown = ", ".join(unmatched[:SHOW_UNMATCHED]) + (
            f", ... ({more} more; --report FILE.json lists them all)" if more > 0 else "")
        report.summary.append(f"{f.spec}: {plural(len(unmatched), 'unmatched LoRA key')}: {shown}")


def _narrow(target, m, tensors, f):
    """The target of a module that owns only some rows of a fused base weight (LitGPT q/k/v pieces)."""
    start, stop, total = m.rows
    shape = tuple(tensors[target.key].shape)
    if target.rows is not None or target.transform is not None or not shape or shape[0] != total:
        raise CkptError(f"{f.spec}: module {m.name!r} changes rows {start}:{stop} of a fused weight of {total} "
                        f"rows, but base tensor {target.key!r} is {list(shape)}")
    return replace(target, rows=(start, stop))


def _resolve(m, keymaps, where, f):
    """(component index, [Target, ...]) for a module, None when nothing matches; ambiguity is an error."""
    for name in m.lookup_names:
        hits = []
        for i, km in enumerate(keymaps):
            amb = km.ambiguous(name)
            if amb:
                raise CkptError(f"{f.spec}: module {m.name!r} matches several base tensors: "
                                f"{', '.join(_show(where[i], t) for t in amb)}")
            targets = km.targets(name)
            if targets:
                hits.append((i, targets))
        if len(hits) > 1:
            raise CkptError(f"{f.spec}: module {m.name!r} matches several base tensors: "
                            f"{', '.join(_show(where[i], t) for i, ts in hits for t in ts)}")
        if hits:
            return hits[0]
    return None


def _show(subdir, t) -> str:
    s = f"{subdir}/{t.key}" if subdir else t.key
    return s + (f" rows {t.rows[0]}:{t.rows[1]}" if t.rows else "")


def _slice_shape(target, shape) -> tuple[int, int] | None:
    """(rows, flattened columns) of the part of a base tensor a module changes, in the module's layout
    (the target's transform's shape rule); None where that part cannot take the transform."""
    shape = ((target.rows[1] - target.rows[0]),) + tuple(shape[1:]) if target.rows else tuple(shape)
    if target.transform is not None:
        try:
            shape = target.transform.shape(shape)
        except ValueError:
            return None
    cols = 1
    for d in shape[1:]:
        cols *= d
    return shape[0], cols


def _why_not(adapter, targets, tensors) -> str | None:
    """Why `adapter` cannot change its targets (the base tensors' shapes), or None when it fits."""
    covered = 0
    for target in targets:
        shape = tuple(tensors[target.key].shape)
        where = f"base tensor {target.key!r} {list(shape)}" + (
            f" rows {target.rows[0]}:{target.rows[1]}" if target.rows else "")
        own = _slice_shape(target, shape) if shape else None
        if own is None:
            return f"{where} cannot take a delta"
        rows, cols = own
        if target.part:
            p0, p1 = target.part
            if p1 - p0 != rows or (adapter.rows is not None and p1 > adapter.rows):
                return f"delta rows {p0}:{p1} do not fit {where}"
            if getattr(getattr(adapter, "dora", None), "row_local", True) is False:
                return "input-axis DoRA cannot be split over several base tensors"
            covered += p1 - p0
            rows = adapter.rows if adapter.rows is not None else rows
        why = adapter.check(rows, cols)
        if why:
            return f"{where}: {why}"
    if covered and adapter.rows is not None and covered != adapter.rows:
        return f"the base tensors take {covered} of its {adapter.rows} delta rows"
    return None


def _oriented(m, targets, tensors):
    """The module as it merges into these targets. PEFT ignores fan_in_fan_out on plain Linear layers, so a
    LoRA saved with it may be stored either way: the base tensors' shapes decide, once, before the module's
    adapter is made. It keeps the stored (transposed) orientation unless that does not fit and the plain one
    does; then it is a copy with fan_in_fan_out off (the loaded module itself is never changed)."""
    if m.family != "lora" or not m.fan_in_fan_out:
        return m
    if _why_not(make_adapter(m), targets, tensors) is None:
        return m
    plain = replace(m, fan_in_fan_out=False)
    return plain if _why_not(make_adapter(plain), targets, tensors) is None else m


def _fit(m, targets, tensors, f):
    """The adapter for module `m` on its targets, checked against the base tensors' shapes."""
    adapter = make_adapter(_oriented(m, targets, tensors))
    why = _why_not(adapter, targets, tensors)
    if why:
        raise CkptError(f"{f.spec}: module {m.name!r} does not fit: {why}")
    return adapter


def _other_bank(m, targets, tensors, f):
    """gate_up_proj's target for an expert LoRA read as down_proj's that does not fit it, else None.

    PEFT saves a `target_parameters` LoRA on `mlp.experts.gate_up_proj` alone under the name down_proj's takes when
    both banks are targeted (`mlp.experts`; `ckpt.merge_lora.keymap.EXPERT_BANKS`). The two banks' [out, in] never
    agree (gate_up_proj's out is twice down_proj's in), so factors that fit only gate_up_proj are its LoRA; with
    a `.base_layer` module beside it (both banks targeted) the name is down_proj's and nothing is moved."""
    if len(targets) != 1 or not isinstance(targets[0].transform, ExpertBank) or m.rows is not None:
        return None
    t = targets[0]
    if not t.key.endswith(".down_proj") or any(n.startswith(m.name + ".base_layer") for n in f.modules):
        return None
    other = replace(t, key=t.key[: -len("down_proj")] + "gate_up_proj")
    if other.key not in tensors or _why_not(make_adapter(_oriented(m, [other], tensors)), [other], tensors):
        return None
    return [other]


def _check_bias(adapter, target, tensors, f) -> None:
    """The base has the bias a module's bias delta lands on, with the rows the delta changes."""
    m = adapter.module
    b = tensors.get(target.bias_key)
    if b is None:
        raise CkptError(f"{f.spec}: module {m.name!r} has a bias delta but the base has no {target.bias_key!r}")
    want = (target.rows[1] - target.rows[0]) if target.rows else (b.shape[0] if b.shape else 0)
    have = (target.part[1] - target.part[0]) if target.part else adapter.bias_rows
    if have != want or (target.part and target.part[1] > adapter.bias_rows):
        raise CkptError(f"{f.spec}: module {m.name!r}: bias delta of {adapter.bias_rows} does not fit "
                        f"{target.bias_key!r} ({want} rows)")
