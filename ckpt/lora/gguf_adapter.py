"""`ckpt lora convert ADAPTER --format gguf --base HF_FOLDER [--save-dtype fp32|fp16|bf16]`: a LoRA as the
llama.cpp adapter GGUF that `convert_lora_to_gguf.py --base HF_FOLDER --outtype f32|f16|bf16` writes (llama.cpp
0c1e57098 as llama-cpp-python 0.3.36 vendors it), for the architectures `convert --to gguf-*` writes
(`ckpt.families.llm.architectures.EXPORTS`).

Why through the base's architecture: llama.cpp adds `scale * B (A x)` to the product with the model tensor named
like the adapter pair (`blk.0.attn_q.weight.lora_a` / `.lora_b` -> `blk.0.attn_q.weight`), so the factors must be
named and transformed exactly as the base's converter named and transformed that weight. The reference passes a
`LoraTorchTensor` (A, B) through its model class's `modify_tensors`; ckpt passes a `LoraWeight` (the weight's
shape, holding the module's factors in the weight's row view: delta = up @ down, a linear layer's B and A)
through the architecture's `LLMArch.tensors` and carries each transform it wraps around the weight over to the
factors as the reference's tensor does (the weight's rows are up's rows):

- renamed only: the factors as stored (byte copies where the type stays);
- q/k rows permuted for llama.cpp's RoPE (`HeadRowsPermuted`), a row slice (`RowSlice`): the rows of up;
- a layer's experts stacked (`Stacked`): the A's stacked [E, r, in], the B's [E, out, r], written when the
  layer's last expert module is reached (one rank for all, as the reference's torch.stack needs);
- any other transform (a norm shift, a transpose, columns split ...) has no form on the factors: the
  architecture is refused for adapters in one line naming the transform, never written wrong.

A pair is `lora_a` = down [r, in], `lora_b` = up [out, r]; the token embedding's, which llama.cpp looks rows up in
(`llm_build_inp_embd`), is `lora_a` = up [vocab, r], `lora_b` = down^T [hidden, r]: for PEFT's `lora_embedding_A`
[r, vocab] / `_B` [hidden, r] that is A^T and B, as the reference writes them.

Modules are found on the base as the reference finds them (`NAME.weight` of the PEFT-stripped module name), else
through ckpt's key map as merge-lora finds them (a kohya-named file of an LLM, as `lora convert --format kohya`
writes one), whole weights only.

Types (prepare_tensors on `.lora_a` / `.lora_b` names): every factor in --save-dtype's type (fp32 F32, fp16 F16,
bf16 BF16), values through float32 where a factor is neither F16 nor F32 (one rounding, as there). Order: the
modules in the adapter's sorted key order (safetensors' `load_file`), each pair lora_a then lora_b.

Metadata (LoraModel.prepare_metadata): general.architecture, general.type `adapter`, adapter.type `lora`, the
`general.*` keys of gguf's `Metadata.load` over the adapter folder (PEFT's README.md model card; general.name
falls back to the base folder's name), `adapter.lora.alpha` (F32: adapter_config.json's lora_alpha),
`adapter.alora.invocation_tokens` where the config gives them (or its `invocation_string`, tokenized by the
base's tokenizer without its first token, as there), general.quantization_version; then ckpt's `ckpt.*` keys.

Scales: llama.cpp scales each pair by adapter.lora.alpha / rank. A module whose scale differs (PEFT's
alpha_pattern, use_rslora's alpha / sqrt(r), a kohya-style file's own alpha per module) gets the ratio folded into
its lora_b, with a note: the reference writes such modules unscaled, and llama.cpp would apply them at the wrong
strength.

Refused in one line, nothing written: no --base; a base that is not an HF LLM folder `convert --to gguf-*` writes;
a module whose weight the base does not have or has in another shape; a module llama.cpp's adapters have no form
for (DoRA, LoHa/LoKr/full, a lora_B bias, a Tucker mid, a fan_in_fan_out layer, a whole replaced tensor such as
PEFT's modules_to_save); a module on a tensor the architecture leaves out (Gemma 2's lm_head, as the reference
refuses it); an incomplete set of expert modules; --to-lora. Modules on a vision tower are left out with a warning
(the reference's filter_tensors drops them: a text adapter has no place for them); rank-0 modules likewise.
"""

from __future__ import annotations

import contextlib
import math
from collections import Counter
from pathlib import Path

from ckpt.lazy import numpy as np, torch

from ckpt import __version__
from ckpt.adapters.checks import alphas as check_alphas
from ckpt.adapters.kinds import make_adapter
from ckpt.errors import CkptError
from ckpt.families.llm.tensors import HeadRowsPermuted, Stacked
from ckpt.io.tensors import RowSlice, Tensor, Transposed
from ckpt.lora.common import LoraOptions, LoraReport, ModuleResult, nothing_left
from ckpt.lora.modules import open_lora
from ckpt.lora.operations import lora_convert_operation
from ckpt.report import listed, plural

# --save-dtype -> (GGML type of every factor, convert_lora_to_gguf.py --outtype)
TYPES = {"fp32": ("F32", "f32"), "fp16": ("F16", "f16"), "bf16": ("BF16", "bf16")}
PLAIN_ROLES = {"down", "up", "alpha"}
EMBEDDING_ROLES = {"emb_A", "emb_B", "alpha"}
WHY_NOT = {"mid": "a Tucker (lora_mid) module", "up_bias": "a module with a lora_B bias",
           "magnitude": "a DoRA module", "dora_scale": "a DoRA module"}


class LoraWeight(Tensor):
    """A base weight as one LoRA module changes it (the reference's `LoraTorchTensor`): the weight's shape and
    name, the module's factors in the weight's row view (delta = up [rows, r] @ down [r, cols]: a linear layer's
    lora_B and lora_A; a PEFT embedding's A^T and B^T). It only travels through an architecture's `tensors`, whose
    transforms `factors` then carries over to `up` and `down`; its values are never read."""

    row_align = 1

    def __init__(self, name: str, shape, up: Tensor, down: Tensor, module: str):
        self.name, self.shape, self.up, self.down, self.module = name, tuple(shape), up, down, module
        self.home = ""
        self.dtype = up.dtype if up.dtype == down.dtype else torch.float32  # the reference: both F32 where they differ

    def read(self, start, stop, device, scratch=None):
        raise CkptError(f"module {self.module!r}: the architecture computes with the values of {self.name!r}, "
                        "which a LoRA adapter does not have; llama.cpp's adapters cannot be made for it")


class Scaled(Tensor):
    """`base * factor` in float32, band by band: a module's own scale folded into its lora_b (module docstring)."""

    def __init__(self, base: Tensor, factor: float):
        self.base, self.factor, self.name, self.home = base, factor, base.name, base.home
        self.shape, self.row_align, self.dtype = tuple(base.shape), base.row_align, torch.float32

    def read(self, start, stop, device, scratch=None):
        return self.base.read(start, stop, device, scratch).to(torch.float32) * self.factor


def factors(arch, gname: str, t: Tensor) -> tuple[Tensor, Tensor]:
    """(up, down) of the GGUF tensor `gname` the architecture made as `t` from `LoraWeight`s: its transforms
    carried over to the factors as the reference's LoraTorchTensor carries them (module docstring)."""
    if isinstance(t, LoraWeight):
        return t.up, t.down
    kind = type(t)
    if kind is HeadRowsPermuted:
        up, down = factors(arch, gname, t.base)
        return HeadRowsPermuted(up, t.head), down
    if kind is RowSlice:
        up, down = factors(arch, gname, t.base)
        return RowSlice(up, t.start, t.start + t.rows, f"{gname}.up"), down
    if kind is Stacked:
        pairs = [factors(arch, gname, p) for p in t.parts]
        ranks = sorted({up.shape[-1] for up, _ in pairs})
        if len(ranks) > 1:
            raise CkptError(f"{gname}: the expert modules stacked into it have ranks {ranks[0]} and {ranks[-1]}; "
                            "llama.cpp stacks the experts' factors into one tensor, which needs one rank")
        return Stacked(f"{gname}.up", [u for u, _ in pairs]), Stacked(f"{gname}.down", [d for _, d in pairs])
    raise CkptError(f"{gname}: llama.cpp's {arch.arch} converter makes it with a transform ({kind.__name__}) that "
                    "a LoRA's factors cannot take as convert_lora_to_gguf.py applies it; --format gguf does not "
                    f"write {arch.arch} adapters for this tensor")


def pair(gname: str, up: Tensor, down: Tensor) -> tuple[Tensor, Tensor]:
    """(lora_a, lora_b) as llama.cpp reads them: down and up (lora_a [r, in], lora_b [out, r]); for the token
    embedding, which llama.cpp looks rows up in (`llm_build_inp_embd`), up [vocab, r] and down^T [hidden, r]."""
    if gname.endswith("token_embd.weight"):
        return up, transposed(down)
    return down, up


def transposed(t: Tensor) -> Tensor:
    """t^T, unwrapping a transpose rather than stacking two (a stored PEFT factor stays a byte copy)."""
    return t.base if type(t) is Transposed else Transposed(t)


def _weights(t: Tensor) -> list[LoraWeight]:
    """The LoraWeights a planned tensor is made of (for the per-module lines)."""
    if isinstance(t, LoraWeight):
        return [t]
    if isinstance(t, Stacked):
        return [w for p in t.parts for w in _weights(p)]
    base = getattr(t, "base", None)
    return _weights(base) if isinstance(base, Tensor) else []


def convert_gguf(spec: str, out, opts: LoraOptions, *, base: str | None = None, to_lora: int | None = None,
                 report: LoraReport | None = None) -> tuple[Path, LoraReport]:
    """The adapter GGUF of `spec` for the base `base` (module docstring); returns (output path, report)."""
    from ckpt.io.output import check_target
    from ckpt.io.plan import OutFile, Plan
    from ckpt.run import check_gguf_output, default_output, output_path, write

    report = report or LoraReport()
    if base is None:
        raise CkptError("--format gguf: give --base HF_FOLDER, the Hugging Face model folder the adapter was trained "
                        "on (llama.cpp names and transforms an adapter's tensors as its architecture's)")
    if to_lora is not None:
        raise CkptError("--to-lora: not with --format gguf (a llama.cpp adapter holds plain LoRA factors; convert "
                        "LoHa/LoKr modules with --format peft --to-lora R first)")
    opts.check(rank_required=False)
    alpha = check_alphas(opts.alphas, 1)[0]
    check_gguf_output(out, "--format gguf")
    gtype, outtype = TYPES[opts.save_dtype]
    with contextlib.ExitStack() as stack:
        ckpt, view, arch, x = _open_base(base, stack)
        f = open_lora(spec, alpha, report)
        stack.callback(f.close)
        if f.unknown:
            raise CkptError(f"{spec}: {plural(len(f.unknown), 'key')} {'is' if len(f.unknown) == 1 else 'are'} no "
                            f"adapter part (e.g. {f.unknown[0]!r}); a llama.cpp adapter holds LoRA factors only")
        config, card = _peft_config(f)
        alpha_g = _global_alpha(spec, f, config)
        sources = _sources(spec, f, view, arch, x, alpha_g, base, report, _parameter_modules(config))
        nothing_left(spec, sources, report)
        outs, planned = _outputs(sources, gtype, report)
        op = lora_convert_operation(spec, opts, base, to_lora)
        fields = _fields(arch, x, f.spec, config, card, alpha_g, planned) + _ckpt_fields(op)
        plan = Plan(single_file=True, files=[OutFile("", {}, outs, "gguf", fields=fields)],
                    notes=[f"llama.cpp {arch.arch} LoRA adapter (convert_lora_to_gguf.py --outtype {outtype}): "
                           f"{plural(len(outs), 'tensor')} {gtype}, adapter.lora.alpha {alpha_g:g}"])
        derived = default_output(spec, Path(spec).expanduser(), f"{gtype}-LoRA", folder=False, ext=".gguf")
        out_path = output_path(out, derived, plan)
        inputs = f.inputs + ckpt.inputs
        check_target(out_path, inputs, opts.overwrite, True, dry_run=opts.dry_run, fmt="gguf")
        report.finish("would write" if opts.dry_run else "wrote")
        path = write(plan, out_path, inputs=inputs, report=report, desc="lora convert", device=torch.device("cpu"),
                     overwrite=opts.overwrite, dry_run=opts.dry_run, quiet=opts.quiet)
    return path, report


# -- the base ---------------------------------------------------------------------------------------------------

def _open_base(base: str, stack):
    """The base folder opened, its architecture and Export as `convert --to gguf-*` reads them (no tokenizer
    needed: an adapter holds no vocabulary)."""
    from ckpt.io.checkpoint import open_checkpoint
    from ckpt.quant.view import logical_view
    from ckpt.targets.planners.gguf_llm_out import export_context

    ckpt = stack.enter_context(open_checkpoint(base))
    if len(ckpt.components) != 1:
        raise CkptError(f"--base {base}: has {len(ckpt.components)} model components, not one Hugging Face LLM "
                        "folder (config.json and its weights)")
    comp = ckpt.components[0]
    if any(fl.kind == "gguf" for fl in comp.files):
        raise CkptError(f"--base {base}: a GGUF; pass the Hugging Face folder it was made from (its config.json "
                        "decides the adapter's names, as for convert_lora_to_gguf.py --base)")
    view = logical_view(comp)
    arch, x, _ = export_context(ckpt, view, tokenizer=False)
    return ckpt, view, arch, x


# -- the modules ------------------------------------------------------------------------------------------------

def _peft_config(f) -> tuple[dict, Path | None]:
    """(adapter_config.json, the adapter folder) of a PEFT folder input; ({}, None) for a single LoRA file (the
    reference reads only folders: no model card then)."""
    from ckpt.io.small_inputs import CONFIG_LIMIT, load_json_object

    folder = f.weights.parent
    cfg = folder / "adapter_config.json"
    if f.weights.name.startswith("adapter_model.") and cfg.is_file():
        return load_json_object(cfg, limit=CONFIG_LIMIT), folder
    return {}, None


def _global_alpha(spec: str, f, config: dict) -> float:
    """adapter.lora.alpha: adapter_config.json's lora_alpha (the reference's); for a file without one, the alpha
    most of its modules have."""
    if config:
        a = config.get("lora_alpha")
        if isinstance(a, bool) or not isinstance(a, (int, float)) or not math.isfinite(a):
            raise CkptError(f"{spec}: adapter_config.json: lora_alpha is {str(a)[:40]}, not the finite number "
                            "llama.cpp's adapter scale is made of")
        return float(a)
    found = Counter(a for m in f.modules.values() if (a := m.alpha()) is not None)
    return float(found.most_common(1)[0][0]) if found else 0.0


def _module_order(f) -> list:
    """The modules in the reference's order: by their first stored key, keys sorted (safetensors' load_file)."""
    return sorted(f.modules.values(), key=lambda m: min(m.keys))


def _weight_of(spec: str, m, view, keymap) -> str | None:
    """The base tensor a module changes: `NAME.weight` for the module's own name or its PEFT-stripped spelling
    (the reference's get_base_tensor_name); else the whole weight ckpt's key map places it on, as merge-lora
    would (a kohya-named file: `lora_unet_model_layers_0_self_attn_q_proj`). None where nothing matches."""
    for name in m.lookup_names:
        if name + ".weight" in view.tensors:
            return name + ".weight"
    for name in m.lookup_names:
        found = keymap().targets(name)
        if len(found) == 1 and found[0].rows is None and found[0].transform is None and found[0].part is None:
            return found[0].key
        if found:
            raise CkptError(f"{spec}: module {m.name!r} lands on part of {found[0].key!r} (rows of a fused weight, "
                            "or through a transform), which a llama.cpp adapter pair cannot say")
    return None


def _refuse_kind(spec: str, m, adapter) -> None:
    """A module llama.cpp's adapters have no form for, in one line."""
    if m.kind == "replace":
        raise CkptError(f"{spec}: module {m.name!r} replaces the whole weight (PEFT modules_to_save or a saved "
                        "base layer); a llama.cpp adapter holds only LoRA factors (merge it with ckpt merge-lora)")
    if m.kind != "lora":
        raise CkptError(f"{spec}: module {m.name!r} is {m.kind}; a llama.cpp adapter holds only plain LoRA factors "
                        "(lora convert --format peft --to-lora R turns it into one)")
    extra = sorted(set(m.parts) - (EMBEDDING_ROLES if "emb_A" in m.parts else PLAIN_ROLES))
    if extra or getattr(adapter, "dora", None) is not None:
        why = WHY_NOT.get(extra[0], f"a module with a {extra[0]} part") if extra else "a DoRA module"
        raise CkptError(f"{spec}: module {m.name!r} is {why}, which llama.cpp's LoRA adapters cannot hold")
    if m.fan_in_fan_out:
        raise CkptError(f"{spec}: module {m.name!r} is stored transposed (fan_in_fan_out), a layer llama.cpp's "
                        "LoRA adapters have no form for")


def _parameter_modules(config: dict) -> tuple[str, ...]:
    """The module paths of PEFT's `target_parameters` (LoRAs on parameters rather than layers: `mlp.experts` of
    `mlp.experts.gate_up_proj`)."""
    params = config.get("target_parameters")
    if not isinstance(params, list):
        return ()
    return tuple(p.rpartition(".")[0] for p in params if isinstance(p, str) and "." in p)


def _on_parameter(m, paths: tuple[str, ...], view) -> bool:
    """Whether module `m` is PEFT's LoRA on one of `paths`' parameters (`...mlp.experts`, or
    `...mlp.experts.base_layer` where one module has several) of a module the base has (its tensors under it)."""
    for name in m.lookup_names:
        while name.endswith(".base_layer"):
            name = name[: -len(".base_layer")]
        targeted = any(name == p or name.endswith("." + p) for p in paths)
        if targeted and any(k.startswith(name + ".") for k in view.tensors):
            return True
    return False


def _sources(spec, f, view, arch, x, alpha_g: float, base: str, report: LoraReport, banks: tuple = ()) -> list:
    """[(GGUF name, lora_a, lora_b)] in the file's order: every module placed on its base weight and passed
    through the architecture's transforms. `banks`: the module paths of PEFT's `target_parameters`, whose LoRAs
    on a fused parameter (transformers 5's expert banks) have no adapter pair in llama.cpp."""
    from functools import cache

    from ckpt.adapters.keymap import build_keymap

    keymap = cache(lambda: build_keymap({n: tuple(t.shape) for n, t in view.tensors.items()}))
    missing, vision, folded, copies = [], [], [], []
    weights = []
    for m in _module_order(f):
        if m.kind == "replace" and all(".base_layer." in k for k in m.keys):
            copies.append(m.keys[0])  # PEFT's copy of a targeted embedding / lm_head: the base's own weight
            continue
        adapter = make_adapter(m)
        _refuse_kind(spec, m, adapter)
        stored = _weight_of(spec, m, view, keymap)
        if stored is None:
            missing.append(m.name)
            continue
        name = arch.source_name(stored)  # the reference's filter_tensors
        if name is None:
            vision.append(m.name)
            continue
        if adapter.rank == 0 or not adapter.rows or not adapter.cols:  # changes nothing (llama.cpp divides by rank)
            report.noop.append(m.name)
            continue
        weights.append((m, adapter, stored, name))
    on_bank = [m.name for m in f.modules.values() if m.name in missing and _on_parameter(m, banks, view)]
    if on_bank:
        raise CkptError(f"{spec}: module {on_bank[0]!r} is a PEFT target_parameters LoRA on a parameter that is no "
                        f"2-D weight of the base {base} (a fused expert bank, transformers 5's MoE layers); "
                        "llama.cpp's adapters have no pair for it (convert_lora_to_gguf.py cannot name it either)")
    if missing:
        raise CkptError(f"{spec}: {plural(len(missing), 'module')} target{'s' * (len(missing) == 1)} a weight the "
                        f"base {base} does not have (e.g. {missing[0]!r}); nothing written (is it the model the "
                        "adapter was trained on?)")
    if copies:
        report.note(f"{plural(len(copies), 'saved base layer')} (PEFT's copy of a targeted embedding or lm_head) left "
                    f"out, as convert_lora_to_gguf.py leaves {'it' if len(copies) == 1 else 'them'}: {listed(copies)}")
    if vision:
        report.warn(f"{plural(len(vision), 'module')} on parts the text model's GGUF does not hold (a vision tower, "
                    f"a projector) left out, as convert_lora_to_gguf.py leaves them: {listed(vision)}")
    out = []
    for m, adapter, stored, name in weights:
        if arch.leaves_out(name):
            raise CkptError(f"{spec}: module {m.name!r} changes {name!r}, which llama.cpp's {arch.arch} model does "
                            "not have (its converter leaves it out); convert_lora_to_gguf.py refuses such an adapter")
        lw = _lora_weight(spec, m, adapter, view.tensors[stored], name)
        scale, rank = adapter.scale, adapter.rank
        if not math.isfinite(scale):
            raise CkptError(f"{spec}: module {m.name!r} has the scale {scale} (alpha {m.alpha()}); nothing written")
        gguf_scale = alpha_g / rank if alpha_g else 1.0  # llama.cpp's llama_adapter_lora_weight::get_scale
        if abs(scale / gguf_scale - 1.0) > 1e-6:
            lw.up, lw.dtype = Scaled(lw.up, scale / gguf_scale), torch.float32
            folded.append(m.name)
        for gname, t in arch.tensors(x, name, lw):
            a, b = pair(gname, *factors(arch, gname, t))
            out.append((gname, a, b, _weights(t)))
    arch.finish(x)
    if folded:
        report.note(f"{plural(len(folded), 'module')} with a scale other than adapter.lora.alpha {alpha_g:g} / rank "
                    "(alpha_pattern, use_rslora or an alpha of its own): the scale folded into lora_b, as llama.cpp "
                    f"applies one alpha (convert_lora_to_gguf.py drops it): {listed(folded)}")
    return out


def _lora_weight(spec, m, adapter, weight: Tensor, name: str) -> LoraWeight:
    """The module's factors in the weight's row view, checked against the base weight's shape."""
    shape = tuple(weight.shape)
    if "emb_A" in m.parts:  # PEFT embedding: A [r, vocab], B [hidden, r]: delta = A^T B^T
        a, b = m.parts["emb_A"], m.parts["emb_B"]
        want = (a.shape[1], b.shape[0]) if len(a.shape) == 2 and len(b.shape) == 2 else None
        lw = None if want != shape else LoraWeight(name, shape, Transposed(a), Transposed(b), m.name)
    else:
        a, b = m.parts["down"], m.parts["up"]
        want = (b.shape[0], a.shape[1]) if len(a.shape) == 2 and len(b.shape) == 2 else None
        lw = None if want != shape else LoraWeight(name, shape, b, a, m.name)
    if lw is None:
        got = "x".join(map(str, want)) if want else f"factors {list(a.shape)} / {list(b.shape)}"
        raise CkptError(f"{spec}: module {m.name!r} changes a {got} weight, but the base's {name} is "
                        f"{'x'.join(map(str, shape))} (is --base the model the adapter was trained on?)")
    return lw


# -- the file ---------------------------------------------------------------------------------------------------

def _outputs(sources, gtype: str, report: LoraReport):
    """The output tensors (lora_a then lora_b of each pair, every one in the outtype's type) and (name, shape)
    of each for the parameter count; the per-module lines."""
    from ckpt.targets.planners.gguf_out import out_tensor

    import gguf

    T = gguf.GGMLQuantizationType
    casters: dict = {}
    outs, planned, seen = [], [], set()
    for gname, a, b, weights in sources:
        for suffix, t in ((".lora_a", a), (".lora_b", b)):
            name = gname + suffix
            if name in seen:
                raise CkptError(f"two adapter tensors named {name!r}")
            seen.add(name)
            if not t.dtype.is_floating_point:
                raise CkptError(f"tensor {t.name!r} is {t.dtype}, not floating point; an adapter's factors are floats")
            outs.append(out_tensor(name, t, int(T[gtype]), tuple(t.shape), report, casters))
            planned.append((name, tuple(t.shape)))
        for w in weights:
            rows, cols = w.shape[:2]
            report.modules.append(ModuleResult(w.module, (rows, cols), w.up.shape[-1], min(rows, cols), 0.0, 0.0,
                                               note=f"-> {gname}"))
    return outs, planned


def _fields(arch, x, spec: str, config: dict, folder: Path | None, alpha_g: float, planned):
    """The key-values in the reference's order (LoraModel: ModelBase.prepare_metadata with its set_type and
    set_gguf_parameters), through an in-memory gguf.GGUFWriter as `convert --to gguf-*` makes them."""
    from contextlib import nullcontext

    import gguf

    from ckpt.families.llm.text import quiet
    from ckpt.io.gguf_writer import from_gguf_writer
    from ckpt.io.small_inputs import read_text
    from ckpt.targets.planners import gguf_vocab

    with quiet():
        counter = gguf.GGUFWriter(path=None, arch=arch.arch)  # GGUFWriter.get_total_parameter_count's own rule
        for name, shape in planned:
            counter.add_tensor_info(name, shape, np.dtype(np.float32), 0, raw_dtype=gguf.GGMLQuantizationType.F32)
        total = counter.get_total_parameter_count()[0]
        if folder is not None:
            for name in ("README.md", "config.json", "generation_config.json"):
                if (folder / name).exists() or (folder / name).is_symlink():
                    read_text(folder / name)  # a regular file of a bounded size, before gguf reads it
        w = gguf.GGUFWriter(path=None, arch=arch.arch)
        with gguf_vocab.read_by(folder, "gguf's model card reader") if folder is not None else nullcontext():
            meta = gguf.Metadata.load(None, folder, None, total)
        if meta.name is None:
            meta.name = x.folder.name
        if meta.size_label is None and total > 0:
            meta.size_label = gguf.size_label(*counter.get_total_parameter_count())
        w.add_type(gguf.GGUFType.ADAPTER)
        w.add_string(gguf.Keys.Adapter.TYPE, "lora")
        meta.set_gguf_meta_model(w)
        w.add_float32(gguf.Keys.Adapter.LORA_ALPHA, alpha_g)
        tokens = _alora_tokens(spec, config, x.folder)
        if tokens:
            w.add_key_value(gguf.Keys.Adapter.ALORA_INVOCATION_TOKENS, tokens, gguf.GGUFValueType.ARRAY,
                            gguf.GGUFValueType.UINT32)
        w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    return from_gguf_writer(w)


def _alora_tokens(spec: str, config: dict, base_folder: Path) -> list[int]:
    """aLoRA's invocation tokens: the config's `alora_invocation_tokens`, or its `invocation_string` tokenized by
    the base's tokenizer without the first token (the reference's off-by-one for older aLoRAs); [] for a LoRA."""
    tokens = config.get("alora_invocation_tokens")
    text = config.get("invocation_string")
    if not tokens and text:
        if not isinstance(text, str):
            raise CkptError(f"{spec}: adapter_config.json: invocation_string is {str(text)[:40]}, not a string")
        from transformers import AutoTokenizer

        from ckpt.targets.planners import gguf_vocab

        with gguf_vocab.read_by(base_folder, "transformers' AutoTokenizer"):
            tokens = AutoTokenizer.from_pretrained(base_folder)(text)["input_ids"][1:]
    if not tokens:
        return []
    if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 2 ** 32
                                               for t in tokens):
        raise CkptError(f"{spec}: adapter_config.json: alora_invocation_tokens is {str(tokens)[:40]}, not a list of "
                        "token ids")
    return tokens


def _ckpt_fields(operation: str):
    from ckpt.io.gguf_writer import string

    return [string("ckpt.version", __version__), string("ckpt.operation", operation)]
