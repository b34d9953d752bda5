"""`convert --to gguf-q8_0|q4_0|q4_1|q5_0|q5_1|bf16|f16`: a diffusion model as the GGUF ComfyUI-GGUF loads.

ComfyUI-GGUF (city96) makes its files in two steps: tools/convert.py writes an F16/BF16 GGUF, then its
patched llama.cpp `llama-quantize` quantizes it. ckpt writes the final file in one pass, tensor by tensor,
choosing each tensor's type as those two steps would:

1. convert.py: the model's own names (a `model.diffusion_model.` / `model.` prefix stripped, `net.`
   when every key has it), `general.architecture` from its key detection (flux, sd3, aura, hidream,
   cosmos, qwen_image, ltxv, hyvid, wan, sdxl, sd1, lumina2), `general.quantization_version`,
   `general.file_type`. Unquantized tensors are BF16 for a BF16 model, else F16 (`--to gguf-f16` /
   `gguf-bf16` choose); 1-D tensors, tensors of at most 1024 values and each family's `keys_hiprec`
   stay F32 (ckpt applies this to F16 sources too: F16 -> F32 is exact, and norms and biases read
   back the same); tensors of more than 4 dims (Wan / HunyuanVideo patch embeddings) are F32, as its
   fix_5d_tensors.py adds them. SD1/SDXL tensors whose last dim is not a multiple of 256 are stored as
   rows of 256 with `comfy.gguf.orig_shape.<name>`.
2. llama-quantize with ComfyUI-GGUF's lcpp.patch: a tensor is quantized when its name ends in `weight`,
   it has exactly 2 dims (leading 1s not counted, as ggml counts), and the family's rule does not keep
   it (input/output layers: for Flux `img_in.`, `txt_in.`, `time_in.`, `vector_in.`, `guidance_in.`,
   `final_layer.`, ...). A row whose length is not a multiple of the block size (32) stays in the
   unquantized type, as llama.cpp falls back.

Values are quantized from their fp32 values by `gguf.quants.quantize` (ComfyUI-GGUF's route first rounds
F32 sources to F16; for BF16 and F16 sources the result is the same), band by band (blocks never cross
a row). K-quants and IQ-quants have no encoder in gguf's Python package: refused by name.

The per-family rules below are ComfyUI-GGUF's (auto_convert branch, Nov 2025), kept in this one table.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch

from ckpt import __version__
from ckpt.cast import Caster
from ckpt.dtypes import FP8, is_float, short_name
from ckpt.errors import CkptError
from ckpt.io.plan import OutFile, OutTensor, Plan
from ckpt.io.tensors import Tensor
from ckpt.report import Report

TARGETS = {"gguf-q8_0": "Q8_0", "gguf-q4_0": "Q4_0", "gguf-q4_1": "Q4_1", "gguf-q5_0": "Q5_0", "gguf-q5_1": "Q5_1",
           "gguf-bf16": "BF16", "gguf-f16": "F16"}
QUANTIZATION_THRESHOLD = 1024  # convert.py: tensors of at most this many values stay F32
REARRANGE_THRESHOLD = 512
MAX_NAME = 127  # ComfyUI-GGUF's patched ggml (GGML_MAX_NAME 128)
MAX_DIMS = 4


@dataclass(frozen=True)
class Family:
    arch: str  # general.architecture
    detect: tuple[tuple[str, ...], ...]  # any one key set fully present
    banned: tuple[str, ...] = ()  # keys of a layout ComfyUI-GGUF refuses (the diffusers layout)
    f32: tuple[str, ...] = ()  # name substrings kept F32 (convert.py keys_hiprec)
    keep: tuple[str, ...] = ()  # name substrings llama-quantize leaves unquantized ("=name": exact name)
    reshape: bool = False  # SD1/SDXL: rows of 256 + comfy.gguf.orig_shape
    ignore: tuple[str, ...] = ()  # name substrings left out (convert.py keys_ignore)


_FLUX_KEEP = ("txt_in.", "img_in.", "time_in.", "vector_in.", "guidance_in.", "final_layer.")
FAMILIES = [
    Family("flux", (("single_transformer_blocks.0.attn.norm_k.weight",), ("double_blocks.0.img_attn.proj.weight",)),
           banned=("single_transformer_blocks.0.attn.norm_k.weight",),
           keep=_FLUX_KEEP + ("single_stream_modulation.", "double_stream_modulation_")),  # (Flux.2)
    Family("sd3", (("transformer_blocks.0.ff_context.net.0.proj.weight",), ("joint_blocks.0.x_block.attn.qkv.weight",)),
           banned=("transformer_blocks.0.ff_context.net.0.proj.weight",),
           keep=("final_layer.", "time_text_embed.", "context_embedder.", "t_embedder.", "y_embedder.",
                 "x_embedder.", "=proj_out.weight", "=pos_embed")),
    Family("aura", (("double_layers.3.modX.1.weight",),
                    ("joint_transformer_blocks.3.ff_context.out_projection.weight",)),
           banned=("joint_transformer_blocks.3.ff_context.out_projection.weight",),
           keep=("t_embedder.", "init_x_linear.", "=modF.1.weight", "=cond_seq_linear.weight", "=final_linear.weight",
                 "=positional_encoding", "=register_tokens")),
    Family("hidream", (("caption_projection.0.linear.weight", "double_stream_blocks.0.block.ff_i.shared_experts.w3.weight"),),
           f32=(".ff_i.gate.weight", "img_emb.emb_pos"),
           keep=("p_embedder.", "t_embedder.", "x_embedder.", "final_layer.", ".ff_i.gate.weight", "caption_projection.")),
    Family("cosmos", (("blocks.0.mlp.layer1.weight", "blocks.0.adaln_modulation_cross_attn.1.weight"),),
           f32=("pos_embedder",), ignore=("_extra_state", "accum_"),
           keep=("p_embedder.", "t_embedder.", "t_embedding_norm.", "x_embedder.", "pos_embedder.", "final_layer.")),
    Family("qwen_image", (("time_text_embed.timestep_embedder.linear_2.weight", "transformer_blocks.0.attn.norm_added_q.weight",
                           "transformer_blocks.0.img_mlp.net.0.proj.weight"),),
           keep=("img_in.", "txt_in.", "time_text_embed.", "proj_out.", "norm_out.")),
    Family("ltxv", (("adaln_single.emb.timestep_embedder.linear_2.weight", "transformer_blocks.27.scale_shift_table",
                     "caption_projection.linear_2.weight"),),
           f32=("scale_shift_table",),
           keep=("adaln_single.", "caption_projection.", "patchify_proj.", "proj_out.", "scale_shift_table")),
    Family("hyvid", (("double_blocks.0.img_attn_proj.weight", "txt_in.individual_token_refiner.blocks.1.self_attn_qkv.weight"),),
           keep=_FLUX_KEEP),
    Family("wan", (("blocks.0.self_attn.norm_q.weight", "text_embedding.2.weight", "head.modulation"),),
           f32=(".modulation", ".encoder.padding_tokens", "trainable_cond_mask", "casual_audio_encoder.weights",
                "casual_audio_encoder.encoder.conv"),
           keep=("modulation.", "patch_embedding.", "text_embedding.", "time_projection.", "time_embedding.", "img_emb.",
                 "head.", "cond_encoder.", "frame_packer.", "audio_injector.", "casual_audio_encoder.",
                 "trainable_cond_mask.")),
    Family("sdxl", (("down_blocks.0.downsamplers.0.conv.weight", "add_embedding.linear_1.weight"),
                    ("input_blocks.3.0.op.weight", "input_blocks.6.0.op.weight", "output_blocks.2.2.conv.weight",
                     "output_blocks.5.2.conv.weight"), ("label_emb.0.0.weight",)),
           reshape=True, keep=("class_embedding.", "time_embedding.", "add_embedding.", "time_embed.", "label_emb.",
                               "conv_in.", "conv_out.", "=input_blocks.0.0.weight", "=out.2.weight")),
    Family("sd1", (("down_blocks.0.downsamplers.0.conv.weight",),
                   ("input_blocks.3.0.op.weight", "input_blocks.6.0.op.weight", "input_blocks.9.0.op.weight",
                    "output_blocks.2.1.conv.weight", "output_blocks.5.2.conv.weight", "output_blocks.8.2.conv.weight")),
           reshape=True, keep=("class_embedding.", "time_embedding.", "add_embedding.", "time_embed.", "label_emb.",
                               "conv_in.", "conv_out.", "=input_blocks.0.0.weight", "=out.2.weight")),
    Family("lumina2", (("cap_embedder.1.weight", "context_refiner.0.attention.qkv.weight"),),  # Lumina 2, Z-Image
           f32=("x_pad_token", "cap_pad_token"),
           keep=("t_embedder.", "x_embedder.", "final_layer.", "cap_embedder.", "context_refiner.", "noise_refiner.",
                 "x_pad_token.", "cap_pad_token.")),
]
ARCHS = ", ".join(f.arch for f in FAMILIES)


def _gguf():
    import gguf

    return gguf


def ggml_type_of(target: str) -> int:
    """The GGML type `--to gguf-...` names; K-/IQ-quants are refused by name (no Python encoder)."""
    if target in TARGETS:
        return int(_gguf().GGMLQuantizationType[TARGETS[target]])
    kind = target[len("gguf-"):].upper()
    if re.fullmatch(r"(Q\d_K(_[SML])?|IQ\d\w*|Q\d_K\w*)", kind):
        raise CkptError(f"--to {target}: K-quants and IQ-quants cannot be written: gguf (llama.cpp's Python "
                        "package, which ckpt quantizes with) has no encoder for them; write --to gguf-bf16 and "
                        "run ComfyUI-GGUF's patched llama-quantize on it")
    raise CkptError(f"--to {target}: unknown GGUF type (choose {', '.join(TARGETS)})")


def _matches(name: str, patterns) -> bool:
    return any(name == p[1:] if p.startswith("=") else p in name for p in patterns)


def detect_family(names) -> Family:
    keys = set(names)
    for fam in FAMILIES:
        for group in fam.detect:
            if all(k in keys for k in group):
                if any(k in keys for k in fam.banned):
                    raise CkptError(f"this is the diffusers layout of a {fam.arch} model; ComfyUI-GGUF loads the "
                                    "original (BFL/SAI) layout only: convert the layout first")
                return fam
    raise CkptError(f"not a diffusion model ComfyUI-GGUF knows (its architectures: {ARCHS}); llama.cpp LLM GGUFs "
                    "are written by llama.cpp's convert_hf_to_gguf.py")


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


def choose(name: str, t: Tensor, fam: Family, target: int) -> Choice:
    """Each tensor's GGUF type and stored shape, by ComfyUI-GGUF's two steps (module docstring)."""
    T = _gguf().GGMLQuantizationType
    shape, n = tuple(t.shape), t.numel
    natural = t.natural_dtype
    if target in (T.F16, T.BF16):
        base = target
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
    if target in (T.F16, T.BF16, T.F32):
        return Choice(t1, shape, reshaped, why)
    if not name.endswith("weight") or ggml_n_dims(shape) != 2:
        return Choice(t1, shape, reshaped, why if t1 == T.F32 else "not a 2-D weight")
    if _matches(name, fam.keep):
        return Choice(t1, shape, reshaped, "input/output layer kept unquantized")
    blk = _gguf().GGML_QUANT_SIZES[target][0]
    if shape[-1] % blk:
        return Choice(t1, shape, reshaped, f"row length not a multiple of {blk}")
    return Choice(target, shape, reshaped, "quantized")


def _plain_type(name: str, dtype: torch.dtype) -> int:
    from ckpt.io.gguf import plain_types

    for t, d in plain_types().items():
        if d == dtype:
            return int(t)
    raise CkptError(f"tensor {name!r} is {short_name(dtype)}, which GGUF has no type for")


class BlockRows(Tensor):
    """A tensor read in bands that hold whole rows of `row_len` values (its GGUF stored rows)."""

    def __init__(self, base: Tensor, row_len: int):
        self.base, self.name, self.home = base, base.name, base.home
        self.dtype, self.shape = base.dtype, tuple(base.shape)
        per_row = math.prod(self.shape[1:]) if self.shape else 1
        align = row_len // math.gcd(per_row, row_len)
        self.row_align = None if base.row_align is None or not self.shape else math.lcm(base.row_align, align)

    @property
    def natural_dtype(self):
        return self.base.natural_dtype

    @property
    def source_bytes(self):
        return self.base.source_bytes

    def read(self, start, stop, device, scratch=None):
        return self.base.read(start, stop, device, scratch)


def _encoder(name: str, ggml_type: int, row_len: int, report: Report):
    from ckpt.quant.gguf import encode

    def cast(x, buffers):
        v = x.float() if x.dtype in FP8 else x
        bad = int((~torch.isfinite(v)).sum()) if v.numel() else 0
        report.count("nonfinite_input", name, bad)
        return encode(v.reshape(-1, row_len), ggml_type)

    return cast


def plan_gguf(ckpt, views, target_name: str, report: Report) -> Plan:
    """The whole GGUF output (one file) for SRC's single component."""
    gguf = _gguf()
    T = gguf.GGMLQuantizationType
    target = ggml_type_of(target_name)
    if len(ckpt.components) != 1:
        subs = ", ".join(c.subdir or "." for c in ckpt.components)
        raise CkptError(f"{ckpt.spec}: a GGUF file holds one model; this has {len(ckpt.components)} components "
                        f"({subs}): pass the folder of the one to convert")
    comp, view = ckpt.components[0], views[0]
    names = list(view.tensors)
    prefix, dropped = strip_prefix(names)
    keep = [n for n in names if n.startswith(prefix)]
    try:
        fam = detect_family([n[len(prefix):] for n in keep])
    except CkptError as e:
        raise CkptError(f"{comp.where}: {e}") from None
    notes = []
    if dropped:
        notes.append(f"{len(dropped)} tensors outside {prefix!r} left out (e.g. {dropped[0]!r}): a ComfyUI-GGUF file "
                     "holds the diffusion model only")
    casters: dict = {}
    outs, orig_shapes, summary = [], [], {}
    ignored = []
    for full in keep:
        name, t = full[len(prefix):], view.tensors[full]
        if _matches(name, fam.ignore):
            ignored.append(name)
            continue
        if len(name) > MAX_NAME:
            raise CkptError(f"{comp.where}: tensor name {name!r} is longer than {MAX_NAME} characters, the most "
                            "ComfyUI-GGUF's ggml accepts")
        c = choose(name, t, fam, target)
        label = T(c.ggml_type).name
        summary.setdefault((label, c.why), 0)
        summary[(label, c.why)] += 1
        if c.reshaped:
            from ckpt.io.gguf_writer import int32_array

            orig_shapes.append(int32_array(f"comfy.gguf.orig_shape.{name}", t.shape))
        from ckpt.io.gguf import plain_types

        plain = plain_types().get(c.ggml_type)
        if plain is not None:
            if is_float(t.dtype):
                caster = casters.setdefault(plain, Caster(plain, report))
                cast = (lambda x, b, n=name, k=caster: k(x, n, b))
            else:
                cast = (lambda x, b: x)
            outs.append(OutTensor(name, plain, c.shape, t, cast))
        else:
            src = BlockRows(t, c.shape[-1])
            outs.append(OutTensor(name, torch.uint8, c.shape, src, _encoder(name, c.ggml_type, c.shape[-1], report),
                                  gguf_type=c.ggml_type))
    if ignored:
        notes.append(f"{len(ignored)} {fam.arch} tensors ComfyUI-GGUF ignores left out (e.g. {ignored[0]!r})")
    from ckpt.io.gguf_writer import string, uint32

    ftype = {T.F16: "MOSTLY_F16", T.BF16: "MOSTLY_BF16"}.get(target, f"MOSTLY_{T(target).name}")
    fields = [string("general.architecture", fam.arch),
              uint32("general.quantization_version", gguf.GGML_QUANT_VERSION),
              uint32("general.file_type", gguf.LlamaFileType[ftype]),
              *orig_shapes,
              string("ckpt.version", __version__),
              string("ckpt.operation", f"convert --to {target_name}")]
    counts = ", ".join(f"{n} {label} ({why})" for (label, why), n in sorted(summary.items(), key=lambda kv: -kv[1]))
    notes.append(f"GGUF {fam.arch}: {counts}")
    if ckpt.copies:
        notes.append(f"{len(ckpt.copies)} other files ({', '.join(ckpt.copies[:3])}...) not copied: a GGUF is one file")
    return Plan(single_file=True, files=[OutFile("", {}, outs, "gguf", fields=fields)], notes=notes)


def default_suffix(target_name: str) -> str:
    """ComfyUI-GGUF / llama.cpp file naming: `model-Q8_0.gguf`, `model-BF16.gguf`."""
    return TARGETS.get(target_name, target_name)
