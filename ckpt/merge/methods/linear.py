"""`linear` (mergekit): the weighted mean of the inputs, sum(w_i * x_i) / sum(w_i) (without the division when
`normalize: false`). Every input, the base included, takes a `weight`; elementwise, so it streams in bands. The sum
runs in input order in the compute dtype, as mergekit's (fp32 unless `dtype: float64`).

Deviation: weights that sum to 0 (in the compute dtype) with `normalize` are refused for the tensor they are
resolved for, before anything is written; mergekit divides by that 0 and writes NaN/Inf."""

from __future__ import annotations

from ckpt.dtypes import as_torch, st_name
from ckpt.errors import CkptError
from ckpt.merge.methods.base import INPUT, SHARED, Method, Param
from ckpt.lazy import torch


def weight_sum(weights, dtype):
    """The sum of `weights` as the merge computes it (a tensor of the compute dtype, summed in input order)."""
    return torch.tensor(weights, dtype=as_torch(dtype)).sum()


# unit roundoff of the compute dtypes whose rounding of a Python float is known without torch (round to nearest even)
_ROUNDOFF = {"F64": 2.0 ** -53, "F32": 2.0 ** -24}


def sums_to_zero(weights, dtype) -> bool:
    """Whether `weight_sum(weights, dtype) == 0`, decided without torch where it is sure (planning runs before torch
    is imported, `ckpt.lazy.prefetch`): the weights rounded to the compute dtype sum exactly (as fractions) to S, and
    each of the n - 1 additions, in whatever order torch reduces them, is off by at most u times a partial sum no
    larger than A = sum |w|; so where |S| > 2 (n - 1) u A no rounding ends at 0, and S == 0 with every weight 0 is
    0 in any order. Anything else (near-cancelling weights, overflow, other compute dtypes) asks torch itself."""
    import struct
    from fractions import Fraction

    name = st_name(dtype)
    u = _ROUNDOFF.get(name)
    if u is not None:
        try:
            if name == "F32":
                ws = [struct.unpack("<f", struct.pack("<f", float(w)))[0] for w in weights]
            else:
                ws = [float(w) for w in weights]
        except OverflowError:  # beyond fp32's range: torch's tensor holds inf
            ws = None
        if ws is not None and all(w == w and abs(w) != float("inf") for w in ws):
            if not any(ws):
                return True
            exact = sum(Fraction(w) for w in ws)
            bound = 2 * max(len(ws) - 1, 0) * Fraction(u) * sum(Fraction(abs(w)) for w in ws)
            if abs(exact) > bound:
                return False
    return bool(weight_sum(weights, dtype) == 0)


def _check(job):
    if job.shared["normalize"] and sums_to_zero([p["weight"] for p in job.per_input], job.compute):
        raise CkptError(f"{job.source}: linear's weights sum to 0 for {job.names[0]}: normalize divides by their sum "
                        "(every value would be NaN/Inf); give weights with another sum, or normalize: false "
                        "(--param normalize=false) to add them undivided")


def _merge(job, xs, band, state):
    out = torch.zeros_like(xs[0])
    weights = torch.tensor([p["weight"] for p in job.per_input], dtype=out.dtype, device=out.device)
    for x, w in zip(xs, weights):
        out.addcmul_(x, w)
    if job.shared["normalize"]:
        out.div_(weights.sum())
    return out


METHODS = (
    Method("linear", (Param("weight", float, INPUT, required=True, help="each model's weight"),
                      Param("normalize", bool, SHARED, default=True, help="divide by the sum of the weights")),
           base="optional", merge=_merge, check_job=_check, summary="weighted mean of the models"),
)
