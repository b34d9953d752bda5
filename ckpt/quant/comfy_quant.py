"""ComfyUI `comfy_quant` layers, both ways: decoded into plain logical tensors, and encoded from them.

A quantized layer `X` of a ComfyUI mixed-precision checkpoint carries `X.comfy_quant` (the UTF-8 bytes of
a JSON object, stored as a U8 tensor) and/or an entry in the file metadata `_quantization_metadata` =
`{"format_version": "1.0", "layers": {"X": {"format": ...}}}` (ComfyUI's `convert_old_quants` turns the
latter into the former). The formats and their stored keys, as ComfyUI's `comfy/ops.py` loads them into
comfy-kitchen layouts (`QUANT_ALGOS`):

- `float8_e4m3fn` / `float8_e5m2`: `X.weight` fp8, `X.weight_scale` fp32 scalar: W = w * s.
- `int8_tensorwise`: `X.weight` int8, `X.weight_scale` fp32, scalar (tensor-wise) or [out, 1] (row-wise):
  W = q * s. With `convrot` (Hadamard-rotated weights) the layer is ConvRot's: `ckpt.quant.convrot`.
- `nvfp4`: `X.weight` U8 (out, in/2), e2m1 codes two per byte; `X.weight_scale` float8_e4m3fn block
  scales, one per 16 inputs, in the cuBLAS blocked layout padded to (128k, 4m); `X.weight_scale_2` fp32
  global scale: W = code * (global * block). `X.pre_quant_scale` (AWQ smoothing, which ComfyUI multiplies
  into the input) is folded into the weight's columns.
- `mxfp8`: `X.weight` float8_e4m3fn, `X.weight_scale` e8m0 exponents, one per 32 inputs, blocked layout.
- `convrot_w4a4`, `asym_w4a8_int8`: ConvRot's 4-bit layouts, decoded and encoded by `ckpt.quant.convrot`.
- `svdquant_w4a4`: int4 codes, group scales, smoothing and a low-rank branch, decoded (and a LoRA baked into
  the branch) by `ckpt.quant.svdquant`.
- `X.input_scale` only quantizes activations at inference: dropped.

Values are computed as comfy-kitchen 0.2.40's eager backend computes them with output_type float32 (the
arithmetic is in `ckpt.quant.microscaling`), then rounded once by the output cast.

comfy-kitchen pads NVFP4 weights to multiples of 16 and MXFP8 weights to multiples of 32 in both
dimensions; ComfyUI takes the true shape from the model's module, not the file. The logical shape is the
layer config's `orig_shape` when present, else `--shapes-from`, else the stored shape.

Encoding is the mirror image (`encode`): one logical weight becomes its stored tensors, streamed in row
bands. Every decoded weight carries its `spec` (format, and for int8 whether scales are per row), so
re-encoding a changed weight in its base's own format and block layout is `encode(decoded.spec, new)`. A per-tensor scale needs the tensor's amax before its first band is written, so those tensors
are read twice (one band at a time for the amax, then the encoding pass); block scales are recomputed
from the band that needs them, so no per-tensor state beyond one scalar is kept.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

from ckpt.lazy import torch

from ckpt.dtypes import FP8, ST_TO_TORCH
from ckpt.io.plan import OutTensor
from ckpt.io.tensors import ComputedTensor, Tensor
from ckpt.io.wrapper import Wrapper
from ckpt.quant import convrot
from ckpt.quant import microscaling as mx
from ckpt.quant import svdquant
from ckpt.quant.common import (DecodeContext, Decoded, activation_keys, companion, float_scale, model_dtype, refuse,
                               scaled, st_name, weight_key)
from ckpt.quant.encoding import Encoding, Lazy
from ckpt.report import Report
from ckpt.quant.formats import Format

FP8_FORMATS = {"float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2"}  # comfy_quant format -> safetensors dtype
BLOCK = {"nvfp4": 16, "mxfp8": 32}
DECODABLE = (*FP8_FORMATS, "int8_tensorwise", "nvfp4", "mxfp8", *convrot.FORMATS, svdquant.NAME)
META_KEY = "_quantization_metadata"


@dataclass(frozen=True)
class QuantSpec:
    """How one weight is stored: a comfy_quant format, and for int8 whether its scale is per row."""

    format: str
    rowwise: bool = False

    @property
    def config(self) -> dict:
        """The layer's `comfy_quant` JSON object."""
        return {"format": self.format}


# ---------------------------------------------------------------------------------------------------
# decoding


class BlockedScales:
    """A stored blocked-layout scale tensor, read as natural (rows, blocks) scale rows of a band.

    Accepts the (padded_rows, padded_cols) tensor comfy-kitchen saves, or the same values flattened."""

    def __init__(self, t: Tensor, rows: int, blocks: int):
        self.t, self.blocks = t, blocks
        self.grid = mx.scale_grid(rows, blocks)
        if tuple(t.shape) not in (self.grid, (math.prod(self.grid),)):
            raise ValueError(f"has shape {list(t.shape)}; {rows} rows of {blocks} blocks need "
                             f"{self.grid[0]} x {self.grid[1]} blocked scales ({list(self.grid)}, or "
                             f"[{math.prod(self.grid)}] flattened)")
        self.flat = tuple(t.shape) != self.grid

    def rows(self, a: int, b: int, device) -> torch.Tensor:
        """uint8 (b - a, blocks) scale bytes of weight rows [a, b)."""
        t0, t1 = a // mx.TILE_ROWS, -(-b // mx.TILE_ROWS)
        width = self.grid[1]
        if not self.flat:
            x = self.t.read(t0 * mx.TILE_ROWS, t1 * mx.TILE_ROWS, device)
        elif len(self.t.shape) == 1:
            x = self.t.read(t0 * mx.TILE_ROWS * width, t1 * mx.TILE_ROWS * width, device)
        else:
            x = self.t.read_all(device).reshape(-1)[t0 * mx.TILE_ROWS * width: t1 * mx.TILE_ROWS * width]
        x = x.contiguous().view(torch.uint8).reshape(-1, width)
        nat = mx.unswizzle(x)
        off = t0 * mx.TILE_ROWS
        return nat[a - off: b - off, : self.blocks]


class BlockQuantWeight(Wrapper):
    """An NVFP4 or MXFP8 weight: stored codes (`base`) and blocked scales -> float32 values of the logical
    shape (`natural`: the model's dtype).

    Bands start on 128-row boundaries (one tile row of the blocked scales) but any start is handled."""

    row_align = mx.TILE_ROWS

    def __init__(self, name: str, spec: QuantSpec, codes: Tensor, scales: BlockedScales, shape, natural,
                 global_scale: Tensor | None = None, col_scale: Tensor | None = None):
        self.name, self.spec, self.base, self.scales = name, spec, codes, scales
        self.global_scale, self.col_scale = global_scale, col_scale
        self.shape, self.home, self.dtype = tuple(shape), codes.home, torch.float32
        self.natural = natural

    def read(self, start, stop, device, scratch=None):
        c = self.base.read(start, stop, device, scratch)
        s = self.scales.rows(start, stop, device)
        if self.spec.format == "nvfp4":
            g = self.global_scale.read_all(device).to(torch.float32).reshape(())
            y = mx.nvfp4_decode(c.view(torch.uint8), g, s.view(torch.float8_e4m3fn))
        else:
            y = mx.mxfp8_decode(c, s)
        cols = self.shape[1]
        if y.shape[1] != cols:
            y = y[:, :cols]
        if self.col_scale is not None:
            y = y * self.col_scale.read_all(device).to(torch.float32).reshape(1, cols)
        return y


def layer_configs(ctx: DecodeContext) -> tuple[dict[str, dict], dict[str, str]]:
    """Layer name -> config, from the `X.comfy_quant` tensors and `__metadata__`; where both name a layer
    the metadata wins, as in ComfyUI (`convert_old_quants` writes it over the tensors). Also returns the
    consumed config keys."""
    layers: dict[str, dict] = {}
    consumed: dict[str, str] = {}
    for key in [k for k in ctx.remaining if k.endswith(".comfy_quant")]:
        companion(ctx, key, "ComfyUI layer quantization config (UTF-8 JSON bytes)", dtypes=(torch.uint8,))
        try:
            conf = json.loads(ctx.remaining[key].read_all(torch.device("cpu")).numpy().tobytes())
            if not isinstance(conf, dict):
                raise TypeError
        except (ValueError, TypeError, RuntimeError):
            raise refuse(ctx, key, f"{key!r} is not ComfyUI quantization JSON") from None
        layers[key[: -len(".comfy_quant")]] = conf
        consumed[key] = "ComfyUI layer quantization config"
    raw = ctx.metadata.get(META_KEY)
    if raw is not None:
        try:
            meta = json.loads(raw)
            if not isinstance(meta["layers"], dict) or not all(isinstance(v, dict) for v in meta["layers"].values()):
                raise TypeError
        except (ValueError, KeyError, TypeError):
            raise refuse(ctx, "", f"__metadata__ {META_KEY} is not valid ComfyUI quantization JSON") from None
        layers.update(meta["layers"])
    return layers, consumed


def decode(ctx: DecodeContext) -> Decoded | None:
    layers, consumed = layer_configs(ctx)
    if not layers:
        return None
    natural, tensors, formats = model_dtype(ctx), {}, set()
    for layer, conf in layers.items():
        fmt = conf.get("format")
        wkey = weight_key(layer)
        if fmt not in DECODABLE:
            raise refuse(ctx, wkey, f"ComfyUI comfy_quant format {fmt!r} (layer {layer!r}) cannot be decoded by ckpt "
                                    f"(supported: {', '.join(DECODABLE)})")
        w = ctx.remaining.get(wkey)
        if w is None:
            raise refuse(ctx, wkey, f"comfy_quant layer {layer!r} has no weight {wkey!r}")
        if fmt in convrot.FORMATS or (fmt == "int8_tensorwise" and convrot.rotated(conf)):
            t = convrot.decode_layer(ctx, layer, conf, wkey, w, natural, consumed)
            from ckpt.quant.convrot_encode import ConvRotEncoding

            t.encoding = ConvRotEncoding.of(t)
            formats.add(t.spec.label)
            tensors[wkey] = t
            consumed.update(activation_keys(ctx, layer))
            continue
        if fmt == svdquant.NAME:  # weight, low-rank branch and LoRA-bake encoding: ckpt.quant.svdquant
            formats.add(fmt)
            tensors.update(svdquant.decode_layer(ctx, layer, conf, wkey, w, consumed))
            consumed.update(activation_keys(ctx, layer))
            continue
        formats.add(fmt)
        if fmt in FP8_FORMATS:
            t = _fp8_layer(ctx, layer, wkey, w, fmt, natural, consumed)
        elif fmt == "int8_tensorwise":
            t = _int8_layer(ctx, layer, conf, wkey, w, natural, consumed)
        else:
            t = _block_layer(ctx, layer, conf, wkey, w, fmt, natural, consumed)
        if t is not None:
            t.encoding = ComfyQuantEncoding(t.spec, wkey, _stored_values_shape(w, fmt), getattr(t, "col_scale", None))
            tensors[wkey] = t
        consumed.update(activation_keys(ctx, layer))
    label = "comfy-quant-" + "+".join(sorted(formats))
    return Decoded(label, tensors, consumed, drop_metadata={META_KEY})


def _fp8_layer(ctx, layer, wkey, w, fmt, natural, consumed):
    if w.dtype not in FP8 or w.dtype_name != FP8_FORMATS[fmt]:
        raise refuse(ctx, wkey, f"comfy_quant layer {layer!r} is {fmt} but {wkey!r} is stored as {st_name(w.dtype)}, "
                                f"not {FP8_FORMATS[fmt]}")
    _require_2d(ctx, layer, wkey, w, fmt)
    skey = f"{layer}.weight_scale"
    if skey not in ctx.remaining:
        return None  # plain fp8 codes: cast as they are
    companion(ctx, skey, f"{fmt} scale of {wkey!r}", dtypes=float_scale)
    t = scaled(ctx, wkey, w, skey, ctx.remaining[skey], natural)
    consumed[skey] = f"scale of {wkey}"
    t.spec = QuantSpec(fmt)
    return t


def _int8_layer(ctx, layer, conf, wkey, w, natural, consumed):
    if w.dtype != torch.int8:
        raise refuse(ctx, wkey, f"comfy_quant layer {layer!r} is int8_tensorwise but {wkey!r} is stored as "
                                f"{st_name(w.dtype)}, not I8")
    _require_2d(ctx, layer, wkey, w, "int8_tensorwise")
    skey = f"{layer}.weight_scale"
    s = ctx.remaining.get(skey)
    if s is None:
        raise refuse(ctx, wkey, f"comfy_quant layer {layer!r} (int8_tensorwise) has no scale {skey!r}")
    companion(ctx, skey, f"int8_tensorwise scale of {wkey!r}", dtypes=float_scale)
    t = scaled(ctx, wkey, w, skey, s, natural)
    if t.layout.kind not in ("tensor", "row") or (t.layout.kind == "row" and tuple(s.shape) != (w.shape[0], 1)):
        raise refuse(ctx, skey, f"scale {skey!r} has shape {list(s.shape)}: int8_tensorwise scales are one value "
                                f"or one per row of {wkey!r} {list(w.shape)} ([{w.shape[0]}, 1], as comfy-kitchen "
                                "saves them)")
    consumed[skey] = f"scale of {wkey}"
    t.spec = QuantSpec("int8_tensorwise", rowwise=t.layout.kind == "row")
    return t


def _block_layer(ctx, layer, conf, wkey, w, fmt, natural, consumed):
    want = torch.uint8 if fmt == "nvfp4" else torch.float8_e4m3fn
    if w.dtype != want:
        raise refuse(ctx, wkey, f"comfy_quant layer {layer!r} is {fmt} but {wkey!r} is stored as {st_name(w.dtype)}, "
                                f"not {st_name(want)}")
    _require_2d(ctx, layer, wkey, w, fmt)
    rows, stored_cols = w.shape
    cols = stored_cols * 2 if fmt == "nvfp4" else stored_cols
    block = BLOCK[fmt]
    if cols % block:
        raise refuse(ctx, wkey, f"{fmt} weight {wkey!r} {list(w.shape)} holds {cols} inputs, not a multiple of "
                                f"the block size {block}")
    skey = f"{layer}.weight_scale"
    s = ctx.remaining.get(skey)
    if s is None:
        raise refuse(ctx, wkey, f"comfy_quant layer {layer!r} ({fmt}) has no block scales {skey!r}")
    scale_types = (torch.uint8, torch.float8_e4m3fn) if fmt == "nvfp4" else (torch.uint8, torch.float8_e8m0fnu)
    if s.dtype not in scale_types:
        raise refuse(ctx, skey, f"{fmt} block scales {skey!r} are stored as {st_name(s.dtype)}, not "
                                f"{' or '.join(st_name(d) for d in scale_types)}")
    try:
        scales = BlockedScales(s, rows, cols // block)
    except ValueError as e:
        raise refuse(ctx, skey, f"{fmt} block scales {skey!r} {e}") from None
    consumed[skey] = f"block scales of {wkey}"
    g = col = None
    if fmt == "nvfp4":
        gkey = f"{layer}.weight_scale_2"
        g = ctx.remaining.get(gkey)
        if g is None:
            raise refuse(ctx, wkey, f"comfy_quant layer {layer!r} (nvfp4) has no global scale {gkey!r}")
        companion(ctx, gkey, f"nvfp4 global scale of {wkey!r}", dtypes=float_scale, numel=1)
        consumed[gkey] = f"global scale of {wkey}"
    shape = _logical_shape(ctx, layer, conf, wkey, (rows, cols), block)
    if fmt == "nvfp4":
        pkey = f"{layer}.pre_quant_scale"
        col = ctx.remaining.get(pkey)
        if col is not None:
            companion(ctx, pkey, f"input smoothing (one scale per column) of {wkey!r} {list(shape)}",
                      dtypes=float_scale, numel=shape[1])
            consumed[pkey] = f"input smoothing of {wkey} (folded into its columns)"
    return BlockQuantWeight(wkey, QuantSpec(fmt), w, scales, shape, natural, g, col)


def _require_2d(ctx, layer, wkey, w, fmt):
    """comfy_quant layers are Linear weights (ComfyUI quantizes its Linear ops, comfy-kitchen's layouts
    are 2-D): any other rank is refused rather than decoded into a tensor no module takes."""
    if len(w.shape) != 2:
        raise refuse(ctx, wkey, f"comfy_quant layer {layer!r}: {wkey!r} is a {len(w.shape)}-D {fmt} weight "
                                f"{list(w.shape)} (expert banks are not decoded by ckpt; 2-D Linear weights are)")


def _stored_values_shape(w: Tensor, fmt: str) -> tuple[int, ...]:
    """How many values the stored weight holds (nvfp4 packs two per byte), padding included."""
    if fmt == "nvfp4":
        return (w.shape[0], w.shape[1] * 2)
    return tuple(w.shape)


def _logical_shape(ctx, layer, conf, wkey, stored, block):
    """The layer config's `orig_shape`, else `--shapes-from`, else the stored (possibly padded) shape."""
    pad = block  # comfy-kitchen pads both dimensions to the block size
    cand, where = conf.get("orig_shape"), "its comfy_quant orig_shape"
    ref = ctx.options.get("shape_of")
    if cand is None and ref is not None:
        cand, where = ref(ctx.component.subdir, wkey), "--shapes-from"
    if cand is None:
        return stored
    if not (isinstance(cand, (list, tuple)) and len(cand) == 2 and all(isinstance(d, int) and d > 0 for d in cand)
            and all(mx.roundup(d, pad) == s for d, s in zip(cand, stored))):
        raise refuse(ctx, wkey, f"{wkey!r} is stored as {list(stored)} values, which {where} {cand} does not fit")
    return tuple(cand)


FORMAT = Format("comfy_quant", "ComfyUI comfy_quant", 30, (decode,), weights=(BlockQuantWeight,))


# ---------------------------------------------------------------------------------------------------
# encoding


def finite_amax(source: Tensor, device: torch.device | None = None) -> torch.Tensor:
    """amax(|x|) over the finite values of `source`, streamed band by band (fp32 scalar, on CPU)."""
    device = torch.device("cpu") if device is None else device
    from ckpt.io.output import bands

    amax = torch.zeros((), dtype=torch.float32)
    for a, b in bands(source):
        band = source.read(a, b, device).reshape(-1)
        for i in range(0, band.numel(), CHUNK_ELEMS):
            x = band[i: i + CHUNK_ELEMS].to(torch.float32)
            lo, hi = torch.aminmax(x)
            m = torch.maximum(hi, -lo)
            if not bool(torch.isfinite(m)):  # rare: leave NaN/Inf out
                m = x.abs().masked_fill_(~torch.isfinite(x), 0.0).max()
            amax = torch.maximum(amax, m.cpu())
    return amax


def count_nonfinite(x: torch.Tensor) -> int:
    """NaN/Inf values in `x`: one sum pass, and an exact count only when that sum is not finite."""
    if x.numel() == 0 or bool(torch.isfinite(x.sum())):
        return 0
    return int((~torch.isfinite(x)).sum())


def unencodable(spec: QuantSpec, shape) -> str | None:
    """Why a weight of `shape` cannot be stored as `spec` without recording a padded shape, or None."""
    if getattr(spec, "convrot", False):
        from ckpt.quant.convrot_encode import unencodable as convrot_unencodable

        return convrot_unencodable(spec, shape)
    if len(shape) != 2 or 0 in shape:
        return "not a non-empty 2-D weight"
    block = BLOCK.get(spec.format)
    if block and (shape[1] % block or shape[0] % block):
        return f"{list(shape)} is not a multiple of the {spec.format} block size {block} in both dimensions"
    return None


CHUNK_ELEMS = 1 << 20  # the encoders work on row chunks of a band: their fp32 temporaries stay small


def encode(spec: QuantSpec, t: Tensor, report: Report, name: str | None = None, meter=None) -> list[OutTensor]:
    """The stored tensors of the logical weight `t` (`X.weight`, its scales) in the layout `spec`,
    each streamed from `t`'s bands. `X.comfy_quant` is not among them (see `config_tensor`).

    The one call a re-encoding merge needs: give it the base layer's `spec` and the merged tensor; `meter`
    (a `ckpt.quant.encoding.ErrorMeter`) then gets each chunk's values and what its codes decode to."""
    if getattr(spec, "convrot", False):  # a ConvRotSpec: ConvRot's encoders
        from ckpt.quant.convrot_encode import encode as convrot_encode

        return convrot_encode(spec, t, report, name=name, meter=meter)
    name = name or t.name
    why = unencodable(spec, t.shape)
    if why:
        raise ValueError(f"{name}: cannot encode as {spec.format}: {why}")
    layer = name[: -len(".weight")] if name.endswith(".weight") else name
    rows, cols = t.shape
    fmt = spec.format

    def scalar(key, fn):
        return OutTensor(key, torch.float32, (), ComputedTensor(key, fn, torch.float32, (), home=t.home))

    def codes(dtype, out_cols, fn, decode):
        """The weight's OutTensor: each band converted to fp32 and encoded by `fn` in row chunks
        (`decode(chunk, codes)`: the fp32 values the codes stand for, for the meter)."""
        def cast(x, buffers):
            n = x.shape[0]
            out = (buffers.typed("comfy_quant", dtype, (n, out_cols)) if buffers is not None and x.device.type == "cpu"
                   else torch.empty((n, out_cols), dtype=dtype, device=x.device))
            step = max(1, CHUNK_ELEMS // cols)
            bad = 0
            for r in range(0, n, step):
                chunk = x[r: r + step].to(torch.float32)
                bad += count_nonfinite(chunk)
                c = fn(chunk)
                out[r: r + step] = c
                if meter is not None:
                    meter.add(chunk, decode(chunk, c))
            report.count("nonfinite_quantized", name, bad)
            return out

        return OutTensor(name, dtype, (rows, out_cols), t, cast)

    if fmt in FP8_FORMATS:
        dt = ST_TO_TORCH[FP8_FORMATS[fmt]]
        top = torch.finfo(dt).max
        scale = Lazy(lambda: _nonzero(finite_amax(t) / top))
        # comfy-kitchen's quantize_per_tensor_fp8: x * (1 / scale), clamped, cast
        return [codes(dt, cols, lambda x: (x * (1.0 / scale().to(x.device))).clamp_(-top, top).to(dt),
                      lambda x, c: c.to(torch.float32) * scale().to(x.device)),
                scalar(f"{layer}.weight_scale", scale)]
    if fmt == "int8_tensorwise":
        if spec.rowwise:
            def row_scales(x):
                return _int8_scale(x.to(torch.float32).abs().amax(dim=-1, keepdim=True))

            srows = _Derived(f"{layer}.weight_scale", t, torch.float32, (rows, 1), row_scales)
            return [codes(torch.int8, cols, lambda x: _int8_round(x / row_scales(x)),
                          lambda x, c: c.to(torch.float32) * row_scales(x)),
                    OutTensor(srows.name, torch.float32, (rows, 1), srows)]
        scale = Lazy(lambda: _int8_scale(finite_amax(t)))
        return [codes(torch.int8, cols, lambda x: _int8_round(x / scale().to(x.device)),
                      lambda x, c: c.to(torch.float32) * scale().to(x.device)),
                scalar(f"{layer}.weight_scale", scale)]
    grid = mx.scale_grid(rows, cols // BLOCK[fmt])
    if fmt == "nvfp4":
        gscale = Lazy(lambda: _nonzero(finite_amax(t) / (mx.E4M3_MAX * mx.E2M1_MAX)))

        def fp4(x):
            g = gscale().to(x.device)
            return mx.nvfp4_codes(x, g, mx.nvfp4_block_scales(x, g))

        def fp4_decoded(x, c):
            g = gscale().to(x.device)
            return mx.nvfp4_decode(c, g, mx.nvfp4_block_scales(x, g))

        def fp4_scales(x):
            return mx.nvfp4_block_scales(x.to(torch.float32), gscale().to(x.device)).view(torch.uint8)

        bs = _Derived(f"{layer}.weight_scale", t, torch.float8_e4m3fn, grid, fp4_scales, blocked=True)
        return [codes(torch.uint8, cols // 2, fp4, fp4_decoded), OutTensor(bs.name, torch.float8_e4m3fn, grid, bs),
                scalar(f"{layer}.weight_scale_2", gscale)]
    bs = _Derived(f"{layer}.weight_scale", t, torch.float8_e8m0fnu, grid,
                  lambda x: mx.mxfp8_block_scales(x.to(torch.float32))[0], blocked=True)
    return [codes(torch.float8_e4m3fn, cols, mx.mxfp8_codes,
                  lambda x, c: mx.mxfp8_decode(c, mx.mxfp8_block_scales(x)[0])),
            OutTensor(bs.name, torch.float8_e8m0fnu, grid, bs)]


def config_tensor(layer: str, spec: QuantSpec, home: str) -> OutTensor:
    """`X.comfy_quant`: the layer's config as UTF-8 JSON bytes in a U8 tensor (ComfyUI's own encoding)."""
    data = json.dumps(spec.config).encode("utf-8")
    key = f"{layer}.comfy_quant"
    src = ComputedTensor(key, lambda: torch.tensor(list(data), dtype=torch.uint8), torch.uint8, (len(data),), home=home)
    return OutTensor(key, torch.uint8, (len(data),), src)


def _nonzero(s: torch.Tensor) -> torch.Tensor:
    """A per-tensor scale; an all-zero tensor gets 1 (any scale decodes zeros to zeros, and 0 would make
    comfy-kitchen's block scales 0/0)."""
    return torch.where(s > 0, s, torch.ones_like(s)).to(torch.float32)


def _int8_round(y: torch.Tensor) -> torch.Tensor:
    """comfy-kitchen's int8 rounding: round half to even, saturate at [-128, 127] (NaN: 0)."""
    return y.nan_to_num_(0.0).round_().clamp_(-128, 127).to(torch.int8)


def _int8_scale(amax: torch.Tensor) -> torch.Tensor:
    """comfy-kitchen's int8 scale: amax / 127, at least 1e-30."""
    return (amax.to(torch.float32) / 127.0).clamp(min=1e-30)


class _Derived(Tensor):
    """A small tensor computed from the rows of a weight: per-row int8 scales, or block scales (then the
    rows of the padded, blocked grid: 128 per tile row, the weight read in bands within each)."""

    def __init__(self, name, weight: Tensor, dtype, shape, fn, blocked: bool = False):
        self.name, self.weight, self.dtype, self.shape, self.fn = name, weight, dtype, tuple(shape), fn
        self.home, self.blocked = weight.home, blocked
        self.row_align = mx.TILE_ROWS if blocked else weight.row_align

    @property
    def source_bytes(self):
        return 0

    def read(self, start, stop, device, scratch=None):
        wrows, cols = self.weight.shape
        a, b = min(start, wrows), min(stop, wrows)
        align = self.weight.row_align
        if align is None:  # the weight is read whole
            parts = [self.fn(self.weight.read(0, wrows, device)[a:b])] if b > a else []
        else:
            step = max(align, CHUNK_ELEMS // max(cols, 1) // align * align)
            parts = [self.fn(self.weight.read(r, min(b, r + step), device)) for r in range(a, b, step)]
        if not self.blocked:
            return torch.cat(parts) if parts else torch.empty((0, 1), dtype=self.dtype, device=device)
        if start % mx.TILE_ROWS or (stop - start) % mx.TILE_ROWS:
            raise ValueError(f"{self.name}: blocked scales are produced in whole 128-row tiles")
        nat = torch.cat(parts) if parts else torch.empty((0, self.shape[1]), dtype=torch.uint8, device=device)
        nat = mx.pad_grid(nat, stop - start, self.shape[1])
        return mx.swizzle(nat).view(self.dtype)

class ComfyQuantEncoding(Encoding):
    """A new value of a comfy_quant layer stored as the base layer is: same format (and int8 row-wise or
    not), `X.weight` and its scales computed from the value's fp32 values by `encode` (comfy-kitchen's
    arithmetic: a per-tensor scale amax / fp8 max, int8 scales amax / 127, nvfp4's global scale amax /
    (448 * 6) and its block scales, mxfp8's e8m0 block exponents). Per-tensor and global scales read the
    value twice (amax pass, then codes); block and row scales are band-local. A weight comfy-kitchen padded
    to the block size is padded again with zeros; nvfp4's `pre_quant_scale` is kept and the value divided
    by it before encoding (the decoder multiplies it back). `X.comfy_quant`, `X.input_scale` and the
    file's `_quantization_metadata` are copied as stored."""

    def __init__(self, spec: QuantSpec, wkey: str, stored_shape, col_scale: Tensor | None = None):
        self.spec, self.wkey, self.stored_shape, self.col_scale = spec, wkey, tuple(stored_shape), col_scale
        layer = wkey[: -len(".weight")] if wkey.endswith(".weight") else wkey
        self.keys = (wkey, f"{layer}.weight_scale") + ((f"{layer}.weight_scale_2",) if spec.format == "nvfp4" else ())
        self.label = f"comfy_quant {spec.format}" + (" row-wise" if spec.rowwise else "")

    def why_not(self) -> str | None:
        return unencodable(self.spec, self.stored_shape)

    def encode(self, value: Tensor, report: Report, meter) -> list[OutTensor]:
        v = value
        if self.col_scale is not None:
            v = _ColumnDivided(v, self.col_scale)
            meter = _ColumnMeter(meter, self.col_scale)
        if tuple(v.shape) != self.stored_shape:
            v = _ZeroPadded(v, self.stored_shape)
        return encode(self.spec, v, report, name=self.wkey, meter=meter)


class _ColumnDivided(Tensor):
    """value / pre_quant_scale per column (what the stored nvfp4 codes hold before ComfyUI's smoothing)."""

    def __init__(self, base: Tensor, col: Tensor):
        self.base, self.col, self.name, self.home = base, col, base.name, base.home
        self.shape, self.dtype, self.row_align = tuple(base.shape), torch.float32, base.row_align

    def read(self, start, stop, device, scratch=None):
        c = self.col.read_all(device).to(torch.float32).reshape(1, -1)
        return self.base.read(start, stop, device, scratch).to(torch.float32) / c


class _ColumnMeter:
    """Measures the error on the smoothed-back values: both sides times the column scales."""

    def __init__(self, meter, col: Tensor):
        self.meter, self.col = meter, col

    def add(self, x, decoded):
        c = self.col.read_all(x.device).to(torch.float32).reshape(1, -1)
        n = c.shape[1]
        self.meter.add(x[:, :n] * c, decoded[:, :n] * c)


class _ZeroPadded(Tensor):
    """A weight padded with zeros to the stored (block-multiple) shape, as comfy-kitchen pads it."""

    def __init__(self, base: Tensor, shape):
        self.base, self.name, self.home = base, base.name, base.home
        self.shape, self.dtype = tuple(shape), torch.float32
        self.row_align = None if base.row_align is None else 1

    def read(self, start, stop, device, scratch=None):
        from ckpt.io.tensors import read_rows

        out = torch.zeros((stop - start, self.shape[1]), dtype=torch.float32, device=device)
        r1 = min(stop, self.base.rows)
        if start < r1:
            out[: r1 - start, : self.base.shape[1]] = read_rows(self.base, start, r1, device).to(torch.float32)
        return out
