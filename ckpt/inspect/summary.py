"""`ckpt inspect`: one report (a JSON-ready dict) about a checkpoint, from headers only unless scanning.

The report predicts the classic trainer/loader failures before a run: mixed fp16/fp32 weights ("expected
scalar type Half but found Float"), FP8 or quantized weights a trainer cannot compute with, meta tensors,
all-in-one key prefixes that make a loader match no key (kohya "Cannot copy out of meta tensor"), NaN/Inf
values (`scan=True` reads every tensor band by band, memory bounded by the band size).

JSON layout (keys are stable; absent facts are null or empty, never missing):

    {"source": SRC as given, "path": local path, "kind": "file" | "folder" | "pipeline",
     "pipeline": model_index.json _class_name | null,
     "training_checkpoint": true when accelerate/trainer state files sit beside the weights,
     "components": [{
        "name": subfolder ("." for the top), "files": [weight files], "index": index file | null,
        "container": "safetensors" | "pickle" | "gguf" | "safetensors+pickle",
        "config_class": config.json _class_name / architectures[0] | null,
        "kind": "model" | "lora" | "empty",
        "family": one-line family label | null,
        "family_id": stable id of the (main) model family, ckpt.families ("sdxl", "flux1", "wan", ...;
                     of the model a LoRA is for) | null,
        "layout": "original" | "diffusers" (the naming of the weights, or of a LoRA's module names) | null,
        "parts": [{"prefix": key prefix ("" = none), "role": what the prefix means, "tensors": n,
                   "family": label | null, "family_id": id | null, "layout": layout | null}],
        "lora": null | {"types": [...], "modules": n, "ranks": [...], "alpha_keys": n, "targets": [...],
                        "adapter_config": {"r", "lora_alpha", "use_rslora", "use_dora"} (mlx-lm: {"fine_tune_type",
                                          "rank", "scale", "num_layers"}) | null,
                        "base_model": ss_base_model_version / modelspec.architecture | null,
                        "network_module": ss_network_module | null},
        "encodings": ["plain"] | ["fp8_e4m3fn (plain, no scales)", "optimum-quanto qint8", ...],
        "quantization": null | {"layers": [{"label": "GPTQ 4-bit, group 128, sym, act-order (g_idx), v1 zero
                                             points", "tensors": n, "settings": {"format", "bits", "group_size",
                                             ... as the decoder reads them}}],
                                "unquantized": {"tensors": n, "matrices": [plain tensors of 2+ dims]}}
                        (the formats with inspect settings: GPTQ, AWQ, compressed-tensors int / NVFP4 / FP8 (with
                         "activations" {"type", "dynamic", "strategy", "group_size"} where the scheme quantizes
                         them), ModelOpt NVFP4, gpt-oss MXFP4, HQQ, torchao; encodings.quantized_layers),
        "tensors": n (stored tensors),
        "parameters": n (the plain model's: decoded shapes of quantized weights, their scales and other
                      companions 0; stored elements where ckpt cannot decode the layout),
        "bytes": n (stored tensor bytes),
        "dtypes": {"fp16": {"tensors": n, "parameters": n, "bytes": n}, ...} (by stored dtype, a quantized
                  weight's parameters under its codes' dtype; GGUF block types by name: "Q8_0"),
        "metadata": {safetensors __metadata__ (GGUF: its key-values, long arrays summarized), merged over files},
        "warnings": [...], "notes": [...],
        "scan": null | {"tensors": n scanned, "nan": {name: count}, "inf": {name: count}}}],
     "totals": {"tensors": n, "parameters": n, "bytes": n},
     "warnings": ["<component>: <warning>", ...], "notes": [...]}
"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

from ckpt.lazy import torch

from ckpt.dtypes import FP8, ST_FLOAT, ST_FP8, ST_ITEMSIZE, is_float, short_name, st_short_name
from ckpt.errors import CkptError
from ckpt import families
from ckpt.families.identify import family_from_config, lora_modules, mostly_lora, split_parts
from ckpt.inspect.encodings import detect_encodings, quantized_layers
from ckpt.io.checkpoint import Checkpoint, Component, open_checkpoint
from ckpt.io.gguf import GGUFStored
from ckpt.io.tensors import PickleTensor
from ckpt.report import plural

QUANTO_FIX = "0.2.5"
QUANTO_KEYERROR = ("the resume failure \"KeyError: '...weight._data'\" comes from optimum-quanto < 0.2.5 loading a "
                   "LoRA onto a quanto-quantized base; it is fixed in optimum-quanto 0.2.5 (PR #295): "
                   "pip install -U 'optimum-quanto>=0.2.5'")


def inspect(src: str, scan: bool = False) -> dict:
    """Open SRC (anything `open_checkpoint` accepts) and build the report described above."""
    with open_checkpoint(src) as ckpt:
        return inspect_checkpoint(ckpt, scan)


def inspect_checkpoint(ckpt: Checkpoint, scan: bool = False) -> dict:
    comps = [summarize_component(ckpt, c, scan) for c in ckpt.components]
    training = bool(ckpt.state)  # trainer state beside the weights (ckpt.io.file_kinds.is_training_state)
    return {
        "source": ckpt.spec,
        "path": str(ckpt.path),
        "kind": ckpt.kind,
        "pipeline": _pipeline_class(ckpt.path),
        "training_checkpoint": training,
        "components": comps,
        "totals": {k: sum(c[k] for c in comps) for k in ("tensors", "parameters", "bytes")},
        "warnings": _checkpoint_warnings(comps),
        "notes": [n for make in CHECKPOINT_NOTES if (n := make(training, comps))],
    }


def _checkpoint_warnings(comps: list[dict]) -> list[str]:
    """Every component's warnings, each led by the component's name when there are several, so that a
    warning in a pipeline folder says which subfolder it is about."""
    if len(comps) <= 1:
        return [w for c in comps for w in c["warnings"]]
    return [f"{c['name'] if c['name'] != '.' else 'top folder'}: {w}" for c in comps for w in c["warnings"]]


def _has_quanto(comps: list[dict]) -> bool:
    """Any optimum-quanto weight: the notes about the quanto resume KeyError are only about those."""
    return any(e.startswith("optimum-quanto") for c in comps for e in c["encodings"])


def _training_note(training: bool, comps: list[dict]) -> str | None:
    """Says that the optimizer/scheduler state beside the weights is seen but not inspected."""
    if training:
        return ("training checkpoint: trainer state (optimizer/scheduler/random states) sits beside the weights; "
                "only the weights are inspected")
    return None


def _nothing_quantized_note(training: bool, comps: list[dict]) -> str | None:
    """A training checkpoint with no quanto weight: people come with the quanto resume KeyError thinking they
    must dequantize; say there is nothing to dequantize and where the error really comes from."""
    if not training or _has_quanto(comps):
        return None
    lora = " (LoRA-only training checkpoint)" if any(c["kind"] == "lora" for c in comps) else ""
    return f"nothing here is quantized{lora}: there is nothing to dequantize; " + QUANTO_KEYERROR


def _old_quanto_note(training: bool, comps: list[dict]) -> str | None:
    """quanto weights with an installed optimum-quanto older than the KeyError fix: the upgrade is the cure.
    Reading the installed version costs ~20 ms, so only when there are quanto weights."""
    installed = _installed_quanto() if _has_quanto(comps) else None
    if installed and _older(installed, QUANTO_FIX):
        return f"installed optimum-quanto {installed} is older than {QUANTO_FIX}: " + QUANTO_KEYERROR
    return None


# The report's own notes, in this order: each (training, components) -> a note or None.
CHECKPOINT_NOTES = (_training_note, _nothing_quantized_note, _old_quanto_note)


def summarize_component(ckpt: Checkpoint, comp: Component, scan: bool) -> dict:
    """One component's entry of the report (layout above); each fact is decided by the step named for it."""
    metadata = _file_metadata(comp)
    folder = ckpt.path / comp.subdir if ckpt.path.is_dir() else ckpt.path.parent
    sidecars = {name: _json(folder / name) for name in ("quanto_qmap.json", "adapter_config.json")}
    view, view_error = _decode(comp)
    enc = detect_encodings(comp.tensors, view, view_error, comp.config, metadata, sidecars)
    quantization = quantized_layers(view, comp.config)
    gguf = {n: t for n, t in comp.tensors.items() if isinstance(t, GGUFStored)}
    tensors, shapes = _named_tensors(comp.tensors, view, gguf)
    enc.aux_keys |= set(gguf)  # GGUF mixes F32 norms with F16 or quantized matrices by design
    is_lora, parts, lora = _parts(tensors, shapes, folder, sidecars, metadata)
    config_class = family_from_config(comp.config or (view.config if view is not None else None))
    family_id, layout = _family_id(parts, comp.config)
    dtypes = _dtype_table(comp.tensors, view, gguf)
    src = shlex.quote(ckpt.spec)
    prefix_warnings, prefix_notes = _prefix_findings(parts, is_lora)
    scan_result = scan_tensors(tensors) if scan else None
    return {
        "name": comp.subdir or ".",
        "files": [f.relpath for f in comp.files],
        "index": comp.index_name,
        "container": _container(comp),
        "config_class": config_class,
        "kind": _component_kind(tensors, is_lora),
        "family": _family_line(parts, is_lora, config_class),
        "family_id": family_id,
        "layout": layout,
        "parts": parts,
        "lora": lora,
        "encodings": enc.names,
        "quantization": quantization,
        "tensors": len(tensors),
        "parameters": sum(d["parameters"] for d in dtypes.values()),
        "bytes": sum(d["bytes"] for d in dtypes.values()),
        "dtypes": dtypes,
        "metadata": metadata,
        "warnings": (_decode_warnings(view_error) + _warnings(tensors, enc, src) + _gguf_warnings(gguf, view, src)
                     + prefix_warnings + _scan_warnings(scan_result)),
        "notes": list(comp.notes) + prefix_notes + _unknown_lora_notes(is_lora, parts),
        "scan": scan_result,
    }


def _file_metadata(comp: Component) -> dict[str, str]:
    """safetensors `__metadata__` and GGUF key-values of the component's files, merged in file order (a later
    shard's key wins): what the trainer or converter wrote about the weights."""
    metadata: dict[str, str] = {}
    for f in comp.files:
        if f.kind == "safetensors":
            metadata.update(f.metadata)
        elif f.kind == "gguf":
            metadata.update(f.gguf.scalars())
    return metadata


def _decode(comp: Component):
    """(logical view, None), or (None, why) when ckpt's decoders refuse the component: inspect reports what
    convert would refuse instead of failing. The view's notes describe decoding, which inspect does not do."""
    try:
        from ckpt.quant.view import logical_view

        return logical_view(comp), None
    except CkptError as e:
        return None, str(e).replace("; nothing was written", "")


def _decode_warnings(view_error: str | None) -> list[str]:
    """Why ckpt cannot decode the component, first: the facts after it come from the stored tensors alone."""
    return [] if view_error is None else [f"cannot be decoded by ckpt: {view_error}"]


def _named_tensors(stored: dict, view, gguf: dict) -> tuple[dict, dict]:
    """(tensors, shapes) that family, LoRA and hazard detection read: the stored ones, except for a GGUF LLM
    (a view with config.json), whose decoded HF names say the family where the GGUF names do not."""
    tensors = view.tensors if gguf and view is not None and view.config is not None else stored
    return tensors, {n: tuple(t.shape) for n, t in tensors.items()}


def _parts(tensors: dict, shapes: dict, folder: Path, sidecars: dict, metadata: dict):
    """(is_lora, parts, lora summary | None): a LoRA's parts are its module names split by prefix, a model's
    its keys split by bundle prefix."""
    kinds, base_shapes, ranks, alphas = lora_modules(tensors, shapes)
    is_lora = mostly_lora(kinds, alphas, len(tensors))
    if not is_lora:
        return is_lora, _model_parts(tensors, shapes), None
    if "LitGPT LoRA" in kinds:
        ranks = _litgpt_rank(folder) or ranks  # hyperparameters.yaml lora_r: the fused q/k/v rows are r per projection
    parts, lora = _lora_parts(kinds, base_shapes, ranks, alphas, sidecars.get("adapter_config.json"), metadata)
    return is_lora, parts, lora


def _component_kind(tensors: dict, is_lora: bool) -> str:
    """"empty" | "lora" | "model": what a loader would be handed."""
    if not tensors:
        return "empty"
    return "lora" if is_lora else "model"


def _container(comp: Component) -> str:
    """The file kinds present, in a fixed order ("safetensors+pickle"), whatever the file order."""
    present = {f.kind for f in comp.files}
    return "+".join(k for k in ("safetensors", "pickle", "gguf") if k in present)


def _dtype_table(stored: dict, view, gguf: dict) -> dict[str, dict[str, int]]:
    """Stored dtype (a GGUF block type by name) -> its tensors, the plain model's parameters, stored bytes."""
    logical = _logical_params(stored, view) if view is not None and not gguf else {}
    dtypes: dict[str, dict[str, int]] = {}
    for name, t in stored.items():
        kind, n, size = _dtype_entry(name, t, logical)
        d = dtypes.setdefault(kind, {"tensors": 0, "parameters": 0, "bytes": 0})
        d["tensors"] += 1
        d["parameters"] += n
        d["bytes"] += size
    return dtypes


def _dtype_entry(name: str, t, logical: dict[str, int]) -> tuple[str, int, int]:
    """(dtype row, parameters, bytes) of one stored tensor: GGUF blocks by their type, the values they hold and
    their bytes; anything else by its dtype, its logical parameters (`_logical_params`) and its bytes."""
    if isinstance(t, GGUFStored):
        return (t.type_name if t.quantized else _dtype(t)[0]), t.logical_numel, t.info.nbytes
    kind, itemsize = _dtype(t)
    return kind, logical.get(name, t.numel), t.numel * itemsize


def _gguf_warnings(gguf: dict, view, src: str) -> list[str]:
    """GGUF-quantized weights only GGUF loaders read: say so, and what `convert --to bf16` writes from them."""
    quantized = sum(t.quantized for t in gguf.values())
    if not quantized:
        return []
    out = "an HF model folder with config.json" if view is not None and view.config else "plain weights"
    return [f"{plural(quantized, 'GGUF-quantized weight')}: only GGUF loaders (llama.cpp, ComfyUI-GGUF) use them; "
            f"`ckpt convert {src} --to bf16` writes {out}"]


def _prefix_findings(parts: list[dict], is_lora: bool) -> tuple[list[str], list[str]]:
    """(warnings, notes) about bundle prefixes on a model's keys (`prefix_message`); a LoRA's module
    prefixes are its own naming, never a hazard."""
    found = None if is_lora else prefix_message(parts)
    if not found:
        return [], []
    level, text = found
    return ([text], []) if level == "warning" else ([], [text])


# --scan's counts: (report key, word in the warning)
SCAN_COUNTS = (("nan", "NaN"), ("inf", "Inf"))


def _scan_warnings(scan_result: dict | None) -> list[str]:
    """One warning per kind of non-finite value --scan found: the total, and the worst five tensors."""
    if not scan_result:
        return []
    return [_scan_warning(scan_result[key], word) for key, word in SCAN_COUNTS if scan_result[key]]


def _scan_warning(per: dict[str, int], word: str) -> str:
    """"N NaN values in M tensors: worst (count), ...": the worst first, so a few names point at the damage."""
    worst = sorted(per.items(), key=lambda kv: -kv[1])
    return (f"{plural(sum(per.values()), word + ' value')} in {plural(len(per), 'tensor')}: "
            + _first([f"{k} ({v})" for k, v in worst], 5))


def _unknown_lora_notes(is_lora: bool, parts: list[dict]) -> list[str]:
    """A LoRA whose module names match no known family: say so rather than leave the family blank unexplained."""
    if is_lora and not any(p["family"] for p in parts):
        return ["LoRA target model not recognised from its module names"]
    return []


def _first(names: list[str], show: int) -> str:
    """The first `show` names, then ", ..." when there are more (the inspect wording of a list cut short)."""
    return ", ".join(names[:show]) + (", ..." if len(names) > show else "")


def _logical_params(stored: dict, view) -> dict[str, int]:
    """Stored key -> the parameters it stands for in the plain model: a decoded tensor's logical shape
    (a bitsandbytes or nvfp4 pack holds two values per byte, a padded comfy_quant weight more than its
    logical shape), its codes' key when they are stored under another name (quanto `X.weight._data`),
    and 0 for what the decoders consume beside the codes (scales, absmax, code tables, markers). Counting
    stored elements instead showed a 1.86M-parameter NF4 model as 1.13M."""
    out = {}
    for key in stored:
        if key in view.consumed:
            name = view.anchors.get(key)
            out[key] = view.tensors[name].numel if name in view.tensors else 0
        elif key in view.tensors:
            out[key] = view.tensors[key].numel
    return out


def _dtype(t) -> tuple[str, int]:
    """(short name, element size) of a tensor's dtype: from its safetensors name, so that a report of
    headers needs no torch (a dtype safetensors has no name for is asked of torch)."""
    name = t.dtype_name
    if name in ST_ITEMSIZE:
        return st_short_name(name), ST_ITEMSIZE[name]
    return short_name(t.dtype), t.dtype.itemsize


def _model_parts(tensors, shapes) -> list[dict]:
    out = []
    for p in split_parts(tensors, shapes=shapes):
        stripped = [k[len(p.prefix):] for k in p.keys]
        m = families.detect(stripped, {k[len(p.prefix):]: shapes[k] for k in p.keys})
        out.append({"prefix": p.prefix, "role": p.role, "tensors": len(p.keys), **_family_fields(m)})
    return out


def _family_fields(m) -> dict:
    return {"family": m.label if m else None, "family_id": m.family_id if m else None,
            "layout": m.layout if m else None}


def _family_id(parts, config) -> tuple[str | None, str | None]:
    """The component's family id and layout: the first part's that has one (the diffusion model comes
    first), else what config.json's class names (a diffusers class: diffusers layout)."""
    for p in parts:
        if p["family_id"]:
            return p["family_id"], p["layout"]
    fam = families.from_config(config)
    if fam is None or len(fam.all_ids) > 1:
        return None, None
    layout = "diffusers" if "diffusers" in fam.layouts and isinstance(config, dict) and "_class_name" in config \
        else None
    return fam.family_id, layout


def _lora_parts(kinds, base_shapes, ranks, alphas, adapter_config, metadata):
    modules = sorted(set().union(*kinds.values()))
    parts = []
    for p in split_parts(modules, lora=True):
        if set(kinds) == {"LitGPT LoRA"} and p.prefix == "transformer.":
            p.role = "LitGPT"  # LitGPT's own module root, not a diffusers pipeline component
        stripped = {m[len(p.prefix):]: base_shapes.get(m) for m in p.keys}
        m = families.detect(stripped, {k: s for k, s in stripped.items() if s})
        parts.append({"prefix": p.prefix, "role": p.role, "tensors": len(p.keys), **_family_fields(m)})
    cfg = None
    if isinstance(adapter_config, dict):
        cfg = {k: adapter_config.get(k) for k in ("r", "lora_alpha", "use_rslora", "use_dora")}
        if isinstance(adapter_config.get("lora_parameters"), dict) and "mlx-lm LoRA" in kinds:  # mlx-lm's fields
            lp = adapter_config["lora_parameters"]
            cfg = {"fine_tune_type": adapter_config.get("fine_tune_type", "lora"), "rank": lp.get("rank"),
                   "scale": lp.get("scale"), "num_layers": adapter_config.get("num_layers")}
    lora = {
        "types": sorted(kinds),
        "modules": len(modules),
        "ranks": sorted(ranks),
        "alpha_keys": alphas,
        "targets": sorted({p["family"] for p in parts if p["family"]}),
        "adapter_config": cfg,
        # what the trainer wrote about itself (kohya ss_*, modelspec), when it did
        "base_model": metadata.get("ss_base_model_version") or metadata.get("modelspec.architecture"),
        "network_module": metadata.get("ss_network_module"),
    }
    return parts, lora


def _litgpt_rank(folder: Path) -> set[int]:
    """{lora_r} from the hyperparameters.yaml `litgpt finetune lora` writes beside its LoRA, if readable."""
    p = folder / "hyperparameters.yaml"
    if not p.is_file():
        return set()
    try:
        import yaml

        r = (yaml.safe_load(p.read_text(encoding="utf-8")) or {}).get("lora_r")
    except Exception:  # unreadable YAML: inspect still reports what the tensors say
        return set()
    return {r} if isinstance(r, int) and not isinstance(r, bool) and r > 0 else set()


def _family_line(parts, is_lora, config_class) -> str | None:
    fams = list(dict.fromkeys(p["family"] for p in parts if p["family"]))
    if not fams:
        return f"{config_class} (from config.json)" if config_class else None
    line = " + ".join(fams)
    if len(parts) > 1 and not is_lora:
        line = f"all-in-one: {line}"
    return f"LoRA for {line}" if is_lora else line


def _warnings(tensors, enc, src: str) -> list[str]:
    """The hazards the tensors predict for a trainer or loader, each check in `TENSOR_WARNINGS` order."""
    return [w for check in TENSOR_WARNINGS for w in check(tensors, enc, src)]


def _mixed_dtype_warnings(tensors, enc, src: str) -> list[str]:
    """Weights of more than one floating dtype: code that loads without casting fails on the minority."""
    floats = _floats_by_dtype(tensors, enc.aux_keys)
    if len(floats) <= 1:
        return []
    major = max(floats, key=lambda k: len(floats[k]))
    listed = "; ".join(f"{k} ({len(v)}: {_first(v, 3)})" for k, v in floats.items() if k != major)
    return [f"mixed floating dtypes: {major} ({plural(len(floats[major]), 'tensor')}) and {listed}; code that loads "
            "without casting fails with \"expected scalar type Half but found Float\"-style errors; "
            f"`ckpt convert {src} --to {major}` makes them one dtype"]


def _floats_by_dtype(tensors, skip: set[str]) -> dict[str, list[str]]:
    """Floating dtype -> the weights stored in it; scalars, fp8 (warned apart) and the scales and states of a
    quantized layout (`skip`, which mix dtypes by design) are left out."""
    floats: dict[str, list[str]] = {}
    for n, t in tensors.items():
        if n in skip or t.numel <= 1 or t.dtype_name in ST_FP8 or t.dtype_name not in ST_FLOAT:
            continue
        floats.setdefault(st_short_name(t.dtype_name), []).append(n)
    return floats


def _fp8_warnings(tensors, enc, src: str) -> list[str]:
    """fp8 weights, per fp8 dtype: trainers cannot compute with them."""
    return [_fp8_warning(kind, n, _fp8_aux(tensors, enc.aux_keys, kind), src) for kind, n in enc.fp8.items()]


def _fp8_aux(tensors, aux_keys: set[str], kind: str) -> list[str]:
    """The scale and marker tensors (`scaled_fp8`) stored in fp8 `kind`: the dtype table counts every stored
    tensor, so the warning names them apart."""
    return [k for k, t in tensors.items()
            if k in aux_keys and t.dtype_name in ST_FP8 and st_short_name(t.dtype_name) == kind]


def _fp8_warning(kind: str, n: int, aux: list[str], src: str) -> str:
    also = (f" (the dtype table's {n + len(aux)} also count{'s' * (n + len(aux) == 1)} "
            f"{plural(len(aux), 'scale/marker tensor')}: {_first(aux, 3)})" if aux else "")
    return (f"{plural(n, 'tensor')} stored as {kind}{also}: trainers cannot compute with fp8 weights "
            f"('expected m1 and m2 to have the same dtype'); `ckpt convert {src} --to bf16` decodes them")


# the quantized layouts whose labels `ckpt dequant` decodes (the others are only recognised)
DEQUANTIZABLE = ("optimum-quanto", "bitsandbytes", "GPTQ", "AWQ")
QUANTO_LORA = "; loading a LoRA onto this base needs optimum-quanto >= 0.2.5 (KeyError '...weight._data' before)"


def _quantized_warnings(tensors, enc, src: str) -> list[str]:
    """Integer-quantized weights, per layout: only loaders with that library use them."""
    return [_quantized_warning(label, n, src) for label, n in enc.quantized.items()]


def _quantized_warning(label: str, n: int, src: str) -> str:
    hint = f"`ckpt dequant {src}` writes plain weights" if label.startswith(DEQUANTIZABLE) \
        else "ckpt cannot decode this layout"
    extra = QUANTO_LORA if label.startswith("optimum-quanto") else ""
    return (f"{plural(n, 'quantized weight')} ({label}): loaders without that library cannot use "
            f"{'it' if n == 1 else 'them'}; {hint}{extra}")


def _meta_warnings(tensors, enc, src: str) -> list[str]:
    """Meta tensors in a pickle: shapes without data, which a loader cannot copy."""
    meta = [n for n, t in tensors.items() if isinstance(t, PickleTensor) and t.value.is_meta]
    return [f"{plural(len(meta), 'meta tensor')} (no data): {', '.join(meta[:5])}"] if meta else []


# The tensor hazards, in the order their warnings print: each (tensors, encodings, quoted SRC) -> warnings.
TENSOR_WARNINGS = (_mixed_dtype_warnings, _fp8_warnings, _quantized_warnings, _meta_warnings)


LDM_CLASSIC = re.compile(r"^(model\.diffusion_model\.|model_ema\.|first_stage_model\.|cond_stage_model\."
                         r"|conditioner\.embedders\.\d+\.)$")


def prefix_message(parts) -> tuple[str, str] | None:
    """("warning" | "note", text) about bundle prefixes on model keys, None when keys are bare.

    The classic SD1/SD2/SDXL single file (UNet under `model.diffusion_model.` with its VAE and text
    encoders) is what SD trainers read, so it only gets a note; any other prefixed layout (a Flux/SD3
    diffusion model under `model.diffusion_model.`, ComfyUI's bundled `text_encoders.*` and `vae.*`) is
    where loaders that expect bare keys matched nothing (kohya #1498), so it is a warning."""
    bundled = [p for p in parts if p["prefix"]]  # model parts: only bundle prefixes are split off
    if not bundled:
        return None
    listed = ", ".join(f"{p['prefix']} ({p['tensors']})" for p in bundled)
    unet = [p for p in bundled if p["prefix"] == "model.diffusion_model."]
    classic = (all(LDM_CLASSIC.match(p["prefix"]) for p in bundled) and unet
               and "UNet (LDM)" in (unet[0]["family"] or ""))
    if classic:
        return "note", (f"keys carry the LDM single-file prefixes {listed}: SD trainers read this layout; "
                        "tools that expect bare or diffusers keys match none of them")
    return "warning", (f"keys carry bundle prefixes {listed}: a loader or trainer expecting bare model keys "
                       "matches none of them and leaves its weights unloaded (kohya: \"Cannot copy out of meta "
                       "tensor\"); use a loader for this all-in-one layout")


def scan_tensors(tensors: dict) -> dict:
    """Count NaN and Inf per floating tensor, reading row bands (memory bounded by the band size)."""
    from ckpt.io.buffers import Buffers
    from ckpt.io.output import bands  # the band planner lives with the writer (which imports torch)

    bufs = Buffers()
    nan: dict[str, int] = {}
    inf: dict[str, int] = {}
    scanned = 0
    cpu = torch.device("cpu")
    for name, t in tensors.items():
        if not is_float(t.dtype) or (isinstance(t, PickleTensor) and t.value.is_meta):
            continue
        scanned += 1
        n_nan = n_inf = 0
        for a, b in bands(t):
            x = t.read(a, b, cpu, bufs).reshape(-1)  # flat: torch reduces over 100,000 dims of 1 for minutes
            if x.dtype in FP8:
                x = x.float()
            n_nan += int(torch.isnan(x).sum())
            n_inf += int(torch.isinf(x).sum())
        if n_nan:
            nan[name] = n_nan
        if n_inf:
            inf[name] = n_inf
    return {"tensors": scanned, "nan": nan, "inf": inf}


def _json(path: Path) -> dict | None:
    """A sidecar JSON object (quanto_qmap.json, adapter_config.json, model_index.json), None when it is
    absent, unreadable or not an object: every caller reads it with `.get`, and inspect reports what the
    tensors say rather than failing on a sidecar (config.json itself is checked when the folder opens)."""
    if not path.is_file():
        return None
    try:
        v = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, RecursionError, json.JSONDecodeError):
        return None
    return v if isinstance(v, dict) else None


def _pipeline_class(path: Path) -> str | None:
    mi = _json(path / "model_index.json") if path.is_dir() else None
    return mi.get("_class_name") if isinstance(mi, dict) and isinstance(mi.get("_class_name"), str) else None


def _installed_quanto() -> str | None:
    from importlib import metadata as importlib_metadata

    try:
        return importlib_metadata.version("optimum-quanto")
    except importlib_metadata.PackageNotFoundError:
        return None


def _older(version: str, than: str) -> bool:
    def nums(v):
        return tuple(int(x) for x in re.findall(r"\d+", v)[:3])
    return nums(version) < nums(than)
