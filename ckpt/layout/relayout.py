"""`ckpt convert --layout diffusers|original`: the same weights under the other layout's names.

Planning only (the write is the shared one): the family registry says what the input is and gives the
tensor-by-tensor correspondence (`Pair`s); each output tensor is a lazy view of input tensors (a row
slice of a fused `qkv`, pieces stacked back into one, halves swapped, a reshape), so nothing is read
before the plan is complete and data then streams band by band. Every input tensor must have a
counterpart: one that has none, an unknown family, or a fused tensor with a missing piece is refused
before anything is written, naming the keys.

Outputs: `--layout diffusers` writes a diffusers model folder (`config.json` derived from the shapes and
the family's CONVENTIONS, or taken from `--config REF`; `diffusion_pytorch_model.safetensors`, sharded with
an index past `--max-shard-size`, by default past diffusers' own `save_pretrained` limit); `--layout original`
writes one safetensors file with the reference model's keys (no `model.diffusion_model.`/`model.model.`
prefix: ComfyUI and the reference code load bare keys), a torch file with `--format torch`, and shards named
as transformers names them with `--max-shard-size`. File names, formats and indexes are
`ckpt.io.plan.plan_files`'s (the one planner of safetensors and torch weight files).

A layout is names *and* a container: the original layout is one file, the diffusers layout a model folder
with its config.json. So a conversion is a no-op only when the input already has both; names already right
(a family with one naming, Qwen-Image and HiDream, whose files use diffusers' names; or a diffusers-named
single file) make the correspondence the identity, and the rest (prefix, config, sharding) is the same
path. A LoRA is not a model: it is refused with the command that converts LoRAs.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from ckpt import families
from ckpt.errors import CkptError
from ckpt.families import DIFFUSERS, ORIGINAL, Family, Pair, Transform
from ckpt.families.prefixes import model_prefix
from ckpt.families.spec import ConventionError
from ckpt.io.checkpoint_plan import provenance
from ckpt.io.plan import Plan, plan_files
from ckpt.io.tensors import ComputedTensor, Reshaped, RowConcat, RowSlice, Tensor, Transposed
from ckpt.io.wrapper import Renamed
from ckpt.report import listed, plural

DIFFUSERS_STEM = "diffusion_pytorch_model"
# diffusers' ModelMixin.save_pretrained(max_shard_size="10GB"), decimal as huggingface_hub counts: a folder
# written here is sharded as diffusers itself would write it unless --max-shard-size says otherwise.
DIFFUSERS_MAX_SHARD = 10 * 10**9
SHOW = 8


def _listed(keys, n=SHOW) -> str:
    return listed(sorted(keys), n)


def _rows(t: Tensor, rows: tuple[int, int] | None) -> list[Tensor]:
    """`t` (or its rows) as a list of row pieces."""
    if rows is None or rows == (0, t.rows):
        return [t]
    return [RowSlice(t, rows[0], rows[1])]


def _check_split_whole(tensors: dict[str, Tensor], pairs: list[Pair]) -> None:
    """Every row of a fused original tensor goes to one diffusers tensor: rows the pairs leave out (a
    tensor larger than its neighbours' widths say) would be lost without a word."""
    taken: dict[str, list[tuple[int, int]]] = {}
    for p in pairs:
        if p.rows is not None:  # a dropped piece (no diffusers tensor) is accounted for as well
            taken.setdefault(p.original, []).append(p.rows)
    for key, spans in taken.items():
        rows, at = tensors[key].rows, 0
        for a, b in sorted(spans):
            if a != at:
                break
            at = b
        if at != rows:
            raise CkptError(f"{key}: {plural(rows, 'row')}, but the layout takes rows "
                            f"{', '.join(f'{a}:{b}' for a, b in sorted(spans))} from it (a mismatched tensor?); "
                            "nothing was written")


def _pieces(t: Tensor, rows, transform: Transform | None, to_original: bool) -> list[Tensor]:
    """Row pieces that, stacked, are the other layout's tensor made from rows `rows` of `t`: the family's
    transform (its inverse towards the original layout) as lazy tensors, so rows still stream in bands
    where the transform keeps them (`Transform.row_spans`)."""
    if transform is None:
        return _rows(t, rows)
    (part,) = _rows(t, rows)
    tr = transform.inverse if to_original else transform
    try:
        shape = tr.shape(part.shape)
    except ValueError as e:
        raise CkptError(f"{t.name}: {e}") from None
    spans = tr.row_spans(part.rows)
    if spans is None:  # rows not kept: transposed, or the same elements regrouped into other rows (read whole)
        return [Transposed(part) if tr is Transform.TRANSPOSE else Reshaped(part, shape)]
    if shape != tuple(part.shape):
        return [Reshaped(part, shape)]
    return [RowSlice(part, a, b) for a, b in spans]


def _one(name: str, pieces: list[Tensor]) -> Tensor:
    if len(pieces) == 1:
        return Renamed(pieces[0], name)
    try:
        return RowConcat(name, pieces)
    except ValueError as e:
        raise CkptError(str(e)) from None


def one_naming(family: Family) -> bool:
    """A family whose only naming is diffusers' (Qwen-Image, HiDream): its original single files hold the
    same names, so its two layouts differ in the container alone. (Families whose one naming is None, T5 or
    language models, have no diffusers model folder to write.)"""
    return family.pairs is None and set(family.layouts) == {DIFFUSERS}


def correspondence(family: Family, shapes, src: str, dst: str) -> list[Pair]:
    """The Pairs from layout `src` to `dst` of the keys in `shapes`: the family's table, or the identity where
    the names are already `dst`'s (one naming, or a diffusers-named single file made a folder). The identity
    keeps only keys the family's table knows in that layout, where it has one, so a stray tensor is still
    refused as having no counterpart. (Not the family's `pairs`: those say which names a model has, which
    LoRA tools read; an identity over whatever keys are given would claim every name.)"""
    if one_naming(family):
        return [Pair(k, k) for k in shapes]
    if src != dst:
        return family.pairs(shapes, src)
    side = (lambda p: p.original) if src == ORIGINAL else (lambda p: p.diffusers)
    known = {side(p) for p in family.pairs(shapes, src)}
    return [Pair(k, k) for k in shapes if k in known]


def relayout(tensors: dict[str, Tensor], family: Family, src: str, dst: str,
             config: dict | None = None) -> tuple[dict[str, Tensor], list[str]]:
    """The tensors of layout `dst` made from `tensors` (keys in layout `src`, file prefix stripped), and
    the keys dropped because they exist in `src` only. Raises CkptError before anything is read when a
    tensor has no counterpart or a fused tensor is incomplete. Towards the original layout, the tensors the
    diffusers model computes (`Family.computed`) are made from `config` (the diffusers config.json; None: the
    model class's defaults), so the file is whole."""
    shapes = {k: tuple(t.shape) for k, t in tensors.items()}
    pairs = correspondence(family, shapes, src, dst)
    covered: set[str] = set()
    dropped: list[str] = []
    out: dict[str, Tensor] = {}
    if src == ORIGINAL:
        _check_split_whole(tensors, pairs)
        for p in pairs:
            covered.add(p.original)
            if p.diffusers is None:
                dropped.append(p.original)
                continue
            out[p.diffusers] = _one(p.diffusers, _pieces(tensors[p.original], p.rows, p.transform, False))
    else:
        groups: dict[str, list[Pair]] = {}
        for p in pairs:
            covered.add(p.diffusers)
            if p.original is None:
                dropped.append(p.diffusers)
                continue
            groups.setdefault(p.original, []).append(p)
        for key, group in groups.items():
            group.sort(key=lambda p: p.rows[0] if p.rows else 0)
            at = 0
            for p in group:
                t = tensors[p.diffusers]
                a, b = p.rows if p.rows else (0, t.rows)
                if a != at or b - a != t.rows:
                    raise CkptError(f"{key}: rows {at}:{a if a != at else b} have no diffusers tensor "
                                    f"(it is made from {', '.join(q.diffusers for q in group)}; is one missing?)")
                at = b
            pieces = [x for p in group for x in _pieces(tensors[p.diffusers], None, p.transform, True)]
            out[key] = _one(key, pieces)
        if src == DIFFUSERS and dst == ORIGINAL:
            out.update(computed_tensors(family, config, out))
    unmatched = [k for k in tensors if k not in covered]
    for pattern, why in family.unconvertible:
        hit = next((k for k in unmatched if re.search(pattern, k)), None)
        if hit is not None:
            raise CkptError(f"{hit}: {why}; nothing was written")
    if unmatched:
        raise CkptError(f"{plural(len(unmatched), 'tensor')} {'has' if len(unmatched) == 1 else 'have'} no "
                        f"counterpart in the {dst} layout of {family.label}: "
                        f"{_listed(unmatched)}; nothing was written")
    return out, dropped


def computed_tensors(family: Family, config: dict | None, have) -> dict[str, Tensor]:
    """The family's computed original tensors (`Family.computed`) that `have` lacks, made now (a few floats)."""
    out: dict[str, Tensor] = {}
    for c in family.computed:
        if c.key not in have:
            try:
                value = c.value(config if isinstance(config, dict) else {})
            except (TypeError, ValueError) as e:
                raise CkptError(f"config.json: cannot make {c.key} from it ({e}); nothing was written") from None
            out[c.key] = ComputedTensor(c.key, lambda v=value: v, value.dtype, tuple(value.shape))
    return out


def strip_prefix(tensors: dict[str, Tensor]) -> tuple[dict[str, Tensor], str]:
    """Keys without the single-file model prefix (`ckpt.families.prefixes`); mixed prefixes (a bundle)
    are refused."""
    prefix = model_prefix(tensors, {k: tuple(t.shape) for k, t in tensors.items()})
    if prefix:
        others = [k for k in tensors if not k.startswith(prefix)]
        if others:
            raise CkptError(f"the file holds more than one model ({prefix}* and e.g. {_listed(others, 3)}): "
                            "--layout converts one model; extract it first")
        return {k[len(prefix):]: t for k, t in tensors.items()}, prefix
    return dict(tensors), ""


def _convertible(f: Family) -> bool:
    return bool(f.pairs and len(f.layouts) > 1) or one_naming(f)


def _match(tensors: dict[str, Tensor], where) -> families.Match:
    shapes = {k: tuple(t.shape) for k, t in tensors.items()}
    m = families.detect(shapes, shapes)
    if m is None or m.layout is None or not _convertible(m.family):
        what = f"{m.label}, which has no diffusers model folder" if m is not None else "no known model family"
        raise CkptError(f"{where}: {what} (keys such as {_listed(tensors, 4)}); --layout converts "
                        + ", ".join(f.family_id for f in families.all_families() if _convertible(f)))
    return m


def _container(ckpt, comp) -> str:
    """The layout the input's container is: a diffusers model folder (a config.json naming a class, or
    weights named `diffusion_pytorch_model*`) is the diffusers one; a file or a set of shards is original."""
    if ckpt.kind == "file":
        return ORIGINAL
    if isinstance(comp.config, dict) and "_class_name" in comp.config:
        return DIFFUSERS
    return DIFFUSERS if all(f.relpath.startswith(DIFFUSERS_STEM) for f in comp.files) else ORIGINAL


def refuse_lora(ckpt, layout: str) -> None:
    """A LoRA passed to --layout matches a family by its module names and then fails on every factor key;
    say what it is instead, with the command that converts a LoRA's naming (inspect's and merge-lora's
    rule decides what a LoRA is)."""
    from ckpt.families.identify import looks_like_lora

    if not looks_like_lora(n for c in ckpt.components for n in c.tensors):
        return
    import shlex

    names = sorted(n for c in ckpt.components for n in c.tensors)
    example = next((n for n in names if not n.endswith(".alpha")), names[0])
    # the LoRA namings whose module names are the layout's: diffusers', ComfyUI's (the original names)
    fmt = "diffusers" if layout == DIFFUSERS else "comfy"
    others = ", ".join(f for f in ("kohya", "peft", "diffusers", "comfy") if f != fmt)
    raise CkptError(f"{ckpt.spec} is a LoRA, not a model ({plural(len(names), 'key')} such as {example}): --layout "
                    f"converts a model's weights; convert a LoRA with `ckpt lora convert {shlex.quote(ckpt.spec)} "
                    f"--format {fmt}` (or {others}); nothing was written")


def load_config_ref(ref: str) -> dict:
    """A diffusers config.json named by REF: the file, a model folder holding it, or a hub id
    `owner/name[/subfolder]` (config.json fetched alone through the hub cache)."""
    p = Path(ref).expanduser()
    if p.is_dir():
        p = p / "config.json"
    elif not p.exists():
        from ckpt.io.hub import config_from_hub, looks_like_repo_id

        if not looks_like_repo_id(ref):
            raise CkptError(f"--config {ref}: no such file or folder")
        p = config_from_hub(ref)
    try:
        cfg = json.loads(p.read_text())
        assert isinstance(cfg, dict)
    except FileNotFoundError:
        raise CkptError(f"--config {ref}: no config.json there") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, AssertionError):
        raise CkptError(f"--config {ref}: {p} is not a JSON object") from None
    return cfg


def plan_model_layout(ckpt, views, make, *, layout: str, operation: str, config_ref: str | None = None,
                      max_shard_size: int | None = None, file_format: str = "safetensors") -> Plan:
    """`--layout` for one model (a single file, a sharded set or a model folder) that is neither a diffusers
    pipeline folder nor an all-in-one file (those are `ckpt.layout.pipeline`'s; `ckpt.layout.plan` decides)."""
    if len(ckpt.components) != 1:
        raise CkptError(f"{ckpt.path}: --layout converts one model (a single file, a sharded set or a model "
                        f"folder); this holds {len(ckpt.components)} ({', '.join(c.subdir or '.' for c in ckpt.components)})")
    comp, view = ckpt.components[0], views[0]
    tensors, prefix = strip_prefix(view.tensors)
    m = _match(tensors, comp.where)
    container = _container(ckpt, comp)
    # the names' layout; one naming serves both, so the container says which one the input is in
    src = container if one_naming(m.family) else m.layout
    if src == layout and container == layout:
        where, held = (comp.where, "one file") if layout == ORIGINAL else (ckpt.path, "a diffusers model folder")
        raise CkptError(f"{where}: already in the {layout} layout ({m.label}, {held}); nothing to convert")
    if layout == DIFFUSERS and file_format != "safetensors":
        raise CkptError("--layout diffusers writes safetensors (diffusers model folders hold no torch pickles)")
    config_in = comp.config if src == DIFFUSERS and isinstance(comp.config, dict) else None
    out, dropped = relayout(tensors, m.family, src, layout, config_in)
    metadata = {k: v for f in comp.files for k, v in f.metadata.items() if k not in view.drop_metadata}
    metadata.setdefault("format", "pt")
    metadata.update(provenance(operation))
    outs = [o for t in out.values() for o in make(t)]
    same = src == layout or one_naming(m.family)
    notes = list(view.notes) + [f"{m.label} -> {layout} layout: {plural(len(out), 'tensor')} from {len(tensors):,}"
                                + (" (the same names)" if same else "")
                                + (f", without the file's {prefix!r} prefix" if prefix else "")]
    if dropped:
        one = len(dropped) == 1
        notes.append(f"{plural(len(dropped), 'tensor')} {'exists' if one else 'exist'} in the {src} layout only "
                     f"and {'is' if one else 'are'} not written: {_listed(dropped)}")
    made = [c for c in m.family.computed if src == DIFFUSERS and layout == ORIGINAL and c.key not in tensors]
    if made:
        notes.append(f"{plural(len(made), 'tensor')} the diffusers model computes, written from "
                     + ("its config.json" if config_in is not None else "the model class's defaults (no config.json)")
                     + ": " + ", ".join(f"{c.key} ({c.source})" if c.source else c.key for c in made))
    if layout == ORIGINAL:  # one file, or transformers-named shards when --max-shard-size asks
        files, indexes = plan_files(outs, "" if max_shard_size is None else "model", file_format, max_shard_size,
                                    metadata)
        plan = Plan(single_file=max_shard_size is None, files=files, indexes=indexes)
        plan.notes += notes
        return plan
    shapes = {k: tuple(t.shape) for k, t in out.items()}
    if config_ref:
        config = load_config_ref(config_ref)
        notes.append(f"config.json taken from {config_ref}")
    elif m.family.diffusers_config is None:
        raise CkptError(f"{m.label}: no config.json can be derived for this family; pass --config REF "
                        "(a diffusers config.json, model folder or hub id)")
    else:
        try:
            config = m.family.diffusers_config(shapes)
        except (ConventionError, KeyError) as e:
            why = str(e) if isinstance(e, ConventionError) else f"tensor {e} is missing"
            raise CkptError(f"{comp.where}: cannot derive the diffusers config.json ({why}); pass --config REF "
                            "(a diffusers config.json, model folder or hub id)") from None
        notes.append(f"config.json derived from the shapes; what no weight holds follows the {m.family.label} "
                     "releases (pass --config REF for a model that differs)")
    files, indexes = plan_files(outs, DIFFUSERS_STEM, file_format, max_shard_size or DIFFUSERS_MAX_SHARD, metadata)
    plan = Plan(single_file=False, files=files, indexes=indexes)
    plan.generated["config.json"] = config
    plan.notes += notes
    return plan
