"""From per-component views to a `Plan` that keeps the input's layout (or reshards on request).

Shared by every command: a command supplies `make(tensor) -> list[OutTensor]` for each logical tensor
(empty to drop it) and this decides files, shard names, index files, metadata and sidecars.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import PurePosixPath
from typing import Callable

from ckpt.lazy import torch

from ckpt import __version__
from ckpt.dtypes import CONFIG_KEYS, CONFIG_NAMES, ST_CONFIG_NAMES, ST_FLOAT, TORCH_TO_ST
from ckpt.io.checkpoint import Checkpoint, Component
from ckpt.errors import CkptError
from ckpt.io.header import MAX_HEADER
from ckpt.io.writer import layout as header_layout
from ckpt.io.plan import OutFile, OutTensor, Plan, output_name, plan_files, safetensors_name, weight_file
from ckpt.io.plan import index_name as plan_index_name

QUANT_SIDECARS = ("quanto_qmap.json", "hf_quant_config.json", "quantize_config.json", "quant_config.json")


def provenance(operation: str) -> dict[str, str]:
    return {"ckpt_version": __version__, "ckpt_operation": operation}


def _stem(relpath: str) -> str:
    name = PurePosixPath(safetensors_name(relpath)).name[: -len(".safetensors")]
    return re.sub(r"-\d{5}-of-\d{5}$", "", name)


def _index_name(index_name: str, file_format: str = "safetensors") -> str:
    """The output index of a sharded input kept as it is: its stem in the output format's naming."""
    base = re.sub(r"\.(bin|pt|pth|safetensors)\.index\.json$", "", index_name)
    return plan_index_name(base if file_format == "torch" else re.sub(r"^pytorch_model", "model", base), file_format)


def plan_component(comp: Component, outs: list[OutTensor], metadata_of: Callable[[str], dict],
                   max_shard_size: int | None, single_file: bool,
                   file_format: str = "safetensors") -> tuple[list[OutFile], dict[str, dict]]:
    """Output files (relative to the component folder) and index files for one component."""
    prefix = f"{comp.subdir}/" if comp.subdir else ""
    if single_file:
        return plan_files(outs, "", file_format, metadata=metadata_of(comp.files[0].relpath))
    if max_shard_size is not None:
        merged = {}
        for f in comp.files:
            merged.update(metadata_of(f.relpath))
        return plan_files(outs, _stem(comp.files[0].relpath), file_format, max_shard_size, merged, prefix)
    by_home: dict[str, list[OutTensor]] = {f.relpath: [] for f in comp.files}
    for t in outs:
        by_home[t.source.home or comp.files[0].relpath].append(t)
    out_files = [weight_file(prefix + output_name(rel, file_format), metadata_of(rel), ts, file_format)
                 for rel, ts in by_home.items() if ts]
    if not comp.sharded:
        return out_files, {}
    weight_map = {t.name: PurePosixPath(f.relpath).name for f in out_files for t in f.tensors}
    total = sum(t.entry.nbytes for f in out_files for t in f.tensors)
    return out_files, {prefix + _index_name(comp.index_name, file_format):
                       {"metadata": {"total_size": total}, "weight_map": weight_map}}


def plan_checkpoint(ckpt: Checkpoint, views: list, make: Callable[[object], list[OutTensor]], *,
                    operation: str, max_shard_size: int | None = None, file_format: str = "safetensors",
                    output_dtype: Callable[[Component], torch.dtype | None] = lambda c: None) -> Plan:
    """`views[i]` is the logical view of `ckpt.components[i]`."""
    # A view with a config of its own (a GGUF LLM) becomes a model folder: weights beside config.json.
    single = ckpt.kind == "file" and max_shard_size is None and not any(v.config for v in views)
    plan = Plan(single_file=single, files=[])
    dequantized_dirs = set()
    for comp, view in zip(ckpt.components, views):
        outs = [o for t in view.tensors.values() for o in make(t)]

        def metadata_of(rel, _f={f.relpath: f for f in comp.files}, _v=view):
            meta = {k: v for k, v in _f[rel].metadata.items() if k not in _v.drop_metadata}
            meta.setdefault("format", "pt")  # what transformers' and diffusers' loaders look for
            meta.update(provenance(operation))
            return meta

        files, indexes = plan_component(comp, outs, metadata_of, max_shard_size, single, file_format)
        for f in files:
            _check_header_size(comp, f)
        plan.files += files
        plan.indexes.update(indexes)
        plan.notes += view.notes
        if view.dequantized:
            dequantized_dirs.add(comp.subdir)
        rel = f"{comp.subdir}/config.json" if comp.subdir else "config.json"
        if view.config is not None:
            plan.generated[rel] = _config_edit(False, output_dtype(comp) or _main_dtype(files))(dict(view.config))
        elif comp.config is not None:  # asked only here: a config-less file's plan of copies needs no torch dtype
            dtype = output_dtype(comp)
            if view.dequantized or dtype is not None:
                plan.json_edits[rel] = _config_edit(view.dequantized, dtype)
    for rel in ckpt.copies:
        p = PurePosixPath(rel)
        if rel in plan.generated:
            plan.notes.append(f"{rel}: not copied (written from the weights' own metadata)")
            continue
        if p.name in QUANT_SIDECARS and str(p.parent if str(p.parent) != "." else "") in dequantized_dirs:
            plan.notes.append(f"{rel}: not copied (the weights are no longer quantized)")
            continue
        plan.copies.append((ckpt.path / rel, rel))
    return plan


_FLOATING = ST_FLOAT | {"F8_E8M0"}  # the names of torch's floating dtypes (`is_float` leaves the scale format out)


def _main_dtype(files) -> str | torch.dtype | None:
    """The floating dtype most output elements have (what a generated config.json declares), by its safetensors
    name where it has one: a plan made without torch names its dtypes, and a name is asked without torch."""
    counts: dict = {}
    for f in files:
        for t in f.tensors:
            dt = t.dtype if isinstance(t.dtype, str) else TORCH_TO_ST.get(t.dtype, t.dtype)  # a torch dtype: imported
            if (dt in _FLOATING) if isinstance(dt, str) else dt.is_floating_point:
                counts[dt] = counts.get(dt, 0) + math.prod(t.shape)
    return max(counts, key=counts.get) if counts else None


def _check_header_size(comp: Component, f: OutFile) -> None:
    """An output safetensors header over the 100 MB safetensors readers accept would be unreadable: refuse
    it while planning (an input header just under the limit grows by ckpt's provenance metadata)."""
    if f.format != "safetensors":
        return
    head, _ = header_layout([t.entry for t in f.tensors], f.metadata)
    if len(head) - 8 <= MAX_HEADER:
        return
    meta = len(json.dumps(f.metadata, ensure_ascii=False).encode())
    why = (f"its __metadata__ alone is {meta / 1e6:.1f} MB" if meta > MAX_HEADER // 2 else
           f"{len(f.tensors)} tensors; --max-shard-size splits them over several files")
    raise CkptError(f"{comp.where}: the output {f.relpath or 'file'} would have a {(len(head) - 8) / 1e6:.1f} MB header, "
                    f"over the {MAX_HEADER / 1e6:.0f} MB that safetensors readers accept ({why}); nothing was written")


def _config_edit(dequantized: bool, dtype: str | torch.dtype | None):
    def edit(cfg: dict) -> dict:
        if dequantized:
            cfg.pop("quantization_config", None)
            cfg.pop("_pre_quantization_dtype", None)
            cfg.pop("quantization", None)  # MLX's block (mlx-lm copies it to quantization_config)
        if dtype is not None:
            name = ST_CONFIG_NAMES.get(dtype) if isinstance(dtype, str) else CONFIG_NAMES.get(dtype)  # names: no torch
            if name is None:
                return cfg
            keys = [k for k in CONFIG_KEYS if k in cfg] or (["torch_dtype"] if "architectures" in cfg else [])
            for k in keys:
                cfg[k] = name
        return cfg

    return edit
