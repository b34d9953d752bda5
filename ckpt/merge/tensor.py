"""One merged output tensor as a logical `Tensor` the ordinary writer streams.

`read(start, stop)` reads rows [start, stop) of every input (each into its own scratch buffers), widens them to
the compute dtype (rounding them to the config's `dtype` first, as mergekit casts its inputs), and lets the method
merge them. A method of kind "stats" makes its whole-tensor statistics on the first read, by passing over the
inputs' bands (`Job.passes`), and keeps them (a few numbers or per-row vectors) for the tensor's life, so the rows
of a fused tensor read piecewise by a layout conversion (`--layout`) reuse them. A "whole" method reads the tensor
in one band.

Bands are at most `BAND_ELEMS` (1M) elements, not the writer's 8M: a merge runs a chain of elementwise operations
over several inputs' bands (TIES: deltas, magnitudes, masks, the sign election), which is bound by memory traffic;
bands that stay in the CPU's caches made a 1 GB TIES merge 2x faster and its peak RSS 3x smaller on the 2-core
machine (256K to 1M elements were equally fast; linear was fastest at 1M).

NaN/Inf the merge makes: every merged band is checked (one min/max reduction over the band, which the cache still
holds). A band with NaN/Inf whose inputs had none (read again, before the config's `dtype` rounding; for a method
with whole-tensor statistics, the whole tensor's inputs) was made by the merge: parameters that scale finite values
past the compute dtype's range or divide by zero. That is refused in one line naming the tensor, before the output
is published, rather than written with a warning that blames the inputs (the Caster's count of the NaN/Inf it
is handed, `ckpt.cast`, holds true only where the inputs had them). The config checks refuse what they can see
before any input is opened (weights of 1e39, weights that sum to 0 and are divided by their sum); this is for what
depends on the values.
"""

from __future__ import annotations

import math

from ckpt.lazy import torch

from ckpt.dtypes import as_torch, st_name
from ckpt.errors import CkptError
from ckpt.io.tensors import Tensor, row_bands
from ckpt.merge.methods.base import Band, Job, Method
from ckpt.report import plural

BAND_ELEMS = 1 << 20


def finite(x) -> bool:
    """No NaN or infinity in the floating tensor `x` (min and max are NaN where any value is)."""
    if not x.numel():
        return True
    v = x.reshape(-1)
    if v.dtype not in (torch.float32, torch.float64):
        v = v.float()
    lo, hi = torch.aminmax(v)
    return bool(torch.isfinite(lo) & torch.isfinite(hi))


def _lcm(values) -> int:
    out = 1
    for v in values:
        out = out * v // math.gcd(out, v)
    return out


class MergedModelTensor(Tensor):
    def __init__(self, job: Job, method: Method, home: str, round_to=None, replaces=None):
        self.job, self.method, self.home = job, method, home
        self.replaces = replaces  # the reference's decoded tensor it stands for (--keep-format re-encodes it)
        self.name, self.shape = job.names[0], tuple(job.shape)
        self.round_to = round_to  # the config's `dtype` below fp32: inputs rounded to it first
        self.kind = method.kind_of(job) if method.kind_of is not None else method.kind
        aligns = [t.row_align for t in job.inputs]
        self.row_align = None if (self.kind == "whole" or not self.shape or None in aligns) else _lcm(aligns)
        self.band_elems = BAND_ELEMS
        self.state = None
        self.stated = False
        job.passes = self._passes

    # Planned by the compute dtype's name (`ckpt.merge.jobs.compute_dtypes`) and the inputs' natural dtype names,
    # without torch; the first read gives the method torch's dtypes (`_torch_dtypes`).
    @property
    def dtype(self):
        return as_torch(self.job.compute)

    @property
    def dtype_name(self) -> str:
        return st_name(self.job.compute)

    def natural_source(self) -> Tensor:
        """The base's (or the first input's) natural dtype is the merged tensor's."""
        return self.job.inputs[self.job.base if self.job.base is not None else 0]

    def _torch_dtypes(self) -> None:
        self.job.compute = as_torch(self.job.compute)
        self.round_to = as_torch(self.round_to) if self.round_to is not None else None

    @property
    def source_bytes(self):
        return sum(t.source_bytes for t in self.job.inputs)

    def _inputs(self, start, stop, device, scratch):
        xs = []
        for i, t in enumerate(self.job.inputs):
            sub = scratch.child(i) if scratch is not None else None
            x = t.read(start, stop, device, sub)
            if self.round_to is not None and x.dtype != self.round_to and x.is_floating_point():
                x = x.to(self.round_to)
            if sub is not None and device.type == "cpu":
                y = sub.typed("merge-in", self.dtype, x.shape)
                y.copy_(x)
            else:
                y = x.to(self.dtype, copy=True)
            xs.append(y)
        return xs

    def _passes(self):
        """One pass over the whole tensor: (Band, inputs) per band, at the writer's band size."""
        from ckpt.io import output

        device = self.job.device or torch.device("cpu")
        for a, b in row_bands(self.rows, self.row_numel, self.row_align, min(output.BAND_ELEMS, self.band_elems)):
            yield Band(a, b, self.row_numel), self._inputs(a, b, device, None)

    def read(self, start, stop, device, scratch=None):
        self._torch_dtypes()
        self.job.device = device
        if self.kind == "stats" and not self.stated:
            self.state = self.method.stats(self.job)
            self.stated = True
        if not self.shape:  # 0-d: the whole value
            start, stop = 0, 1
        xs = self._inputs(start, stop, device, scratch)
        y = self.method.merge(self.job, xs, Band(start, stop, self.row_numel), self.state)
        if y.dtype != self.dtype:
            y = y.to(self.dtype)
        if not finite(y) and self._inputs_finite(start, stop, device):
            n = int((~torch.isfinite(y)).sum())
            raise CkptError(f"{self.job.source}: {self.method.name} made {plural(n, 'NaN/Inf value')} in {self.name} "
                            "from finite inputs (its parameters take the values past the compute dtype's range, or "
                            "divide by 0); nothing was written")
        return y

    def _inputs_finite(self, start, stop, device) -> bool:
        """Whether the inputs, as stored (before the config's dtype rounding), are finite in rows [start, stop),
        or in the whole tensor where the method's statistics span it."""
        if self.kind != "rows" or not self.shape:
            bands = row_bands(self.rows, self.row_numel, self.row_align, min(BAND_ELEMS, self.band_elems))
        else:
            bands = [(start, stop)]
        for a, b in bands:
            for t in self.job.inputs:
                x = t.read(a, b, device, None)
                if x.is_floating_point() and not finite(x):
                    return False
        return True
