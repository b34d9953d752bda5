"""What every decoder module shares: the context it gets and the result it returns (`DecodeContext`,
`Decoded`), how it refuses (`refuse`, `companion`), what it reads of config.json (`quant_config`,
`model_dtype`), how it names a layer's keys (`weight_key`, `activation_keys`), and the scaled weight
W = codes * scale that FP8 and ComfyUI's comfy_quant layers both decode to (`scaled`, `ScaledTensor`).

Why a module of its own: these were private names of `ckpt.quant.fp8` that `comfy_quant` and `bnb`
imported, so the decoders were one import knot (fp8 -> fp8_encode -> comfy_quant -> fp8, and `view` ->
each decoder -> `view`). A new format module imports from here (and `ckpt.quant.encoding` for its
encoder), is listed in `ckpt.quant.view`, and imports no other decoder.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ckpt.lazy import torch

from ckpt.cast import fp8_upcast
from ckpt.dtypes import FP8, TORCH_TO_ST, config_dtype
from ckpt.errors import CkptError
from ckpt.io.checkpoint import Component
from ckpt.io.header import read_into
from ckpt.io.tensors import PickleTensor, RawTensor, Tensor, read_rows
from ckpt.io.wrapper import Wrapper
from ckpt.report import plural

# Last name segment of scales that only quantize activations (or the KV cache) at inference time.
ACTIVATION_SCALES = {"input_scale", "activation_scale", "output_scale", "input_scale_ub", "qscale_act",
                     "scale_input", "k_scale", "v_scale", "q_scale", "kv_scale", "prob_scale"}
DEFAULT_BLOCK = (128, 128)  # HF fine-grained FP8 / DeepSeek-V3 default weight_block_size


@dataclass
class DecodeContext:
    component: Component
    remaining: dict[str, Tensor]  # stored keys not claimed yet, stored order
    metadata: dict[str, str]  # merged __metadata__ of the component's files
    config: dict | None
    options: dict = field(default_factory=dict)  # command options a decoder may need (e.g. qtype)


@dataclass
class Decoded:
    format: str  # e.g. "comfy-scaled-fp8"
    tensors: dict[str, Tensor]  # logical name -> decoded tensor (replaces the stored key of that name)
    consumed: dict[str, str]  # stored key -> why it is not in the output
    drop_metadata: set[str] = field(default_factory=set)
    dequantized: bool = True  # the config's quantization_config no longer applies
    notes: list[str] = field(default_factory=list)
    anchors: dict[str, str] = field(default_factory=dict)  # consumed stored key -> logical name placed there
    config: dict | None = None  # config.json the encoding itself describes (a GGUF LLM's metadata)


# ---------------------------------------------------------------------------------------------------
# refusing, reading the config, naming keys


def _file_of(ctx: DecodeContext, key: str):
    t = ctx.component.tensors.get(key)
    for f in ctx.component.files:
        if t is not None and f.relpath == t.home:
            return f.path
    return ctx.component.where


def refuse(ctx: DecodeContext, key: str, problem: str) -> CkptError:
    """The error a decoder raises about stored key `key`: its file, the problem, and that nothing was
    written (every decoder refuses before any output exists)."""
    return CkptError(f"{_file_of(ctx, key)}: {problem}; nothing was written")


def st_name(dtype) -> str:
    """A torch dtype's safetensors name ("F8_E4M3"), as refusals show it."""
    return TORCH_TO_ST.get(dtype, str(dtype))


def float_scale(dtype) -> bool:
    """A scale stored as a plain float (fp32/fp16/bf16/fp64): what every scaled layout writes. An fp8 scale
    is a block scale of another format (NVFP4's e4m3), e8m0 an exponent-only one: each layout that takes
    those says so itself."""
    return dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def companion(ctx: DecodeContext, key: str, what: str, dtypes=None, shape=None, numel: int | None = None) -> Tensor:
    """The stored tensor `key` a decoder consumes beside its codes (a scale, absmax, shift, code table,
    JSON config), refused unless it has one of `dtypes` (a tuple of dtypes, or `float_scale`), the
    `shape` and `numel` values (each checked only when given).

    Why one checker: a companion of the wrong dtype or shape still reads as numbers, and a decoder that
    only checked that it exists wrote garbage with exit 0 (an int64 nested absmax, packed codes stored as
    float32). Every decoder (bitsandbytes, comfy_quant, the FP8 layouts, optimum-quanto) calls this for
    every key it consumes, so each refusal is worded the same: the key, what it is, what was found, what
    was expected."""
    t = ctx.remaining.get(key)
    if t is None:
        raise refuse(ctx, key, f"{what} {key!r} is missing")
    problems, wanted = [], []
    if dtypes is float_scale:
        wanted.append("a floating dtype")
        problems.append(not float_scale(t.dtype))
    elif dtypes is not None:
        wanted.append(" or ".join(st_name(d) for d in dtypes))
        problems.append(t.dtype not in dtypes)
    if shape is not None:
        wanted.append(f"shape {list(shape)}")
        problems.append(tuple(t.shape) != tuple(shape))
    if numel is not None:
        wanted.append(plural(numel, "value"))
        problems.append(t.numel != numel)
    if any(problems):
        raise refuse(ctx, key, f"{what} {key!r} is {st_name(t.dtype)} {list(t.shape)}; expected {', '.join(wanted)}")
    return t


def quant_config(ctx: DecodeContext) -> dict:
    """config.json's `quantization_config`: {} when there is none or it is not an object."""
    qc = (ctx.config or {}).get("quantization_config")
    return qc if isinstance(qc, dict) else {}


def method_config(ctx: DecodeContext, method: str, side_file: str, label: str, ours) -> tuple[dict, str] | None:
    """(config, where it came from) of a format configured by config.json's `quantization_config` (`quant_method`
    == `method`) or, in its libraries' own saves, by a JSON file beside the weights (`side_file`, when `ours(cfg)`
    says it is this format's); None when neither names the format. Another method's quantization_config wins
    over whatever lies beside it."""
    import json

    qc = quant_config(ctx)
    if str(qc.get("quant_method", "")).lower() == method:
        return qc, "config.json quantization_config"
    if qc:
        return None
    files = ctx.component.files
    p = files[0].path.parent / side_file if files else None
    if p is None or not p.is_file():
        return None
    try:
        cfg = json.loads(p.read_text())
        if not isinstance(cfg, dict):
            raise ValueError
    except (ValueError, UnicodeDecodeError):
        raise CkptError(f"{p}: not {label} (expected a JSON object); nothing was written") from None
    return (cfg, str(p)) if ours(cfg) else None


def nvfp4_parts(ctx: DecodeContext, packed_key: str, scale_key: str, global_key: str, what: str, global_label: str):
    """The three stored parts of an NVFP4 weight (compressed-tensors and ModelOpt store the same ones under other
    names): uint8 packed e2m1 codes [out, in / 2] in whole blocks of 16 inputs, e4m3 block scales [out, in / 16]
    and one float32 per-tensor scale; anything else is refused naming the key."""
    packed = companion(ctx, packed_key, f"{what} packed weight", dtypes=(torch.uint8,))
    if len(packed.shape) != 2 or packed.shape[1] * 2 % 16:
        raise refuse(ctx, packed_key, f"{what}: {packed_key.rsplit('.', 1)[-1]} is {list(packed.shape)}; expected "
                                      "2-D [out, in / 2] with whole blocks of 16 inputs")
    n, k = packed.shape[0], packed.shape[1] * 2
    scale = companion(ctx, scale_key, f"{what} block scales", dtypes=(torch.float8_e4m3fn,), shape=(n, k // 16))
    glob = companion(ctx, global_key, f"{what} {global_label}", dtypes=(torch.float32,), numel=1)
    return packed, scale, glob


def model_dtype(ctx: DecodeContext) -> torch.dtype:
    """The model's dtype before quantization: config.json `torch_dtype`/`dtype`, else bf16."""
    return config_dtype(ctx.config) or torch.bfloat16


def weight_key(layer: str) -> str:
    """The weight of layer `layer` (`""`: a file holding one bare `weight`)."""
    return f"{layer}.weight" if layer else "weight"


def activation_keys(ctx: DecodeContext, layer: str) -> dict[str, str]:
    """The activation scales of `layer` still unclaimed, with why they are dropped (they only configure
    inference kernels)."""
    return {f"{layer}.{n}": "activation scale (inference only)" for n in ACTIVATION_SCALES
            if f"{layer}.{n}" in ctx.remaining}


# ---------------------------------------------------------------------------------------------------
# scaled weights: W = codes * scale


class ScaleLayout:
    """How a scale tensor broadcasts over its weight.

    kind: "tensor" (one value), "row" (one per dim-0 row), "group" ([rows, ng] or [rows, ng, 1]: ng equal
    groups along the input dim, kohya block-64), "block" ([*lead, ceil(out/bo), ceil(in/bi)], 2-D tiles
    of the last two dims, cropped at the edges).
    """

    def __init__(self, kind: str, groups: int = 0, block: tuple[int, int] = (0, 0)):
        self.kind, self.groups, self.block = kind, groups, block

    def __repr__(self):
        return f"ScaleLayout({self.kind}, groups={self.groups}, block={self.block})"


def infer_layout(wshape, sshape, block: tuple[int, int] | None = None) -> ScaleLayout | None:
    """The layout that makes a scale of shape `sshape` fit a weight of shape `wshape`, or None."""
    wshape, sshape = tuple(wshape), tuple(sshape)
    n = math.prod(sshape)
    if n == 1:
        return ScaleLayout("tensor")
    if len(wshape) >= 2:
        *lead, out, inn = wshape
        for bo, bi in [block] if block else [DEFAULT_BLOCK]:
            if sshape == (*lead, -(-out // bo), -(-inn // bi)):
                return ScaleLayout("block", block=(bo, bi))
    if wshape and sshape and sshape[0] == wshape[0] and n == wshape[0]:
        return ScaleLayout("row")
    if len(wshape) == 2 and len(sshape) in (2, 3) and sshape[0] == wshape[0] and (len(sshape) == 2 or sshape[2] == 1):
        if sshape[1] and wshape[1] % sshape[1] == 0:
            return ScaleLayout("group", groups=sshape[1])
    return None


def _codes_to_float(x: torch.Tensor, scratch=None) -> torch.Tensor:
    """Stored values as float32, never a view of the source (it is scaled in place): in `scratch`'s "scaled"
    buffer on the CPU (fresh pages fault in at about 1 GB/s here: a 2 GB fp8 -> bf16 convert spent 3-5 s of its
    reading stage here), else a fresh tensor."""
    cpu = scratch is not None and x.device.type == "cpu"
    if x.dtype in FP8:
        y = fp8_upcast(x, torch.float32, scratch if cpu else None, role="scaled")
        return y if y.data_ptr() != x.data_ptr() else y.clone()
    if cpu:
        return scratch.typed("scaled", torch.float32, x.shape).copy_(x)
    return x.to(torch.float32, copy=True)


class ScaledTensor(Wrapper):
    """W = w.float() * s (* extra), with s broadcast per `layout`; float32 values, rounded once later.
    `base` is the stored codes w (what reading costs), `natural` the model's dtype (bf16 if not given).

    Bands: rows [start, stop) along dim 0 read the matching slice of the scale only. 2-D block layouts
    want bands that start on a block boundary (`row_align` = block rows) but any start is handled.
    """

    def __init__(self, weight: Tensor, scale: Tensor, natural: torch.dtype | None = None,
                 layout: ScaleLayout | None = None, extra: Tensor | None = None):
        self.base, self.scale, self.extra = weight, scale, extra
        self.name, self.shape, self.home = weight.name, weight.shape, weight.home
        self.dtype = torch.float32
        self.natural = torch.bfloat16 if natural is None else natural
        self.layout = layout or infer_layout(weight.shape, scale.shape)
        if self.layout is None:
            raise ValueError(f"{scale.name}: shape {list(scale.shape)} does not fit {weight.name} {list(weight.shape)}")
        if self.layout.kind == "block" and len(self.shape) == 2:
            self.row_align = self.layout.block[0]
        else:
            self.row_align = weight.row_align

    def read(self, start, stop, device, scratch=None):
        x = self.base.read(start, stop, device, scratch)
        lay = self.layout
        if lay.kind == "tensor" and x.dtype in FP8:
            s = self._scale_rows(0, 1, device).reshape(())  # one scale: the table does the multiply
            y = fp8_upcast(x, torch.float32, scratch if device.type == "cpu" else None, role="scaled",
                           scale=s.to(torch.float32))
            return y if y.data_ptr() != x.data_ptr() else y.clone()
        w = _codes_to_float(x, scratch)  # fp32, scaled in place
        if device.type == "cpu":
            return self._scale(w, start, stop, device)
        # x86 keeps a NaN operand's payload in a multiply, CUDA writes 0x7FFFFFFF: the CPU's bytes on every device
        codes = w.clone()
        return torch.where(torch.isnan(codes), codes, self._scale(w, start, stop, device))

    def _scale(self, w: torch.Tensor, start: int, stop: int, device) -> torch.Tensor:
        """`w` (the codes as fp32, rows [start, stop)) times its scales, in place."""
        lay = self.layout
        if lay.kind == "tensor":
            return w.mul_(self._scale_rows(0, 1, device).reshape(()))
        rows = stop - start
        if lay.kind == "row":
            s = self._scale_rows(start, stop, device)
            return w.mul_(s.reshape(rows, *([1] * (w.dim() - 1))))
        if lay.kind == "group":
            s = self._scale_rows(start, stop, device).reshape(rows, lay.groups, 1)
            w.view(rows, lay.groups, -1).mul_(s)
            return w
        bo, bi = lay.block
        if w.dim() == 2:  # rows of one matrix: scale rows covering [start, stop)
            s = self._scale_rows(start // bo, -(-stop // bo), device).unsqueeze(0)
            _mul_blocks(w.unsqueeze(0), s, bo, bi, start)
        else:  # leading (expert) dims: whole matrices per band
            out_rows, inn = w.shape[-2:]
            s = self._scale_rows(start, stop, device)
            _mul_blocks(w.view(-1, out_rows, inn), s.reshape(-1, *s.shape[-2:]), bo, bi, 0)
        return w

    def _scale_rows(self, a, b, device) -> torch.Tensor:
        sliceable = self.scale.shape and self.scale.row_align is not None
        s = (self.scale.read(a, b, device) if sliceable else self.scale.read_all(device)).float()
        if self.extra is not None:
            s = s * self.extra.read_all(device).float().reshape(())
        return s


def _mul_blocks(w: torch.Tensor, s: torch.Tensor, bo: int, bi: int, row0: int) -> None:
    """w: (L, R, C) = rows row0.. of L matrices; s: (L, nbo, nbi) scales from block row row0 // bo."""
    cols = w.shape[-1]
    s_cols = s.repeat_interleave(bi, dim=-1)[..., :cols]  # (L, nbo, C): small, one row per block row
    r, rows = 0, w.shape[1]
    while r < rows:
        blk = (row0 + r) // bo
        end = min(rows, (blk + 1) * bo - row0)
        w[:, r:end].mul_(s_cols[:, blk - row0 // bo: blk - row0 // bo + 1])
        r = end


def scaled(ctx, wkey, w, skey, s, natural, block=None, extra=None) -> ScaledTensor:
    """The decoded weight `wkey` = codes `w` * scale `s` (key `skey`), refused by name when the scale's
    shape fits no layout or it is stored as something other than a float or e8m0 scale."""
    layout = infer_layout(w.shape, s.shape, block)
    if layout is None:
        raise refuse(ctx, skey, f"scale {skey!r} has shape {list(s.shape)}, which fits no known layout for "
                                f"{wkey!r} {list(w.shape)}")
    if not (float_scale(s.dtype) or s.dtype == torch.float8_e8m0fnu):
        raise refuse(ctx, skey, f"scale {skey!r} is stored as {st_name(s.dtype)} (packed/swizzled block scales, e.g. "
                                "MXFP8 or NVFP4), which ckpt cannot decode")
    return ScaledTensor(w, s, natural, layout, extra)


# ---------------------------------------------------------------------------------------------------
# reading columns


def read_columns(t: Tensor, a: int, b: int, device) -> torch.Tensor:
    """Columns [a, b) of the 2-D stored tensor `t`, on `device`.

    Why not `t.read`: stored tensors read row bands, and a band of GPTQ output rows is a band of columns of
    every stored tensor. A safetensors tensor is read with one pread per stored row (only the bytes the
    band needs); a pickled one is sliced; anything else is read whole and cut."""
    rows, cols = t.shape
    if a == 0 and b == cols:
        out = read_rows(t, 0, rows, torch.device("cpu"))
    elif isinstance(t, RawTensor):
        isz = t.dtype.itemsize
        out = torch.empty((rows, b - a), dtype=t.dtype)
        if rows and b > a:
            mv = memoryview(out.view(torch.uint8).numpy()).cast("B")
            fd, w = t.handles.fd(t.info.path), (b - a) * isz
            for r in range(rows):
                read_into(fd, mv[r * w:(r + 1) * w], t.info.start + (r * cols + a) * isz, t.info.path)
    elif isinstance(t, PickleTensor):
        out = t.value[:, a:b].contiguous()
    else:
        out = read_rows(t, 0, rows, torch.device("cpu"))[:, a:b]
    return out.to(device)
