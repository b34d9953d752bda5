"""`ckpt lora convert LORA --format kohya|peft|diffusers|comfy [--base BASE]`: the same LoRA in the
naming another loader expects.

Every module of the LoRA is first placed on the weights of a base, exactly as `ckpt merge-lora`
places it (the key map: names of either layout, row slices of fused weights, transforms). The base is
BASE when given; otherwise a *virtual base* made from the LoRA itself: one weight per module, named
by the module's own name without its trainer prefix and shaped as its factors say, recognised by the
family registry like any base (kohya's flattened names are matched against the family's tensor
names: `ckpt.lora.unflatten`). The output naming then cuts that base into modules
(`ckpt.lora.naming`), and each output module's factors are put together from the input modules that
land on its rows:

- a rename (one input module is the whole output module): the factors as they are, alpha kept;
- a split (kohya `img_attn.qkv` -> diffusers `to_q`, `to_k`, `to_v`): the up rows of each piece, the
  same down; exact, same rank;
- a fusion (diffusers `to_q`, `to_k`, `to_v` -> kohya `img_attn.qkv`): the pieces' factors block-
  diagonally, up [3H, 3r] with each piece's up in its rows, down [3r, in] stacked; exact. Rows no
  input module touches stay zero;
- transforms (adaLN shift/scale `swap_halves`, `transpose`) permute or swap the factors.

Scales: a module keeps its alpha where the contributors share one scale (alpha' = scale x rank');
otherwise each contributor's scale is folded into its up factor and alpha' = rank' (scale 1).
LoHa / LoKr / full modules and DoRA magnitudes are carried over on renames to formats that have them
(kohya, comfy: LyCORIS keys); elsewhere they are refused by name, or turned into plain LoRA modules by
SVD with --to-lora RANK (error reported per module).

Rank-0 modules change nothing and are left out (warned). Renamed modules keep their values, NaN/Inf
included and counted; a module with NaN/Inf that must be recut (split, fused, scale folded, SVD) is
refused by name, or left out with --skip-nonfinite.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from pathlib import Path

from ckpt.lazy import torch

from ckpt.devices import exact_fp32, resolve_device
from ckpt.errors import CkptError
from ckpt.families import Transform
from ckpt.families.lora_namings import naming_of
from ckpt.io.plan import Plan
from ckpt.lora import svd as S
from ckpt.lora.common import (LoraOptions, LoraReport, ModuleResult, early_target_check, is_noop, nothing_left,
                              usable)
from ckpt.lora.embeddings import embedding_keys
from ckpt.lora.formats import Layout, OutModule, plan_lora
from ckpt.lora.modules import Source, open_lora, stored, to_layout
from ckpt.lora.naming import Naming
from ckpt.lora.operations import lora_convert_operation
from ckpt.lora.store import FactorStore
from ckpt.lora.unflatten import unflatten
from ckpt.adapters.checks import alphas as check_alphas
from ckpt.progress import progress_bar
from ckpt.report import plural
from ckpt.run import default_output, output_path, write

FORMATS = ("kohya", "peft", "diffusers", "comfy")
LYCORIS_FORMATS = ("kohya", "comfy")  # formats whose files carry LoHa/LoKr/full/IA3/GLoRA keys
SHOW = 5


@dataclass
class Contribution:
    """Rows of one input module's delta that land on rows of an output group's stacked delta."""

    src: Source
    module_rows: tuple[int, int]
    stack_rows: tuple[int, int]
    transform: Transform | None  # the target's: from the base's rows to the input module's


@dataclass
class _Out:
    group: object
    total_rows: int  # rows of the group's stacked delta
    contributions: list[Contribution] = field(default_factory=list)


def convert(spec: str, out: str | Path | None, opts: LoraOptions, *, base: str | None = None,
            to_lora: int | None = None, report: LoraReport | None = None) -> tuple[Path, LoraReport]:
    report = report or LoraReport()
    fmt = opts.format
    if fmt == "gguf":  # a llama.cpp adapter: named by the base's architecture (`ckpt.lora.gguf_adapter`)
        from ckpt.lora.gguf_adapter import convert_gguf

        return convert_gguf(spec, out, opts, base=base, to_lora=to_lora, report=report)
    if fmt not in FORMATS:
        raise CkptError(f"--format {fmt}: choose one of {', '.join(FORMATS + ('gguf',))}")
    if to_lora is not None and to_lora < 1:
        raise CkptError(f"--to-lora {to_lora}: a rank is at least 1")
    opts.check(rank_required=False)
    alpha = check_alphas(opts.alphas, 1)[0]
    device = resolve_device(opts.device, heavy=to_lora is not None)  # renames, or SVDs for --to-lora
    with contextlib.ExitStack() as stack:
        f = open_lora(spec, alpha, report)
        stack.callback(f.close)
        if f.unknown:
            raise CkptError(f"{spec}: {plural(len(f.unknown), 'key')} {'is' if len(f.unknown) == 1 else 'are'} no "
                            f"adapter part (e.g. {f.unknown[0]!r}); "
                            "nothing to convert them to")
        sources = {m.name: Source(m, device) for m in f.modules.values()}
        if base is not None:
            from ckpt.io.checkpoint import open_checkpoint
            from ckpt.quant.view import logical_view

            ckpt = stack.enter_context(open_checkpoint(base))
            comps = [(c.subdir, {k: tuple(t.shape) for k, t in logical_view(c).tensors.items()}, c.config)
                     for c in ckpt.components]
            renames: dict[str, str] = {}
            inputs_extra = ckpt.inputs
        else:
            comps, renames = _virtual_base(sources, spec)
            inputs_extra = []
        namings = [Naming(fmt, shapes, sub, config, len(comps) == 1) for sub, shapes, config in comps]
        outs = _place(sources, renames, namings, comps, spec, base)
        layout = Layout.of("kohya" if fmt == "comfy" else fmt,
                           tuple(sorted({p for n in namings for p in n.prefixes})))
        folder = layout.container == "folder"
        derived = default_output(spec, Path(spec).expanduser(), fmt, folder=folder)
        out_path = output_path(out, derived, Plan(single_file=not folder, files=[]))
        inputs = f.inputs + inputs_extra
        early_target_check(out_path, inputs, opts.overwrite, not folder, opts.dry_run)
        if opts.dry_run:
            report.summary.append(f"would write {plural(sum(len(o.group.pieces) for o in outs), 'module')} in {fmt} "
                                  f"naming from {plural(len(sources), 'input module')}")
            return out_path, report
        store = stack.enter_context(FactorStore(out_path))
        modules = _build(outs, fmt, layout, opts, to_lora, store, report)
        nothing_left(spec, modules, report)
        report.finish("wrote")
        op = lora_convert_operation(spec, opts, base, to_lora)
        model = {p.name for n in namings for g in n.groups if g.pieces for p in g.pieces} if base else None
        plan = plan_lora(modules, layout, lambda x: x.dtype, op, report=report, model_names=model)
        write(plan, out_path, inputs=inputs, report=report, desc="lora convert", device=torch.device("cpu"),
              overwrite=opts.overwrite, dry_run=False, quiet=opts.quiet)
    return out_path, report


# -- where the input modules land ----------------------------------------------------------------------

def _virtual_base(sources: dict[str, Source], spec: str):
    """A base made from the LoRA: one weight per module (trainer prefix removed, kohya names
    unflattened through the family registry), per model part (`unet/`, `transformer/`,
    `text_encoder[_N]/`), shaped as the factors say. Returns the components and module name ->
    the virtual weight's module path (the name the key map will be asked)."""
    parts: dict[str, dict[str, tuple[int, ...]]] = {}
    flat_dm: dict[str, tuple[str, tuple[int, ...]]] = {}
    where: dict[str, tuple[str, str]] = {}
    for name, src in sources.items():
        shape = (src.shape2d[0],) + src.weight_tail() if not src.transposed else tuple(src.shape2d)
        prefix, naming = naming_of(name)
        rest = name[len(prefix):]
        comp = _component(prefix)
        if naming in ("kohya", "OneTrainer", "LyCORIS"):
            if not comp.startswith("text_encoder"):
                flat_dm[name] = (rest, shape)
                continue
            # kohya text encoders: Hugging Face CLIP / T5 names, unflattened the same way below
            flat_dm.setdefault("__te__" + name, (rest, shape))
            where[name] = (comp, rest)
            continue
        parts.setdefault(comp, {})[rest + ".weight"] = shape
        where[name] = (comp, rest)
    if flat_dm:
        dm = {n: v for n, v in flat_dm.items() if not n.startswith("__te__")}
        mapping, _ = unflatten({rest: shape for rest, shape in dm.values()})
        for name, (rest, shape) in dm.items():
            dotted = mapping.get(rest)
            if dotted is None:
                continue
            parts.setdefault("model", {})[dotted + ".weight"] = shape
            where[name] = ("model", dotted)
        te = {n[len("__te__"):]: v for n, v in flat_dm.items() if n.startswith("__te__")}
        by_comp: dict[str, dict] = {}
        for name, (rest, shape) in te.items():
            by_comp.setdefault(where[name][0], {})[rest] = (name, shape)
        for comp, items in by_comp.items():
            mapping, _ = unflatten({rest: shape for rest, (_, shape) in items.items()})
            for rest, (name, shape) in items.items():
                dotted = mapping.get(rest)
                if dotted is None:
                    where.pop(name, None)
                    continue
                parts.setdefault(comp, {})[dotted + ".weight"] = shape
                where[name] = (comp, dotted)
    missing = [n for n in sources if n not in where]
    if missing:
        raise CkptError(f"{spec}: {plural(len(missing), 'module')} {'is' if len(missing) == 1 else 'are'} named in a "
                        "way no known family explains without a "
                        f"base (e.g. {missing[0]!r}); pass --base BASE (the model the LoRA was trained on)")
    comps = [(comp, shapes, None) for comp, shapes in sorted(parts.items())]
    return comps, {name: f"{comp}/{path}" for name, (comp, path) in where.items()}


def _component(prefix: str) -> str:
    """The pipeline component a trainer prefix stands for ("model" where the prefix does not say:
    kohya's `lora_unet_`, ComfyUI's `diffusion_model.`, no prefix)."""
    if prefix.startswith("lora_te"):
        n = prefix[len("lora_te"):-1]
        return "text_encoder" if n in ("", "1") else f"text_encoder_{n}"
    if prefix.startswith(("text_encoder", "transformer.", "unet.", "prior.")):
        return prefix.rstrip(".")
    return "model"


def _place(sources, renames, namings, comps, spec, base) -> list[_Out]:
    """Every input module's Targets in the (virtual) base, as contributions to the output groups."""
    index: list[dict[str, tuple[object, int, int]]] = []
    for naming, (_, shapes, _) in zip(namings, comps):
        at: dict[str, tuple[object, int, int]] = {}
        for g in naming.groups:
            total = sum(shapes[k][0] if shapes[k] else 1 for k in g.keys)
            off = 0
            for k in g.keys:
                at[k] = (g, off, total)
                off += shapes[k][0] if shapes[k] else 1
        index.append(at)
    outs: dict[int, _Out] = {}
    unmatched = []
    for name, src in sources.items():
        hit = _resolve(src.module, renames.get(name), namings, comps)
        if hit is None:
            unmatched.append(name)
            continue
        ci, targets = hit
        for t in targets:
            entry = index[ci].get(t.key)
            if entry is None:
                raise CkptError(f"{spec}: module {name!r} lands on {t.key!r}, which no LoRA names in this format "
                                "(a VAE or another model)")
            g, off, total = entry
            if g.pieces is None:
                hint = "" if base else "; pass --base BASE (the model the LoRA was made for): its own modules do not say"
                raise CkptError(f"{spec}: module {name!r}: {g.reason}{hint}")
            shapes = comps[ci][1]
            key_rows = shapes[t.key][0]
            rows = t.rows or (0, key_rows)
            mrows = t.part or (0, src.shape2d[0])
            outs.setdefault(id(g), _Out(g, total)).contributions.append(
                Contribution(src, mrows, (off + rows[0], off + rows[1]), t.transform))
    if unmatched:
        where = f"the base {base}" if base else "the model its names describe"
        raise CkptError(f"{spec}: {plural(len(unmatched), 'module')} match{'es' * (len(unmatched) == 1)} no weight of {where} "
                        f"(e.g. {unmatched[0]!r})")
    return list(outs.values())


def _resolve(module, renamed, namings, comps):
    names = [renamed] if renamed else list(module.lookup_names)
    if renamed:  # "comp/path" of the virtual base: its own component's key map
        comp, path = renamed.split("/", 1)
        ci = next(i for i, (sub, _, _) in enumerate(comps) if sub == comp)
        targets = namings[ci].km.targets(path)
        return (ci, targets) if targets else None
    for name in names:
        hits = [(i, n.km.targets(name)) for i, n in enumerate(namings)]
        hits = [(i, t) for i, t in hits if t]
        if len(hits) > 1:
            raise CkptError(f"{module.source}: module {module.name!r} matches weights of several models of the base")
        if hits:
            return hits[0]
    return None


# -- the output modules -------------------------------------------------------------------------------

def _build(outs: list[_Out], fmt: str, layout: Layout, opts: LoraOptions, to_lora, store, report) -> list[OutModule]:
    modules: list[OutModule] = []
    dtype = opts.dtype
    screened: dict[int, bool] = {}  # id(Source) -> finite (`usable`)
    with progress_bar(len(outs), "lora convert", opts.quiet) as bar, exact_fp32(), torch.no_grad():
        for o in outs:
            bar.update(1)
            total = o.total_rows
            for piece in o.group.pieces:
                p0, p1 = piece.rows or (0, total)
                cs = sorted((c for c in o.contributions if c.stack_rows[0] < p1 and c.stack_rows[1] > p0),
                            key=lambda c: c.stack_rows)
                for c in cs:  # rank 0: changes nothing, left out (once per input module)
                    if is_noop(c.src) and c.src.module.name not in report.noop:
                        report.noop.append(c.src.module.name)
                cs = [c for c in cs if not is_noop(c.src)]
                if not cs:
                    continue
                renamed = _as_renamed(cs, piece, p0, p1, fmt, layout, store)
                if renamed is not None:
                    modules.append(renamed)
                    src = cs[0].src
                    rows, cols = src.shape2d
                    report.modules.append(ModuleResult(piece.name, (rows, cols), src.rank or 0, min(rows, cols), 0.0,
                                                       0.0, note=f"renamed from {src.module.name}"))
                    continue
                for c in cs:  # recut: computed with, so checked (once per input module, every piece it has)
                    if id(c.src) not in screened:
                        screened[id(c.src)] = usable(c.src, c.src.module.name, opts, report)
                if not all(screened[id(c.src)] for c in cs):
                    continue
                modules.append(_combined(cs, piece, p0, p1, fmt, layout, to_lora, dtype, store, report))
            for c in o.contributions:
                c.src.release()
    return modules


def _is_whole(c: Contribution, p0: int, p1: int) -> bool:
    rows = c.src.shape2d[0]
    return c.stack_rows == (p0, p1) and c.module_rows == (0, rows)


def _as_renamed(cs, piece, p0, p1, fmt, layout, store) -> OutModule | None:
    """One input module that is exactly the output module (transforms cancelling): its stored tensors
    under the new name, alpha kept. None when the factors must be recut."""
    if len(cs) != 1 or not _is_whole(cs[0], p0, p1):
        return None
    c = cs[0]
    if _compose(c.transform, piece.transform) is not None:
        return None
    src, m = c.src, c.src.module
    name = piece.name
    if src.plain_lora and _stored_as_embedding(src):  # PEFT's lora_embedding_A/B: kept where the output has them
        keys = _embedding_keys(name, cs, layout)
        alpha = _kept_alpha(src, layout)
        if keys is None or alpha is False:
            return None  # kohya / comfy keys, or a scale to fold: recut (A^T, B^T) below
        return OutModule(name, m.parts["emb_B"], m.parts["emb_A"], alpha, keys)
    if src.kind == "lora" and not src.transposed:
        if _embedding_keys(name, cs, layout):
            return None  # an embedding in PEFT's spelling: its factors stored transposed (recut below)
        keys = src.roles
        extra = {}
        for role, key in keys.items():
            t = m.parts[role]
            if role in ("magnitude", "dora_scale"):
                if getattr(src.adapter.dora, "axis", "rows") != "rows":
                    raise CkptError(f"{m.source}: module {m.name!r}: an input-axis DoRA magnitude has no form in "
                                    f"the {fmt} naming")
                if fmt in LYCORIS_FORMATS:
                    extra[f"{name}.dora_scale"] = _reshaped(t, (t.shape[0], 1))
                else:
                    extra[f"{name}.lora_magnitude_vector"] = _reshaped(t, (t.shape[0],))
            elif role == "up_bias":
                if fmt in LYCORIS_FORMATS:
                    raise CkptError(f"{m.source}: module {m.name!r} has a lora_B bias, which {fmt} LoRAs cannot "
                                    "hold (use --format peft or diffusers)")
                extra[f"{name}.lora_B.bias"] = t
            elif role == "mid":
                if fmt not in LYCORIS_FORMATS:
                    return None  # a Tucker LoCon: fold the mid factor (recut below)
                extra[f"{name}.lora_mid.weight"] = t
        a = _kept_alpha(src, layout)
        if a is False:
            return None  # the scale must be folded into up
        return OutModule(name, m.parts["up"], m.parts["down"], a, {}, extra)
    if src.kind in ("loha", "lokr", "full", "ia3", "glora") and fmt in LYCORIS_FORMATS:
        extra = {f"{name}.{key[len(m.name) + 1:]}": t for key, t in stored(m).items()}
        return OutModule(name, extra=extra)
    return None


def _kept_alpha(src, layout: Layout):
    """The alpha a renamed module keeps (its own, or the one that gives its scale at its rank in the
    output), None where the output stores none and the scale is 1; False where the output stores none
    and the scale is not 1 (it must be folded into up: a recut)."""
    m = src.module
    alpha, scale = m.alpha(), src.scale
    if not layout.stores_alpha and abs(scale - 1.0) > 0:
        return False
    return alpha if (alpha is not None and not m.rslora and not layout.rslora) else layout.alpha_for(scale, src.rank)


def _stored_as_embedding(src) -> bool:
    """An input module in PEFT's embedding spelling (`lora_embedding_A/B`): its factors A^T, B^T are the
    embedding weight's row view, as a kohya module of that weight would have them."""
    return "emb_A" in src.roles


def _embedding_keys(name: str, cs, layout: Layout) -> dict[str, str] | None:
    """PEFT's embedding keys for output module `name` where the output spells them (`Layout.embedding_keys`):
    a module named as an embedding, or one made only of input modules stored as one; else None."""
    if not layout.peft_keys:
        return None
    if layout.embedding_keys(name) or all(_stored_as_embedding(c.src) for c in cs):
        return embedding_keys(name)
    return None


def _reshaped(t, shape):
    from ckpt.io.tensors import Reshaped

    return t if tuple(t.shape) == tuple(shape) else Reshaped(t, shape)


def _compose(a: Transform | None, b: Transform | None) -> Transform | None:
    """What an input module's delta goes through to become an output module's: its target's transform
    `a` undone (module -> base rows), then the piece's `b` (base rows -> output module); None where they
    cancel (the same transform, or none)."""
    if a == b:
        return None
    if a is None:
        return b
    if b is None:
        return a.inverse
    raise CkptError(f"cannot combine the transforms {a} and {b}")


def _apply(transform: Transform | None, up, down, undo: bool = False):
    """The factors of T(up @ down) on the 2-D row view (`Transform.factors`), of T's inverse with `undo`;
    None: as they are."""
    if transform is None:
        return up, down
    return (transform.inverse if undo else transform).factors(up, down)


def _factors(c: Contribution, fmt, to_lora, report):
    """(up [rows, r], down [r, cols], scale) of one contribution's whole module, in row view."""
    src, m = c.src, c.src.module
    if src.plain_lora and (not src.transposed or _stored_as_embedding(src)):
        up, down = src.factors()
        return up, down, src.scale
    if src.kind == "lora":
        kind = "a DoRA module" if not src.plain_lora else "a transposed (fan_in_fan_out / embedding) module"
        raise CkptError(f"{m.source}: module {m.name!r} is {kind}; it converts only where it stays one module "
                        f"of the same rows in the {fmt} naming")
    if to_lora is None:
        raise CkptError(f"{m.source}: module {m.name!r} is {src.kind}, which the {fmt} naming has no form for "
                        "here; pass --to-lora RANK to turn it into a plain LoRA by SVD")
    d = src.delta()
    k = max(1, min(to_lora, *d.shape))
    U, sv, Vh = S.svd(d, k, S.SvdOptions())
    up, down = S.factors(d, U, sv, Vh, k)
    err, norm = S.error_of_whole(d, up, down)
    report.modules.append(ModuleResult(m.name, tuple(d.shape), k, min(d.shape), S.rel(err, norm), norm,
                                       note=f"{src.kind} -> lora"))
    return up, down, 1.0


def _combined(cs, piece, p0, p1, fmt, layout: Layout, to_lora, dtype, store, report) -> OutModule:
    """The output module's factors from every contribution on its rows: pieces of a split module,
    block-diagonal fusions, transforms; one scale kept where all share it, else folded into up."""
    parts = []
    for c in cs:
        up, down, scale = _factors(c, fmt, to_lora, report)
        up, down = _apply(c.transform, up, down, undo=True)  # the module's rows back into the base's
        a, b = c.module_rows
        up = up[a:b]
        s0, s1 = c.stack_rows
        if s0 >= p0 and s1 <= p1:
            block = torch.zeros((p1 - p0, up.shape[1]), dtype=up.dtype, device=up.device)
            block[s0 - p0:s1 - p0] = up
        elif s0 <= p0 and s1 >= p1:
            block = up[p0 - s0:p1 - s0]
        else:
            raise CkptError(f"{c.src.module.source}: module {c.src.module.name!r} covers rows {s0}:{s1}, which cut "
                            f"across {piece.name!r} ({p0}:{p1})")
        parts.append((block, down, scale))
    scales = {s for _, _, s in parts}
    if len(scales) == 1 and layout.stores_alpha:
        scale = scales.pop()
    else:
        parts = [(u * s, d, 1.0) for u, d, s in parts]
        scale = 1.0
    up = torch.cat([u for u, _, _ in parts], dim=1)
    down = torch.cat([d for _, d, _ in parts], dim=0)
    up, down = _apply(piece.transform, up, down)
    k = up.shape[1]
    up_s, down_s = up.to(dtype), down.to(dtype)
    err, norm = S.error_of_product(up, down, up_s.float(), down_s.float())
    tails = {c.src.weight_tail() for c in cs}
    keeps_rows = piece.transform is None or piece.transform.keeps_rows  # conv input dims stay with their rows
    tail = tails.pop() if len(tails) == 1 and keeps_rows else (down.shape[1],)
    if math.prod(tail) != down.shape[1]:
        tail = (down.shape[1],)
    keys = _embedding_keys(piece.name, cs, layout)
    if keys:
        tail = (down.shape[1],)
    upt, downt = to_layout(up_s, down_s, tail, bool(keys))  # an embedding: PEFT's B, A
    report.modules.append(ModuleResult(piece.name, (up.shape[0], down.shape[1]), k, min(up.shape[0], down.shape[1]),
                                       S.rel(err, norm), norm, note=" + ".join(c.src.module.name for c in cs)))
    return OutModule(piece.name, store.put(piece.name + ".up", upt), store.put(piece.name + ".down", downt),
                     layout.alpha_for(scale, k), keys or {})

