"""Whole pipelines for `convert --layout`: a diffusers pipeline folder <-> the all-in-one single file
(UNet/transformer, VAE and text encoders under their LDM prefixes) that A1111, ComfyUI and kohya load.

One table per pipeline kind (`ckpt.families.pipelines.PIPELINES`, with the families) says which folder
goes under which file prefix and in which naming: the diffusion model and the VAE in their original
(LDM/SAI) layout, Hugging Face text encoders under their HF names (wrapped in `text_model.` as the single
files have them), SDXL's second text encoder as an OpenCLIP tower. The tensors are the family registry's
lazy views (`ckpt.layout.relayout.relayout`), written band by band like every other output.

Single file -> pipeline needs `--config REF`, a diffusers pipeline of the same kind (folder or hub id):
a single file holds no tokenizer, scheduler or component config, so those files are copied from REF,
and only the weights come from the file. Bookkeeping tensors of LDM files (noise schedule buffers,
`model_ema.*`, position ids) are not model weights: they are dropped, with a note; any other key that
no part claims is refused.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from ckpt import families
from ckpt.errors import CkptError
from ckpt.families import DIFFUSERS, ORIGINAL
from ckpt.families.pipelines import PIPELINES, PipelinePart
from ckpt.layout.relayout import DIFFUSERS_MAX_SHARD, DIFFUSERS_STEM, relayout
from ckpt.io.wrapper import Renamed
from ckpt.io.checkpoint_plan import provenance
from ckpt.io.plan import Plan, plan_files
from ckpt.io.tensors import Tensor
from ckpt.report import plural

TRANSFORMERS_STEM = "model"  # a pipeline's text encoders are transformers models; its other parts diffusers'


BY_CLASS = {cls: kind for kind, (cls, _) in PIPELINES.items()}
# LDM single-file tensors that are no model weights: the noise schedule, EMA copies, position ids.
BOOKKEEPING = re.compile(r"^(model_ema\.|(alphas_cumprod|alphas_cumprod_prev|betas|log_one_minus_alphas_cumprod|"
                         r"sqrt_\w+|posterior_\w+|model_ema_\w*)$)|position_ids$|logit_scale$")
CLIP_TOP = ("embeddings.", "encoder.", "final_layer_norm.")
WEIGHTS = re.compile(r"\.(safetensors|bin|pt|pth|ckpt|gguf|msgpack|h5|onnx)$|\.index\.json$")


def _hf_to_file(name: str, family: str) -> str:
    """HF text-encoder names as single files hold them: CLIP wrapped in `text_model.`."""
    if family == "clip" and name.startswith(CLIP_TOP):
        return "text_model." + name
    return name


def pipeline_kind(ckpt) -> str | None:
    """The PIPELINES kind of a diffusers pipeline folder (model_index.json), None for anything else."""
    if ckpt.kind != "pipeline":
        return None
    mi = ckpt.path / "model_index.json"
    try:
        cls = json.loads(mi.read_text()).get("_class_name")
    except (OSError, ValueError, AttributeError):
        return None
    if cls not in BY_CLASS:
        raise CkptError(f"{ckpt.path}: a {cls} pipeline; --layout converts whole pipelines of "
                        + ", ".join(sorted(BY_CLASS)) + " (convert its model folders one by one otherwise)")
    return BY_CLASS[cls]


def single_file_kind(tensors: dict[str, Tensor]) -> str | None:
    """The PIPELINES kind of an all-in-one single file (its diffusion model's family), else None."""
    dm = {k[len("model.diffusion_model."):]: tuple(t.shape) for k, t in tensors.items()
          if k.startswith("model.diffusion_model.")}
    others = any(not k.startswith("model.diffusion_model.") and not BOOKKEEPING.search(k) for k in tensors)
    if not dm or not others:
        return None
    m = families.detect(dm, dm)
    if m is None:
        return None
    if m.family_id in PIPELINES:
        return m.family_id
    return "sd1" if m.family is families.get("sd1") and m.family_id is None else None


def _converted(tensors: dict[str, Tensor], part: PipelinePart, to: str) -> tuple[dict[str, Tensor], list[str]]:
    fam = families.get(part.family)
    if part.naming == "hf":
        if to == ORIGINAL:
            return {_hf_to_file(k, part.family): Renamed(t, _hf_to_file(k, part.family)) for k, t in tensors.items()}, []
        return dict(tensors), []
    return relayout(tensors, fam, DIFFUSERS if to == ORIGINAL else ORIGINAL, to)


def plan_pipeline_to_file(ckpt, views, make, kind: str, operation: str, file_format: str,
                          max_shard_size: int | None = None) -> Plan:
    """One all-in-one file; with `max_shard_size`, transformers-named shards and their index in a folder, as
    `--layout original` shards one model (`ckpt.layout.relayout.plan_model_layout`)."""
    cls, parts = PIPELINES[kind]
    by_folder = {c.subdir: (c, v) for c, v in zip(ckpt.components, views)}
    missing = [p.folder for p in parts if p.folder not in by_folder]
    if missing:
        raise CkptError(f"{ckpt.path}: the {cls} has no {', '.join(missing)} folder; nothing was written")
    outs, notes = [], []
    for p in parts:
        comp, view = by_folder[p.folder]
        tensors = {k: t for k, t in view.tensors.items() if not BOOKKEEPING.search(k)}
        dropped = [k for k in view.tensors if k not in tensors]
        converted, one_sided = _converted(tensors, p, ORIGINAL)
        for name, t in converted.items():
            outs += make(Renamed(t, p.prefix + name))
        if dropped or one_sided:
            notes.append(f"{p.folder}: not written ({plural(len(dropped) + len(one_sided), 'tensor')} no single file holds): "
                         + ", ".join((dropped + one_sided)[:4]))
    others = [c.subdir for c in ckpt.components if c.subdir not in {p.folder for p in parts}]
    if others:
        notes.append(f"not part of a single file, not written: {', '.join(others)}")
    files, indexes = plan_files(outs, "" if max_shard_size is None else TRANSFORMERS_STEM, file_format,
                                max_shard_size, metadata={"format": "pt", **provenance(operation)})
    plan = Plan(single_file=max_shard_size is None, files=files, indexes=indexes)
    plan.notes += [f"{cls} -> one {kind} single file ({plural(len(outs), 'tensor')})"] + notes
    return plan


def _ref_folder(ref: str | None, kind: str, where) -> Path:
    cls = PIPELINES[kind][0]
    if not ref:
        raise CkptError(f"{where}: an all-in-one {kind} file holds no tokenizer, scheduler or component config; "
                        f"pass --config REF, a diffusers {cls} folder or hub id to take them from")
    p = Path(ref).expanduser()
    if not p.exists():
        from ckpt.io.hub import looks_like_repo_id, sidecars_from_hub

        if not looks_like_repo_id(ref):
            raise CkptError(f"--config {ref}: no such folder")
        p = sidecars_from_hub(ref)
    mi = p / "model_index.json"
    try:
        found = json.loads(mi.read_text()).get("_class_name")
    except (OSError, ValueError, AttributeError):
        raise CkptError(f"--config {ref}: not a diffusers pipeline (no readable model_index.json)") from None
    if found != cls:
        raise CkptError(f"--config {ref}: a {found} pipeline, but the file is a {kind} model ({cls})")
    return p


def plan_file_to_pipeline(ckpt, views, make, kind: str, operation: str, config_ref: str | None,
                          max_shard_size: int | None = None) -> Plan:
    """A diffusers pipeline folder. Each component folder is sharded as its own library's `save_pretrained`
    shards it, past `max_shard_size`: a diffusers model by default past diffusers' limit (`DIFFUSERS_MAX_SHARD`,
    as `--layout diffusers` shards one model), a transformers text encoder only when asked."""
    cls, parts = PIPELINES[kind]
    comp, view = ckpt.components[0], views[0]
    ref = _ref_folder(config_ref, kind, comp.where)
    claimed: set[str] = set()
    files, indexes, notes = [], {}, []
    for p in sorted(parts, key=lambda p: -len(p.prefix)):
        tensors = {k[len(p.prefix):]: t for k, t in view.tensors.items()
                   if k.startswith(p.prefix) and k not in claimed and not BOOKKEEPING.search(k)}
        claimed.update(p.prefix + k for k in tensors)
        if not tensors:
            raise CkptError(f"{comp.where}: no {p.folder} weights under {p.prefix!r}; not an all-in-one {kind} file")
        converted, one_sided = _converted(tensors, p, DIFFUSERS)
        hf = p.naming == "hf" or p.family == "clip"
        stem = TRANSFORMERS_STEM if hf else DIFFUSERS_STEM
        outs = [o for name, t in converted.items() for o in make(Renamed(t, name))]
        part_files, part_index = plan_files(outs, stem, "safetensors",
                                            max_shard_size if hf else max_shard_size or DIFFUSERS_MAX_SHARD,
                                            metadata={"format": "pt", **provenance(operation)}, prefix=f"{p.folder}/")
        files += part_files
        indexes.update(part_index)
        if one_sided:
            notes.append(f"{p.folder}: {plural(len(one_sided), 'tensor')} of the single file only, not written")
    dropped = [k for k in view.tensors if BOOKKEEPING.search(k)]
    unclaimed = [k for k in view.tensors if k not in claimed and k not in dropped]
    if unclaimed:
        raise CkptError(f"{comp.where}: {plural(len(unclaimed), 'tensor')} belong{'s' * (len(unclaimed) == 1)} to no "
                        f"part of a {cls}: "
                        f"{', '.join(sorted(unclaimed)[:8])}; nothing was written")
    if dropped:
        notes.append(f"{plural(len(dropped), 'bookkeeping tensor')} (noise schedule, EMA, position ids) not written: "
                     + ", ".join(dropped[:4]))
    plan = Plan(single_file=False, files=files, indexes=indexes)
    for f in sorted(ref.rglob("*")):  # everything but weights: model_index, configs, tokenizers, scheduler
        rel = f.relative_to(ref)
        if f.is_file() and not any(x.startswith(".") for x in rel.parts) and not WEIGHTS.search(f.name):
            plan.copies.append((f, str(rel)))
    plan.notes += [f"one {kind} single file -> {cls} folder; tokenizers, scheduler and configs from {config_ref}"]
    plan.notes += notes
    return plan
