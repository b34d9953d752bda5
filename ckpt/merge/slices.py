"""mergekit's `slices:`: the output's layers are taken, slice by slice, from layer ranges of the inputs.

Output layer j of a slice of n layers is merged from layer `start + j` of each of the slice's sources, with
t = j / (n - 1) (t = 1 for a one-layer slice), and the layers are numbered on across slices. Tensors outside the
layers are merged from the first slice's sources when they come before the layers (the embeddings) and from the
last slice's otherwise (final norm, head), at t = 0, as mergekit's pre- and post-layer weights. The
output config's layer count follows (`num_hidden_layers`). Layers are `layers.N.` (language models); a slice of a
model whose layers ckpt cannot number is refused.
"""

from __future__ import annotations

import re
from dataclasses import replace

from ckpt.errors import CkptError
from ckpt.io.wrapper import Renamed
from ckpt.merge.blocks import layer_split
from ckpt.report import plural


def _split(model):
    if len(model.views) != 1:
        raise CkptError(f"{model.label}: slices: take one model (a file, shards or a model folder), not a pipeline")
    layers: dict[int, dict[str, object]] = {}
    other: dict[str, object] = {}
    prefix = None
    for k, t in model.views[0].tensors.items():
        s = layer_split(k)
        if s is None:
            other[k] = t
            continue
        p, i, rest = s
        if prefix is not None and p != prefix:
            raise CkptError(f"{model.label}: layers under two names ({prefix}N and {p}N): slices cannot number them")
        prefix = p
        layers.setdefault(i, {})[rest] = t
    if prefix is None:
        raise CkptError(f"{model.label}: no `layers.N.` tensors: slices: take models with numbered layers")
    return prefix, layers, other


def sliced_views(recipe, method, models, ref, opts, report):
    from ckpt.merge.jobs import compute_dtypes, make_job
    from ckpt.merge.tensor import MergedModelTensor

    compute, round_to = compute_dtypes(recipe)
    split = {k: _split(m) for k, m in models.items()}
    prefix, ref_layers, ref_other = split[ref.ref.text]
    keys = list(ref.views[0].tensors)
    out: dict[str, object] = {}
    groups = [(order, order.index(b) if b is not None else None) for _, order, b in recipe.groups()]

    def merged(name, inputs, sl, order, base, t, chains):
        shapes = {tuple(x.shape) for x in inputs}
        if len(shapes) != 1:
            raise CkptError(f"{name}: different shapes in the slice's models ({', '.join(str(list(s)) for s in shapes)})")
        job = make_job(method, name, (name, name), t, inputs[0].shape, inputs, order, base, chains,
                   [sl.parameters, recipe.parameters], recipe, compute)
        report.merged += 1
        if (method.name == "passthrough" and job.per_input[0].get("scale") is None and round_to is None
                and not opts.keep_format):
            # the source's tensor itself, as mergekit writes it: its stored bytes are copied by the kernel
            # (ckpt.io.byte_copy) where its dtype is the output's, cast once otherwise
            kept = Renamed(inputs[0], name)
            kept.home = ""  # placed by the output's planner, as merged tensors are
            return kept
        # --keep-format re-encodes it into the reference's stored tensor of the same name, where it has one
        return MergedModelTensor(job, method, "", round_to, replaces=ref.views[0].tensors.get(name))

    def outside(names, sl, group):
        order, base = group
        chains = _chains(sl, order, recipe)
        for k in names:
            inputs = []
            for o in order:
                x = split[o][2].get(k)
                if x is None:
                    raise CkptError(f"{o} has no {k} (slices take the embeddings and head from the first and last "
                                    "slice's models)")
                inputs.append(x)
            out[k] = merged(k, inputs, sl, order, base, 0.0, chains)

    pre = [k for k in keys if k in ref_other and _before_layers(k)]
    post = [k for k in keys if k in ref_other and not _before_layers(k)]
    outside(pre, recipe.slices[0], groups[0])
    n_out = 0
    for si, sl in enumerate(recipe.slices):
        order, base = groups[si]
        chains = _chains(sl, order, recipe)
        n = sl.sources[0].layer_range[1] - sl.sources[0].layer_range[0]
        starts = {s.model.text: s.layer_range[0] for s in sl.sources}
        if base is not None and order[base] not in starts:
            starts[order[base]] = sl.sources[0].layer_range[0]
        for j in range(n):
            t = j / (n - 1) if n > 1 else 1.0
            per = []
            for o in order:
                layer = split[o][1].get(starts[o] + j)
                if layer is None:
                    have = len(split[o][1])
                    raise CkptError(f"slices[{si}]: {o} has no layer {starts[o] + j} (it has {have})")
                per.append(layer)
            for rest in per[0]:
                name = f"{prefix}{n_out}{rest}"
                inputs = [p.get(rest) for p in per]
                if any(x is None for x in inputs):
                    raise CkptError(f"slices[{si}]: layer tensor {rest!r} is missing in one of the slice's models")
                out[name] = merged(name, inputs, sl, order, base, t, chains)
            n_out += 1
    outside(post, recipe.slices[-1], groups[-1])
    report.layers = n_out
    report.summary.append(f"{method.name}: {plural(n_out, 'layer')} from {plural(len(recipe.slices), 'slice')}, "
                          f"{plural(report.merged, 'tensor')}")
    return [replace(ref.views[0], tensors={k: (t if t.name == k else Renamed(t, k)) for k, t in out.items()},
                    origin=ref.views[0])]


def _before_layers(name: str) -> bool:
    """Embeddings come before the layers (mergekit's pre-weights); the final norm and the head after them."""
    return re.search(r"(^|\.)(embed\w*|wte|wpe|tok_embeddings|embeddings)(\.|$)", name) is not None


def _chains(sl, order, recipe):
    per = {s.model.text: s.parameters for s in sl.sources}
    return [[per.get(o), sl.parameters, recipe.parameters] for o in order]


def layers_edit(plan, ref, report) -> None:
    """config.json's layer count follows the slices (transformers' num_hidden_layers)."""
    n = getattr(report, "layers", None)
    comp = ref.ckpt.components[0]
    if n is None or comp.config is None or "num_hidden_layers" not in comp.config:
        return
    prev = plan.json_edits.get("config.json")

    def edit(cfg, prev=prev):
        cfg = prev(cfg) if prev else cfg
        cfg["num_hidden_layers"] = n
        return cfg

    plan.json_edits["config.json"] = edit
    if n != comp.config["num_hidden_layers"]:
        plan.notes.append(f"config.json: num_hidden_layers {comp.config['num_hidden_layers']} -> {n}")
