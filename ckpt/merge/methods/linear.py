"""`linear` (mergekit): the weighted mean of the inputs, sum(w_i * x_i) / sum(w_i) (without the division when
`normalize: false`). Every input, the base included, takes a `weight`; elementwise, so it streams in bands. The sum
runs in input order in the compute dtype, as mergekit's (fp32 unless `dtype: float64`).

Deviation: weights that sum to 0 (in the compute dtype) with `normalize` are refused for the tensor they are
resolved for, before anything is written; mergekit divides by that 0 and writes NaN/Inf."""

from __future__ import annotations

from ckpt.errors import CkptError
from ckpt.merge.methods.base import INPUT, SHARED, Method, Param
from ckpt.lazy import torch


def weight_sum(weights, dtype):
    """The sum of `weights` as the merge computes it (a tensor of the compute dtype, summed in input order)."""
    return torch.tensor(weights, dtype=dtype).sum()


def _check(job):
    if job.shared["normalize"] and weight_sum([p["weight"] for p in job.per_input], job.compute) == 0:
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
