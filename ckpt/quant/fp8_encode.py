"""Storing a new value of a scaled-FP8 weight the way its base stored it (the encodings `ckpt.quant.fp8`'s
decoders attach; see `ckpt.quant.encoding`).

- ComfyUI legacy scaled fp8 (`X.weight` fp8, `X.scale_weight` fp32 scalar): a new scale from the new value and
  the codes, by the rule of the layout's own writer, `convert --to fp8_e4m3fn --scaled` (`ckpt.targets.planners.fp8_out`,
  ComfyUI's "tensor / scale"), so that a --keep-format merge is byte for byte `convert --scaled` of the plain
  merge: s = amax(|finite W|) / fp8 max (at least the smallest normal fp32; 1 for an all-zero tensor), codes =
  W / s saturated at +-fp8 max (NaN stays NaN), in the weight's own fp8 type. Not comfy-kitchen's
  `quantize_per_tensor_fp8` (that is the comfy_quant layout's rule): it multiplies by the rounded 1/s, which
  lands one fp8 step apart where W / s lies within an fp32 rounding of a halfway point (about one value in
  seven million), and leaves a scale under 448 * 2^-126 subnormal, whose reciprocal overflows. Read twice: an
  amax pass, then the codes. A high-precision layer that carries a (dummy) `scale_weight` keeps it: W / s in
  the weight's dtype.
- kohya sd-scripts / musubi-tuner `fp8_scaled` (`X.scale_weight` [1] per tensor, [out, 1] per row, or
  [out, nb, 1] per block of in/nb inputs, with musubi's optional second-level `X.scale_weight_tensor`):
  musubi-tuner's `quantize_weight` in fp32 on the new value, mode and block size from the stored scale's
  shape: scale = amax / fp8 max clamped to >= 1e-8 (per tensor, row or block); with a tensor-level scale
  t = max(block scales) >= 1e-8, block scale = max(scale / t, 1e-8), total = max(scale * t, 1e-8); codes =
  clamp(nan_to_num(W / total), +-fp8 max). Scales are stored in their stored dtype and the codes divided by
  the stored (rounded) scales, so decoding them gives back what the codes were made from. Per-row and
  per-block scales are band-local; per-tensor ones read the value twice.
"""

from __future__ import annotations

from ckpt.lazy import torch

from ckpt.dtypes import FP8, short_name
from ckpt.io.plan import OutTensor
from ckpt.io.tensors import ComputedTensor, Tensor
from ckpt.quant.encoding import Derived, Encoding, ErrorMeter, Lazy
from ckpt.report import Report

KOHYA_MIN_SCALE = 1e-8  # musubi-tuner's numerical floor for every scale


def _scalar_out(key: str, dtype, shape, fn, home: str) -> OutTensor:
    src = ComputedTensor(key, lambda: fn().to(dtype).reshape(shape), dtype, shape, home=home)
    return OutTensor(key, dtype, tuple(shape), src)


class ComfyScaledFP8Encoding(Encoding):
    """ComfyUI legacy scaled fp8 (module docstring)."""

    def __init__(self, wkey: str, weight: Tensor, skey: str, scale: Tensor):
        self.wkey, self.skey, self.weight, self.scale = wkey, skey, weight, scale
        self.keys = (wkey, skey) if weight.dtype in FP8 else (wkey,)
        self.label = f"comfy scaled {short_name(weight.dtype)}" if weight.dtype in FP8 else \
            f"{short_name(weight.dtype)} (scale_weight kept)"

    def why_not(self) -> str | None:
        if self.weight.dtype in FP8 and self.weight.dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
            return f"{self.wkey!r} is {short_name(self.weight.dtype)}, which ComfyUI's scaled fp8 does not write"
        if self.weight.dtype in FP8 and (self.scale.dtype != torch.float32 or self.scale.numel != 1):
            return (f"{self.skey!r} is {short_name(self.scale.dtype)} {list(self.scale.shape)}; ckpt writes "
                    "ComfyUI's one fp32 scale per weight")
        return None

    def encode(self, value: Tensor, report: Report, meter: ErrorMeter) -> list[OutTensor]:
        from ckpt.quant.comfy_quant import finite_amax

        if self.weight.dtype not in FP8:
            return _kept_scale(self.wkey, self.weight, self.scale, value, report, meter)
        dt, wkey = self.weight.dtype, self.wkey
        scale = Lazy(lambda: legacy_scale(finite_amax(value), torch.finfo(dt).max))

        def enc(x, buffers):
            x = x.to(torch.float32)
            s = scale().to(x.device)
            report.count("nonfinite_input", wkey, int((~torch.isfinite(x)).sum()))
            codes = legacy_codes(x, s, dt)
            meter.add(x, codes.to(torch.float32) * s)
            return codes

        return [OutTensor(wkey, dt, tuple(self.weight.shape), value, enc),
                _scalar_out(self.skey, torch.float32, tuple(self.scale.shape), scale, value.home)]


def legacy_scale(amax: torch.Tensor, top: float) -> torch.Tensor:
    """The legacy layout's per-tensor scale of a weight whose finite amax is `amax` (module docstring)."""
    return torch.where(amax > 0, torch.clamp(amax / top, min=torch.finfo(torch.float32).tiny),
                       torch.ones((), dtype=torch.float32))


def legacy_codes(x: torch.Tensor, s: torch.Tensor, dt: torch.dtype) -> torch.Tensor:
    """fp32 values -> the legacy layout's codes: W / s saturated at +-max of `dt`, NaN kept NaN (module docstring)."""
    y = x / s
    top = torch.finfo(dt).max
    return torch.where(torch.isfinite(y), y.clamp(-top, top), y).to(dt)


def _kept_scale(wkey, weight, scale, value, report, meter) -> list[OutTensor]:
    """A high-precision weight with a scale: W / s stored in the weight's dtype, the scale kept as stored."""
    from ckpt.cast import Caster

    caster = Caster(weight.dtype, report)

    def cast(x, buffers):
        s = scale.read_all(x.device).to(torch.float32).reshape(())
        y = caster(x.to(torch.float32) / s, wkey, buffers)
        meter.add(x, y.to(torch.float32) * s)
        return y

    return [OutTensor(wkey, weight.dtype, tuple(weight.shape), value, cast)]


class KohyaFP8Encoding(Encoding):
    """kohya / musubi-tuner fp8_scaled (module docstring). `layout` is the decoder's ScaleLayout."""

    def __init__(self, wkey: str, weight: Tensor, skey: str, scale: Tensor, layout, tkey: str | None = None,
                 tscale: Tensor | None = None):
        self.wkey, self.weight, self.skey, self.scale, self.layout = wkey, weight, skey, scale, layout
        self.tkey, self.tscale = tkey, tscale
        self.keys = (wkey, skey) + ((tkey,) if tkey else ())
        mode = {"tensor": "per tensor", "row": "per row", "group": f"blocks of {self._block()}"}.get(layout.kind, "")
        self.label = f"kohya {short_name(weight.dtype)} scaled ({mode})"

    def _block(self) -> int:
        return self.weight.shape[1] // self.layout.groups if self.layout.kind == "group" else 0

    def why_not(self) -> str | None:
        if self.weight.dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
            return f"{self.wkey!r} is {short_name(self.weight.dtype)}, not e4m3fn or e5m2"
        if self.layout.kind not in ("tensor", "row", "group") or (self.layout.kind != "tensor" and len(self.weight.shape) != 2):
            return f"scale layout {self.layout.kind} of {self.skey!r} is not one musubi-tuner writes"
        if self.tkey and self.layout.kind != "group":
            return f"{self.tkey!r} beside a {self.layout.kind} scale is not a layout musubi-tuner writes"
        return None

    def encode(self, value: Tensor, report: Report, meter: ErrorMeter) -> list[OutTensor]:
        from ckpt.quant.comfy_quant import finite_amax

        dt, sdt = self.weight.dtype, self.scale.dtype
        top = torch.finfo(dt).max
        kind, groups = self.layout.kind, self.layout.groups
        floor = KOHYA_MIN_SCALE

        def stored(s: torch.Tensor, dtype) -> torch.Tensor:
            return s.to(dtype).to(torch.float32)  # what the decoder will read back

        # per-tensor amax, when a scale needs it (read once, on first use, by a streamed pass)
        amax = Lazy(lambda: finite_amax(value))
        tensor_scale = Lazy(lambda: stored(torch.clamp(amax() / top, min=floor), self.tscale.dtype if self.tscale is not None else sdt))

        def row_scales(x: torch.Tensor) -> torch.Tensor:
            """Stored scales (fp32 of the stored dtype) of a band, shaped to broadcast over its rows."""
            rows = x.shape[0]
            if kind == "row":
                return stored(torch.clamp(x.abs().reshape(rows, -1).amax(dim=1, keepdim=True) / top, min=floor), sdt)
            bm = x.abs().reshape(rows, groups, -1).amax(dim=2, keepdim=True) / top
            if self.tkey is None:
                return stored(torch.clamp(bm, min=floor), sdt)
            return stored(torch.clamp(bm / tensor_scale().to(x.device), min=floor), sdt)

        def total(x: torch.Tensor) -> torch.Tensor:
            if kind == "tensor":
                return stored(torch.clamp(amax().to(x.device) / top, min=floor), sdt).reshape(())
            s = row_scales(x)
            if self.tkey is not None:
                s = torch.clamp(s * tensor_scale().to(x.device), min=floor)
            return s

        def enc(x, buffers):
            x = x.to(torch.float32)
            report.count("nonfinite_input", self.wkey, int((~torch.isfinite(x)).sum()))
            t = total(x)
            shaped = x.reshape(x.shape[0], groups, -1) if kind == "group" else x
            codes = torch.clamp(torch.nan_to_num(shaped / t), -top, top).to(dt).reshape(x.shape)
            dec = (codes.to(torch.float32).reshape(shaped.shape) * t).reshape(x.shape)
            meter.add(x, dec)
            return codes

        outs = [OutTensor(self.wkey, dt, tuple(self.weight.shape), value, enc)]
        sshape = tuple(self.scale.shape)
        if kind == "tensor":
            outs.append(_scalar_out(self.skey, sdt, sshape, lambda: torch.clamp(amax() / top, min=floor), value.home))
        else:
            src = Derived(self.skey, value, sdt, sshape,
                          lambda x, a, b: row_scales(x.to(torch.float32)).to(sdt).reshape((b - a, *sshape[1:])))
            outs.append(OutTensor(self.skey, sdt, sshape, src))
        if self.tkey is not None:
            outs.append(_scalar_out(self.tkey, self.tscale.dtype, tuple(self.tscale.shape),
                                    lambda: tensor_scale(), value.home))
        return outs
