"""`convert --to gguf-q4_k_m|q8_0|...|f16`: a diffusion model as the GGUF ComfyUI-GGUF loads.

ComfyUI-GGUF (city96) makes its files in two steps: tools/convert.py writes an F16/BF16 GGUF, then its
patched llama.cpp `llama-quantize` quantizes it. ckpt writes the final file in one pass, tensor by tensor,
choosing each tensor's type as those two steps would:

1. convert.py: the model's own names (a `model.diffusion_model.` / `model.` prefix stripped, `net.`
   when every key has it), `general.architecture`, `general.quantization_version`, `general.file_type`.
   Unquantized tensors are BF16 for a BF16 model, else F16 (`--to gguf-f16` / `gguf-bf16` choose);
   1-D tensors, tensors of at most 1024 values and the family's F32 list (`keys_hiprec`) stay F32 (ckpt
   applies this to F16 sources too: F16 -> F32 is exact); tensors of more than 4 dims (Wan /
   HunyuanVideo patch embeddings) are F32, as its fix_5d_tensors.py adds them. SD1/SDXL tensors whose
   last dim is not a multiple of 256 are stored as rows of 256 with `comfy.gguf.orig_shape.<name>`.
2. llama-quantize with ComfyUI-GGUF's lcpp.patch: a tensor is quantized when its name ends in `weight`,
   it has exactly 2 dims (leading 1s not counted, as ggml counts), and the family does not keep it
   (its input and output layers). Its type is the mix's (`ckpt.targets.planners.gguf_mixes.ImageMix`: the patch's
   `img_tensor_get_type`, with its F16 fallback for K-type rows that are not a multiple of 256). A row whose
   length is not a multiple of a legacy type's block (32) stays in the unquantized type.

Where the rules live: each family module's `gguf=GGUFStorage(arch, f32, reshape, ignore)` and its
`high_precision[ORIGINAL]` (the layers kept unquantized; the comfy_quant writer reads the same list) in
`ckpt/families/` (`high_precision` of the only layout for families with one naming: HiDream, Qwen-Image).
Every architecture ComfyUI-GGUF writes has its module there (AuraFlow and Cosmos carry only recognition
and these two fields); this module holds the two steps, no family's facts. Rules from ComfyUI-GGUF's
auto_convert branch (Nov 2025).

Values are quantized from their fp32 values (`ckpt.quant.gguf.encode`: gguf's quantizers for the legacy types,
ckpt's for the K-quants and IQ4; ComfyUI-GGUF's route first rounds F32 sources to F16; for BF16 and F16 sources
the result is the same), band by band (blocks never cross a row).

Two edges where llama.cpp's own tools have no sensible output, and what ckpt does instead:
- a tensor without values (a dim of 0, `[256, 0]`): convert.py keeps it F32 (at most 1024 values), and ckpt keeps
  it there. llama-quantize would divide by its row length (SIGFPE for rows of 0 values), gguf's quantize and
  dequantize cannot reshape an empty row, while ggml's loader and gguf's reader read an empty F32 tensor. A
  planner that gives such a tensor a block type anyway (the LLM exporter, whose reference crashes on it) is
  refused in one line (`out_tensor`).
- a finite value too large for its block's fp16 scale (|x| beyond about 65504 * the type's largest quant, or a
  NaN/Inf in the block): llama.cpp writes an Inf/NaN scale and the whole block decodes as NaN/Inf. ckpt writes
  the same bytes and counts those values per tensor (`nonfinite_decoded`, besides `nonfinite_input`).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from ckpt.lazy import torch

from ckpt import __version__
from ckpt.cast import Caster
from ckpt.targets.planners.gguf_mixes import NEVER_QUANTIZED, ImageMix, Mix
from ckpt.dtypes import FP8, is_float, short_name
from ckpt.errors import CkptError
from ckpt.io.plan import OutFile, OutTensor, Plan
from ckpt.io.tensors import Tensor
from ckpt.quant.gguf import BlockRows
from ckpt.report import Report, plural

QUANTIZATION_THRESHOLD = 1024  # convert.py: tensors of at most this many values stay F32
REARRANGE_THRESHOLD = 512
MAX_NAME = 127  # ComfyUI-GGUF's patched ggml (GGML_MAX_NAME 128)
MAX_DIMS = 4


@dataclass(frozen=True)
class Rules:
    """ComfyUI-GGUF's rules for one model: regexes on names (model prefix stripped)."""

    arch: str  # general.architecture
    f32: tuple[str, ...] = ()  # kept F32 (its convert.py keys_hiprec)
    keep: tuple[str, ...] = ()  # left unquantized: the input and output layers (its lcpp.patch)
    reshape: bool = False  # SD1/SDXL: rows of 256 + comfy.gguf.orig_shape
    ignore: tuple[str, ...] = ()  # left out (its convert.py keys_ignore)
    where: str = ""  # where the rule is written, for the plan's note


def _gguf():
    """The gguf package with the types it lacks added (`ckpt.io.ggml_types.gguf_package`: Q2_0)."""
    from ckpt.io.ggml_types import gguf_package

    return gguf_package()


def _matches(name: str, patterns) -> bool:
    return any(re.search(p, name) for p in patterns)


def rules_for(names: list[str], shapes: dict) -> Rules:
    """The rules of the model these names (prefix stripped) are: its family module's `gguf` and
    `high_precision` fields."""
    from ckpt import families

    m = families.detect(names, shapes)
    if m is not None and m.family.gguf is not None:
        # the original layout, or the only one (HiDream, Qwen-Image files use diffusers' names)
        layout = families.ORIGINAL if families.ORIGINAL in m.family.layouts else m.layout
        if m.layout != layout:
            raise CkptError(f"this is the diffusers layout of a {m.label}; ComfyUI-GGUF loads the original layout: "
                            "run `ckpt convert SRC --layout original` first")
        g = m.family.gguf
        arch = g.arch_for(m.family_id)
        if arch is not None:
            return Rules(arch, f32=g.f32, keep=m.family.high_precision.get(layout, ()), reshape=g.reshape,
                         ignore=g.ignore, where=f"the {m.family.family_id} family module (ckpt/families)")
    raise CkptError(f"not a diffusion model ComfyUI-GGUF knows (its architectures: {', '.join(known_archs())}); "
                    "an LLM is exported from its Hugging Face folder (config.json, tokenizer)")


def known_archs() -> list[str]:
    """ComfyUI-GGUF's architecture names the family modules declare, once each, in family order."""
    from ckpt import families

    out: dict[str, None] = {}
    for fam in families.all_families():
        if fam.gguf is not None:
            arch = fam.gguf.arch
            out.update(dict.fromkeys([arch] if isinstance(arch, str) else arch.values()))
    return list(out)


def strip_prefix(names: list[str]) -> tuple[str, list[str]]:
    """convert.py's prefix rule: `model.diffusion_model.` or `model.` if any key has it (keys without it
    are left out), `net.` if every key has it. Returns (prefix, keys left out)."""
    for pfx in ("model.diffusion_model.", "model."):
        if any(n.startswith(pfx) for n in names):
            return pfx, [n for n in names if not n.startswith(pfx)]
    if names and all(n.startswith("net.") for n in names):
        return "net.", []
    return "", []


def ggml_n_dims(shape) -> int:
    """ggml's count of dims: trailing size-1 dims of its (innermost-first) order, leading ones in torch's,
    do not count."""
    dims = list(shape)
    while len(dims) > 1 and dims[0] == 1:
        dims.pop(0)
    return len(dims)


@dataclass
class Choice:
    ggml_type: int
    shape: tuple[int, ...]  # stored shape
    reshaped: bool
    why: str  # for the plan's summary
    fallback: str | None = None  # the type the mix gave, where rows that are not whole blocks changed it


def choose(name: str, t: Tensor, fam: Rules, m: Mix, img: ImageMix) -> Choice:
    """Each tensor's GGUF type and stored shape, by ComfyUI-GGUF's two steps (module docstring)."""
    T = _gguf().GGMLQuantizationType
    shape, n = tuple(t.shape), t.numel
    natural = t.natural_dtype
    if not m.quantized:
        base = T[m.default]
    else:
        base = T.BF16 if natural == torch.bfloat16 else T.F16
    if not is_float(t.dtype):
        return Choice(_plain_type(name, t.dtype), shape, False, "integer")
    if len(shape) > MAX_DIMS:
        return Choice(T.F32, shape, False, "more than 4 dims")
    t1, why = base, "unquantized"
    if len(shape) <= 1 or n <= QUANTIZATION_THRESHOLD:
        t1, why = T.F32, "1-D or small"
    elif _matches(name, fam.f32):
        t1, why = T.F32, "kept F32 for the family"
    reshaped = False
    if (fam.reshape and len(shape) > 1 and n >= REARRANGE_THRESHOLD and n % 256 == 0 and shape[-1] % 256):
        shape, reshaped = (n // 256, 256), True
    if not m.quantized:
        return Choice(t1, shape, reshaped, why)
    if not name.endswith("weight") or ggml_n_dims(shape) != 2:
        return Choice(t1, shape, reshaped, why if t1 == T.F32 else "not a 2-D weight")
    if _matches(name, fam.keep):
        return Choice(t1, shape, reshaped, "input/output layer kept unquantized")
    if any(s in name for s in NEVER_QUANTIZED):
        return Choice(t1, shape, reshaped, "never quantized by llama.cpp")
    if img.leaves(name):
        return Choice(t1, shape, reshaped, "--leave-output-tensor")
    if n == 0:  # module docstring: nothing to quantize, and llama-quantize cannot (it divides by the row length)
        return Choice(t1, shape, reshaped, "no values to quantize")
    chosen, why, fell = img.type_of(name, shape[-1])
    if fell is not None:
        return Choice(T[chosen], shape, reshaped, why, fallback=fell)
    blk = _gguf().GGML_QUANT_SIZES[T[chosen]][0]
    if shape[-1] % blk:
        return Choice(t1, shape, reshaped, f"{chosen} fallback: rows of {shape[-1]} are not a multiple of {blk}",
                      fallback=chosen)
    return Choice(T[chosen], shape, reshaped, why)


def _plain_type(name: str, dtype: torch.dtype) -> int:
    from ckpt.io.ggml_types import plain_types

    for t, d in plain_types().items():
        if d == dtype:
            return int(t)
    raise CkptError(f"tensor {name!r} is {short_name(dtype)}, which GGUF has no type for")


# Every fp16 block scale of every GGUF block type is at most about the largest |value| of its block (K-quant super-
# block scales are sub-block scales divided by 15..128; Q4_1/Q5_1 store the block's minimum itself): a band whose
# values all lie within fp16's range cannot decode as NaN/Inf, and needs no further look (`_nonfinite`).
FP16_MAX = 65504.0


def _nonfinite(v: torch.Tensor, q: torch.Tensor, ggml_type: int, row_len: int) -> tuple[int, int]:
    """(NaN/Inf input values, finite input values that decode as NaN/Inf) of one band `v` (rows of `row_len`)
    encoded as `q`. One min/max pass over the band (NaN propagates through it); only a band with a NaN/Inf or a
    value beyond fp16's range is decoded (gguf's dequantize, what every reader of the file gets) to count what its
    overflowed or NaN block scales turned into NaN/Inf."""
    if not v.numel():
        return 0, 0
    lo, hi = torch.aminmax(v)
    if -FP16_MAX <= float(lo) and float(hi) <= FP16_MAX:
        return 0, 0
    from ckpt.quant.gguf import dequantize

    finite = torch.isfinite(v).reshape(-1).cpu()
    decoded = dequantize(q.reshape(-1), ggml_type, row_len)
    return int((~finite).sum()), int((finite & ~torch.isfinite(decoded)).sum())


def _block_cast(name: str, ggml_type: int, row_len: int, report: Report, importance=None,
                stored_rows_per_row: int = 1, total_rows: int = 0):
    """(cast, positional) of one GGUF block tensor: each band encoded (`ckpt.quant.gguf.encode`), its NaN/Inf
    counted. `importance` (--imatrix): float32 [n_mat, row_len], one row for a 2-D tensor, one per expert for a
    3-D one (`total_rows` stored rows in all); a band of a 3-D tensor takes its experts' rows, so that cast is
    positional (`start`: the band's first source row, of `stored_rows_per_row` stored rows each), as llama-quant.cpp
    passes `imatrix + (row / nrows_per_expert) * n_per_row`."""
    from ckpt.quant.gguf import encode

    qw_all = None if importance is None else torch.from_numpy(importance).float()
    n_mat = 0 if qw_all is None else qw_all.shape[0]
    per_mat = total_rows // n_mat if n_mat else 0

    def cast(x, buffers, start: int = 0):
        v = x.float() if x.dtype in FP8 else x
        rows = v.reshape(-1, row_len)
        qw = None
        if n_mat == 1:
            qw = qw_all[0]
        elif n_mat > 1:
            first = start * stored_rows_per_row
            qw = qw_all[torch.arange(first, first + rows.shape[0]) // per_mat]
        try:
            q = encode(rows, ggml_type, qw)
        except CkptError as e:  # a kernel's refusal (values where ggml's search aborts) names no tensor
            raise CkptError(f"tensor {name!r}: {e}") from None
        bad, decoded_bad = _nonfinite(v, q, ggml_type, row_len)
        report.count("nonfinite_input", name, bad)
        report.count("nonfinite_decoded", name, decoded_bad)
        return q

    return cast, n_mat > 1


def out_tensor(name: str, t: Tensor, ggml_type: int, shape: tuple, report: Report, casters: dict,
               importance=None) -> OutTensor:
    """The output of one GGUF tensor stored as `ggml_type` with stored `shape`: plain types cast (one Caster per
    dtype, shared through `casters`), block types encoded band by band in whole stored rows, with the tensor's
    importance (`QuantFlags.importance`) where given."""
    from ckpt.io.ggml_types import plain_types

    plain = plain_types().get(ggml_type)
    if plain is None and not t.numel:  # module docstring: convert.py keeps these F32 (`choose`)
        raise CkptError(f"tensor {name!r} has no values (shape {list(t.shape)}): llama.cpp cannot quantize it to "
                        f"{_gguf().GGMLQuantizationType(ggml_type).name} (llama-quantize divides by its row length); "
                        "--to gguf-f32, gguf-f16 or gguf-bf16 write it")
    if plain is not None:
        if is_float(t.dtype):
            cast = casters.setdefault(plain, Caster(plain, report)).band(name)
        else:
            cast = (lambda x, b: x)
        return OutTensor(name, plain, shape, t, cast, stateless=True)
    from ckpt.quant.gguf import can_encode

    if importance is None and not can_encode(ggml_type):  # IQ1_S, IQ2_XXS, IQ2_XS: ggml asserts an importance
        raise CkptError(f"tensor {name!r}: {_gguf().GGMLQuantizationType(ggml_type).name} needs an importance "
                        "matrix entry for it (--imatrix), as llama-quantize does; it has none")
    src = BlockRows(t, shape[-1])
    per_row = math.prod(src.shape[1:]) // shape[-1] if len(src.shape) > 1 else 1
    cast, positional = _block_cast(name, ggml_type, shape[-1], report, importance, per_row,
                                   math.prod(shape) // shape[-1])
    return OutTensor(name, torch.uint8, shape, src, cast, gguf_type=ggml_type, stateless=True, positional=positional)


def fallback_note(fallbacks: dict) -> str | None:
    """The summary line of the tensors whose rows did not fit the mix's type: `{(from, to): count}`."""
    if not fallbacks:
        return None
    total = sum(fallbacks.values())
    parts = ", ".join(f"{n} {a} -> {b}" for (a, b), n in sorted(fallbacks.items()))
    return f"{plural(total, 'tensor')} fell back to another type (rows not a whole number of blocks): {parts}"


def plan_gguf(ckpt, views, m: Mix, flags, report: Report, operation: str) -> Plan:
    """The whole GGUF output (one file) for SRC's single component."""
    from ckpt.io.gguf_writer import int32_array, string, uint32

    gguf = _gguf()
    T = gguf.GGMLQuantizationType
    if len(ckpt.components) != 1:
        subs = ", ".join(c.subdir or "." for c in ckpt.components)
        raise CkptError(f"{ckpt.spec}: a GGUF file holds one model; this has {len(ckpt.components)} components "
                        f"({subs}): pass the folder of the one to convert")
    comp, view = ckpt.components[0], views[0]
    names = list(view.tensors)
    prefix, dropped = strip_prefix(names)
    keep = [n for n in names if n.startswith(prefix)]
    try:
        fam = rules_for([n[len(prefix):] for n in keep], {n[len(prefix):]: tuple(view.tensors[n].shape) for n in keep})
    except CkptError as e:
        raise CkptError(f"{comp.where}: {e}") from None
    if not m.image:
        raise CkptError(f"--to gguf-{m.name}: ComfyUI-GGUF does not quantize image models to {m.label} "
                        f"({m.not_for_images}); choose a K-quant such as gguf-q4_k_m")
    notes = []
    if dropped:
        notes.append(f"{plural(len(dropped), 'tensor')} outside {prefix!r} left out (e.g. {dropped[0]!r}): "
                     "a ComfyUI-GGUF file holds the diffusion model only")
    casters: dict = {}
    outs, orig_shapes, summary, fallbacks = [], [], {}, {}
    ignored = []
    kw = flags.mix_kwargs()
    kw.pop("imatrix_names")
    img = ImageMix(m, names=[n[len(prefix):] for n in keep], **kw)
    quantized = []
    for full in keep:
        name, t = full[len(prefix):], view.tensors[full]
        if _matches(name, fam.ignore):
            ignored.append(name)
            continue
        if len(name) > MAX_NAME:
            raise CkptError(f"{comp.where}: tensor name {name!r} is longer than {MAX_NAME} characters, the most "
                            "ComfyUI-GGUF's ggml accepts")
        c = choose(name, t, fam, m, img)
        label = T(c.ggml_type).name
        summary.setdefault((label, c.why), 0)
        summary[(label, c.why)] += 1
        if c.fallback is not None:
            fallbacks[(c.fallback, label)] = fallbacks.get((c.fallback, label), 0) + 1
        if c.reshaped:
            orig_shapes.append(int32_array(f"comfy.gguf.orig_shape.{name}", t.shape))
        importance = None
        if c.ggml_type not in (T.F32, T.F16, T.BF16):
            quantized.append(name)
            importance = flags.importance(name, c.shape, label, report)
        outs.append(out_tensor(name, t, c.ggml_type, c.shape, report, casters, importance))
    flags.check_used(quantized)
    notes += flags.notes()
    for unused in img.unused():
        report.warn(f"{unused} gave no tensor its type (nothing matched, or an earlier rule took them)")
    if ignored:
        notes.append(f"{plural(len(ignored), fam.arch + ' tensor')} ComfyUI-GGUF ignores left out "
                     f"(e.g. {ignored[0]!r})")

    fields = [string("general.architecture", fam.arch),
              uint32("general.quantization_version", gguf.GGML_QUANT_VERSION),
              uint32("general.file_type", gguf.LlamaFileType[m.ftype]),
              *orig_shapes,
              *flags.fields(),
              string("ckpt.version", __version__),
              string("ckpt.operation", operation)]
    counts = ", ".join(f"{n} {label} ({why})" for (label, why), n in sorted(summary.items(), key=lambda kv: -kv[1]))
    notes.append(f"GGUF {m.label} {fam.arch} (rules: {fam.where} and ComfyUI-GGUF's image mix): {counts}")
    fell = fallback_note(fallbacks)
    if fell:
        notes.append(fell)
    if ckpt.copies:
        notes.append(f"{plural(len(ckpt.copies), 'other file')} ({', '.join(ckpt.copies[:3])}...) not copied: a GGUF is "
                     "one file")
    # the compute stage encodes (gguf's quantize on every core it has, ckpt.quant.gguf); the reader only reads
    return Plan(single_file=True, files=[OutFile("", {}, outs, "gguf", fields=fields)], notes=notes,
                busy_stage="compute" if m.quantized else None)


def default_suffix(target_name: str) -> str:
    """ComfyUI-GGUF / llama.cpp file naming: `model-Q8_0.gguf`, `model-BF16.gguf` (the target's suffix)."""
    from ckpt import targets

    t = targets.get(target_name)
    return t.suffix if t is not None else target_name
