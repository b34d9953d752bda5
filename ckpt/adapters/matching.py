"""Adapters matched to a base's logical tensors: every module of every LoRA resolved to the base tensors it lands on
(the key map), checked against their shapes, and queued as patches per component; the summary lines every command
prints (matched, zero-delta and unmatched modules). `ckpt merge-lora` and `ckpt merge`'s `model: BASE+LORA` both
match through `match_loras`.

A matched module whose delta is zero (rank 0, an untrained all-zero lora_B) gets no patch: the summary names it,
and a LoRA made only of such modules is reported as the no-op it is rather than as tensors "changed". Modules are
counted by their stored name (LitGPT's q/k/v pieces of one `attn.qkv` module are one module, as `ckpt inspect`
counts them).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from ckpt.adapters.keymap import ExpertBank, build_keymap, family_note
from ckpt.adapters.kinds import make_adapter
from ckpt.adapters.kinds.experts import experts_patches
from ckpt.adapters.loading import LoraFile
from ckpt.adapters.merged import Patch
from ckpt.errors import CkptError
from ckpt.report import Report, listed, plural

SHOW_UNMATCHED = 10  # keys listed in the summary; --report FILE.json holds all of them
Patches = list[dict[str, list[Patch]]]  # per component: view key -> patches in order


@dataclass
class MatchReport(Report):
    """Report plus the matching summary every run prints (stdout, also with --quiet)."""

    summary: list[str] = field(default_factory=list)
    matched: dict[str, int] = field(default_factory=dict)  # LoRA -> modules matched
    changed: list[str] = field(default_factory=list)  # base tensors changed
    zero: dict[str, list[str]] = field(default_factory=dict)  # LoRA -> matched modules whose delta is zero
    unmatched: dict[str, list[str]] = field(default_factory=dict)  # LoRA -> stored keys that matched nothing


class MatchError(CkptError):
    """A matching failure that still comes with the matching report (unmatched keys)."""

    def __init__(self, message: str, report: MatchReport):
        super().__init__(message)
        self.report = report


def _build_keymap(shapes: dict[str, tuple[int, ...]], component: str | None):
    return build_keymap(shapes, component=component or None)


def match_loras(ckpt, views, files: list[LoraFile], ratios: list[float], report: MatchReport,
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
    swapped = swapped_hint(ckpt)
    bad = {s: u for s, u in report.unmatched.items() if u}
    if bad and not allow_unmatched:
        s, u = next(iter(bad.items()))
        f = next(f for f in files if f.spec == s)
        raise MatchError(f"{s}: {plural(len(u), 'LoRA key')} match{'es' * (len(u) == 1)} no base tensor (e.g. {u[0]!r}; "
                         f"{family_note(f.modules.values(), keymaps)}){swapped}; nothing was written "
                         "(pass --allow-unmatched to merge the rest)", report)
    if not report.changed and not zero:
        raise MatchError(f"no LoRA module matched the base ({family_note(files[0].modules.values(), keymaps)})"
                         f"{swapped}; nothing to merge", report)
    return experts_patches(patches, views)


def _looks_like_lora(ckpt) -> bool:
    """The base's own keys are mostly LoRA factors (inspect's rule): the arguments were probably swapped."""
    from ckpt.families.identify import looks_like_lora

    return looks_like_lora(n for c in ckpt.components for n in c.tensors)


def swapped_hint(ckpt) -> str:
    if not _looks_like_lora(ckpt):
        return ""
    return f"; BASE {ckpt.spec} is itself a LoRA: swapped? the order is `ckpt merge-lora BASE LORA...`"


def _match(f: LoraFile, ratio: float, views, keymaps, where, patches: Patches, report: MatchReport) -> None:
    """Resolve every module of one LoRA to its base tensors, check shapes, queue its patches, and add
    its lines to the report."""
    unmatched = list(f.unknown)
    matched: set[str] = set()  # stored module names: LitGPT's q/k/v pieces of one attn.qkv module count once
    kinds: dict[str, set[str]] = {}
    zero: set[str] = set()
    nonzero: set[str] = set()  # a LitGPT attn.qkv module is zero only if each of its pieces is
    ordered = sorted(f.modules.values(), key=lambda m: m.kind != "replace")  # replacements first
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
        kind = adapter.kind + ("+dora" if getattr(adapter, "dora", None) is not None else "")
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
    """(component index, [Placement, ...]) for a module, None when nothing matches; ambiguity is an error."""
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
    if m.kind != "lora" or not m.fan_in_fan_out:
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
    both banks are targeted (`mlp.experts`; `ckpt.adapters.keymap.EXPERT_BANKS`). The two banks' [out, in] never
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
