"""ComfyUI's ConvRot layers, decoded: weights stored after a group-wise Hadamard rotation, in three `comfy_quant`
formats (comfy-kitchen 0.2.40's layouts, ComfyUI's `comfy/ops.py` loader):

- `int8_tensorwise` with `"convrot": true` (W8A8, `TensorWiseINT8Layout`): `X.weight` int8 [out, in] of the
  rotated weight, `X.weight_scale` fp32 [out, 1] (one per output channel; a single value also loads);
- `convrot_w4a4` (`TensorCoreConvRotW4A4Layout`): `X.weight` int8 [out, in/2], signed 4-bit codes two per byte
  (even column in the low nibble), `X.weight_scale` fp32 [out] (one per row);
- `asym_w4a8_int8` (`AsymW4A8Int8Layout`, 4-bit): `X.weight` int8 [out, in/2] of unsigned 4-bit codes,
  `X.weight_s_rel` e4m3 (or fp32; U8 bytes are viewed as e4m3, as ComfyUI does) [out, in/group_size] relative
  group scales, `X.weight_s_channel` fp32 [out], optional `X.weight_codebook` fp32 [16] (without it the codes
  are uniform, code - 8) and optional `X.weight_correction` [in/group_size, out] (asymmetric storage);
- the same format at 6 bits (W6A8): `X.weight` int8 [out, 3*in/4], the 4-bit nibble plane [out, in/2] followed by
  a plane of each code's top 2 bits (column c in byte c//4 at bit 2*(c%4)), uniform codes (code - 32), no codebook
  and no correction. As in comfy-kitchen, `in` comes from the group scales (groups * group_size) and the bit depth
  from the packed width; 6 bits need `in` a multiple of 32 and group_size a multiple of 16.

The parameters are read as ComfyUI reads them: each key at the top level of the layer config, else under its
`params` object, else the default (`convrot_groupsize` 256, W4A8 `group_size` 16).

Values are comfy-kitchen's eager dequantize with output dtype float32, rounded once by the output cast. The
rotation is one `torch.matmul` of the [out, in/g, g] weight with the transposed normalized Hadamard matrix, and
CPU BLAS results of a row depend on how many rows the call holds: so a weight is decoded whole, the very call
comfy-kitchen makes, and its bands are cut from that, rather than rotated band by band (which can differ in the
last bit).
The arithmetic is restated here from comfy-kitchen (Apache-2.0), which is the oracle of tests/test_convrot.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ckpt.lazy import torch

from ckpt.io.tensors import Tensor
from ckpt.io.wrapper import Wrapper
from ckpt.quant.common import companion, float_scale, refuse, st_name
from ckpt.quant.formats import Format

FORMATS = ("convrot_w4a4", "asym_w4a8_int8")  # comfy_quant formats that are always rotated
DEFAULT_GROUPSIZE = 256  # comfy-kitchen's and ComfyUI's default convrot_groupsize
W4A8_GROUP = 16  # comfy-kitchen's default W4A8 group_size
W4A4_QUANT_GROUP = 64  # comfy-kitchen's int4 kernels' quant_group_size (the only one it takes)
INT4_MAX = 7


@dataclass(frozen=True)
class ConvRotSpec:
    """How one ConvRot weight is stored: its comfy_quant format and parameters. `codebook` (W4A8): the 16
    levels to keep (a re-encoded layer keeps its base's), None to choose them as comfy-kitchen does;
    `uniform`: a W4A8 base without codebook; `s_rel_dtype`: the group scales' stored dtype; `bits`: W4A8's code
    width (4, or 6 for W6A8); `asymmetric`: W4A8 stored with a per-group correction (of `correction_dtype`)."""

    format: str  # "int8_tensorwise" | "convrot_w4a4" | "asym_w4a8_int8"
    convrot_groupsize: int = DEFAULT_GROUPSIZE
    group_size: int = W4A8_GROUP
    linear_dtype: str = "int4"
    codebook: tuple | None = None
    uniform: bool = False
    s_rel_dtype: str = "float8_e4m3fn"
    rowwise: bool = True  # what the comfy_quant planner's summary asks of a spec
    convrot: bool = True
    bits: int = 4
    asymmetric: bool = False
    correction_dtype: str = "float32"

    @property
    def config(self) -> dict:
        """The layer's `comfy_quant` JSON object, as ComfyUI's `_quantized_weight_state_dict` writes it."""
        if self.format == "int8_tensorwise":
            return {"format": self.format, "convrot": True, "convrot_groupsize": self.convrot_groupsize}
        if self.format == "convrot_w4a4":
            conf = {"format": self.format, "convrot_groupsize": self.convrot_groupsize}
            return conf | ({"linear_dtype": self.linear_dtype} if self.linear_dtype != "int4" else {})
        return {"format": self.format, "group_size": self.group_size, "convrot_groupsize": self.convrot_groupsize}

    @property
    def label(self) -> str:
        if self.format == "asym_w4a8_int8" and self.bits == 6:
            return "asym_w4a8_int8-w6a8"
        return {"int8_tensorwise": "int8_tensorwise+convrot"}.get(self.format, self.format)

    @property
    def misfit(self) -> str:
        """Which weights this spec cannot store (the planner's note on the weights it keeps)."""
        need = self.convrot_groupsize
        if self.format == "convrot_w4a4":
            need = math.lcm(need, W4A4_QUANT_GROUP)
        elif self.format == "asym_w4a8_int8":
            need = math.lcm(need, self.group_size, 16)
        return f"input width not a multiple of {need}"


def rotated(conf: dict) -> bool:
    """Whether an int8_tensorwise layer config says `convrot` (top level, else under `params`)."""
    return bool(_param(conf, "convrot", False))


def _param(conf: dict, key: str, default):
    params = conf.get("params") if isinstance(conf.get("params"), dict) else {}
    return conf.get(key, params.get(key, default))


# ---------------------------------------------------------------------------------------------------
# the arithmetic (comfy-kitchen's eager backend)


def hadamard(size: int) -> torch.Tensor:
    """comfy-kitchen's normalized regular Hadamard matrix (float32): H4 kron ... kron H4 / sqrt(size)."""
    h4 = torch.tensor([[1, 1, 1, -1], [1, 1, -1, 1], [1, -1, 1, 1], [-1, 1, 1, 1]], dtype=torch.float32)
    h, n = h4, 4
    while n < size:
        h, n = torch.kron(h, h4), n * 4
    return h / (size ** 0.5)


def rotate(w: torch.Tensor, group: int) -> torch.Tensor:
    """W @ blockdiag(H)^T, the group-wise rotation (its own inverse: H is symmetric and orthogonal)."""
    out, cols = w.shape
    return torch.matmul(w.reshape(out, cols // group, group), hadamard(group).T.to(w.dtype)).reshape(out, cols)


def power_of_4(g) -> bool:
    return (isinstance(g, int) and not isinstance(g, bool) and g >= 4 and g & (g - 1) == 0
            and (g.bit_length() - 1) % 2 == 0)


def unpack_signed4(packed: torch.Tensor) -> torch.Tensor:
    """[n, k/2] bytes -> [n, k] int8 in [-8, 7] (even column in the low nibble)."""
    x = packed.view(torch.uint8).to(torch.int32)
    lo, hi = x & 0x0F, (x >> 4) & 0x0F
    lo, hi = torch.where(lo >= 8, lo - 16, lo), torch.where(hi >= 8, hi - 16, hi)
    return torch.stack([lo, hi], dim=-1).reshape(packed.shape[0], -1).to(torch.int8)


def unpack_unsigned4(packed: torch.Tensor) -> torch.Tensor:
    """[n, k/2] bytes -> [n, k] int64 codes in [0, 15]."""
    x = packed.view(torch.uint8).to(torch.int64)
    return torch.stack([x & 0xF, (x >> 4) & 0xF], dim=-1).reshape(packed.shape[0], -1)


def unpack_codes(packed: torch.Tensor, k: int, bits: int) -> torch.Tensor:
    """W4A8 / W6A8 storage -> [n, k] int64 unsigned codes: the nibble plane, at 6 bits plus the 2-bit plane."""
    codes = unpack_unsigned4(packed[:, : k // 2])
    if bits == 6:
        hi = packed[:, k // 2:].view(torch.uint8).to(torch.int64).unsqueeze(-1)
        codes = codes | (((hi >> torch.tensor([0, 2, 4, 6])) & 0x3).reshape(packed.shape[0], k) << 4)
    return codes


def w4a8_int8_grid(codes: torch.Tensor, s_rel: torch.Tensor, codebook: torch.Tensor | None, group: int,
                   bits: int = 4):
    """The int8 values the W4A8 GEMM consumes: round(clamp(level * s_rel)) per group (uniform levels: code minus
    the mid-range, 8 or 32)."""
    n, k = codes.shape
    values = codebook.to(torch.float32)[codes] if codebook is not None else codes.float() - float(1 << (bits - 1))
    values = values.view(n, k // group, group) * s_rel.float().unsqueeze(-1)
    return values.view(n, k).round().clamp_(-127, 127).to(torch.int8)


def w4a8_dequantize(codes, s_rel, s_channel, codebook, correction, group: int, rot: int, bits: int = 4):
    n, k = codes.shape
    w = w4a8_int8_grid(codes, s_rel, codebook, group, bits).float().view(n, k // group, group)
    w = w * s_channel.float().view(n, 1, 1)
    if correction is not None:
        w = w + correction.t().unsqueeze(-1).float()
    return rotate(w.view(n, k).to(torch.float32), rot)


# ---------------------------------------------------------------------------------------------------
# decoding


class ConvRotWeight(Wrapper):
    """A ConvRot weight: stored codes (`base`) and their scales -> float32 values in the original basis
    (`natural`: the model's dtype). Any band may be read, but each is cut from one whole decode (see the module
    docstring), kept until the band holding the last row has been read: a weight read band by band in order is
    decoded once, and holds one float32 copy of itself meanwhile, as comfy-kitchen's dequantize does."""

    row_align = 1

    def __init__(self, name: str, spec: ConvRotSpec, codes: Tensor, parts: dict[str, Tensor], shape, natural):
        self.name, self.spec, self.base, self.parts = name, spec, codes, parts
        self.shape, self.home, self.dtype, self.natural = tuple(shape), codes.home, torch.float32, natural
        self._whole = None
        self.s_rel_stored, self.asymmetric, self.scalar_scale = None, False, False  # what re-encoding needs to know

    def read(self, start, stop, device, scratch=None):
        whole = self._whole if self._whole is not None and self._whole.device == torch.device(device) else \
            self._decode(device)
        self._whole = None if stop >= self.shape[0] else whole
        return whole[start:stop]

    def _decode(self, device) -> torch.Tensor:
        c = self.base.read_all(device)
        p = {k: t.read_all(device) for k, t in self.parts.items()}
        spec, rows = self.spec, self.shape[0]
        if spec.format == "int8_tensorwise":
            s = p["weight_scale"].to(torch.float32)
            w = rotate(c.view(torch.int8).float() * (s.reshape(rows, 1) if s.numel() == rows and rows > 1 else
                                                     s.reshape(())), spec.convrot_groupsize)
        elif spec.format == "convrot_w4a4":
            w = unpack_signed4(c).to(torch.float32) * p["weight_scale"].to(torch.float32).reshape(-1, 1)
            w = rotate(w.float(), spec.convrot_groupsize)
        else:
            codes = unpack_codes(c, self.shape[1], spec.bits)
            w = w4a8_dequantize(codes, p["weight_s_rel"], p["weight_s_channel"], p.get("weight_codebook"),
                                p.get("weight_correction"), spec.group_size, spec.convrot_groupsize, spec.bits)
        return w


def decode_layer(ctx, layer: str, conf: dict, wkey: str, w: Tensor, natural, consumed: dict) -> ConvRotWeight:
    """One ConvRot layer of a comfy_quant checkpoint (`ckpt.quant.comfy_quant.decode` hands it here), its
    stored keys checked and consumed (its encoding, `convrot_encode.ConvRotEncoding.of`, is given by the caller:
    the encoders import this module)."""
    fmt = conf.get("format")
    what = "int8_tensorwise with convrot" if fmt == "int8_tensorwise" else fmt

    def bad(key, problem):
        return refuse(ctx, key, f"comfy_quant layer {layer!r} ({what}): {problem}")

    if len(w.shape) != 2:
        raise bad(wkey, f"{wkey!r} is a {len(w.shape)}-D weight {list(w.shape)}; ConvRot weights are 2-D Linear "
                        "weights")
    allowed = (torch.int8,) if fmt == "int8_tensorwise" else (torch.int8, torch.uint8)
    if w.dtype not in allowed:
        raise bad(wkey, f"{wkey!r} is stored as {st_name(w.dtype)}, not {' or '.join(st_name(d) for d in allowed)}")
    rows, stored = w.shape
    cols = stored if fmt == "int8_tensorwise" else stored * 2
    bits = 4
    if fmt == "asym_w4a8_int8":  # rows of 3*in/4 bytes (in from the group scales, as comfy-kitchen reads it): W6A8
        sr, gs = ctx.remaining.get(f"{layer}.weight_s_rel"), _param(conf, "group_size", W4A8_GROUP)
        if sr is not None and len(sr.shape) == 2 and type(gs) is int and stored * 8 == sr.shape[1] * gs * 6 > 0:
            bits, cols = 6, sr.shape[1] * gs
            if cols % 32 or gs % 16:
                raise bad(wkey, f"{wkey!r} {list(w.shape)} holds 6-bit codes (W6A8), which need an input width "
                                f"divisible by 32 (not {cols}) and a group_size multiple of 16 (not {gs})")
            for extra in ("weight_codebook", "weight_correction"):
                if f"{layer}.{extra}" in ctx.remaining:
                    raise bad(f"{layer}.{extra}", f"{wkey!r} holds 6-bit codes (W6A8), which are uniform and "
                                                  f"symmetric: no {extra[7:]}")
    g = _param(conf, "convrot_groupsize", DEFAULT_GROUPSIZE)
    if not power_of_4(g):
        raise bad(wkey, f"convrot_groupsize {str(g)[:20]} is not a power of 4 (4, 16, 64, 256 ...)")
    if rows == 0 or cols % g:
        raise bad(wkey, f"convrot_groupsize {g} does not divide the input width {cols} of {wkey!r} {list(w.shape)}")
    spec = ConvRotSpec(fmt, convrot_groupsize=g)
    parts: dict[str, Tensor] = {}

    def take(suffix, what_it_is, dtypes, shapes, optional=False):
        key = f"{layer}.{suffix}"
        t = ctx.remaining.get(key)
        if t is None:
            if optional:
                return None
            raise bad(wkey, f"has no {what_it_is} {key!r}")
        companion(ctx, key, f"{what_it_is} of {wkey!r}", dtypes=dtypes)
        if tuple(t.shape) not in shapes:
            want = " or ".join(str(list(s)) for s in shapes)
            raise bad(key, f"{what_it_is} {key!r} has shape {list(t.shape)}, not {want}")
        consumed[key] = f"{what_it_is} of {wkey}"
        parts[suffix] = t
        return t

    if fmt == "int8_tensorwise":
        take("weight_scale", "per-channel scale", float_scale, ((rows, 1), (), (1,)))
    elif fmt == "convrot_w4a4":
        ld = _param(conf, "linear_dtype", "int4")
        if ld not in ("int4", "int8"):
            raise bad(wkey, f"linear_dtype {str(ld)[:20]!r} is neither 'int4' nor 'int8'")
        spec = ConvRotSpec(fmt, convrot_groupsize=g, linear_dtype=ld)
        take("weight_scale", "per-row scale", float_scale, ((rows,), (rows, 1)))
    else:
        gs = _param(conf, "group_size", W4A8_GROUP)
        if not (isinstance(gs, int) and not isinstance(gs, bool) and gs >= 4 and (16 % gs == 0 or gs % 16 == 0)):
            raise bad(wkey, f"group_size {str(gs)[:20]} is not 4, 8, 16 or a multiple of 16")
        if cols % 16 or cols % gs:
            raise bad(wkey, f"group_size {gs} does not divide the input width {cols} of {wkey!r} {list(w.shape)} "
                            "(which must also be a multiple of 16)")
        s_rel = take("weight_s_rel", "group scales", (torch.float8_e4m3fn, torch.uint8, torch.float32),
                     ((rows, cols // gs),))
        take("weight_s_channel", "channel scales", float_scale, ((rows,),))
        cb = take("weight_codebook", "codebook", float_scale, ((16,),), optional=True)
        corr = take("weight_correction", "asymmetric correction", float_scale, ((cols // gs, rows),), optional=True)
        if s_rel.dtype == torch.uint8:
            parts["weight_s_rel"] = _Viewed(s_rel, torch.float8_e4m3fn)
        spec = ConvRotSpec(fmt, convrot_groupsize=g, group_size=gs, uniform=cb is None,
                           s_rel_dtype="float32" if s_rel.dtype == torch.float32 else "float8_e4m3fn", bits=bits,
                           asymmetric=corr is not None,
                           correction_dtype=str(corr.dtype).removeprefix("torch.") if corr is not None else "float32")
        t = ConvRotWeight(wkey, spec, w, parts, (rows, cols), natural)
        t.s_rel_stored, t.asymmetric = s_rel.dtype, corr is not None
        return t
    t = ConvRotWeight(wkey, spec, w, parts, (rows, cols), natural)
    t.scalar_scale = fmt == "int8_tensorwise" and parts["weight_scale"].numel == 1 and rows > 1
    return t


class _Viewed(Wrapper):
    """A stored tensor's bytes viewed as another dtype of the same width (W4A8 group scales saved as U8)."""

    def __init__(self, base: Tensor, dtype):
        self.base, self.name, self.home, self.dtype = base, base.name, base.home, dtype
        self.shape, self.row_align = tuple(base.shape), base.row_align

    def read(self, start, stop, device, scratch=None):
        return self.base.read(start, stop, device, scratch).view(self.dtype)


def inspect_settings(t: ConvRotWeight, config) -> dict:
    """inspect's settings of one ConvRot weight: the format, its bits and parameters."""
    s = t.spec
    kind = {"int8_tensorwise": ("W8A8", 8, "per-channel scales"), "convrot_w4a4": ("W4A4", 4, "per-row scales"),
            "asym_w4a8_int8": ("W4A8" if s.bits == 4 else "W6A8", s.bits,
                               "e4m3 group scales" if s.s_rel_dtype != "float32" else "fp32 group scales")}
    name, bits, scales = kind[s.format]
    scales += ", asymmetric" if s.asymmetric else ""
    out = {"format": "ComfyUI ConvRot", "type": f"{name} ({s.format}, rotation group {s.convrot_groupsize}, {scales})",
           "bits": bits, "convrot_groupsize": s.convrot_groupsize}
    if s.format == "asym_w4a8_int8":
        out["group_size"] = s.group_size
        out["codebook"] = "uniform" if s.uniform else "16 levels"
        if s.asymmetric:
            out["asymmetric"] = True
    return out


FORMAT = Format("convrot", "ComfyUI ConvRot", 31, (), weights=(ConvRotWeight,), settings=inspect_settings)
