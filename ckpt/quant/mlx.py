"""MLX affine-quantized weights (what `mlx_lm.convert -q` writes, and the `mlx-community` releases) decoded as
`mlx.core.dequantize` computes them, and the quantizer that writes them (`quantize`: `mx.quantize`'s CPU kernel).

A quantized Linear or Embedding `X` of a weight [N, K] (bits b in 2, 3, 4, 5, 6, 8; group size g) is stored as
- `X.weight` uint32 [N, K b / 32]: each row one little-endian bit stream, code j at bit j b (for b = 3, 5, 6 MLX
  packs 8 or 4 codes per 3 or 5 bytes, which is the same stream);
- `X.scales`, `X.biases` [N, K / g] in the model's dtype (bf16, fp16 or fp32).
W[n, k] = D(D(q[n, k] * scales[n, k / g]) + biases[n, k / g]) with D the scales' dtype: `mx.dequantize` multiplies
and adds in that dtype, rounding twice (one fused float32 rounding differs in about one bf16 value in three).

Config: config.json `quantization` {group_size, bits, mode} (mlx-lm copies it to `quantization_config`, without a
`quant_method`), and per-layer entries keyed by the module path: a dict of its own {group_size, bits, mode} or
`false` (left unquantized; mlx-lm's mixed recipes write these). Only mode `affine` stores scales and biases; the
`mxfp4` / `nvfp4` / `mxfp8` modes (uint8 exponent scales, no biases) are refused by name: mlx-lm writes them only
on request (`--q-mode`), and nothing downstream (transformers, llama.cpp) reads them. Every layer's stored shapes
must agree with its bits and group size (K b / 32 words, K / g scales): a block that disagrees with the tensors is
refused by name.

`merge-lora --keep-format` (`MlxEncoding`): a changed weight is quantized again from its new value with its own
bits and group size (fresh scales and biases), as `mlx_lm fuse` does (`nn.QuantizedLinear.from_linear`).

The quantizer (`quantize`), per group of g inputs, in float32 (mlx's CPU kernel, `mlx/backend/cpu/quantized.cpp`):
scale = max((max - min) / (2^b - 1), 1e-7), negated unless |min| > |max|; edge = min or max (the larger in
magnitude); q0 = rint(edge / scale); where q0 != 0: scale = edge / q0, bias = edge, else bias = 0; codes =
clamp(rint((w - bias) / scale), 0, 2^b - 1) with the float32 scale and bias; scales and biases stored rounded to
the weight's dtype. tests/serve/test_mlx.py holds both directions to `mx.quantize` / `mx.dequantize` bit for bit.
"""

from __future__ import annotations

from ckpt.lazy import torch

from ckpt.io.plan import OutTensor
from ckpt.io.tensors import Tensor
from ckpt.io.wrapper import Wrapper
from ckpt.quant.common import DecodeContext, Decoded, companion, refuse
from ckpt.quant.encoding import Derived, Encoding, ErrorMeter
from ckpt.quant.formats import Format
from ckpt.report import Report

BITS = (2, 3, 4, 5, 6, 8)
GROUPS = (32, 64, 128)  # what mx.quantize accepts
MODES = ("affine", "mxfp4", "nvfp4", "mxfp8")  # mlx-lm's --q-mode choices; ckpt decodes affine
PARAMS = ("group_size", "bits", "mode")
CHUNK = 1 << 20  # values quantized at a time within a band (`encoded`)


def _stream_words(words: torch.Tensor) -> torch.Tensor:
    """uint32 (or int32) words [R, W] -> int64 [R, W] of their unsigned values."""
    w = words.view(torch.int32) if words.dtype == torch.uint32 else words.to(torch.int32)
    return w.to(torch.int64) & 0xFFFFFFFF


def unpack(words: torch.Tensor, bits: int) -> torch.Tensor:
    """Words [R, W] (each row one little-endian bit stream) -> codes int64 [R, 32 W / bits]."""
    R, W = words.shape
    w = _stream_words(words).reshape(R, W // bits, bits)  # 32 codes per `bits` words
    mask = (1 << bits) - 1
    out = torch.empty((R, W // bits, 32), dtype=torch.int64, device=words.device)
    for j in range(32):
        i, off = divmod(j * bits, 32)
        c = w[:, :, i] >> off
        if off + bits > 32:
            c = c | (w[:, :, i + 1] << (32 - off))
        out[:, :, j] = c & mask
    return out.reshape(R, -1)


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes [R, n] (n * bits a multiple of 32) -> uint32 words [R, n * bits / 32], the inverse of `unpack`."""
    if 32 % bits:  # 3, 5, 6 bits: codes straddle words
        from ckpt.quant.int_pack_encode import pack_rows

        return pack_rows(codes, bits).view(torch.uint32)
    per = 32 // bits
    c = codes.to(torch.int32).reshape(codes.shape[0], -1, per)
    words = c[:, :, 0].clone()
    for j in range(1, per):  # int32 fields OR'ed in place: the top one's sign bit is its own high bit
        words |= c[:, :, j] << (j * bits)
    return words.view(torch.uint32)


def quantize(w: torch.Tensor, group: int, bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes uint32 [R, K b / 32], scales, biases [R, K / g] in w's dtype) of rows `w` [R, K]: `mx.quantize`'s
    affine mode (module docstring)."""
    n_bins = float((1 << bits) - 1)
    x = w.to(torch.float32).reshape(w.shape[0], -1, group)
    w_max, w_min = x.amax(-1, keepdim=True), x.amin(-1, keepdim=True)
    mask = w_min.abs() > w_max.abs()
    scale = torch.clamp((w_max - w_min) / n_bins, min=1e-7)
    scale = torch.where(mask, scale, -scale)
    edge = torch.where(mask, w_min, w_max)
    q0 = torch.round(edge / scale)
    nz = q0 != 0
    scale = torch.where(nz, edge / q0, scale)
    bias = torch.where(nz, edge, torch.zeros_like(edge))
    q = x.sub_(bias) if x.data_ptr() != w.data_ptr() else x - bias  # in place on the float32 copy
    q = q.div_(scale).round_().clamp_(0, n_bins).nan_to_num_(0.0)
    codes = pack(q.reshape(w.shape[0], -1), bits)
    return codes, scale.squeeze(-1).to(w.dtype), bias.squeeze(-1).to(w.dtype)


def dequantize(codes: torch.Tensor, scales: torch.Tensor, biases: torch.Tensor, group: int, bits: int):
    """`mx.dequantize`: D(D(q * scale) + bias) in the scales' dtype D, [R, K]."""
    q = unpack(codes, bits).to(scales.dtype)
    s = scales.repeat_interleave(group, dim=1)
    b = biases.to(scales.dtype).repeat_interleave(group, dim=1)
    return q.mul_(s).add_(b)


class MlxWeight(Wrapper):
    """W [N, K] of an MLX affine-quantized layer; `base` is `X.weight` (uint32 codes)."""

    row_align = 1

    def __init__(self, name: str, codes: Tensor, scales: Tensor, biases: Tensor, group: int, bits: int):
        self.name, self.base, self.scales, self.biases = name, codes, scales, biases
        self.group, self.bits, self.home = group, bits, codes.home
        self.shape = (codes.shape[0], codes.shape[1] * 32 // bits)
        self.dtype = self.natural = scales.dtype

    @property
    def encoding(self):
        return MlxEncoding(self)

    def read(self, start, stop, device, scratch=None):
        codes = self.base.read(start, stop, device, scratch)
        return dequantize(codes, self.scales.read(start, stop, device), self.biases.read(start, stop, device),
                          self.group, self.bits)


class MlxEncoding(Encoding):
    """A new value of an MLX weight quantized again with its bits and group size (`mlx_lm fuse`): the codes, scales
    and biases keys, each computed row band by row band (groups run along a row)."""

    def __init__(self, w: MlxWeight):
        self.w = w
        self.label = f"MLX {w.bits}-bit"
        self.keys = (w.base.name, w.scales.name, w.biases.name)
        self.note = ("MLX: each changed weight is quantized again from its new value with its bits and group size "
                     "(fresh scales and biases, as mlx_lm fuse does)")

    def encode(self, value: Tensor, report: Report, meter: ErrorMeter) -> list[OutTensor]:
        return encoded(value, self.w.base.name, self.w.scales.name, self.w.biases.name, self.w.group, self.w.bits,
                       self.w.dtype, report, meter)


def encoded(value: Tensor, wkey: str, skey: str, bkey: str, group: int, bits: int, dtype, report: Report | None,
            meter: ErrorMeter | None = None) -> list[OutTensor]:
    """The three stored keys of `value` [N, K] quantized in `dtype` (its values rounded once to `dtype` first, as
    mlx quantizes the model's weights in their dtype)."""
    import threading

    n, k = value.shape
    done: dict = {}  # (start, stop) -> [the band's three parts, how many were taken]: each band quantized once
    lock = threading.Lock()

    def band(x, start, stop):
        x = x.to(dtype)
        if report is not None:
            report.count("nonfinite_quantized", value.name, int((~torch.isfinite(x)).sum()))
        step = max(1, CHUNK // max(1, k))  # rows at a time: the float32 temporaries stay small on every core
        parts = [quantize(x[a:a + step], group, bits) for a in range(0, x.shape[0], step)]
        q = tuple(torch.cat([p[i] for p in parts]) for i in range(3))
        if meter is not None:
            meter.add(x, dequantize(*q, group, bits))
        return q

    def part(i):
        def fn(x, start, stop):
            with lock:
                hit = done.get((start, stop))
            if hit is None:
                hit = [band(x, start, stop), 0]
                with lock:
                    while len(done) >= 8:  # bounded: a part read twice never holds more than a few bands
                        done.pop(next(iter(done)))
                    done[(start, stop)] = hit
            with lock:
                hit[1] += 1
                if hit[1] >= 3:
                    done.pop((start, stop), None)
            return hit[0][i]
        return fn

    shapes = ((wkey, torch.uint32, (n, k * bits // 32)), (skey, dtype, (n, k // group)), (bkey, dtype, (n, k // group)))
    return [OutTensor(name, dt, shape, Derived(name, value, dt, shape, part(i), band_by_value=True))
            for i, (name, dt, shape) in enumerate(shapes)]


# ---------------------------------------------------------------------------------------------------
# the config


def mlx_quantization(config: dict | None) -> dict | None:
    """config.json's MLX `quantization` block (a dict with bits and group_size), or None."""
    q = (config or {}).get("quantization")
    return q if isinstance(q, dict) and "bits" in q and "group_size" in q else None


def _short(v) -> str:
    s = repr(v)
    return s if len(s) <= 40 else s[:40] + "..."


def _params(ctx: DecodeContext, key: str, where: str, p: dict) -> tuple[int, int]:
    """(group_size, bits) of one block of the config, refused unless affine with bits and a group MLX writes."""
    mode = p.get("mode", "affine")
    if mode != "affine":
        raise refuse(ctx, key, f"MLX quantization mode {_short(mode)} ({where}) is not decoded (ckpt decodes affine)")
    bits, group = p.get("bits"), p.get("group_size")
    if isinstance(bits, bool) or bits not in BITS:
        raise refuse(ctx, key, f"MLX quantization bits {_short(bits)} ({where}) is not one of "
                               f"{', '.join(map(str, BITS))}")
    if isinstance(group, bool) or not isinstance(group, int) or group <= 0:
        raise refuse(ctx, key, f"MLX quantization group_size {_short(group)} ({where}) is not a positive integer")
    return group, bits


def decode(ctx: DecodeContext) -> Decoded | None:
    """Every quantized layer of an MLX folder (an `X.scales` beside an `X.biases` and a uint32 `X.weight`) becomes
    its decoded `X.weight`, each checked against its block of the config before anything is read."""
    layers = [k[: -len(".scales")] for k in ctx.remaining
              if k.endswith(".scales") and f"{k[: -len('.scales')]}.biases" in ctx.remaining]
    qcfg = mlx_quantization(ctx.config)
    if qcfg is None:
        for layer in layers:
            w = ctx.remaining.get(f"{layer}.weight")
            if w is not None and w.dtype in (torch.uint32, torch.int32):
                raise refuse(ctx, f"{layer}.weight", f"{layer!r} is MLX-quantized (uint32 codes, scales, biases) "
                                                     "but config.json has no MLX `quantization` block")
        return None
    default = _params(ctx, "config.json", "config.json quantization", qcfg)
    tensors, consumed, anchors = {}, {}, {}
    for layer in layers:
        wk, sk, bk = f"{layer}.weight", f"{layer}.scales", f"{layer}.biases"
        own = qcfg.get(layer)
        if own is False:
            raise refuse(ctx, sk, f"config.json's quantization leaves {layer!r} unquantized, but it has {sk!r}")
        group, bits = _params(ctx, sk, f"config.json quantization[{layer!r}]", own) if isinstance(own, dict) \
            else default
        codes = companion(ctx, wk, "MLX packed weight", dtypes=(torch.uint32,))
        if len(codes.shape) != 2:
            raise refuse(ctx, wk, f"MLX packed weight {wk!r} is {list(codes.shape)}; ckpt decodes 2-D layers "
                                  "(stacked MoE experts are not decoded)")
        n, words = codes.shape
        k = words * 32 // bits
        if words * 32 % bits or k % group:
            raise refuse(ctx, wk, f"MLX {layer!r}: {words} words per row are not whole groups of {group} "
                                  f"{bits}-bit codes (config.json's quantization disagrees with the tensors)")
        scales = companion(ctx, sk, f"MLX scales of {layer!r}", dtypes=(torch.bfloat16, torch.float16, torch.float32))
        if tuple(scales.shape) != (n, k // group):
            raise refuse(ctx, sk, f"MLX {layer!r}: scales {list(scales.shape)} do not fit {bits}-bit codes "
                                  f"{list(codes.shape)} in groups of {group} (config.json's quantization disagrees "
                                  "with the tensors)")
        companion(ctx, bk, f"MLX biases of {layer!r}", dtypes=(scales.dtype,), shape=(n, k // group))
        tensors[wk] = MlxWeight(wk, codes, scales, ctx.remaining[bk], group, bits)
        consumed[sk] = f"scales of {wk}"
        consumed[bk] = f"biases of {wk}"
    for key, t in ctx.remaining.items():  # codes without scales: the block names a layer whose parts are missing
        if key.endswith(".weight") and key not in tensors and t.dtype == torch.uint32:
            layer = key[: -len(".weight")]
            missing = f"{layer}.scales" if f"{layer}.scales" not in ctx.remaining else f"{layer}.biases"
            raise refuse(ctx, missing, f"MLX {missing.rsplit('.', 1)[-1]} {missing!r} of uint32 codes {key!r} "
                                       "is missing")
    bits = sorted({t.bits for t in tensors.values()})
    notes = [f"MLX: decoded {len(tensors)} affine layer{'s' if len(tensors) != 1 else ''} "
             f"({'/'.join(map(str, bits))}-bit, config.json quantization)"]
    return Decoded(f"MLX affine {'/'.join(map(str, bits))}-bit", tensors, consumed, notes=notes, anchors=anchors)


def inspect_settings(t, config) -> dict:
    """What `ckpt inspect` says of a decoded MLX weight."""
    return {"format": "MLX", "bits": t.bits, "group_size": t.group, "mode": "affine"}


FORMAT = Format("mlx", "MLX", 85, (decode,), weights=(MlxWeight,), settings=inspect_settings, llm=True)
