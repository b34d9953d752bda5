"""Storing a new value of an integer-grid weight (GPTQ, AWQ, compressed-tensors int) on the base's own grid
(the encodings `ckpt.quant.gptq`, `awq` and `compressed_tensors` attach; see `ckpt.quant.encoding`).

The grid is kept: the stored scales, zero points and `g_idx` are the base's, copied byte for byte (calibrated
GPTQ / AWQ scales are kept, not re-optimized; a LoRA merge moves values along the grid the calibration chose).
Only the codes are written again:

    GPTQ, AWQ:           code = clamp(round(x / scale) + zero, 0, 2^bits - 1)
    compressed-tensors:  code = clamp(round(D(D(D(x) / scale) + zero)), -2^(bits-1), 2^(bits-1) - 1)

GPTQ's own quantizer (AutoGPTQ `quantizer.quantize`, AutoAWQ's `pseudo_quantize_tensor` likewise) on ckpt's fp32
merged value x and the stored scale widened to fp32 (`requantize`). compressed-tensors 0.20's quantizer
(`forward_helpers._quantize`, what `ModelCompressor.compress_model` runs on a model's CPU weights) as a user gets
it from the libraries: the model loaded in its dtype D (the scale's, bf16 as llm-compressor saves), PEFT's
`merge_and_unload` leaving D(x) (one rounding of the fp32 merge, as PEFT adds its fp32 delta in place), then every
step in D: D(x) / scale rounded to D, the zero point added in D (before rounding, the package's convention), round
half to even (`requantize_in`). Rounding x / scale to bf16 (8 significant bits) moves it by up to 1/32 of a code at
the grid's ends and often onto an exact .5, so this is not the fp32 rule: about one code in a hundred of an int4
tensor would differ (tests/test_keep_format_int.py). compressed-tensors packs code + 2^(bits-1). The package's GPU
path (its Triton kernel, taken for CUDA weights) divides in float32 instead: there it gives the fp32 rule with the
zero point added before rounding (on an H200, 0.8% of a bf16 int4 tensor's codes apart from its own CPU path),
which ckpt does not follow: one rule on every device (ckpt's bf16 steps give the same codes on CUDA), the package's
torch implementation. The libraries' packers do not clamp (a code past the grid spills into the next field of its
word), so the clamp is what keeps every field in its bits; compressed-tensors clamps, which is the same code. An
unchanged value (the base's own decoded weight) gives back its own code, except compressed-tensors int8: a code's
distance from the zero point needs up to 9 significant bits, which its bf16 decode does not hold, and the package's
own decompress -> compress round trip moves about 0.1% of those codes by one (ckpt, matching the package, does the
same to the unchanged values of a changed tensor; tensors the merge leaves alone are copied as stored). NaN stores
the zero point (value 0), +-Inf the grid's ends (counted as `nonfinite_quantized`); values past the grid's ends are
clamped and counted (`CLAMPED`, a per-tensor count in the run's warnings).

Packing, one packer for every layout (`pack_rows`): code j of a row at bit j * bits of the row's
little-endian bit stream, whole int32 words, a code straddling two words keeping its low bits in the first.
That is AutoGPTQ's `QuantLinear.pack` along the input dim (its 3-bit loops write exactly this stream: codes
10 and 21 of each 32 cross words), AutoAWQ GEMV along the input dim, AutoAWQ GEMM along the output dim after
its interleave (nibble i of a word holds output order[i]), and compressed-tensors 0.20's `pack_to_int32`.

Streaming: the value is read in bands of output rows. Where output rows are stored rows (compressed-tensors,
AWQ GEMV) each band is encoded and written on its own. GPTQ's `qweight` [K * bits / 32, N] and AWQ GEMM's
[K, N / 8] hold output rows as columns, and the writer writes stored rows in order, so a row band of the
stored codes needs every output row: those are encoded per whole tensor, the value still read band by band
(never whole in fp32) into the packed words, so memory is the packed tensor itself (bits / 8 bytes per
weight) plus one band.
"""

from __future__ import annotations

import math
from typing import Callable

from ckpt.lazy import torch

from ckpt.io.plan import OutTensor
from ckpt.io.tensors import Tensor, read_rows, row_bands
from ckpt.quant.encoding import Derived, Encoding, ErrorMeter
from ckpt.report import Report

# the per-tensor count of values clamped to the grid's ends (a Report count kind; the warning line reads it)
CLAMPED = "clamped_to_grid"  # the Report count kind (its wording: Report.DESCRIBE)


def pack_rows(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Unsigned codes [R, n] (each in [0, 2^bits - 1]) -> int32 words [R, ceil(n * bits / 32)]: code j at bit
    j * bits of its row's little-endian stream (module docstring); the last word's unused bits are zero."""
    R, n = codes.shape
    words = -(-n * bits // 32)
    blocks = -(-n // 32)  # 32 codes fill exactly `bits` words
    c = codes.to(torch.int64)
    if blocks * 32 != n:
        c = torch.nn.functional.pad(c, (0, blocks * 32 - n))
    c = c.reshape(R, blocks, 32)
    out = torch.zeros((R, blocks, bits), dtype=torch.int64, device=codes.device)
    for j in range(32):
        w, off = divmod(j * bits, 32)
        out[:, :, w] |= (c[:, :, j] << off) & 0xFFFFFFFF
        if off + bits > 32:
            out[:, :, w + 1] |= c[:, :, j] >> (32 - off)
    out = out.reshape(R, blocks * bits)[:, :words]
    return torch.where(out >= 1 << 31, out - (1 << 32), out).to(torch.int32)


def requantize(x: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, lo: int, hi: int):
    """(codes int32, how many were clamped): clamp(round(x / scale) + zero, lo, hi), x fp32 [n, K], scale and
    zero broadcastable to it (zero None: symmetric). NaN (x or 0 / 0) stores the zero point."""
    q = torch.nan_to_num(torch.round(x / scale), nan=0.0, posinf=math.inf, neginf=-math.inf)
    if zero is not None:
        q = q + zero
    out = (q < lo) | (q > hi)
    n_out = int(out.sum()) - int(torch.isinf(q).sum())  # an Inf input is counted as nonfinite, not here
    return q.clamp_(lo, hi).to(torch.int32), n_out


def requantize_in(x: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, lo: int, hi: int,
                  dtype: torch.dtype):
    """(codes int32, how many were clamped): compressed-tensors' rule in `dtype` (module docstring),
    clamp(round(D(D(D(x) / D(scale)) + D(zero))), lo, hi); x fp32, scale (fp32 of the stored scale) and zero
    broadcastable to it. NaN stores the zero point; a finite x that overflows D counts as clamped."""
    v = x.to(dtype) / scale.to(dtype)
    if zero is not None:
        v = v + zero.to(dtype)
    q = torch.round(v).to(torch.float32)
    nan = torch.isnan(q)
    if bool(nan.any()):
        q = torch.where(nan, torch.zeros_like(q) if zero is None else zero.to(torch.float32).expand_as(q), q)
    n_out = int((((q < lo) | (q > hi)) & torch.isfinite(x)).sum())  # an Inf input is counted as nonfinite
    return q.clamp_(lo, hi).to(torch.int32), n_out


class IntGridEncoding(Encoding):
    """The codes of one integer-grid weight re-encoded on its stored grid (module docstring).

    `weight`: the decoded tensor ([N, K], its `dtype` what ckpt's decoder returns), with `grid(start, stop,
    device)` -> (scale fp32, zero int32 or None) of output rows [start, stop), broadcastable to [n, K].
    `stored`: the stored codes key. `store(codes [n, K] int32)` -> the stored piece of those output rows:
    stored rows (`per_column` None) or stored columns [.., n / per_column] (`per_column` output rows per
    stored column: GPTQ 1, AWQ GEMM 8; bands align to it). `dtype`: None for the fp32 rule (GPTQ, AWQ), else the
    dtype compressed-tensors quantizes in (`requantize_in`)."""

    def __init__(self, weight: Tensor, label: str, stored: Tensor, bits: int, lo: int, hi: int,
                 store: Callable[[torch.Tensor], torch.Tensor], per_column: int | None = None,
                 dtype: torch.dtype | None = None):
        self.w, self.label, self.stored, self.bits = weight, label, stored, bits
        self.lo, self.hi, self.store, self.per_column, self.dtype = lo, hi, store, per_column, dtype
        self.keys = (stored.name,)
        self.note = ("integer grids (GPTQ, AWQ, compressed-tensors int): the base's scales, zero points and g_idx are "
                     "kept as calibrated (not re-optimized); only the changed weights' codes are re-rounded onto them, "
                     "clamped to the grid's ends")

    def encode(self, value: Tensor, report: Report, meter: ErrorMeter) -> list[OutTensor]:
        enc = self

        def band(x: torch.Tensor, start: int, stop: int) -> torch.Tensor:
            """Output rows [start, stop) of the value (`x`, as read) -> their stored codes."""
            x = x.to(torch.float32)
            report.count("nonfinite_quantized", enc.w.name, int((~torch.isfinite(x)).sum()))
            scale, zero = enc.w.grid(start, stop, x.device)
            if enc.dtype is None:
                codes, n_out = requantize(x, scale, zero, enc.lo, enc.hi)
            else:
                codes, n_out = requantize_in(x, scale, zero, enc.lo, enc.hi, enc.dtype)
            report.count(CLAMPED, enc.w.name, n_out)
            q = codes if zero is None else codes - zero
            meter.add(x, (q.to(torch.float32) * scale).to(enc.w.natural_dtype))  # what the format's loader gives
            return enc.store(codes)

        class Columns(Tensor):
            """Stored columns = output rows: the whole packed tensor, filled band by band of output rows."""

            name, dtype, shape, home = enc.stored.name, enc.stored.dtype, tuple(enc.stored.shape), value.home
            row_align = None

            def read(self, start, stop, device, scratch=None):
                from ckpt.io import output

                per = enc.per_column
                out = torch.empty(self.shape, dtype=self.dtype, device=device)
                align = None if value.row_align is None else math.lcm(per, value.row_align)
                for a, b in row_bands(value.rows, value.row_numel, align, output.BAND_ELEMS):
                    out[:, a // per: -(-b // per)] = band(read_rows(value, a, b, device), a, b)
                return out

        # stored rows = output rows: each band encoded on its own, banded as the fp32 value (not the packed words)
        src = (Derived(self.stored.name, value, self.stored.dtype, self.stored.shape, band, band_by_value=True)
               if self.per_column is None else Columns())
        return [OutTensor(self.stored.name, self.stored.dtype, tuple(self.stored.shape), src)]
