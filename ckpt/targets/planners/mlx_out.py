"""`convert --to mlx-qN [--group-size G]`: a Hugging Face LLM folder (or anything ckpt reads as one: a GGUF LLM, a
GPTQ / AWQ / FP8 / MLX release, decoded) written as `mlx_lm.convert --hf-path F -q --q-bits N --q-group-size G`
writes it, streamed: the tensors byte for byte, config.json and the index as its `save` writes them.

What mlx-lm does, restated from `mlx_lm.convert` / `utils.quantize_model` / `utils.save` (0.32.2):
- the model's weights as its `sanitize` leaves them: for the families here (Llama, Mistral, Qwen2, Qwen3: mlx-lm's
  module names are Hugging Face's) `rotary_emb.inv_freq` dropped and `lm_head.weight` dropped when the embeddings
  are tied; other model types are refused by name (their sanitize renames or stacks tensors: MoE experts, VLMs);
- every floating tensor cast to config.json's `torch_dtype` when that is float16, bfloat16 or float32, else to
  `text_config.dtype`, else kept in its dtype (transformers 5 writes `dtype`, not `torch_dtype`: then nothing is cast);
- every Linear and Embedding weight (the 2-D `.weight`s of these families) whose input width is a multiple of G
  quantized (`ckpt.quant.mlx.quantize`: uint32 codes, scales and biases in the weight's dtype); the others kept;
- one `model.safetensors` (metadata format=mlx) up to 5 GiB, else `model-0000i-of-0000n.safetensors`;
  `model.safetensors.index.json` always, with `total_size` and `total_parameters` (a quantized layer counted as
  its unpacked weight), indented by 4, the weight map sorted;
- config.json: the source's, `eos_token_id` from generation_config.json when that sets one, `quantization` and
  `quantization_config` = {group_size, bits, mode: affine}, `_name_or_path` and `vision_config` dropped, top-level
  keys sorted, indented by 4, non-finite floats tagged `{"__float__": "NaN"}`; a quantization block of a decoded
  source is replaced.
Tokenizer files, chat template, generation_config.json and the other side files are copied as they are (mlx-lm
re-saves the tokenizer through transformers and writes a model card README.md; ckpt keeps the source's files).
"""

from __future__ import annotations

import json
import math

from ckpt.dtypes import is_float
from ckpt.errors import CkptError
from ckpt.io.checkpoint_plan import QUANT_SIDECARS, provenance
from ckpt.io.plan import OutFile, OutTensor, Plan
from ckpt.quant.mlx import encoded
from ckpt.targets.planners.kept import kept as kept_tensor
from ckpt.report import plural

FAMILIES = ("llama", "mistral", "qwen2", "qwen3")  # mlx-lm model types whose sanitize only drops keys
CONVERSION_DTYPES = ("float16", "bfloat16", "float32")  # mlx_lm.convert's MODEL_CONVERSION_DTYPES
MAX_FILE = 5 << 30  # mlx_lm.utils.MAX_FILE_SIZE_GB
INDEX = "model.safetensors.index.json"


def _model_config(ckpt, views) -> dict:
    """The LLM's config.json (a GGUF LLM's: the one its metadata makes), refused unless mlx-lm's layout is the
    folder's own."""
    where = ckpt.components[0].where if ckpt.components else ckpt.path
    if len(ckpt.components) != 1:
        raise CkptError(f"{ckpt.path}: not a Hugging Face LLM folder (--to mlx-* writes one causal LM; this holds "
                        f"{len(ckpt.components)} components)")
    cfg = views[0].config or ckpt.components[0].config
    if not isinstance(cfg, dict):
        raise CkptError(f"{where}: not a Hugging Face LLM folder (no config.json): --to mlx-* writes an LLM as "
                        "mlx_lm.convert does")
    model_type = cfg.get("model_type")
    if model_type not in FAMILIES:
        shown = repr(model_type) if len(repr(model_type)) <= 40 else repr(model_type)[:40] + "..."
        raise CkptError(f"{where}: model_type {shown} is not one --to mlx-* writes ({', '.join(FAMILIES)}: the "
                        "families whose mlx-lm layout is the Hugging Face one)")
    return cfg


def _cast_dtype(cfg: dict):
    """The dtype mlx_lm.convert casts every floating tensor to, or None (kept)."""
    from ckpt.lazy import torch

    name = cfg.get("torch_dtype")
    if name is None and isinstance(cfg.get("text_config"), dict):
        name = cfg["text_config"].get("dtype")
    return getattr(torch, name) if name in CONVERSION_DTYPES else None


def _tag_floats(obj):
    """mlx-lm's `_encode_tagged_floats`: NaN and infinities as {"__float__": ...}, so the file stays JSON."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return {"__float__": "NaN" if math.isnan(obj) else ("Infinity" if obj > 0 else "-Infinity")}
    if isinstance(obj, dict):
        return {k: _tag_floats(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_tag_floats(v) for v in obj]
    return obj


def config_text(ckpt, cfg: dict, bits: int, group: int) -> str:
    """config.json as mlx_lm.convert saves it (module docstring)."""
    from ckpt.io.small_inputs import load_json_object

    cfg = dict(cfg)
    if "generation_config.json" in ckpt.copies:
        gen = load_json_object(ckpt.path / "generation_config.json")
        if eos := gen.get("eos_token_id", False):
            cfg["eos_token_id"] = eos
    quant = {"group_size": group, "bits": bits, "mode": "affine"}
    cfg["quantization"], cfg["quantization_config"] = quant, dict(quant)
    cfg.pop("_name_or_path", None)
    cfg.pop("vision_config", None)
    return json.dumps(_tag_floats(dict(sorted(cfg.items()))), indent=4)


def plan_mlx(ckpt, views, bits: int, group: int, report, operation: str, target: str) -> Plan:
    cfg = _model_config(ckpt, views)
    cast_to = _cast_dtype(cfg)
    tied = bool(cfg.get("tie_word_embeddings", False))
    casters: dict = {}
    outs: list[OutTensor] = []
    quantized, kept, dropped, params = [], [], [], 0
    for name, t in views[0].tensors.items():
        if "self_attn.rotary_emb.inv_freq" in name or (tied and name == "lm_head.weight"):
            dropped.append(name)
            continue
        floating = is_float(t.dtype)
        dtype = (cast_to or t.natural_dtype) if floating else t.dtype
        if floating and name.endswith(".weight") and len(t.shape) == 2 and t.shape[-1] % group == 0 and t.numel:
            layer = name[: -len(".weight")]
            outs += encoded(t, name, f"{layer}.scales", f"{layer}.biases", group, bits, dtype, report)
            quantized.append(name)
            params += t.numel
            continue
        if floating and name.endswith(".weight") and len(t.shape) == 2:
            kept.append(name)
        params += t.numel
        outs.append(kept_tensor(t, casters, report, dtype, name))
    outs.sort(key=lambda o: o.name)
    meta = {"format": "mlx", **provenance(operation)}
    files: list[list[OutTensor]] = []
    size = 0
    for o in outs:  # mlx_lm.utils.make_shards
        if not files or size + o.entry.nbytes > MAX_FILE:
            files.append([])
            size = 0
        files[-1].append(o)
        size += o.entry.nbytes
    names = (["model.safetensors"] if len(files) == 1 else
             [f"model-{i + 1:05d}-of-{len(files):05d}.safetensors" for i in range(len(files))])
    plan = Plan(single_file=False, files=[OutFile(n, dict(meta), ts) for n, ts in zip(names, files)])
    weight_map = {o.name: n for n, ts in zip(names, files) for o in ts}
    index = {"metadata": {"total_size": sum(o.entry.nbytes for o in outs), "total_parameters": params},
             "weight_map": dict(sorted(weight_map.items()))}
    plan.generated[INDEX] = json.dumps(index, indent=4)
    plan.generated["config.json"] = config_text(ckpt, cfg, bits, group)
    for rel in ckpt.copies:
        if rel in plan.generated or rel.rsplit("/", 1)[-1] in QUANT_SIDECARS:
            continue
        plan.copies.append((ckpt.path / rel, rel))
    plan.notes += views[0].notes
    plan.notes.append(f"{plural(len(quantized), 'weight')} stored as MLX {bits}-bit affine, group {group} "
                      f"(mlx_lm.convert -q --q-bits {bits} --q-group-size {group})"
                      + (f"; {plural(len(kept), 'weight')} kept: width not a multiple of {group} "
                         f"({', '.join(kept[:3])}{', ...' if len(kept) > 3 else ''})" if kept else ""))
    if dropped:
        plan.notes.append(f"{plural(len(dropped), 'tensor')} not written, as mlx-lm's sanitize drops them "
                          f"({', '.join(dropped[:3])}{', ...' if len(dropped) > 3 else ''})")
    return plan
