"""Planning and running `ckpt merge`; also the Python API (`merge_models`).

view -> transform -> plan -> write, as every command: each input is opened and decoded to its logical view
(`ckpt.merge.sources`), brought under the reference's names, every output tensor becomes a `MergedModelTensor`
(its inputs, its method, the parameters resolved for it), and the plan is the reference's own layout
(`plan_checkpoint`: files, shards, config and sidecars), the layout `--layout` names (`plan_layout`, as `convert
--layout` plans it) or the reference's stored encoding (`--keep-format`, as merge-lora re-encodes). The reference
is the base, else the first model (for the SD classics, model A). Every problem with the inputs is found while
planning, before any output exists.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field, replace
from pathlib import Path, PurePosixPath

from ckpt import targets
from ckpt.devices import cpu_without_torch, resolve_device
from ckpt.errors import CkptError
from ckpt.merge import blocks
from ckpt.merge.methods import get_method
from ckpt.merge.jobs import compute_dtypes, make_job
from ckpt.merge.recipe import Recipe
from ckpt.merge.sources import Model, aligned, open_model, original_names
from ckpt.options import WriteOptions
from ckpt.report import Report, listed, plural
from ckpt.run import output_path, write
from ckpt.targets.casts import Natural
from ckpt.lazy import prefetch, torch

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja", "chat_template.json",
                   "vocab.txt", "spiece.model")
SHOW = 5
RECIPE_KEY = "ckpt_merge_recipe"  # safetensors __metadata__ key holding the resolved YAML


@dataclass
class ModelMergeOptions(WriteOptions):
    allow_missing: bool = False
    seed: int | None = None


@dataclass
class ModelMergeReport(Report):
    summary: list[str] = field(default_factory=list)
    merged: int = 0
    from_reference: list[str] = field(default_factory=list)  # --allow-missing: tensors some input lacks
    left_out: list[str] = field(default_factory=list)  # --allow-missing: tensors the reference lacks
    meters: list = field(default_factory=list)
    requantization: dict = field(default_factory=dict)
    recipe: str = ""
    layers: int | None = None  # slices: the output's layer count

    def facts(self) -> dict:
        return {"summary": self.summary, "merged": self.merged, "from_reference": self.from_reference,
                "left_out": self.left_out, "recipe": self.recipe, "requantization": self.requantization or None}


def merge_models_operation(recipe: Recipe) -> str:
    """The `ckpt_operation` written into the output's metadata."""
    return f"merge {recipe.method} " + " ".join(Path(r.text).name for r in recipe.refs)


def merge_models(recipe: Recipe, out: str | Path | None, opts: ModelMergeOptions, *, default_from: str | None = None,
                 report: ModelMergeReport | None = None) -> tuple[Path, ModelMergeReport]:
    """Run `recipe`; returns (output path, report). Raises CkptError on bad input (nothing written).
    `default_from`: what the default output is named after (the config file; else the reference model)."""
    report = report or ModelMergeReport()
    prefetch(torch)  # imported beside the planning (ckpt.lazy), which needs none
    method = get_method(recipe.method)
    if opts.to is None and recipe.out_dtype is not None:
        opts = replace(opts, to=recipe.out_dtype)
    target = _target(opts)
    if method.randomized:
        if recipe.seed is None:
            recipe.seed = opts.seed if opts.seed is not None else 0
            if opts.seed is None:
                report.note(f"{method.name} is randomized: seed 0 (pass --seed N for another drop mask)")
    elif opts.seed is not None or recipe.seed is not None:
        report.note(f"--seed {opts.seed if opts.seed is not None else recipe.seed}: {method.name} is not randomized; "
                    "the seed changes nothing")
        recipe.seed = None
    report.recipe = recipe.to_yaml()
    cpu = cpu_without_torch(opts.device)  # else asked after planning: asking imports torch (ckpt.devices)
    with contextlib.ExitStack() as stack:
        models = {r.text: open_model(r, stack, report) for r in recipe.refs}
        ref = _reference(recipe, models)
        fmt = target.output_format(opts, out, ref.ckpt)
        views = _merged_views(recipe, method, models, ref, opts, report)
        plan = _plan(recipe, models, ref, views, opts, report, target, fmt)
        name_from = default_from or ref.ref.spec
        derived = _default_output(name_from, ref, plan, fmt, target, opts, method.name)
        inputs = [p for m in models.values() for p in m.inputs]
        if default_from:
            inputs.append(Path(default_from))
        device = None if cpu else resolve_device(opts.device)  # None: the CPU
        path = write(plan, output_path(out, derived, plan), inputs=inputs, report=report, desc="merge",
                     device=device, overwrite=opts.overwrite, dry_run=opts.dry_run, quiet=opts.quiet)
    target.finish(report, opts.dry_run)
    return path, report


def _target(opts: ModelMergeOptions):
    """--keep-format (the reference's encoding), --to (every target: a dtype, fp8, comfy_quant, GGUF, in one pass
    with the merge), else the reference's own dtypes, FP8 and LLM-quantization inputs in bf16."""
    if opts.layout is not None and opts.layout not in ("original", "diffusers"):
        raise CkptError(f"--layout {opts.layout}: choose original or diffusers")
    return targets.choose(opts, Natural(fp8="BF16", llm="BF16", role="reference"))  # names: planned without torch


def _reference(recipe: Recipe, models: dict[str, Model]) -> Model:
    if recipe.base_model is not None:
        return models[recipe.base_model.text]
    if recipe.slices:
        return models[recipe.slices[0].sources[0].model.text]
    return models[recipe.models[0].model.text]


def _params_of(recipe: Recipe) -> dict[str, dict]:
    out: dict[str, dict] = {}
    for m in recipe.models:
        out.setdefault(m.model.text, m.parameters)
    return out


def _merged_views(recipe: Recipe, method, models: dict[str, Model], ref: Model, opts, report) -> list:
    """The reference's views with every merged tensor in place (the plan is made from these)."""
    from ckpt.dtypes import is_float
    from ckpt.merge.tensor import MergedModelTensor

    if recipe.slices is not None:
        from ckpt.merge.slices import sliced_views

        return sliced_views(recipe, method, models, ref, opts, report)
    order = [r.text for r in recipe.refs]
    base = order.index(recipe.base_model.text) if recipe.base_model is not None else None
    compute, round_to = compute_dtypes(recipe)
    al: dict[str, list[dict]] = {}
    for key, m in models.items():
        if m is ref:
            al[key] = [dict(v.tensors) for v in ref.views]
            continue
        al[key], notes = aligned(ref, m)
        report.notes.extend(notes)
    for m in models.values():
        report.notes.extend(m.notes)
    params = _params_of(recipe)
    chains = [[params.get(k), recipe.parameters] for k in order]
    out_views = []
    missing: dict[str, list[str]] = {}
    extra: dict[str, list[str]] = {}
    shapes_differ: list[str] = []
    for ci, view in enumerate(ref.views):
        prefix = f"{ref.ckpt.components[ci].subdir}/" if ref.ckpt.components[ci].subdir else ""
        names, family = original_names(ref, ci)
        ts = blocks.positions(names, family)
        tensors = {}
        for k in order:
            if models[k] is not ref:
                for x in al[k][ci]:
                    if x not in view.tensors:
                        extra.setdefault(k, []).append(prefix + x)
        for key, t in view.tensors.items():
            inputs = [al[k][ci].get(key) for k in order]
            lacking = [k for k, x in zip(order, inputs) if x is None]
            if lacking:
                for k in lacking:
                    missing.setdefault(k, []).append(prefix + key)
                tensors[key] = t
                report.from_reference.append(prefix + key)
                continue
            if any(tuple(x.shape) != tuple(t.shape) for x in inputs):
                shapes_differ.append(f"{prefix}{key} (" + ", ".join(f"{k} {list(x.shape)}" for k, x in zip(order, inputs))
                                     + ")")
                continue
            if not all(is_float(x.dtype_name) for x in inputs):  # names: planned without torch
                tensors[key] = t  # integer buffers (position ids, counters): the reference's
                continue
            names_t = (key, names.get(key, key) or key)
            job = make_job(method, key, names_t, ts.get(key, 0.0), t.shape, inputs, order, base, chains,
                       [recipe.parameters], recipe, compute)
            tensors[key] = MergedModelTensor(job, method, t.home, round_to, replaces=t)
            report.merged += 1
        out_views.append(replace(view, tensors=tensors, origin=view))
    if shapes_differ:
        raise CkptError(f"{plural(len(shapes_differ), 'tensor')} {'has' if len(shapes_differ) == 1 else 'have'} "
                        f"different shapes in the inputs: {listed(shapes_differ, 3)}; nothing was written "
                        "(models of one family and size merge)")
    left_out = sorted({x for xs in extra.values() for x in xs})
    if (missing or left_out) and not opts.allow_missing:
        if missing:
            k, keys = next(iter(missing.items()))
            raise CkptError(f"{k} lacks {plural(len(keys), 'tensor')} the reference {ref.label} has: "
                            f"{listed(keys, SHOW)}; nothing was written (--allow-missing takes them from "
                            f"{ref.label})")
        k, keys = next(iter(extra.items()))
        raise CkptError(f"{k} has {plural(len(keys), 'tensor')} the reference {ref.label} lacks: {listed(keys, SHOW)}; "
                        f"nothing was written (--allow-missing leaves them out)")
    report.left_out = left_out
    report.summary.append(f"{method.name}: {plural(report.merged, 'tensor')} merged from {plural(len(order), 'model')}"
                          + (f"; {plural(len(report.from_reference), 'tensor')} some input lacks taken from "
                             f"{ref.label}" if report.from_reference else "")
                          + (f"; {plural(len(left_out), 'tensor')} the reference lacks left out" if left_out else ""))
    if not report.merged:
        raise CkptError("no tensor is common to every input: nothing to merge; nothing was written")
    return out_views


def _plan(recipe: Recipe, models, ref: Model, views, opts, report, target, fmt: str):
    """The write plan: the output side's (`ckpt.targets`: the reference's layout or --layout, the output dtypes or
    encoding, or --keep-format), then what a merge adds: the tokenizer and config files, the recipe in the
    metadata and, for a folder, a model card."""
    plan = targets.plan_output(target, ref.ckpt, views, opts, report, fmt, merge_models_operation(recipe))
    if recipe.slices is not None:
        from ckpt.merge.slices import layers_edit

        layers_edit(plan, ref, report)
    _tokenizer(recipe, models, ref, plan, report)
    for f in plan.files:
        if f.format == "safetensors":
            f.metadata[RECIPE_KEY] = report.recipe
    if plan.busy_stage is None:  # the merge runs in the reading stage: every core (an encoder's stage keeps its own)
        plan.busy_stage = "read"
    if not plan.single_file:
        plan.copies = [(s, r) for s, r in plan.copies if PurePosixPath(r).name.lower() != "readme.md"]
        plan.generated["README.md"] = model_card(recipe, report.recipe)
        plan.generated["mergekit_config.yml"] = report.recipe  # where mergekit users look for the recipe
    return plan


def _tokenizer(recipe: Recipe, models, ref: Model, plan, report) -> None:
    """tokenizer_source: MODEL takes that model's tokenizer files instead of the reference's."""
    src = recipe.tokenizer_source
    if src is None or src.text == ref.ref.text:
        return
    other = models.get(src.text)
    if other is None:  # a model outside the merge: refused (its tokenizer need not fit these embeddings)
        raise CkptError(f"tokenizer_source: {src.text} is not one of the merged models")
    theirs = [rel for rel in other.ckpt.copies if PurePosixPath(rel).name in TOKENIZER_FILES]
    if not theirs:
        raise CkptError(f"tokenizer_source: {src.text} has no tokenizer files ({', '.join(TOKENIZER_FILES[:3])}, ...)")
    plan.copies = [(s, r) for s, r in plan.copies if PurePosixPath(r).name not in TOKENIZER_FILES]
    plan.copies += [(other.ckpt.path / rel, rel) for rel in theirs]
    report.note(f"tokenizer from {src.text}: {', '.join(theirs)}")


def model_card(recipe: Recipe, recipe_yaml: str) -> str:
    """The README.md of a merged model folder, as mergekit writes one: what was merged, how, and the recipe."""
    base = recipe.base_model.text if recipe.base_model is not None else None
    models = [r.text for r in recipe.refs if r.text != base]
    lines = ["---", "base_model:"] + [f"- {m}" for m in ([base] if base else []) + models] + [
        "library_name: transformers", "tags:", "- mergekit", "- merge", "- ckpt", "---",
        "# merged model", "", f"This model was merged with `ckpt merge` using the **{recipe.method}** method"
        + (f", with {base} as the base." if base else "."), "", "## Models merged", ""]
    lines += [f"* {m}" for m in models] + ["", "## Configuration", "", "```yaml", recipe_yaml.rstrip(), "```", ""]
    return "\n".join(lines)


def _default_output(name_from: str, ref: Model, plan, fmt: str, target, opts, method: str) -> Path:
    """Beside the config, named after it (`recipe.yaml` -> `recipe-merged/`); a flag-built merge beside the
    reference, named after it and the method (`a.safetensors` -> `a-weighted_sum.safetensors`), never what
    merge-lora names its output (`a-merged.safetensors`)."""
    from ckpt.run import default_output, file_ext

    ext = target.ext or (".gguf" if fmt == "gguf" else file_ext(fmt))
    suffix = f"-{target.suffix}" if opts.to else ""
    p = Path(name_from)
    if p.suffix in (".yaml", ".yml") and p.is_file():
        return default_output(name_from, p, "merged" + suffix, folder=not plan.single_file, ext=ext)
    return default_output(name_from, ref.ckpt.path, method + suffix, folder=not plan.single_file, ext=ext)
