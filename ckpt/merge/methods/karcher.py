"""`karcher` (mergekit): the Karcher (Riemannian) mean of the models on the unit hypersphere, rescaled.

Every input, the base among them when there is one (mergekit ignores the base's role here: it is one more model),
counts equally. Each tensor is one long vector: its direction (tensor / norm) is a point on the sphere; inputs of
norm <= `tol` have no direction and are left out of the mean. Starting from the normalized mean of the
directions (the first direction if that mean is shorter than `tol`), each iteration moves the mean along the
average of the log maps of the directions (theta / sin(theta) * (u - cos(theta) * mean), directions closer than
`tol` contributing nothing) by the exponential map, and renormalizes it; it stops after `max_iter` iterations or
when the step is shorter than `tol`. The result is that direction times the mean of all the inputs' norms. One
input is returned as it is; inputs all shorter than `tol` give zeros.

Streaming: kind "whole". Every iteration needs dot products of the whole current mean with every input, and the
mean changes between iterations, so each tensor is merged in one band: one whole tensor per input in memory
(the only method that needs this).

Deviation: mergekit takes a negative `tol` (then identical directions give 0/0 = NaN), a negative `max_iter` (no
iterations) and a `max_iter` of any size (with `tol: 0` and `max_iter: 10**12`, a run without end); ckpt refuses
them: tol >= 0, max_iter in [0, MAX_ITER]. (At `tol: 0` a direction exactly equal to the mean is still 0/0: the
merge then refuses the tensor, NaN made from finite inputs, `ckpt.merge.tensor`.)
"""

from __future__ import annotations

from ckpt.merge.methods.base import SHARED, Method, Param
from ckpt.lazy import torch

MAX_ITER = 1000  # mergekit's default is 10; every iteration is a pass over each input's whole tensor


def _merge(job, xs, band, state):
    if len(xs) == 1:
        return xs[0]
    tol = job.shared["tol"]
    share = 1.0 / len(xs)  # every input's weight in the final scale
    norms = [torch.linalg.vector_norm(x) for x in xs]
    kept = [i for i, n in enumerate(norms) if n.item() > tol]
    if not kept:
        return torch.zeros_like(xs[0])
    total = sum(share for _ in kept)
    alpha = [share / total for _ in kept]  # weights of the kept directions, summing to 1
    dirs = [xs[i] / norms[i] for i in kept]

    mean = torch.zeros_like(dirs[0])
    for a, u in zip(alpha, dirs):
        mean += a * u
    length = torch.linalg.vector_norm(mean)
    mean = dirs[0].clone() if length.item() < tol else mean / length

    for _ in range(job.shared["max_iter"]):
        step = torch.zeros_like(mean)
        for a, u in zip(alpha, dirs):
            cos = torch.clamp(torch.dot(mean.reshape(-1), u.reshape(-1)), -1.0, 1.0)
            theta = torch.arccos(cos)
            if theta.item() < tol:
                continue  # this direction is where the mean is: no pull
            step += a * (theta / torch.sin(theta)) * (u - cos * mean)
        size = torch.linalg.vector_norm(step)
        if size.item() < tol:
            break
        mean = torch.cos(size) * mean + torch.sin(size) * (step / size)
        length = torch.linalg.vector_norm(mean)
        if length.item() > tol:
            mean = mean / length
    scale = sum(share * n for n in norms)
    return scale * mean


METHODS = (
    Method("karcher", (Param("max_iter", int, SHARED, default=10, low=0, high=MAX_ITER,
                             why="each iteration passes over every input's whole tensor",
                             help=f"most iterations of the mean (at most {MAX_ITER})"),
                       Param("tol", float, SHARED, default=1e-5, low=0,
                             why="a negative tolerance makes identical directions 0/0",
                             help="stop when a step is shorter; norms at most this have no direction")),
           base="optional", kind="whole", merge=_merge,
           summary="Riemannian (Karcher) mean of the models' directions on the sphere, times their mean norm"),
)
