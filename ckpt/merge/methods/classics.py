"""The Stable Diffusion "classic" merges (A1111's checkpoint merger, supermerger, sd-mecha), as sd-mecha 1.1.8
defines them. `models: [A, B]` or `[A, B, C]` in that order, no `base_model` (A is the primary model and names the
output); one shared `alpha` per tensor (a scalar, a gradient over the blocks, or `{filter, value}` conditions: a
supermerger per-block list).

- `weighted_sum`: `(1 - alpha) * A + alpha * B` (sd-mecha's `torch.lerp(A, B, alpha)`; A1111 `A*(1-M) + B*M`),
  alpha 0.5 by default.
- `add_difference`: `A + alpha * (B - C)` (A1111 `A + (B - C)*M`), alpha 1.0.
- `train_difference`: supermerger's "Train Difference": add_difference whose alpha is, element by element,
  sd-mecha's `train_difference_mask`, `alpha * 1.8 * nan_to_num(|B - A| / (|B - A| + |B - C|))`; alpha 1.0.
- `add_perpendicular`: sd-mecha's: with `a = A - C`, `b = B - C`, adds to A the part of `b` perpendicular to
  `a` over the whole tensor: `A + alpha * (b - a * <a, b> / <a, a>)` (nothing is added where `a` is zero or a
  difference is not finite: sd-mecha's NaN fallback); alpha 1.0. The dot products are whole-tensor statistics
  (kind "stats": one pass over the bands, summed in fp64); the other three are elementwise and stream as rows.

alpha reaches the computation as a 0-d tensor of the compute dtype, as sd-mecha hands its methods a Tensor
parameter, so the fp32 results are sd-mecha's bit for bit (tests/test_merge_classics.py).
"""

from __future__ import annotations

import math

from ckpt.errors import CkptError
from ckpt.merge.methods.base import SHARED, Method, Param
from ckpt.lazy import torch


def _alpha(default: float, what: str) -> Param:
    return Param("alpha", float, SHARED, default=default, help=what)


def _check(recipe, where):
    if recipe.slices is not None:
        raise CkptError(f"{where}: {recipe.method} merges models: [A, B, ...] as listed, whole; slices: are for "
                        "the mergekit methods")


def _alpha_of(job, x):
    """alpha as a 0-d tensor of the compute dtype, as sd-mecha hands its methods a Tensor parameter: the same
    kernels and roundings as its (alpha * 1.8 of train_difference rounds in that dtype too)."""
    return torch.tensor(job.shared["alpha"], dtype=x.dtype, device=x.device)


def _weighted_sum(job, xs, band, state):
    return torch.lerp(xs[0], xs[1], _alpha_of(job, xs[0]))


def _add_difference(job, xs, band, state):
    return xs[0].addcmul(xs[1] - xs[2], _alpha_of(job, xs[0]))


def _train_difference(job, xs, band, state):
    a, b, c = xs
    d = b - c
    ab = (b - a).abs_()
    mask = torch.nan_to_num(ab / (ab + d.abs()), nan=0.0).mul_(_alpha_of(job, a) * 1.8)
    return a.addcmul(d, mask)


def _perpendicular_stats(job):
    """<a, b> / <a, a> over the whole tensor (a = A - C, b = B - C), in fp64; None where the projection is
    undefined (a is zero) or a difference is not finite: then nothing is added."""
    dot = aa = 0.0
    for _, (x, y, z) in job.passes():
        a = (x - z).double()
        b = (y - z).double()
        if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
            return None
        dot += float(torch.sum(a * b))
        aa += float(torch.sum(a * a))
    if aa == 0.0 or not math.isfinite(aa) or not math.isfinite(dot):
        return None
    return dot / aa


def _add_perpendicular(job, xs, band, state):
    x, y, z = xs
    if state is None:
        return x.clone()
    perp = (y - z).sub_(x - z, alpha=state)
    return x.addcmul(perp, _alpha_of(job, x))


def _classic(name, n, merge, alpha, summary, **kw) -> Method:
    return Method(name, (_alpha(*alpha),), base="primary", models=(n, n), merge=merge, check=_check,
                  summary=summary, **kw)


METHODS = (
    _classic("weighted_sum", 2, _weighted_sum, (0.5, "how much of B: (1 - alpha) * A + alpha * B"),
             "A1111/sd-mecha weighted sum of A and B"),
    _classic("add_difference", 3, _add_difference, (1.0, "how much of the difference: A + alpha * (B - C)"),
             "A1111/sd-mecha add difference: A + alpha * (B - C)"),
    _classic("train_difference", 3, _train_difference,
             (1.0, "scale of the mask: A + alpha * 1.8 * |B - A| / (|B - A| + |B - C|) * (B - C)"),
             "supermerger's Train Difference (sd-mecha's train_difference_mask as the alpha of add_difference)"),
    _classic("add_perpendicular", 3, _add_perpendicular,
             (1.0, "how much of B - C perpendicular to A - C is added to A"),
             "sd-mecha add_perpendicular: A + alpha * the part of B - C perpendicular to A - C",
             kind="stats", stats=_perpendicular_stats),
)
