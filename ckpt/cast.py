"""Casting bands to the target dtype: exact, fast, and never silent about overflow.

- FP8 sources use a lookup table built from torch's own cast, indexed two bytes at a time (65536
  entries, each holding the two target values): bit-identical to `.to()` for all 256 patterns,
  NaN payloads included, and 5-8x faster on CPU (measured, 16M elements).
- Other casts on the CPU are `copy_` into reused buffers, fused with the NaN/Inf check: the band is cast in
  steps small enough that each step's output is still in cache when `aminmax` checks it, so the band crosses
  memory once. Only a band with a NaN/Inf after the cast (a NaN/Inf input or an overflow) is computed again by
  the device formulation below, which rewrites NaNs, counts and clamps. An overflow is a finite input that the
  cast made inf; `clamp` replaces exactly those with the signed finite maximum, so --clamp never changes a
  value that casts to a finite one.
- On a GPU the same result is computed without branching on device values (NaN rewrite and clamp by masks,
  counts as device tensors), so a band costs no host synchronisation; the write stages report the counts when
  the band arrives on the host (`Slot.defer`).
- Without torch: a file whose computed tensors are all casts of stored fp32/fp16/bf16 bytes to another of the
  three is written without importing torch (`BandCast.host`, `ckpt.io.output.host_casts`), its bands cast by
  compiled kernels over the bit patterns (`ckpt.cast_cpu`) with the same bytes and counts. In a process that
  runs torch anyway the torch path above is kept: loading numba and its kernels there (0.3-0.4 s, ~120 MB, most
  of it while the stages run) cost a 2 GB merge-lora 0.5-1 s more than the cast gained (measured on tmpfs).
"""

from __future__ import annotations

from ckpt import cast_cpu
from ckpt.dtypes import FP8, ST_ITEMSIZE, LazyTable, as_torch, is_float, st_name
from ckpt.lazy import torch
from ckpt.io.buffers import Buffers
from ckpt.report import Report

_PAIR_LUTS: dict[tuple, torch.Tensor] = {}


def _pair_lut(src: torch.dtype, dst: torch.dtype, device) -> torch.Tensor:
    """65536 entries: entry (i + 32768) holds the two `dst` values of the int16 bit pattern i."""
    key = (src, dst, str(device))
    if key not in _PAIR_LUTS:
        pairs = (torch.arange(65536, dtype=torch.int32) - 32768).to(torch.int16)
        vals = pairs.view(torch.uint8).view(src).to(dst)  # torch's own cast, 131072 values
        wide = {2: torch.int32, 4: torch.int64, 8: None}[dst.itemsize]
        _PAIR_LUTS[key] = vals.view(wide).to(device) if wide else vals.to(device)
    return _PAIR_LUTS[key]


_SCALED_LUT: list = [None, None]  # (key, table) of the last scaled table (a tensor's scale serves all its bands)


def _scaled_pair_lut(src: torch.dtype, scale: torch.Tensor) -> torch.Tensor:
    """The float32 pair table with every value times `scale` (0-d float32): the same fp32 multiply as
    scaling each value after the lookup, done once for the 131072 table entries instead of per element."""
    key = (src, scale.view(torch.int32).item())
    if _SCALED_LUT[0] != key:
        _SCALED_LUT[:] = [key, (_pair_lut(src, torch.float32, "cpu").view(torch.float32) * scale).view(torch.int64)]
    return _SCALED_LUT[1]


_BYTE_LUTS: dict[tuple, torch.Tensor] = {}


def _byte_lut(src: torch.dtype, dst: torch.dtype, device, scale: torch.Tensor | None) -> torch.Tensor:
    """The 256 `dst` values of the fp8 bit patterns (times `scale`), computed by the CPU cast and multiply and
    moved to `device`: a GPU gathers from it instead of casting, so its bytes are the CPU's, NaN payloads
    included (CUDA's own cast and multiply give every NaN as 0x7FFF / 0x7FFFFFFF)."""
    key = (src, dst, str(device), None if scale is None else scale.cpu().view(torch.int32).item())
    if key not in _BYTE_LUTS:
        if len(_BYTE_LUTS) > 64:  # one table per tensor scale: keep the last few only
            _BYTE_LUTS.clear()
        vals = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(src).to(dst)
        _BYTE_LUTS[key] = (vals if scale is None else vals.mul_(scale.cpu())).to(device)
    return _BYTE_LUTS[key]


def fp8_upcast(x: torch.Tensor, dst: torch.dtype, buffers: Buffers | None, role: str = "cast",
               scale: torch.Tensor | None = None) -> torch.Tensor:
    """Exact cast of an fp8 tensor to a wider float dtype via the pair lookup table. The result lives in
    `buffers` under `role` (a decoder passes its own role: the Caster casts its output in "cast").
    `scale` (a 0-d float32 tensor, `dst` float32): the values times it, as `x.to(float32) * scale` gives
    them, from a table of scaled pairs (`_scaled_pair_lut`): one pass instead of two over each band."""
    n = x.numel()
    flat = x.reshape(-1)
    if x.device.type != "cpu":
        return _byte_lut(x.dtype, dst, x.device, scale)[flat.view(torch.uint8).to(torch.int32)].view(x.shape)
    scaled = (lambda y: y.mul_(scale)) if scale is not None else (lambda y: y)
    if dst.itemsize > 4 or n < 2:
        return scaled(x.to(dst))
    y = buffers.typed(role, dst, (n,)) if buffers else torch.empty(n, dtype=dst)
    even = n - (n % 2)
    if flat.storage_offset() % 2:
        return scaled(x.to(dst))
    wide = torch.int32 if dst.itemsize == 2 else torch.int64
    idx = buffers.typed(role + "-idx", torch.int32, (even // 2,)) if buffers else torch.empty(even // 2, dtype=torch.int32)
    idx.copy_(flat[:even].view(torch.int16))
    idx.add_(32768)
    lut = _pair_lut(x.dtype, dst, "cpu") if scale is None else _scaled_pair_lut(x.dtype, scale)
    torch.index_select(lut, 0, idx, out=y[:even].view(wide))
    if n % 2:
        y[even:] = scaled(flat[even:].to(dst))
    return y.view(x.shape)


# NaN payloads: devices disagree (CUDA's fp32 -> fp16 gives 0x7FFF for every NaN, x86 keeps sign and payload)
# and even torch's CPU kernels do in two cases (their vector body and scalar tail give different NaNs for
# fp16 -> fp32 and fp64 -> bf16). Every NaN a cast makes is therefore rewritten with one rule, computed with
# integer operations on whatever device holds it: the bytes torch 2.13 writes on x86 CPUs (the vector body
# where the two disagree), measured in tests/test_cast_nan.py for random payloads of every source/target pair.
_BITS = LazyTable(lambda: {torch.float64: (torch.int64, 52, 11), torch.float32: (torch.int32, 23, 8),
                           torch.float16: (torch.int16, 10, 5), torch.bfloat16: (torch.int16, 7, 8)})
_NAN_CONSTANT = LazyTable(lambda: {(torch.float32, torch.bfloat16): 0xFFFF, (torch.float64, torch.bfloat16): 0xFFFF,
                                   (torch.float16, torch.bfloat16): 0x7FC0})


def nan_bits(x: torch.Tensor, dst: torch.dtype) -> torch.Tensor:
    """The `dst` values torch's CPU cast gives the NaNs `x` (a tensor of NaNs only): a fixed NaN for the
    pairs listed in _NAN_CONSTANT; bf16 -> fp32 shifts the bits (exact); every other pair keeps the sign,
    sets the quiet bit and truncates or zero-extends the payload."""
    itype, ms, es = _BITS[x.dtype]
    otype, md, ed = _BITS[dst]
    width = 1 + md + ed
    if (x.dtype, dst) in _NAN_CONSTANT:
        out = torch.full(x.shape, _NAN_CONSTANT[(x.dtype, dst)], dtype=torch.int64, device=x.device)
    else:
        b = x.view(itype).to(torch.int64)
        if x.dtype != torch.float64:
            b = b & ((1 << (1 + ms + es)) - 1)  # the unsigned bit pattern
        sign = (b >> (ms + es)) & 1
        frac = b & ((1 << ms) - 1)
        frac = frac >> (ms - md) if ms >= md else frac << (md - ms)
        quiet = 0 if (x.dtype, dst) == (torch.bfloat16, torch.float32) else 1 << (md - 1)
        out = (sign << (width - 1)) | (((1 << ed) - 1) << md) | quiet | frac
    out = out - (out >= (1 << (width - 1))).to(torch.int64) * (1 << width)  # as a signed `width`-bit integer
    return out.to(otype).view(dst)


FUSE_ELEMS = 1 << 16  # elements per intra-op thread and fused step (256 kB of fp32 output: in L2)


def _copy_and_check(y: torch.Tensor, x: torch.Tensor) -> bool:
    """`y.copy_(x)` for flat CPU tensors, each cache-sized step checked right after it is cast; True if
    `y` holds a NaN or an infinity. Each step spans the intra-op threads, each thread checking the part
    it just wrote (torch splits both ops the same way)."""
    n = x.numel()
    if n == 0:
        return False
    step = FUSE_ELEMS * max(1, torch.get_num_threads())
    k = -(-n // step)
    lo, hi = torch.empty(k, dtype=y.dtype), torch.empty(k, dtype=y.dtype)
    for yc, xc, lo_j, hi_j in zip(y.split(step), x.split(step), lo.unbind(), hi.unbind()):
        yc.copy_(xc)
        torch.aminmax(yc, out=(lo_j, hi_j))
    return not bool(torch.isfinite(lo).all() and torch.isfinite(hi).all())


def kernel_casts(src: str, dst: str) -> bool:
    """Whether `ckpt.cast_cpu` casts `src` to `dst` (safetensors names) here."""
    return cast_cpu.supports(src, dst) and cast_cpu.available()


def _later(buffers, fn, value: torch.Tensor) -> None:
    """`fn(value)` once `value` (a device tensor of counts) is on the host: when the write stages brings
    the band back (`Slot.defer`), else now."""
    defer = getattr(buffers, "defer", None)
    if defer is not None:
        defer(fn, value)
    else:
        fn(value.cpu())


class Caster:
    """Casts bands of floating tensors to `target`, counting what the user must know about."""

    def __init__(self, target: torch.dtype | str, report: Report, clamp: bool = False):
        self._target, self.report, self.clamp = target, report, clamp  # a name: a plan made without torch

    def band(self, name: str) -> "BandCast":
        """The cast of tensor `name`'s bands (what `OutTensor.cast` holds)."""
        return BandCast(self, name)

    @property
    def target(self) -> torch.dtype:
        return as_torch(self._target)

    def __call__(self, x: torch.Tensor, name: str, buffers: Buffers | None = None) -> torch.Tensor:
        # Element-wise work on a flat view: the result has x's shape, but reductions and masks never walk
        # a shape like [1] * 100000 + [4] (torch takes minutes reducing over that many dims).
        return self._cast(x.reshape(-1), name, buffers).view(x.shape)

    def _cast(self, x: torch.Tensor, name: str, buffers: Buffers | None) -> torch.Tensor:
        dst = self.target
        if not is_float(x.dtype) or x.dtype == dst:
            if is_float(x.dtype):
                self._scan_input(x, name, buffers)
            return x
        if x.dtype in FP8:
            if dst in FP8:
                return self._to_fp8(x.float(), name, buffers)
            y = fp8_upcast(x, dst, buffers)  # exact; only NaN/Inf already in the input can be there
            self._scan_input(y, name, buffers)
            return y
        if dst in FP8:
            return self._to_fp8(x, name, buffers)
        if x.device.type != "cpu":
            return self._cast_on_device(x, name, buffers)
        y = buffers.typed("cast", dst, x.shape) if buffers else torch.empty(x.shape, dtype=dst)
        if _copy_and_check(y, x):
            # the rare band with a NaN/Inf after the cast (a NaN/Inf input or an overflow): the device formulation,
            # which rewrites NaNs, counts and clamps (values just above the finite maximum round down to it)
            return self._cast_on_device(x, name, buffers)
        return y

    def counted(self, name: str, nonfinite: int, overflowed: int) -> None:
        """Report a band's NaN/Inf inputs and its overflows (clamped ones with --clamp)."""
        self.report.count("nonfinite_input", name, nonfinite)
        self.report.count("clamped" if self.clamp else "overflow", name, overflowed)

    def host_cast(self, src: str, name: str):
        """The cast of tensor `name`'s bands of stored `src` values (a safetensors name) as numpy arrays, without
        torch: `fn(x, buffers) -> y` (y in `buffers`' host memory, `Buffers.host`), or None where no kernel casts
        `src` to the target here."""
        dst = st_name(self._target)
        if not kernel_casts(src, dst):
            return None
        ratio = ST_ITEMSIZE[dst] / ST_ITEMSIZE[src]

        def fn(x, buffers):
            y = buffers.host("cast", int(x.nbytes * ratio))
            if x.size:
                self.counted(name, *cast_cpu.cast(src, dst, x, y, self.clamp))
            return y

        return fn

    def _cast_on_device(self, x: torch.Tensor, name: str, buffers) -> torch.Tensor:
        """The CPU path's result (and the kernels', `ckpt.cast_cpu`) without a host round trip: every rewrite
        is a mask, counts stay on the device until the band is back on the host."""
        dst = self.target
        limit = torch.finfo(dst).max
        y = x.to(dst)
        bad_in = ~torch.isfinite(x)
        over = torch.isinf(y) & ~bad_in
        if x.dtype in _BITS and dst in _BITS and dst != torch.float64:
            y = torch.where(torch.isnan(x), nan_bits(x, dst), y)  # nan_bits of the non-NaNs is discarded
        if self.clamp:
            y.masked_fill_(over & (x > 0), limit).masked_fill_(over & (x < 0), -limit)
        kind = "clamped" if self.clamp else "overflow"

        def report(c, name=name, kind=kind):
            self.report.count("nonfinite_input", name, int(c[0]))
            self.report.count(kind, name, int(c[1]))

        _later(buffers, report, torch.stack([bad_in.sum(), over.sum()]))
        return y

    def _scan_input(self, x: torch.Tensor, name: str, buffers=None) -> None:
        if not x.numel():
            return
        v = x.float() if x.dtype in FP8 else x
        if v.device.type != "cpu":
            _later(buffers, lambda c, n=name: self.report.count("nonfinite_input", n, int(c)),
                   (~torch.isfinite(v)).sum())
            return
        mn, mx = torch.aminmax(v.reshape(-1))
        if not (torch.isfinite(mn) and torch.isfinite(mx)):
            self.report.count("nonfinite_input", name, int((~torch.isfinite(v)).sum()))

    def _to_fp8(self, x: torch.Tensor, name: str, buffers=None) -> torch.Tensor:
        limit = torch.finfo(self.target).max
        finite = torch.isfinite(x)
        counts = torch.stack([(~finite).sum(), ((x.abs() > limit) & finite).sum()])

        def report(c, name=name):
            self.report.count("nonfinite_input", name, int(c[0]))
            self.report.count("saturated", name, int(c[1]))

        if x.device.type == "cpu":
            report(counts)
        else:
            _later(buffers, report, counts)
        return torch.where(finite, x.clamp(-limit, limit), x).to(self.target)


class BandCast:
    """A Caster's cast of one tensor's bands, `fn(band, buffers)` as `OutTensor.cast` takes it; `host(src)` is the
    same cast of stored `src` bytes without torch (`Caster.host_cast`), which `ckpt.io.output` runs where every
    computed tensor of a file has one."""

    def __init__(self, caster: Caster, name: str):
        self.caster, self.name = caster, name

    def __call__(self, x, buffers=None):
        return self.caster(x, self.name, buffers)

    def host(self, src: str):
        return self.caster.host_cast(src, self.name)
