"""`convert ./my-llm --to gguf-<type>`: a Hugging Face causal LM folder as the GGUF llama.cpp runs, as llama.cpp's
`convert_hf_to_gguf.py` writes it (then, for K-quant and IQ mixes, as `llama-quantize` would type it), streamed.

The reference is llama.cpp 0c1e57098 as vendored in llama-cpp-python 0.3.36 (`convert_hf_to_gguf.py` and its
`conversion/` package: `TextModel`, `LlamaModel`, `Qwen2Model`, `Qwen3Model`, `Gemma2Model`, `Gemma3Model`,
`Phi3MiniModel`; which one an architecture is, is data in `ckpt.families.llm`). What it does, and so ckpt:

- tensors: each safetensors part in sorted order, names sorted within a part (gguf's `SafetensorsLocal`), each named
  by gguf's tensor-name table (`TensorNameMap.get_name`); a name the table does not know is an error (the reference
  raises "Can not map tensor"), never a dropped key. `*.rotary_emb.inv_freq` (old checkpoints) is left out, as there.
  Llama's rope type `llama3` adds `rope_freqs.weight` (its factors, F32) first (`generate_extra_tensors`).
- llama: q_proj / k_proj rows (weights and biases) permuted per head for llama.cpp's RoPE (`LlamaModel.permute`,
  k with the kv head count), band by band in whole heads (`HeadRowsPermuted`, the mirror of the reader's).
- tied embeddings: no `lm_head.weight` in the files, no `output.weight` in the GGUF (llama.cpp ties them itself).
- Gemma 2 / 3: every `*norm.weight` + 1 (`Shifted`: in float32 for a BF16 model, in F16 for an F16 one, as
  there), Gemma 2's lm_head left out, Gemma 3's token_embd cut to the tokenizer's size; their own
  `set_gguf_parameters` (softcapping, sliding window). Phi-3: its own parameters, fused qkv / gate_up kept fused
  (llama.cpp splits them), a long-context model's `rope_factors_long/short.weight` and attention factor.
- mixture of experts (Mixtral as `llama`, Qwen3-MoE): each layer's per-expert matrices stacked into one
  `blk.N.ffn_{gate,up,down}_exps.weight` [experts, rows, cols] (`Stacked`, read a few experts per band), written
  where the reference writes them (when the layer's last expert tensor is reached, in its projection order).
  Checkpoints with fused expert tensors (`mlp.experts.gate_up_proj`) are refused by name.
- types (`prepare_tensors`): F32 for 1-D tensors, `*_norm.weight`, names not ending in `.weight` and the
  reference's always-F32 list (MoE routers, position embeddings); the others in the mix's type. `--to gguf-f16`,
  `-bf16`, `-f32` and `-q8_0` are `--outtype f16|bf16|f32|q8_0`. A quantizing mix starts from what
  `--outtype auto` gives (BF16 for a BF16 model, else F16: what one would feed `llama-quantize`) and
  `ckpt.families.llm.quant_mix.llm_types` (llama.cpp's `llama_tensor_get_type`) gives each tensor its final type.
  Values go through float32 as there (BF16 sources are upcast before rounding to F16: one rounding either way).
  A mix `convert_hf_to_gguf.py` has no outtype for (K-quants, IQ4, q4_0...) is the file `llama-quantize` makes of
  the `--outtype auto` file: tensors in its order (block number, then name) and `general.quantization_version`,
  `general.file_type` moved last as it sets them; from a BF16 or F16 model the bytes are its bytes, from an F32
  one ckpt quantizes the F32 values where that route would round them to F16 first.
- metadata (`TextModel.set_gguf_parameters`, `LlamaModel.set_gguf_parameters`): the hyperparameters as
  `AutoConfig.from_pretrained(folder).to_dict()` gives them (defaults filled in by transformers, as the reference
  reads them; config.json as it is where transformers is not installed), rope scaling, `general.file_type` (the
  mix's `gguf.LlamaFileType`), `general.quantization_version`; the `general.*` model-card keys from gguf's own
  `Metadata.load` (name, size label, ...); the tokenizer from `ckpt.targets.planners.gguf_vocab`. The `add_*` calls go to
  an in-memory `gguf.GGUFWriter` in the reference's order, so keys and value types are gguf's own; ckpt adds
  `ckpt.version` and `ckpt.operation`.

Refused in one line before anything is written: an architecture outside `ckpt.families.llm.architectures.EXPORTS`, a folder
without config.json or a tokenizer, a BPE pre-tokenizer llama.cpp does not know, a tensor with no GGUF name. The
inputs are checked first, where the reference takes them on trust: config.json's values for type, range and
agreement with the tensors (`ckpt.families.llm.config_keys`, on the file as written and again on the values
transformers fills in), every tokenizer file (`gguf_vocab.check_tokenizer`), and the token list written against
the embedding rows, so that what is written is a GGUF llama.cpp loads.
"""

from __future__ import annotations

import math
import re
from contextlib import nullcontext
from dataclasses import replace
from pathlib import Path

from ckpt.lazy import torch

from ckpt import __version__
from ckpt.errors import CkptError
from ckpt.families.llm import config_keys
from ckpt.families.llm.arch import Export, LLMArch
from ckpt.families.llm.architectures import EXPORTS
from ckpt.families.llm.tensors import HeadRowsPermuted, Packed, Shifted
from ckpt.families.llm.text import load_hparams, quiet, rope_parameters, text_merged
from ckpt.io.plan import OutFile, OutTensor, Plan
from ckpt.io.tensors import Tensor
from ckpt.report import Report, plural

# prepare_tensors' always-F32 tensors that these architectures can have (gguf.MODEL_TENSOR names)
F32_TENSORS = ("FFN_GATE_INP", "FFN_GATE_INP_SHEXP", "POS_EMBD", "TOKEN_TYPES", "SSM_CONV1D", "ALTUP_CORRECT_COEF",
               "ALTUP_PREDICT_COEF")
PLAIN = ("F32", "F16", "BF16")
CONVERT_OUTTYPES = ("f32", "f16", "bf16", "q8_0")  # convert_hf_to_gguf.py --outtype; other mixes are llama-quantize's


def ggml_shape(shape: tuple) -> tuple:
    """The shape llama-quantize's file gives a tensor: gguf_add_tensor stores ggml_n_dims dimensions, so size-1
    dims at the front of the torch shape (ggml's trailing ones) go: Qwen3-Next's [1, hidden] shared-expert gate is
    [hidden] there."""
    i = 0
    while i < len(shape) - 1 and shape[i] == 1:
        i += 1
    return tuple(shape[i:])


def block_number(name: str) -> int:
    """llama.cpp's weight order key (llama_model_loader's weight_name_comparer): sscanf "blk.%d.", -1 outside."""
    m = re.match(r"blk\.(\d+)\.", name)
    return int(m.group(1)) if m else -1


def _gguf():
    """The gguf package with the types it lacks added (`ckpt.io.ggml_types.gguf_package`: Q2_0)."""
    from ckpt.io.ggml_types import gguf_package

    return gguf_package()


def _first_class(value) -> str | None:
    return value[0] if isinstance(value, list) and value and isinstance(value[0], str) else None


def _architecture(cfg: dict | None) -> str | None:
    """get_model_architecture: `architectures[0]`, a text_config's own where it has one (None where there is no
    list of class names)."""
    if not isinstance(cfg, dict):
        return None
    arch = _first_class(cfg.get("architectures"))
    text = cfg.get("text_config")
    if isinstance(text, dict) and _first_class(text.get("architectures")) is not None:
        arch = _first_class(text["architectures"])
    return arch


def applies(ckpt, views) -> bool:
    """An HF causal LM folder (its config.json names a `*ForCausalLM` / `*LMHeadModel` /
    `*ForConditionalGeneration` class, or its tensors are a Llama-style decoder's) or a llama.cpp LLM GGUF: the LLM
    exporter plans it, supported or not (an unsupported one is refused by name there, not taken for a diffusion
    model)."""
    if len(ckpt.components) != 1:
        return False
    comp = ckpt.components[0]
    if _gguf_llm_source(comp) is not None:
        return True
    arch = _architecture(comp.config)
    if arch is not None:
        return arch in EXPORTS or arch.endswith(("ForCausalLM", "LMHeadModel", "ForConditionalGeneration"))
    return any(re.match(r"(model\.)?layers\.\d+\.self_attn\.q_proj\.", n) for n in views[0].tensors)


def _gguf_llm_source(comp):
    """The GGUFHeader of a component that is one llama.cpp LLM GGUF (`blk.N.*` names), else None."""
    from ckpt.quant.gguf_llm import is_llm

    if len(comp.files) == 1 and comp.files[0].kind == "gguf" and is_llm(comp.files[0].gguf, comp.tensors):
        return comp.files[0].gguf
    return None


def _folder(ckpt) -> Path:
    comp = ckpt.components[0]
    root = ckpt.path if ckpt.kind != "file" else ckpt.path.parent
    return root / comp.subdir


def _f32_names(arch_enum, n_block: int) -> set[str]:
    gguf = _gguf()
    out = set()
    for key in F32_TENSORS:
        k = getattr(gguf.MODEL_TENSOR, key, None)
        if k is None or k not in gguf.MODEL_TENSORS[arch_enum]:
            continue
        name = gguf.TENSOR_NAMES[k]
        out.update(name.format(bid=b) + ".weight" for b in range(n_block)) if "{bid}" in name else \
            out.add(name + ".weight")
    return out


def _source_order(view, comp) -> list[str]:
    """The reference's tensor order: parts in sorted order, names sorted within each."""
    return sorted(view.tensors, key=lambda n: (view.tensors[n].home or "", n))


def _llm_types(mix, tensors, *, arch: str, n_layer: int, n_head: int, n_head_kv: int, n_expert: int, flags):
    from ckpt.families.llm.quant_mix import llm_types

    return llm_types(mix.ftype, tensors, arch=arch, n_layer=n_layer, n_head=n_head, n_head_kv=n_head_kv,
                     n_expert=n_expert, **flags.mix_kwargs())


def _warn_unused(flags, types, report: Report) -> None:
    """A --tensor-type / --output-tensor-type / --token-embedding-type that gave no tensor its type: a counted
    warning (llama.cpp says nothing of it)."""
    from ckpt.families.llm.quant_mix import unused_tensor_types

    unused = unused_tensor_types(flags.tensor_types, types)
    for flag, given in (("--output-tensor-type", flags.output_tensor_type),
                        ("--token-embedding-type", flags.token_embedding_type)):
        if given and not any(reason == flag or reason.startswith(flag + ":") for _, reason, _ in types):
            unused.append(flag)
    for u in unused:
        report.warn(f"{u} gave no tensor its type (nothing matched, or an earlier rule took them)")


def plan_gguf_llm(ckpt, views, mix, flags, report: Report, operation: str) -> Plan:
    """The whole single-file llama.cpp GGUF of an HF causal LM folder (module docstring)."""
    comp, view = ckpt.components[0], views[0]
    if (header := _gguf_llm_source(comp)) is not None:
        return plan_from_gguf(comp, header, view, mix, flags, report, operation)
    arch, x, stated = _export(ckpt, view)
    sources, skipped = _sources(arch, x, view, comp)
    outs, counts, fallbacks = _outputs(arch, x, sources, mix, flags, report, comp)
    if mix.name not in CONVERT_OUTTYPES:  # llama-quantize's file: its weights_map order
        sources = sorted(sources, key=lambda s: (block_number(s[0]), s[0]))
    fields, notes = _fields(arch, x, stated, sources, mix, report, operation, flags)
    if skipped:
        notes.append(f"{plural(len(skipped), 'tensor')} llama.cpp does not use left out (e.g. {skipped[0]!r})")
    notes += x.notes + flags.notes()
    if "output.weight" not in {g for g, _ in sources}:
        notes.append("no lm_head.weight: tied embeddings (llama.cpp uses token_embd.weight as the output layer)")
    notes.append(f"GGUF {arch.arch} LLM, {mix.label} (llama.cpp's convert_hf_to_gguf.py rules): {counts}")
    from ckpt.targets.planners.gguf_out import fallback_note

    if (fb := fallback_note(fallbacks)) is not None:
        notes.append(fb)
    return Plan(single_file=True, files=[OutFile("", {}, outs, "gguf", fields=fields)], notes=notes,
                busy_stage="compute" if mix.quantized else None)  # the encoders hold the work (ckpt.quant.gguf)


def _export(ckpt, view, tokenizer: bool = True) -> tuple[LLMArch, Export, dict]:
    """The architecture of the folder, its config checked and read as the reference reads it; refused in one line
    where the reference could not convert it (or would write a GGUF llama.cpp cannot load)."""
    from ckpt.targets.planners import gguf_vocab

    comp = ckpt.components[0]
    folder = _folder(ckpt)
    where = folder / "config.json"
    hf_arch = _architecture(comp.config)
    if comp.config is None:
        raise CkptError(f"{folder}: no config.json beside the weights; a llama.cpp GGUF is made from the model's "
                        "config (architecture, heads, RoPE): copy the model's config.json into the folder")
    for cfg in (comp.config, comp.config.get("text_config")):
        if isinstance(cfg, dict) and "architectures" in cfg and _first_class(cfg["architectures"]) is None:
            raise CkptError(f"{where}: architectures is {config_keys.show(cfg['architectures'])}, not a list of "
                            "model class names")
    if hf_arch is None:
        raise CkptError(f"{where}: has no architectures (the model class, which decides the GGUF architecture "
                        f"llama.cpp's converter writes)")
    arch = EXPORTS.get(hf_arch)
    if arch is None:
        raise CkptError(f"{folder}: architecture {hf_arch!r} cannot be written as a llama.cpp GGUF by ckpt (supported: "
                        f"{', '.join(EXPORTS)}); use llama.cpp's convert_hf_to_gguf.py")
    if tokenizer:  # a LoRA adapter's GGUF (`export_context`) holds no vocabulary
        gguf_vocab.check_tokenizer(folder)
    shapes = {s: tuple(t.shape) for n, t in view.tensors.items() if (s := arch.source_name(n)) is not None}
    stated = text_merged(comp.config)
    config_keys.check(stated, shapes, arch, str(where))  # before transformers' config class builds anything
    hparams = load_hparams(folder, comp.config)
    sizes = config_keys.check(hparams, shapes, arch, str(where), stated=stated)
    gguf = _gguf()
    arch_enum = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch.arch)
    x = Export(comp.where, folder, where, hparams, rope_parameters(hparams), sizes.blocks, sizes.heads,
               sizes.kv_heads, sizes.experts, gguf.get_tensor_name_map(arch_enum, sizes.blocks),
               tensor_shapes=shapes, tensors={s: view.tensors[n] for n in _source_order(view, comp)
                                              if (s := arch.source_name(n)) is not None})
    arch.check(x, hf_arch)
    return arch, x, stated


def export_context(ckpt, view, *, tokenizer: bool = True) -> tuple[LLMArch, Export, dict]:
    """(architecture, Export, config.json as stated) of an HF LLM folder, checked as `plan_gguf_llm` checks it: for
    other GGUF files made from the folder's architecture (`ckpt.lora.gguf_adapter`: a LoRA adapter, which holds no
    vocabulary, so `tokenizer=False` does not ask for one)."""
    return _export(ckpt, view, tokenizer=tokenizer)


def _sources(arch: LLMArch, x: Export, view, comp) -> tuple[list[tuple[str, Tensor]], list[str]]:
    """The GGUF tensors in the reference's order, with their names and (transformed) sources; and the HF tensors
    left out."""
    sources = list(arch.extra_tensors(x))
    skipped = []
    for stored in _source_order(view, comp):
        name = arch.source_name(stored)  # the reference's filter_tensors (a VLM's text model)
        if name is None or arch.leaves_out(name):
            skipped.append(stored)
            continue
        sources += arch.tensors(x, name, view.tensors[stored])
    arch.finish(x)
    seen: set[str] = set()
    for g, _ in sources:
        if g in seen:
            raise CkptError(f"{comp.where}: two tensors map to GGUF name {g!r}")
        seen.add(g)
    return sources, skipped


def _outputs(arch: LLMArch, x: Export, sources, mix, flags, report: Report, comp):
    """Each tensor's type (--outtype's, or auto's, first; then the mix's per-tensor rule) and its output tensor, in
    the file's order; the type counts said in the summary and the fallbacks."""
    from ckpt.targets.planners.gguf_out import out_tensor

    gguf = _gguf()
    T = gguf.GGMLQuantizationType
    f32_names = _f32_names(next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch.arch), x.n_block)
    big = next((t for _, t in sources if len(t.shape) >= 2), None)
    base = mix.default if mix.default in PLAIN else \
        ("BF16" if big is not None and big.natural_dtype == torch.bfloat16 else "F16")
    before = []
    for gname, t in sources:
        if not t.dtype.is_floating_point:
            raise CkptError(f"{comp.where}: tensor {t.name!r} is {t.dtype}, not floating point; llama.cpp's converter "
                            "writes float weights only")
        if isinstance(t, Packed):  # bytes the reference writes as they are (gpt-oss's MXFP4 experts): their type
            before.append((gname, tuple(t.shape), t.ggml_type))
            continue
        f32 = len(t.shape) <= 1 or gname.endswith("_norm.weight") or gname in f32_names or \
            gname[-7:] not in (".weight", ".lora_a", ".lora_b")
        before.append((gname, tuple(t.shape), "F32" if f32 else base))
    types = _llm_types(mix, before, arch=arch.arch, n_layer=x.n_block, n_head=x.n_head, n_head_kv=x.n_head_kv,
                       n_expert=x.n_expert, flags=flags)
    _warn_unused(flags, types, report)
    order = list(range(len(sources)))
    if mix.name not in CONVERT_OUTTYPES:  # llama-quantize's file: its weights_map order
        order.sort(key=lambda i: (block_number(sources[i][0]), sources[i][0]))
    casters: dict = {}
    outs, summary, fallbacks, quantized = [], {}, {}, []
    for i in order:
        (gname, t), (_, shape, _), (tname, why, fell) = sources[i], before[i], types[i]
        if mix.name not in CONVERT_OUTTYPES:
            shape = ggml_shape(shape)
        if isinstance(t, Packed) and (mix.name in CONVERT_OUTTYPES or tname == t.ggml_type):
            # convert_hf_to_gguf.py writes it in its own type whatever --outtype; a llama-quantize mix keeps it
            # where its rule gives that type, else quantizes its values (llama-quantize --allow-requantize)
            tname, why, fell = t.ggml_type, "as stored, repacked", False
            outs.append(OutTensor(gname, torch.uint8, shape, t.packed, gguf_type=int(T[tname])))
        else:
            outs.append(out_tensor(gname, t, int(T[tname]), shape, report, casters,
                                   flags.importance(gname, ggml_shape(tuple(t.shape)), tname, report)))
            if tname != before[i][2]:
                quantized.append(gname)
        summary[(tname, why)] = summary.get((tname, why), 0) + 1
        if fell:
            fallbacks[(mix.default, tname)] = fallbacks.get((mix.default, tname), 0) + 1
    flags.check_used(quantized)
    counts = ", ".join(f"{n} {label} ({why})" for (label, why), n in sorted(summary.items(), key=lambda kv: -kv[1]))
    return outs, counts, fallbacks


def _fields(arch: LLMArch, x: Export, stated: dict, sources, mix, report: Report, operation: str, flags):
    """The key-values, in the reference's order (ModelBase.prepare_metadata, TextModel.prepare_metadata), and the
    notes the architecture's parameters gave; the token count checked against the embedding rows."""
    from ckpt.io.gguf_writer import from_gguf_writer, string

    gguf = _gguf()
    with quiet():
        w = gguf.GGUFWriter(path=None, arch=arch.arch)
        arch.early_parameters(w, x)
        notes, n_tokens, vocab_file = _metadata(w, gguf, arch, x, mix, sources)
    embd = next((t for g, t in sources if g == "token_embd.weight"), None)
    if embd is not None and embd.shape and n_tokens != embd.shape[0]:
        raise CkptError(f"{vocab_file}: the tokenizer has {n_tokens} tokens but {embd.name} has {embd.shape[0]} rows; "
                        "llama.cpp needs one embedding row per token")
    for warning in config_keys.token_id_warnings(stated, n_tokens, str(x.config_path)):
        report.warn(warning)
    fields = from_gguf_writer(w)
    if mix.name not in CONVERT_OUTTYPES:  # llama-quantize sets these two last (gguf_set_val_u32 re-adds a key)
        last = ("general.quantization_version", "general.file_type")
        fields = [f for f in fields if f.key not in last] + [f for k in last for f in fields if f.key == k]
    fields += flags.fields()  # llama-quantize's kv_overrides, set after its own two
    fields += [string("ckpt.version", __version__),
               string("ckpt.operation", operation)]
    return fields, notes


def _metadata(w, gguf, arch: LLMArch, x: Export, mix, sources):
    """ModelBase.prepare_metadata + TextModel.prepare_metadata: the key-values after general.architecture; returns
    (notes, the number of tokens written, the tokenizer file they came from)."""
    from ckpt.targets.planners import gguf_vocab

    folder = x.folder
    w.add_type(gguf.GGUFType.MODEL)
    model_card(w, folder, sources)
    notes = arch.parameters(w, x, int(gguf.LlamaFileType[mix.ftype]))
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    n_tokens, vocab_file = gguf_vocab.set_vocab(w, arch.vocab, folder, x.hparams)
    return notes, n_tokens, vocab_file


def model_card(w, folder: Path, sources) -> None:
    """ModelBase.prepare_metadata's `general.*` model card keys (gguf's `Metadata.load` over the folder, its name
    and size label filled in from the planned tensors `sources`: (GGUF name, Tensor)); shared with the projector
    planner (`gguf_mmproj_out`), whose MmprojModel prepares them the same way."""
    from ckpt.targets.planners import gguf_vocab
    from ckpt.families.llm.tokenizer_files import read_json
    from ckpt.io.small_inputs import read_text

    gguf = _gguf()
    total, shared, expert, n_expert = _param_counts(sources)
    # gguf's Metadata reads generation_config.json and README.md itself: each read here first (a regular file of
    # a bounded size), the sampling defaults checked, and what its YAML model card reader raises said in one line
    if (gen := read_json(folder, "generation_config.json")) is not None:
        config_keys.check_generation(gen, str(folder / "generation_config.json"))
    card = folder / "README.md"
    if card.exists() or card.is_symlink():
        read_text(card)
    with gguf_vocab.read_by(card, "gguf's model card reader") if card.exists() else nullcontext():
        meta = gguf.Metadata.load(None, folder, None, total)
        if meta.name is None:
            meta.name = folder.name
        if meta.size_label is None and total > 0:
            meta.size_label = gguf.size_label(total, shared, expert, n_expert)
        meta.set_gguf_meta_model(w)


def _param_counts(sources) -> tuple[int, int, int, int]:
    """GGUFWriter.get_total_parameter_count over the planned tensors: (total, shared, expert, expert count)."""
    total = shared = expert = expert_sum = n_expert_tensors = 0
    for gname, t in sources:
        size = math.prod(t.shape)
        if "_exps." in gname and len(t.shape) >= 3:
            count = t.shape[-2 if ".bias" in gname else -3]
            expert += size // count
            expert_sum += count
            n_expert_tensors += 1
        else:
            shared += size
        total += size
    return total, shared, expert, (expert_sum // n_expert_tensors) if n_expert_tensors else 0


def _stored_of(v, stored) -> bool:
    """Whether the view's tensor `v` is the stored GGUF tensor unchanged: only the reader's own wrappers (its HF
    name, dequantized values, q/k rows unpermuted) between them; a merged or otherwise computed tensor is not."""
    from ckpt.quant.gguf import GGUFValues
    from ckpt.quant.gguf_llm import HeadRowsUnpermuted, HFNamed, NormUnshifted

    while True:
        if v is stored:
            return True
        if type(v) is GGUFValues:
            return v.stored is stored
        if type(v) not in (HFNamed, HeadRowsUnpermuted, NormUnshifted):
            return False
        v = v.base


def _header_int(header, key: str, default=None) -> int:
    v = header.value(key, default)
    if isinstance(v, list):  # per-layer values: llama.cpp's quantizer counts with the first layer's
        v = v[0] if v else default
    if v is None or isinstance(v, bool) or not isinstance(v, int):
        raise CkptError(f"{header.path}: metadata {key!r} is {v!r}, not the integer llama.cpp's quantizer needs")
    return v


def plan_from_gguf(comp, header, view, mix, flags, report: Report, operation: str) -> Plan:
    """`convert model-F16.gguf --to gguf-<mix>`, and merge-lora into a GGUF base: `llama-quantize` of a llama.cpp
    GGUF. Its metadata copied (tokenizer included) with `general.quantization_version` and `general.file_type`
    set last, as llama-quantize sets them; the tensors in its order (block, then name) and per-tensor types
    (`llm_types` from each stored type). A tensor the view leaves as stored and whose type stays is copied byte for
    byte; one the view changed (a merged LoRA) is taken from the view under its GGUF name (llama's q/k rows
    permuted back). Requantizing an already quantized tensor into another type is refused, as llama-quantize
    refuses it without --allow-requantize."""
    from ckpt.targets.planners.gguf_out import fallback_note, out_tensor
    from ckpt.io.gguf_writer import fields_from, string, uint32
    from ckpt.quant.gguf import GGUFValues, stored_output
    from ckpt.quant.gguf_llm import ARCHS

    gguf = _gguf()
    T = gguf.GGMLQuantizationType
    f = comp.files[0]
    arch = header.architecture
    K = gguf.Keys
    n_layer = _header_int(header, K.LLM.BLOCK_COUNT.format(arch=arch))
    n_head = _header_int(header, K.Attention.HEAD_COUNT.format(arch=arch))
    n_head_kv = _header_int(header, K.Attention.HEAD_COUNT_KV.format(arch=arch), n_head)
    n_expert = _header_int(header, K.LLM.EXPERT_COUNT.format(arch=arch), 0)
    permute = ARCHS[arch].rope_permute if arch in ARCHS else False
    shift = ARCHS[arch].norm_shift if arch in ARCHS else 0.0
    placed = set(view.anchors.values())
    # a tensor the reader rebuilt from several stored ones (gpt-oss's fused expert banks) has no place; unchanged
    # (the decoded view's own object), its stored tensors are taken as they are; changed, it is refused
    decoded = (view.origin or view).tensors
    extra = sorted(n for n in view.tensors if n not in placed and view.tensors[n] is not decoded.get(n))
    if extra:
        raise CkptError(f"{f.path}: tensor {extra[0]!r}, changed by the merge, is rebuilt from several of the GGUF's "
                        f"tensors (MLA's split kv_b, stacked experts, fused projections) and cannot be written back "
                        f"into them ({plural(len(extra), 'such tensor')}); merge into the Hugging Face folder instead "
                        f"(merge-lora HF_FOLDER LORA --to gguf-{mix.name}); nothing was written")
    names = sorted(f.names, key=lambda n: (block_number(n), n))  # llama-quantize's weights_map order
    sources, before = [], []
    for gname in names:
        stored = comp.tensors[gname]
        hf = view.anchors.get(gname)
        v = view.tensors.get(hf) if hf is not None else None
        if v is None or _stored_of(v, stored):
            src, changed = GGUFValues(stored, name=gname), False
        else:
            src, changed = v, True
            if permute and gname.endswith((".attn_q.weight", ".attn_q.bias", ".attn_k.weight", ".attn_k.bias")):
                src = HeadRowsPermuted(v, v.shape[0] // (n_head if ".attn_q." in gname else n_head_kv))
            if shift and gname.endswith("norm.weight"):  # Gemma's norms, shifted back as the converter stores them
                src = Shifted(src, shift)
        sources.append((gname, stored, src, changed))
        before.append((gname, tuple(stored.stored_shape), stored.type_name))
    types = _llm_types(mix, before, arch=arch, n_layer=n_layer, n_head=n_head, n_head_kv=n_head_kv,
                       n_expert=n_expert, flags=flags)
    _warn_unused(flags, types, report)
    casters: dict = {}
    outs, summary, fallbacks, copied, quantized = [], {}, {}, 0, []
    for (gname, stored, src, changed), (tname, why, fell) in zip(sources, types):
        if tname == stored.type_name and not changed:
            out = stored_output(stored)
            outs.append(replace(out, shape=ggml_shape(tuple(out.shape))))  # llama-quantize's dims (ggml_n_dims)
            copied += 1
        elif stored.quantized and tname != stored.type_name:
            raise CkptError(f"{f.path}: tensor {gname} is {stored.type_name}; requantizing it as {tname} loses "
                            f"precision twice (llama-quantize refuses it without --allow-requantize): write "
                            f"--to gguf-{mix.name} from the F16/BF16/F32 GGUF or the Hugging Face folder")
        else:
            shape = ggml_shape(tuple(stored.stored_shape))
            outs.append(out_tensor(gname, src, int(T[tname]), shape, report, casters,
                                   flags.importance(gname, shape, tname, report)))
            if tname != stored.type_name:
                quantized.append(gname)
        summary[(tname, why)] = summary.get((tname, why), 0) + 1
        if fell:
            fallbacks[(mix.default, tname)] = fallbacks.get((mix.default, tname), 0) + 1
    last = ("general.quantization_version", "general.file_type")
    fields = [x for x in fields_from(header) if x.key not in last and not x.key.startswith("ckpt.")]
    fields += [uint32("general.quantization_version", gguf.GGML_QUANT_VERSION),
               uint32("general.file_type", gguf.LlamaFileType[mix.ftype]),
               *flags.fields(),
               string("ckpt.version", __version__),
               string("ckpt.operation", operation)]
    counts = ", ".join(f"{n} {label} ({why})" for (label, why), n in sorted(summary.items(), key=lambda kv: -kv[1]))
    flags.check_used(quantized)
    notes = [f"GGUF {arch} LLM -> {mix.label} as llama-quantize types it: {counts}; {copied} copied as stored"]
    notes += flags.notes()
    if (fb := fallback_note(fallbacks)) is not None:
        notes.append(fb)
    return Plan(single_file=True, files=[OutFile("", {}, outs, "gguf", fields=fields)], notes=notes,
                busy_stage="compute" if mix.quantized else None)  # the encoders hold the work (ckpt.quant.gguf)
