"""Storing a new value of an NVFP4 weight in the base's own layout (`merge-lora --keep-format`), with its scales
recomputed from the new value as the format's own quantizer computes them (see `ckpt.quant.encoding`).

Two NVFP4 layouts share the stored shape (codes uint8 [N, K / 2], two e2m1 codes per byte, the even element in
the LOW nibble; float8_e4m3fn block scales [N, K / 16]; one fp32 per-tensor scale) and differ in the per-tensor
scale's direction and in the float32 operation order, which decides the last bit of a block scale or a code:

- compressed-tensors 0.20 (`nvfp4-pack-quantized`, what llm-compressor's NVFP4 scheme writes with its min-max
  observer): `weight_global_scale` g = 448 * 6 / amax (`generate_gparam`: amax = max |x| over the tensor, at
  least `tiny`; a non-finite g becomes 1); block scale s = e4m3(g * (block amax / 6)) clamped to +-448
  (`calculate_qparams` with `scale_dtype` float8_e4m3fn), a zero scale replaced by 0.125 (its eps for e4m3);
  code = e2m1(clamp(x / (s / g), -6, 6)) (`_quantize`: the scale divided by g first, then x divided in
  float32), packed by `pack_fp4_to_uint8`. The observer hands both functions the min/max of the weight in the
  model's own dtype, so `448 * 6 / amax` and `block amax / 6` are rounded to that dtype (bf16: g carries 8
  significant bits) before the float32 product with g; ckpt does the same on the merged weight rounded to the
  model's dtype (what PEFT's `merge_and_unload` leaves in a bf16 model, `dtype` of the encoding).
- ModelOpt 0.47 (`NVFP4QTensor.quantize`, dynamic path): `weight_scale_2` s2 = amax / (6 * 448); block scale
  s = e4m3(clamp(block amax / (6 * s2), 2^-9, 448)), a zero one replaced by 1.0 first; code = e2m1(x / (s * s2)).

e2m1 rounding is to nearest, ties to the even code (both libraries: compressed-tensors' `cast_to_fp4` bounds,
ModelOpt's `searchsorted` plus its odd-bound adjustment), magnitudes past 6 give 6, and the sign bit is set for
x < 0 only (a value that rounds to zero keeps its minus sign, -0.0 itself gets code 0: torch.sign(-0.0) is
+0 in compressed-tensors, `weight < 0` in ModelOpt). ckpt's e2m1 code table (`microscaling.encode_e2m1`) does
the rounding; its nibble order is swapped to the low-first one.

The value is ckpt's fp32 merge, rounded once to the dtype the library quantizes in (compressed-tensors: the
model's, bf16, as above; ModelOpt: float32, unchanged). The per-tensor scale needs the whole tensor's amax before
the first band: one streamed pass for it (`comfy_quant.finite_amax`, finite values only; a NaN/Inf value is stored
as code 0 and counted as `nonfinite_quantized`), then the codes and the block scales band by band of output rows
(each band its own block scales: they are row-local). The error meter gets each band's fp32 values and what the
format's decoder (`ckpt.quant.compressed_tensors` / `ckpt.quant.modelopt`) gives for the written bytes.
"""

from __future__ import annotations

from ckpt.lazy import torch

from ckpt.io.plan import OutTensor
from ckpt.io.tensors import ComputedTensor, Tensor
from ckpt.quant import microscaling as mx
from ckpt.quant.encoding import Derived, Encoding, ErrorMeter, Lazy
from ckpt.report import Report

CT, MODELOPT = "compressed-tensors", "modelopt"
FP4_MAX, FP8_MAX = 6.0, 448.0


def e2m1_codes_low_first(y: torch.Tensor) -> torch.Tensor:
    """float32 [..., 2n] (already divided by the block scale) -> packed bytes [..., n], even element in the low
    nibble: round to nearest e2m1, ties to even, |y| > 6 -> 6, sign bit for y < 0 (module docstring)."""
    y = y.nan_to_num(0.0).clamp_(-FP4_MAX, FP4_MAX).add_(0.0)  # -0.0 + 0.0 = +0.0: no sign bit for -0.0
    c = mx.encode_e2m1(y)
    return c[..., 0::2] | (c[..., 1::2] << 4)


def global_scale(flavor: str, amax: torch.Tensor) -> torch.Tensor:
    """The per-tensor scale as stored (float32): compressed-tensors' g = 448 * 6 / amax computed in amax's dtype
    (`generate_gparam`: the model's dtype, module docstring), ModelOpt's s2 = amax / (6 * 448) in float32."""
    if flavor == CT:
        g = (FP8_MAX * FP4_MAX) / torch.clamp(amax, min=torch.finfo(amax.dtype).tiny)
        return torch.nan_to_num(g, nan=1.0, posinf=1.0, neginf=1.0).to(torch.float32)
    return amax.to(torch.float32) / (FP4_MAX * FP8_MAX)


def block_scales(flavor: str, x: torch.Tensor, gs: torch.Tensor) -> torch.Tensor:
    """Rows [n, K] -> float32 values of their e4m3 block scales [n, K / 16] (module docstring); compressed-tensors:
    block amax / 6 in x's dtype (the model's), times g in float32."""
    bamax = mx.block_amax(x, 16)
    if flavor == CT:
        s = (gs.to(torch.float32) * (bamax / FP4_MAX).to(torch.float32)).clamp_(-FP8_MAX, FP8_MAX)
        s = s.to(torch.float8_e4m3fn).to(torch.float32)
        return torch.where(s == 0, torch.full_like(s, 0.125), s)
    bamax = bamax.to(torch.float32)
    s = bamax / (FP4_MAX * gs)
    s[s == 0] = 1.0
    return s.clamp_(min=2.0 ** -9, max=FP8_MAX).to(torch.float8_e4m3fn).to(torch.float32)


def codes(flavor: str, x: torch.Tensor, gs: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """Rows [n, K] + their block scales -> packed bytes [n, K / 2] (x divided by the step in float32)."""
    n, k = x.shape
    step = s / gs if flavor == CT else s * gs
    return e2m1_codes_low_first((x.to(torch.float32).reshape(n, -1, 16) / step.unsqueeze(-1)).reshape(n, k))


def decoded(flavor: str, packed: torch.Tensor, gs: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """What ckpt's decoder of the format gives for these bytes (float32; compressed-tensors' bf16 rounding)."""
    n = packed.shape[0]
    vals = mx.unpack_e2m1(((packed & 15) << 4) | (packed >> 4)).reshape(n, -1, 16)
    if flavor == CT:
        step = s.to(torch.float8_e4m3fn).to(torch.bfloat16) / gs.reshape(1)  # fp32, as the [1] stored scale
        return (vals.to(step.dtype) * step.unsqueeze(-1)).to(torch.bfloat16).to(torch.float32).reshape(n, -1)
    return (vals * (s * gs).unsqueeze(-1)).reshape(n, -1)


class Nvfp4Encoding(Encoding):
    """A changed NVFP4 weight stored as its base stores it (module docstring): `stored` the three stored
    tensors (packed codes, block scales, per-tensor scale) whose keys, dtypes and shapes are written again.
    `dtype`: what the library quantizes the merged weight in (compressed-tensors: the decoded weight's natural
    dtype, the model's; ModelOpt: float32). `amax`: where the per-tensor scale is shared with other weights (what
    llm-compressor does for the q/k/v and gate/up weights that vLLM fuses), a callable giving their common finite
    amax (the default is this value's own, one streamed pass)."""

    def __init__(self, flavor: str, weight: Tensor, packed: Tensor, scale: Tensor, per_tensor: Tensor, amax=None):
        self.flavor, self.w, self.packed, self.scale, self.per_tensor = flavor, weight, packed, scale, per_tensor
        self.amax = amax
        self.dtype = weight.natural_dtype if flavor == CT else torch.float32
        self.keys = (packed.name, scale.name, per_tensor.name)
        self.label = f"{'compressed-tensors' if flavor == CT else 'ModelOpt'} nvfp4"
        self.note = (f"NVFP4 ({'compressed-tensors' if flavor == CT else 'ModelOpt'}): per-tensor and block scales "
                     "recomputed from the merged weight as the library's quantizer computes them (one extra read "
                     "of each changed weight for its amax)")

    def encode(self, value: Tensor, report: Report, meter: ErrorMeter) -> list[OutTensor]:
        from ckpt.quant.comfy_quant import finite_amax

        flavor, name, dtype = self.flavor, self.w.name, self.dtype
        # the amax of the rounded values is the rounded amax (rounding to nearest is monotonic)
        amax = self.amax or (lambda: finite_amax(value))
        gs = Lazy(lambda: global_scale(flavor, amax().to(dtype)))

        def band(x: torch.Tensor, with_codes: bool):
            x = x.to(torch.float32)
            xq = x.to(dtype)  # what the library quantizes: the merge in the model's dtype
            g = gs().to(x.device)
            s = block_scales(flavor, xq, g)
            if not with_codes:
                return s
            report.count("nonfinite_quantized", name, int((~torch.isfinite(x)).sum()))
            c = codes(flavor, xq, g, s)
            meter.add(x, decoded(flavor, c, g, s))
            return c

        def rows(stored: Tensor, with_codes: bool) -> OutTensor:
            """Stored rows = output rows: each band of the value encoded on its own."""
            fn = ((lambda x, a, b: band(x, True)) if with_codes
                  else (lambda x, a, b: band(x, False).to(torch.float8_e4m3fn)))
            src = Derived(stored.name, value, stored.dtype, stored.shape, fn, band_by_value=True)
            return OutTensor(stored.name, stored.dtype, tuple(stored.shape), src)

        pt = self.per_tensor
        shape = tuple(pt.shape)
        glob = ComputedTensor(pt.name, lambda: gs().reshape(shape), torch.float32, shape, home=value.home)
        return [rows(self.packed, True), rows(self.scale, False),
                OutTensor(pt.name, torch.float32, shape, glob)]


# ---------------------------------------------------------------------------------------------------
# gpt-oss MXFP4 expert banks


def mx_exponents(x: torch.Tensor) -> torch.Tensor:
    """float32 [..., K] -> uint8 e8m0 codes [..., K / 32], compressed-tensors 0.20's `generate_mx_scales` on each
    block's amax (`calculate_qparams` for an MXFP4 scheme): amax rounded to a power of two p (its float32 bits
    plus 2^21, mantissa masked off: up from 1.75 * 2^n), code = clamp(round(127 + floor(log2 p) - 2), 0, 255)
    (2 = floor(log2 6), e2m1's largest exponent); an all-zero block gets code 0."""
    lo, hi = torch.aminmax(x.reshape(*x.shape[:-1], -1, 32), dim=-1)
    amax = torch.maximum(hi.clamp(min=0.0), lo.clamp(max=0.0).abs())
    p = ((amax.view(torch.int32) + (1 << 21)) & -(1 << 23)).view(torch.float32)
    return torch.round(torch.clamp(127 + torch.floor(torch.log2(p)) - 2, 0, 255)).to(torch.uint8)


def mx_codes(x: torch.Tensor, exps: torch.Tensor) -> torch.Tensor:
    """float32 [..., K] + e8m0 codes [..., K / 32] -> packed e2m1 bytes [..., K / 2], even element in the low
    nibble: x / 2^(e - 127) (compressed-tensors' `maybe_convert_from_mx_exp` scale), rounded as `cast_to_fp4`."""
    scale = 2.0 ** (exps.to(torch.int32) - 127).to(torch.float32)
    y = x.reshape(*exps.shape, 32) / scale.unsqueeze(-1)
    return e2m1_codes_low_first(y.reshape(x.shape))


class Mxfp4BankEncoding(Encoding):
    """A changed gpt-oss expert bank [E, K, N] stored as its base stores it: `P_blocks` [E, N, K / 32, 16] and
    `P_scales` [E, N, K / 32], both recomputed from the merged value by the OCP MX rules as compressed-tensors
    0.20 applies them (`generate_mx_scales` for the shared exponent, then `_quantize` and `pack_fp4_to_uint8`:
    `mx_exponents`, `mx_codes`). That is the rule the issue names; it is not triton_kernels'
    `downcast_to_mxfp_torch` (which rounds amax / 6 up to a power of two, the rule `tests/helpers/mxfp4_ref`
    restates and gpt-oss's own release used): a block whose amax lies in [1.5, 1.75) * 2^n gets an exponent one
    lower here (finer, saturating its amax to 6). Both are valid OCP MX scales; transformers decodes either.

    Block-local: each band of experts is encoded on its own, no extra pass. The meter gets the fp32 merged
    experts and ckpt's decode of the written blocks (`mxfp4.decode_blocks`, transformers' arithmetic)."""

    label = "gpt-oss MXFP4"
    note = ("gpt-oss MXFP4: changed expert banks re-encoded with e8m0 block exponents recomputed from the merged "
            "values (OCP MX rule as compressed-tensors' generate_mx_scales applies it)")

    def __init__(self, bank: Tensor, blocks: Tensor, scales: Tensor, decode_blocks):
        """`decode_blocks(blocks, exps) -> float32`: the decoder's own arithmetic (`mxfp4.decode_blocks`, passed in
        by the decoder so that this module does not import it back)."""
        self.bank, self.blocks, self.scales, self.decode_blocks = bank, blocks, scales, decode_blocks
        self.keys = (blocks.name, scales.name)

    def encode(self, value: Tensor, report: Report, meter: ErrorMeter) -> list[OutTensor]:
        decode_blocks = self.decode_blocks
        name = self.bank.name

        def band(x: torch.Tensor, with_codes: bool) -> torch.Tensor:
            x = x.to(torch.float32).transpose(1, 2).contiguous()  # [e, N, K]
            exps = mx_exponents(x)
            if not with_codes:
                return exps
            report.count("nonfinite_quantized", name, int((~torch.isfinite(x)).sum()))
            packed = mx_codes(x, exps).reshape(*exps.shape, 16)
            meter.add(x, decode_blocks(packed, exps))
            return packed

        def rows(stored: Tensor, with_codes: bool) -> OutTensor:
            """Stored rows = experts: each band of experts encoded on its own."""
            src = Derived(stored.name, value, stored.dtype, stored.shape, lambda x, a, b: band(x, with_codes),
                          band_by_value=True)
            return OutTensor(stored.name, stored.dtype, tuple(stored.shape), src)

        return [rows(self.blocks, True), rows(self.scales, False)]
