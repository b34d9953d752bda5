"""Storing a new value of an optimum-quanto weight as the base stored it (the encodings `ckpt.quant.quanto`'s
decoders attach; see `ckpt.quant.encoding`).

What `quantize(model, weights=qtype); freeze(model)` does to a module whose weight holds the new value, with
the same torch operations (so the stored bytes are identical to quanto's own):
- the value is first rounded to the module's dtype (the scale's dtype): quanto quantizes the module's
  weight, and every step below runs in that dtype;
- qint8 / qfloat8 (`AbsmaxOptimizer`, axis 0): scale = amax(|W|) per row / qtype.qmax (127, or the fp8
  maximum), data = W / scale, rounded for int8, clamped to the storage type's range; one scale for a
  one-row weight (quanto quantizes per tensor then);
- qint4 / qint2 (`MaxOptimizer`, axis 0, groups of 128/96/64/32 inputs when in_features > 128, as the
  stored data's shape says): per group row scale = (max - min) / (2**bits - 1), shift = -min; data =
  round((W + shift) / scale) clamped to [0, 2**bits - 1]; an integer (uint8) shift, which quanto writes
  with a zero-point optimizer, is round(shift / scale) clamped, and data = round(W / scale) + shift; then
  packed as quanto packs it (unpacked row i * rows_p + r in bit field i of packed row r).
Scales are per row or per group row, so every band is encoded on its own; the packed data reads the value
at the (8 / bits) places its packed rows interleave. Other optimizers (HQQ) cannot be told from the file:
the default ones are used. `M.input_scale` / `M.output_scale` are copied as stored.
"""

from __future__ import annotations

import math

from ckpt.lazy import torch

from ckpt.dtypes import short_name
from ckpt.io.plan import OutTensor
from ckpt.io.tensors import ComputedTensor, Tensor, read_rows
from ckpt.quant.encoding import Derived, Encoding, ErrorMeter
from ckpt.report import Report


def _qmax(dtype: torch.dtype):
    """quanto's qtype.qmax of the storage dtype: 127 for qint8, the fp8 maximum for qfloat8."""
    return torch.finfo(dtype).max if dtype.is_floating_point else 2 ** 7 - 1


class QuantoBytesEncoding(Encoding):
    """qint8 / qfloat8 (module docstring)."""

    def __init__(self, weight):  # a ckpt.quant.quanto.QBytesWeight
        self.w = weight
        self.keys = (weight.data.name, weight.scale.name)
        q = "qint8" if weight.data.dtype == torch.int8 else "q" + short_name(weight.data.dtype).replace("fp8", "float8")
        self.label = f"quanto {q}"

    def why_not(self) -> str | None:
        w = self.w
        if not w.shape or (w.scale.numel != 1 and not (w.rows > 1 and w.scale.shape[0] == w.rows
                                                       and w.scale.numel == w.rows)):
            return f"{self.keys[1]!r} {list(w.scale.shape)} is not one scale per row or per tensor"
        return None

    def encode(self, value: Tensor, report: Report, meter: ErrorMeter) -> list[OutTensor]:
        w = self.w
        sdt, ddt = w.scale.dtype, w.data.dtype
        per_row = w.rows > 1 and w.scale.numel == w.rows  # else one scale (quanto: a one-row weight)
        info = torch.finfo(ddt) if ddt.is_floating_point else torch.iinfo(ddt)
        qmax = _qmax(ddt)

        def scales(v: torch.Tensor) -> torch.Tensor:
            if per_row:
                return torch.amax(torch.abs(torch.abs(v)), dim=list(range(1, v.ndim)), keepdim=True) / qmax
            return torch.max(torch.abs(v)) / qmax

        def codes(v, s):
            data = v / s
            if not ddt.is_floating_point:
                data = torch.round(data)
            return torch.clamp(data, min=info.min, max=info.max).to(ddt)

        def enc(x, buffers):
            report.count("nonfinite_input", w.name, int((~torch.isfinite(x)).sum()) if x.is_floating_point() else 0)
            v = x.to(sdt)
            s = scales(v) if per_row else whole_scale().to(v.device)
            d = codes(v, s)
            meter.add(x, (d.to(sdt) * s) if ddt.is_floating_point else s * d)
            return d

        cache = {}

        def whole_scale():
            if "s" not in cache:
                cache["s"] = scales(read_rows(value, 0, value.rows, torch.device("cpu")).to(sdt))
            return cache["s"]

        sshape = tuple(w.scale.shape)
        if per_row:
            ssrc = Derived(w.scale.name, value, sdt, sshape, lambda x, a, b: scales(x.to(sdt)).reshape((b - a, *sshape[1:])))
        else:
            ssrc = ComputedTensor(w.scale.name, lambda: whole_scale().reshape(sshape), sdt, sshape, home=value.home)
        return [OutTensor(w.data.name, ddt, tuple(w.data.shape), value, enc),
                OutTensor(w.scale.name, sdt, sshape, ssrc)]


class QuantoBitsEncoding(Encoding):
    """qint4 / qint2 (module docstring)."""

    def __init__(self, weight):  # a ckpt.quant.quanto.QBitsWeight
        self.w = weight
        self.keys = (weight.packed.name, weight.scale.name, weight.shift.name)
        self.label = f"quanto qint{weight.bits}"

    def encode(self, value: Tensor, report: Report, meter: ErrorMeter) -> list[OutTensor]:
        w = self.w
        bits, urows, inner = w.bits, w.urows, w.inner
        sdt = w.scale.dtype
        top = 2 ** bits - 1
        int_shift = not w.shift.dtype.is_floating_point
        rows_p = w.packed.rows
        q = w.q  # grouped rows per value row (None: read whole)
        dims_row = urows > 1  # quanto: one grouped row -> the optimizer reduces over dim 0 instead

        def grouped(a: int, b: int):
            """(fp32 values, values in the module dtype) of grouped rows [a, b)."""
            if q is None:
                x = read_rows(value, 0, value.rows, torch.device("cpu")).to(torch.float32).reshape(urows, *inner)[a:b]
            else:
                r0, r1 = a // q, -(-b // q)
                x = read_rows(value, r0, r1, torch.device("cpu")).to(torch.float32).reshape(-1, *inner)
                x = x[a - r0 * q: b - r0 * q]
            return x, x.to(sdt)

        def scale_shift(v: torch.Tensor):
            dim = list(range(1, v.ndim)) if dims_row else list(range(0, v.ndim - 1))
            rmin = torch.amin(v, dim=dim, keepdim=True)
            rmax = torch.amax(v, dim=dim, keepdim=True)
            scale = (rmax - rmin) / (2 ** (bits - 1) - 1 - (-(2 ** (bits - 1))))
            shift = -rmin
            if int_shift:
                shift = torch.clamp(torch.round(shift / scale), 0, top).to(torch.uint8)
            return scale, shift

        def codes(v, scale, shift):
            if shift.dtype.is_floating_point:
                data = torch.round((v + shift) / scale)
            else:
                data = torch.round(v / scale) + shift
            return torch.clamp(data, min=0, max=top).to(torch.uint8)

        def decoded(u, scale, shift):
            if shift.dtype.is_floating_point:
                return scale * u - shift
            return scale * (u.to(torch.int8) - shift.to(torch.int8))

        sshape, zshape = tuple(w.scale.shape), tuple(w.shift.shape)

        class Packed(Tensor):
            name, dtype, shape, home, row_align = w.packed.name, torch.uint8, tuple(w.packed.shape), value.home, 1

            def read(self, start, stop, device, scratch=None):
                out = torch.zeros((stop - start, *inner), dtype=torch.uint8)
                for i in range(8 // bits):
                    a, b = i * rows_p + start, min(i * rows_p + stop, urows)
                    if a >= b:
                        continue
                    x, v = grouped(a, b)
                    report.count("nonfinite_input", w.name, int((~torch.isfinite(x)).sum()))
                    if dims_row:
                        scale, shift = scale_shift(v)
                    else:
                        scale, shift = whole()
                    u = codes(v, scale, shift)
                    meter.add(x, decoded(u, scale, shift))
                    out[: b - a] |= u << (bits * i)
                return out.to(device)

        cache = {}

        def whole():
            if "ss" not in cache:
                cache["ss"] = scale_shift(grouped(0, urows)[1])
            return cache["ss"]

        class StoredCompanion(Tensor):
            """The scales (which=0) or shifts (which=1) of grouped rows, computed from them."""

            home = value.home

            def __init__(self, key, dtype, shape, which):
                self.name, self.dtype, self.shape, self.which = key, dtype, shape, which
                self.row_align = 1 if dims_row else None

            def read(self, start, stop, device, scratch=None):
                if not dims_row:
                    return whole()[self.which].reshape(self.shape).to(device)
                part = scale_shift(grouped(start, stop)[1])[self.which]
                return part.reshape((stop - start, *self.shape[1:])).to(device)

        zdt = w.shift.dtype if int_shift else sdt
        return [OutTensor(w.packed.name, torch.uint8, tuple(w.packed.shape), Packed()),
                OutTensor(w.scale.name, sdt, sshape, StoredCompanion(w.scale.name, sdt, sshape, 0)),
                OutTensor(w.shift.name, zdt, zshape, StoredCompanion(w.shift.name, zdt, zshape, 1))]

    def why_not(self) -> str | None:
        w = self.w
        if w.shift.dtype.is_floating_point and w.shift.dtype != w.scale.dtype:
            return f"{self.keys[2]!r} is {w.shift.dtype}, not the scale's dtype {w.scale.dtype}"
        if not w.shift.dtype.is_floating_point and w.shift.dtype != torch.uint8:
            return f"{self.keys[2]!r} is {w.shift.dtype}; quanto writes a float or uint8 shift"
        if math.prod(w.scale.shape) not in (w.urows, math.prod(w.inner)):
            return f"{self.keys[1]!r} {list(w.scale.shape)} is not one scale per group row"
        return None
