"""The inputs of a model merge: opened, decoded and brought under one set of names.

Each input is any source ckpt reads (file, shards, model folder or pipeline, hub id, GGUF, torch pickle, every
quantized format a decoder knows), opened as `convert` opens it and read through its logical view, so a quantized
input is decoded band by band as it is merged. mergekit's `BASE+LORA` is the base with the LoRA applied, matched as
`merge-lora` matches it (`ckpt.adapters.matching.match_loras`), streamed as merge-lora streams it.

The reference input (the base, else the first model) names the output. Another input whose keys differ is brought
to the reference's names through the family registry: a diffusers-layout fine-tune of an original-layout model (or
the other way round) is converted as `convert --layout` converts it (renames and row slices, no values change), a
file prefix (`model.diffusion_model.`) is stripped or added. What is left over is said by name: inputs of different
families, one name with different shapes (Flux Fill vs Dev `img_in`), keys some inputs lack.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

from ckpt import families
from ckpt.errors import CkptError
from ckpt.io.checkpoint import Checkpoint, open_checkpoint
from ckpt.io.tensors import Tensor
from ckpt.io.wrapper import Renamed
from ckpt.merge.recipe import ModelRef
from ckpt.report import Report, plural

SHOW = 4


@dataclass
class Model:
    ref: ModelRef
    ckpt: Checkpoint
    views: list  # ckpt.quant.view.View per component
    notes: list[str] = field(default_factory=list)
    lora_inputs: list = field(default_factory=list)  # BASE+LORA: the LoRA's files (never an output)

    @property
    def label(self) -> str:
        return self.ref.text

    @property
    def inputs(self) -> list:
        return self.ckpt.inputs + self.lora_inputs


def open_model(ref: ModelRef, stack: contextlib.ExitStack, report: Report) -> Model:
    """Open one input (and its LoRA, for `BASE+LORA`) for the life of `stack`."""
    from ckpt.quant.view import logical_view

    try:
        ckpt = stack.enter_context(open_checkpoint(ref.spec))
    except CkptError as e:
        raise CkptError(f"model {ref.text}: {e}") from None
    try:
        views = [logical_view(c) for c in ckpt.components]
    except CkptError as e:
        raise CkptError(f"model {ref.text}: {e}") from None
    model = Model(ref, ckpt, views)
    if ref.lora is not None:
        _apply_lora(model, stack, report)
    return model


def _apply_lora(model: Model, stack, report: Report) -> None:
    from dataclasses import replace

    from ckpt.adapters.checks import settle_alphas
    from ckpt.adapters.matching import MatchError, MatchReport, match_loras
    from ckpt.adapters.loading import load_lora
    from ckpt.adapters.merged import MergedTensor

    base_dir = model.ckpt.path if model.ckpt.path.is_dir() else model.ckpt.path.parent
    sub = MatchReport()
    try:
        f = load_lora(model.ref.lora, base_dir)
        stack.callback(f.close)
        model.lora_inputs = list(f.inputs)
        settle_alphas(f, None, sub)
        patches = match_loras(model.ckpt, model.views, [f], [1.0], sub)
    except MatchError as e:
        raise CkptError(f"model {model.ref.text}: {e}") from None
    except CkptError as e:
        raise CkptError(f"model {model.ref.text}: {e}") from None
    for w in sub.warned:
        report.warn(f"{model.ref.text}: {w}")
    model.notes += [f"{model.ref.text}: LoRA applied: {line}" for line in sub.summary]
    model.views = [replace(v, tensors={k: MergedTensor(t, ps[k]) if k in ps else t for k, t in v.tensors.items()})
                   for v, ps in zip(model.views, patches)]


def _listed(keys, n=SHOW) -> str:
    keys = list(keys)
    return ", ".join(keys[:n]) + (f", ... ({len(keys) - n} more)" if len(keys) > n else "")


def _pairs(ref: Model, other: Model) -> list[tuple[int, int]]:
    """(reference component, other component) index pairs: by subfolder, or the one model of each."""
    if len(ref.views) == 1 and len(other.views) == 1:
        return [(0, 0)]
    rs = [c.subdir for c in ref.ckpt.components]
    os_ = [c.subdir for c in other.ckpt.components]
    if set(rs) != set(os_):
        raise CkptError(f"{other.label} holds {', '.join(s or '.' for s in os_)}, {ref.label} holds "
                        f"{', '.join(s or '.' for s in rs)}: merge pipelines with the same components")
    return [(i, os_.index(s)) for i, s in enumerate(rs)]


def _family(tensors: dict[str, Tensor]):
    shapes = {k: tuple(t.shape) for k, t in tensors.items()}
    return families.detect(shapes, shapes)


def aligned(ref: Model, other: Model) -> tuple[list[dict[str, Tensor]], list[str]]:
    """`other`'s logical tensors under the reference's names, per reference component, and notes on what was
    converted. Keys that still differ are left for the caller to report (with every input's in view)."""
    from ckpt.layout.relayout import relayout, strip_prefix

    out: list[dict[str, Tensor]] = [{} for _ in ref.views]
    notes: list[str] = []
    for ri, oi in _pairs(ref, other):
        rt, ot = ref.views[ri].tensors, other.views[oi].tensors
        if set(rt) == set(ot):
            out[ri] = dict(ot)
            continue
        try:
            rstrip, rprefix = strip_prefix(rt)
            ostrip, oprefix = strip_prefix(ot)
        except CkptError:
            out[ri] = dict(ot)
            continue
        rm, om = _family(rstrip), _family(ostrip)
        conv = ostrip
        if rm is not None and om is not None and rm.family is not om.family and set(rstrip) != set(ostrip):
            raise CkptError(f"{other.label} is {om.label}, {ref.label} is {rm.label}: a merge takes models of one "
                            "family; nothing was written")
        if (rm is not None and om is not None and rm.family is om.family and rm.layout and om.layout
                and rm.layout != om.layout and rm.family.pairs is not None):
            conv, dropped = relayout(ostrip, om.family, om.layout, rm.layout)
            notes.append(f"{other.label}: {om.label} in the {om.layout} layout, read in the {rm.layout} layout of "
                         f"{ref.label} ({plural(len(conv), 'tensor')})"
                         + (f"; {plural(len(dropped), 'tensor')} with no counterpart left out" if dropped else ""))
        elif oprefix != rprefix:
            notes.append(f"{other.label}: read with the prefix {rprefix!r} instead of {oprefix!r}")
        out[ri] = {rprefix + k: (t if rprefix + k == t.name else Renamed(t, rprefix + k)) for k, t in conv.items()}
    return out, notes


def original_names(model: Model, ci: int) -> tuple[dict[str, str], object]:
    """Each output key of component `ci` -> the name filters and blocks match: its original-layout name with the
    file prefix stripped (the key itself where the family has one naming); "" for the keys of an all-in-one file
    outside its diffusion model (text encoders, VAE: no block, t = 0; filters still see their full key). Also
    the family (None if unknown)."""
    from ckpt.families.prefixes import model_prefix

    tensors = model.views[ci].tensors
    shapes = {k: tuple(t.shape) for k, t in tensors.items()}
    prefix = model_prefix(tensors, shapes)
    stripped = {k[len(prefix):]: t for k, t in tensors.items() if k.startswith(prefix)}
    names = {k: (k[len(prefix):] if k.startswith(prefix) else "") for k in tensors}
    m = _family(stripped)
    if m is None:
        return names, None
    if m.layout == families.DIFFUSERS and m.family.pairs is not None and families.ORIGINAL in m.family.layouts:
        inner = {k: v for k, v in ((k[len(prefix):], s) for k, s in shapes.items() if k.startswith(prefix))}
        try:
            for p in m.family.pairs(inner, families.DIFFUSERS):
                if p.diffusers in stripped and p.original:
                    names[prefix + p.diffusers] = p.original
        except (CkptError, KeyError, ValueError):
            pass
    return names, m.family
