"""`linear` (mergekit): the weighted mean of the inputs, sum(w_i * x_i) / sum(w_i) (without the division when
`normalize: false`). Every input, the base included, takes a `weight`; elementwise, so it streams in bands. The sum
runs in input order in the compute dtype, as mergekit's (fp32 unless `dtype: float64`)."""

from __future__ import annotations

from ckpt.merge.methods.base import INPUT, SHARED, Method, Param


def _merge(job, xs, band, state):
    import torch

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
           base="optional", merge=_merge, summary="weighted mean of the models"),
)
