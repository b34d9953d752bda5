"""How a logical tensor is stored, and how a new value of it is stored the same way (the mirror of decoding).

`ckpt merge-lora --keep-format` writes the base in its own encoding: every stored key a LoRA does not touch
is copied as it is stored (codes, scales, markers: byte for byte), and each changed logical tensor is
encoded again into exactly the stored keys it was decoded from. A decoder says how by giving the tensor it
returns an `encoding` attribute (an `Encoding`); a stored tensor no decoder touched is its own plain
encoding (`PlainEncoding`: cast to its stored dtype). Formats that decode only (bitsandbytes, the HF/
compressed-tensors FP8 layouts) give a `NoEncoder` with the reason, and the command refuses them by name.

`Encoding.encode(value, report, meter)` returns the `OutTensor`s of the stored keys (`keys`), each streamed
from `value` in bands, in the stored dtypes and shapes; the planner checks that. The tensor holding the codes
also feeds `meter` with each band's fp32 values and what decoding its codes gives back, so the requantization
error (relative RMS of decode(encode(x)) against x) is measured on the bytes actually written, at no extra
pass. Encodings whose scale depends on the whole tensor (a per-tensor or global scale) read the value twice:
one streamed pass for the amax, then the encoding pass; each says so in its docstring.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ckpt.lazy import torch

from ckpt.dtypes import is_float
from ckpt.io.plan import OutTensor
from ckpt.io.tensors import PickleTensor, RawTensor, Tensor
from ckpt.report import Report


class ErrorMeter:
    """Accumulates ||decoded - x||^2 and ||x||^2 in float64 over a tensor's bands (finite x only)."""

    def __init__(self, name: str, label: str):
        self.name, self.label = name, label
        self.err2 = 0.0
        self.ref2 = 0.0

    def add(self, x: torch.Tensor, decoded: torch.Tensor) -> None:
        x = x.detach().reshape(-1).to(torch.float64)
        y = decoded.detach().reshape(-1).to(device=x.device, dtype=torch.float64)
        ok = torch.isfinite(x) & torch.isfinite(y)
        if not bool(ok.all()):
            x, y = x[ok], y[ok]
        self.err2 += float(((y - x) ** 2).sum())
        self.ref2 += float((x * x).sum())

    @property
    def rel_rms(self) -> float:
        """||decoded - x|| / ||x|| (0 for an exact encoding; inf when x is all zero but decoding is not)."""
        if self.err2 == 0:
            return 0.0
        return math.sqrt(self.err2 / self.ref2) if self.ref2 > 0 else math.inf


class Lazy:
    """A per-tensor scalar computed once, on first use, by one streamed pass over the source (an encoder's
    amax or per-tensor scale, which its first band already needs)."""

    def __init__(self, fn):
        self.fn, self._v = fn, None

    def __call__(self) -> torch.Tensor:
        if self._v is None:
            self._v = self.fn()
        return self._v


class Encoding:
    """One logical tensor's stored form. Subclasses set `label` (what the report calls the format) and `keys`
    (the stored keys `encode` writes again), and implement `encode`."""

    label: str = ""
    keys: tuple[str, ...] = ()
    note: str | None = None  # said once per run (e.g. a K-quant re-encoded in another GGUF type)
    resizes: bool = False  # writes its keys in new shapes, same dtypes (SVDQuant's low-rank factors grow by a LoRA's rank)

    def why_not(self) -> str | None:
        """Why a new value cannot be stored this way (no encoder for the format), or None."""
        return None

    def encode(self, value: Tensor, report: Report, meter: ErrorMeter) -> list[OutTensor]:
        raise NotImplementedError


class NoEncoder(Encoding):
    """A format ckpt decodes but cannot write (the reason names it)."""

    def __init__(self, label: str, reason: str):
        self.label, self.reason = label, reason

    def why_not(self) -> str | None:
        return self.reason


@dataclass
class PlainEncoding(Encoding):
    """A stored tensor of a plain dtype (fp32/fp16/bf16, unscaled fp8, ints): the new value cast to that
    dtype, rounded once (the Caster counts overflow). `key`/`dtype`/`shape` are the stored ones."""

    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def label(self) -> str:
        from ckpt.dtypes import short_name

        return short_name(self.dtype)

    @property
    def keys(self) -> tuple[str, ...]:
        return (self.key,)

    def why_not(self) -> str | None:
        if not is_float(self.dtype):
            return f"{self.key!r} is stored as {self.dtype}, not a floating dtype"
        return None

    def encode(self, value: Tensor, report: Report, meter: ErrorMeter) -> list[OutTensor]:
        from ckpt.cast import Caster

        caster = Caster(self.dtype, report)

        def cast(x, buffers):
            y = caster(x, self.key, buffers)
            meter.add(x, y.to(torch.float32) if y.dtype.itemsize == 1 else y)
            return y

        return [OutTensor(self.key, self.dtype, self.shape, value, cast)]


def encoding_of(t: Tensor) -> Encoding | None:
    """The tensor's stored form: what its decoder said, a stored tensor's own dtype, else None (a decoded
    tensor whose decoder gives no encoding)."""
    enc = getattr(t, "encoding", None)
    if enc is not None:
        return enc
    if isinstance(t, (RawTensor, PickleTensor)):
        return PlainEncoding(t.name, t.dtype, tuple(t.shape))
    return None


class Derived(Tensor):
    """A stored key computed from rows of a new value: `fn(rows a..b of value, a, b)` gives the stored rows
    [a, b) (per-row scales, shifts, packed codes; whatever is row-local). Bands follow the value's own alignment;
    with `band_by_value` a band holds as many rows as the writer's band of the value does (a packed key's rows
    are a few bytes, the fp32 value's are not, so the stored key's own size would make value bands too big)."""

    def __init__(self, name: str, value: Tensor, dtype: torch.dtype, shape, fn, rows_of=None,
                 band_by_value: bool = False):
        self.name, self.value, self.dtype, self.shape, self.fn = name, value, dtype, tuple(shape), fn
        self.home = value.home
        self.rows_of = rows_of or (lambda a, b: (a, b))  # stored rows [a, b) -> value rows needed
        self.row_align = 1 if value.row_align is not None and self.shape else None
        self.band_by_value = band_by_value

    @property
    def band_elems(self):
        if not self.band_by_value:
            return None
        from ckpt.io import output

        return max(1, output.BAND_ELEMS // max(1, self.value.row_numel)) * self.row_numel

    @property
    def source_bytes(self):
        return 0

    def read(self, start, stop, device, scratch=None):
        from ckpt.io.tensors import read_rows

        a, b = self.rows_of(start, stop)
        if self.row_align is None:
            a, b = 0, self.value.rows
        x = read_rows(self.value, a, b, device)
        return self.fn(x, start, stop)
