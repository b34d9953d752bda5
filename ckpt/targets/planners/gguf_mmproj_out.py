"""`convert ./my-vlm --to gguf-f16 --mmproj`: a Hugging Face vision-language model folder's vision tower and
projector as the `mmproj` GGUF llama.cpp's multimodal tools load beside the text model's GGUF (`llama-mtmd-cli -m
model.gguf --mmproj mmproj.gguf`), as llama.cpp's `convert_hf_to_gguf.py --mmproj` writes it, streamed.

The reference is llama.cpp 0c1e57098 as vendored in llama-cpp-python 0.3.36: `MmprojModel` (conversion/base.py) and
its per-model classes, which are data and methods in `ckpt.families.llm.vision` (one module per class, through the
interface of `ckpt.families.llm.projector`). What it does, and so ckpt:

- which class: config.json's `architectures[0]` (a `vision_config.architectures[0]` where there is one), among
  `ckpt.families.llm.projectors.PROJECTORS`; a text-only model, or a VLM whose projector ckpt does not write, is
  refused by name. The hyperparameters are the whole config as transformers fills it in (`vision_config` read as
  it is, the text model's hidden size as `clip.vision.projection_dim`); preprocessor_config.json then
  processor_config.json give the image mean and deviation (and Gemma 3's image token count).
- tensors: each safetensors part in sorted order, names sorted within a part; the language model's left out
  (`filter_tensors`), the others named by gguf's MMPROJ table built for the vision layer count (`TensorNameMap`),
  after the class's own transforms (`modify_tensors`: q/k rows permuted, fused qkv split, Conv3D kernels split,
  norms + 1, ...). A name the table does not know is refused, as the reference raises "Can not map tensor".
- types (`prepare_tensors`): the class's forced type first (`tensor_force_quant`: patch embeddings F16 in an F16
  file and F32 otherwise, Gemma 3's input projection always F16, ...), but F32 for 1-D tensors and
  `*_norm.weight`; F32 for the always-F32 tensors (position embeddings) and names not ending in `.weight` when
  nothing is forced; the others in the outtype's type. `--to gguf-f16`, `-bf16`, `-f32`, `-q8_0` are `--outtype
  f16|bf16|f32|q8_0` (the reference's others: `auto`, which ckpt has the user spell out, and the ternary
  tq1_0/tq2_0, which ckpt does not write); a Q8_0 tensor whose rows are not a whole number of blocks is F16, as the reference falls back.
  Values go through float32 as there (one rounding).
- metadata: general.architecture `clip`, general.type `mmproj`, the model card keys of `gguf.Metadata.load`
  (`gguf_llm_out.model_card`, as for the text model), the class's `set_gguf_parameters` and
  general.quantization_version, through an in-memory `gguf.GGUFWriter` in the reference's order; ckpt adds
  `ckpt.version` and `ckpt.operation`. No tokenizer: a projector has none.

Checked first, where the reference takes them on trust or fails with a traceback: the vision config's values
(types and ranges), its layer count and width against the tensors, the preprocessor's mean and deviation.

Where ckpt writes what the reference does not (each in its vision module's docstring): a Pixtral projector (Mistral
3, Llava) gets the `v.token_embd.img_break` row the reference's class means to write and llama.cpp requires (the
reference filters the embedding out first, and llama.cpp refuses its file); a Gemma 3 saved by transformers 5
(`vision_tower.` without `vision_model.`) is read as Google's layout, where the reference cannot map the names.
"""

from __future__ import annotations

import copy

from ckpt import __version__
from ckpt.errors import CkptError
from ckpt.io.plan import OutFile, Plan
from ckpt.report import Report, plural

OUTTYPES = ("f32", "f16", "bf16", "q8_0")  # convert_hf_to_gguf.py --outtype, as --to gguf-<outtype>
# prepare_tensors' always-F32 tensors (gguf.MODEL_TENSOR names): the reference's list; those of the MMPROJ table apply
F32_TENSORS = ("FFN_GATE_INP", "FFN_GATE_INP_SHEXP", "POS_EMBD", "TOKEN_TYPES", "SSM_CONV1D", "SHORTCONV_CONV",
               "TIME_MIX_FIRST", "TIME_MIX_W1", "TIME_MIX_W2", "TIME_MIX_DECAY_W1", "TIME_MIX_DECAY_W2",
               "TIME_MIX_LERP_FUSED", "POSNET_NORM1", "POSNET_NORM2", "V_ENC_EMBD_POS", "A_ENC_EMBD_POS",
               "ALTUP_CORRECT_COEF", "ALTUP_PREDICT_COEF", "SSM_CONV1D_Q", "SSM_CONV1D_K", "SSM_CONV1D_V",
               "INDEXER_PROJ")
SKIPPED = (".attention.masked_bias", ".attention.bias", ".rotary_emb.inv_freq")  # prepare_tensors: "we don't need these"
PREPROCESSOR_FILES = (("preprocessor_config.json", "media_proc_cfg"), ("processor_config.json", "image_processor"))


def _gguf():
    """The gguf package with the types it lacks added (`ckpt.io.ggml_types.gguf_package`: Q2_0)."""
    from ckpt.io.ggml_types import gguf_package

    return gguf_package()


def check_options(opts, mix) -> None:
    """The GGUF target's checks of `--mmproj` (before the input is read): an outtype the reference has for it."""
    if mix.name not in OUTTYPES:
        raise CkptError(f"--mmproj with --to gguf-{mix.name}: llama.cpp's converter writes a projector as "
                        f"{', '.join('gguf-' + t for t in OUTTYPES)} only (its --outtype choices)")
    from ckpt.targets.planners.gguf_quant_flags import given

    for flag in (["--pure"] if opts.pure else []) + given(opts):
        raise CkptError(f"{flag} does not apply to --mmproj (the projector's types are the converter's)")


def plan_mmproj(ckpt, views, mix, report: Report, operation: str) -> Plan:
    """The projector GGUF of an HF vision-language model folder (module docstring)."""
    vis, x = _export(ckpt, mix)
    sources, skipped = _sources(vis, x, views[0], ckpt.components[0])
    vis.check(x, [(g, t) for g, t, _ in sources])
    outs, counts, fellback = _outputs(vis, x, sources, mix, report, ckpt.components[0])
    fields = _fields(vis, x, sources, operation)
    notes = []
    if skipped:
        notes.append(f"{plural(len(skipped), 'tensor')} outside the vision tower and projector left out (e.g. "
                     f"{skipped[0]!r}): convert without --mmproj for the text model")
    notes += x.notes
    notes.append(f"GGUF mmproj ({vis.name}), {mix.label} (llama.cpp's convert_hf_to_gguf.py --mmproj rules): {counts}")
    if fellback:
        notes.append(f"{plural(fellback, 'tensor')} written F16 instead of Q8_0 (rows not a whole number of 32-value "
                     "blocks), as llama.cpp's converter falls back")
    return Plan(single_file=True, files=[OutFile("", {}, outs, "gguf", fields=fields)], notes=notes,
                busy_stage="compute" if mix.quantized else None)


def _architecture(cfg: dict) -> str | None:
    """get_model_architecture for --mmproj: `architectures[0]`, a vision_config's own where it has one."""
    def first(v):
        return v[0] if isinstance(v, list) and v and isinstance(v[0], str) else None

    arch = first(cfg.get("architectures"))
    vision = cfg.get("vision_config")
    if isinstance(vision, dict) and first(vision.get("architectures")) is not None:
        arch = first(vision["architectures"])
    return arch


def _export(ckpt, mix):
    """The vision class of the folder and its context (MmprojModel.__init__ and the class's own)."""
    from ckpt.families.llm.projector import BLOCK_KEYS, VisionExport, check_value
    from ckpt.families.llm.projectors import PROJECTORS
    from ckpt.families.llm.text import load_config, quiet

    gguf = _gguf()
    if len(ckpt.components) != 1:
        raise CkptError(f"{ckpt.spec}: --mmproj reads one Hugging Face model folder; this has "
                        f"{len(ckpt.components)} components")
    comp = ckpt.components[0]
    if any(f.kind == "gguf" for f in comp.files):
        raise CkptError(f"{comp.where}: --mmproj writes a projector from the Hugging Face folder of a vision-language "
                        "model, not from a GGUF")
    root = ckpt.path if ckpt.kind != "file" else ckpt.path.parent
    folder = root / comp.subdir
    where = folder / "config.json"
    if comp.config is None:
        raise CkptError(f"{folder}: no config.json beside the weights; --mmproj needs the model's config (its "
                        "architecture and vision_config)")
    hf_arch = _architecture(comp.config)
    vis = PROJECTORS.get(hf_arch)
    if vis is None:
        raise CkptError(f"{folder}: --mmproj: {hf_arch or 'a model without architectures'} has no vision projector "
                        f"ckpt writes (supported: {', '.join(PROJECTORS)})")
    if not isinstance(comp.config.get("vision_config"), dict):
        raise CkptError(f"{where}: no vision_config object (the vision tower's hyperparameters --mmproj writes)")
    with quiet():
        cfg = load_config(folder, comp.config)
    for key in ("llm_config", "lm_config", "language_config"):  # ModelBase.load_hparams' renames
        if key in cfg:
            cfg["text_config"] = cfg[key]
    text = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else {}
    text = {**cfg, **text}
    n_embd = check_value(text.get("hidden_size", text.get("n_embd", 0)), f"{where}: text_config.hidden_size", "int")
    vision = copy.deepcopy(cfg.get("vision_config"))
    if not isinstance(vision, dict):
        raise CkptError(f"{where}: no vision_config object (the vision tower's hyperparameters --mmproj writes)")
    key = next((k for k in BLOCK_KEYS if k in vision), None)
    if key is None:
        raise CkptError(f"{where}: vision_config has none of {', '.join(BLOCK_KEYS)} (the vision layer count)")
    n_block = check_value(vision[key], f"{where}: vision_config.{key}", "int")
    table = gguf.get_tensor_name_map(gguf.MODEL_ARCH.MMPROJ, n_block)
    x = VisionExport(comp.where, folder, where, cfg, vision, _preprocessor(folder), n_embd, n_block, table, mix.ftype)
    vis.prepare(x)
    return vis, x


def _preprocessor(folder) -> dict:
    """MmprojModel.__init__: preprocessor_config.json (media_proc_cfg moved up), then processor_config.json
    (image_processor moved up) over it."""
    from ckpt.families.llm.tokenizer_files import read_json

    out: dict = {}
    for name, inner in PREPROCESSOR_FILES:
        cfg = read_json(folder, name)
        if cfg is None:
            continue
        if isinstance(cfg.get(inner), dict):
            cfg = {**cfg, **cfg[inner]}
        out = {**out, **cfg}
    return out


def _block(name: str) -> int | None:
    """prepare_tensors' block id: the first number-like part of the name."""
    return next((int(p) for p in name.split(".") if p.isdecimal()), None)


def _sources(vis, x, view, comp):
    """The GGUF tensors in the reference's order: (GGUF name, tensor, the HF name the class saw); and the tensors
    the class never reads."""
    sources, skipped = [], []
    for name in sorted(view.tensors, key=lambda n: (view.tensors[n].home or "", n)):
        kept = vis.keeps(x, name)
        if kept is None:
            skipped.append(name)
            continue
        if kept.endswith(SKIPPED):
            continue
        t = view.tensors[name]
        if not t.dtype.is_floating_point:
            raise CkptError(f"{comp.where}: tensor {name!r} is {t.dtype}, not floating point; llama.cpp's converter "
                            "writes float weights only")
        outs = vis.tensors(x, kept, t)
        if not outs:  # read and left out by the class (LlavaVisionModel: the language model's)
            skipped.append(name)
        sources += [(g, out, kept) for g, out in outs]
    if not sources:
        raise CkptError(f"{comp.where}: no vision tensors ({vis.name} reads none of the {len(view.tensors)}); nothing "
                        "was written")
    seen: set[str] = set()
    for g, _, _ in sources:
        if g in seen:
            raise CkptError(f"{comp.where}: two tensors map to GGUF name {g!r}")
        seen.add(g)
    return sources, skipped


def _always_f32(gname: str, bid: int | None) -> bool:
    """prepare_tensors' match_model_tensor_name over its always-F32 list, for the MMPROJ architecture."""
    gguf = _gguf()
    known = gguf.MODEL_TENSORS[gguf.MODEL_ARCH.MMPROJ]
    for key in F32_TENSORS:
        k = getattr(gguf.MODEL_TENSOR, key, None)
        if k is None or k not in known:
            continue
        template = gguf.TENSOR_NAMES[k]
        if "{bid}" in template:
            if bid is not None and gname == template.format(bid=bid) + ".weight":
                return True
        elif bid is None and gname == template + ".weight":
            return True
    return False


def _outputs(vis, x, sources, mix, report: Report, comp):
    """Each tensor's type (module docstring) and its output tensor, in the file's order; the type counts said in
    the summary and how many Q8_0 tensors fell back to F16."""
    from ckpt.targets.planners.gguf_out import out_tensor

    T = _gguf().GGMLQuantizationType
    base = mix.default
    casters: dict = {}
    outs, summary, fellback = [], {}, 0
    for gname, t, kept in sources:
        shape = tuple(t.shape)
        forced = vis.force_type(x, kept, gname)
        if len(shape) <= 1 or gname.endswith("_norm.weight"):
            tname, why = "F32", "1-D or norm"
        elif forced is None and (_always_f32(gname, _block(kept)) or
                                 gname[-7:] not in (".weight", ".lora_a", ".lora_b")):
            tname, why = "F32", "kept F32"
        elif forced is not None:
            tname, why = forced, "the converter's choice"
        else:
            tname, why = base, "outtype"
        if tname == "Q8_0" and shape[-1] % 32:
            tname, why = "F16", "Q8_0 fallback"
            fellback += 1
        outs.append(out_tensor(gname, t, int(T[tname]), shape, report, casters))
        summary[(tname, why)] = summary.get((tname, why), 0) + 1
    counts = ", ".join(f"{n} {label} ({why})" for (label, why), n in sorted(summary.items(), key=lambda kv: -kv[1]))
    return outs, counts, fellback


def _fields(vis, x, sources, operation: str):
    """The key-values in the reference's order (ModelBase.prepare_metadata with MmprojModel's type and
    parameters)."""
    from ckpt.families.llm.text import quiet
    from ckpt.io.gguf_writer import from_gguf_writer, string
    from ckpt.targets.planners.gguf_llm_out import model_card

    gguf = _gguf()
    with quiet():
        w = gguf.GGUFWriter(path=None, arch=gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.MMPROJ])
        w.add_type(gguf.GGUFType.MMPROJ)
        model_card(w, x.folder, [(g, t) for g, t, _ in sources])
        vis.parameters(w, x)
        w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    return from_gguf_writer(w) + [string("ckpt.version", __version__), string("ckpt.operation", operation)]
