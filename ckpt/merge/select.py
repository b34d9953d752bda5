"""The exact k-th largest of a tensor's values without holding the tensor: radix selection over bands.

Methods that keep the top-k magnitudes of a whole tensor (TIES, breadcrumbs, sce's variance selection) need the
threshold before the first band is written. Scores are non-negative floats, whose fp32 bit patterns order as
integers (read as an int32 view, no copy): a first pass counts the top 16 bits of every score (a 32768-bin histogram), which names the bin holding
the k-th largest; a second counts the low 16 bits inside that bin, which gives the value exactly. When several
scores equal that value and only some of them fit in k, the first ones in flat index order are kept (a third
pass finds the index of the last one kept), so the selection does not depend on how bands are read. (mergekit's
argsort breaks such ties in an unspecified order; with real weights they are rare.) NaN scores count as the
largest. Memory: the histograms and one band.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable

from ckpt.lazy import torch

BINS = 1 << 16


def _bits(x) -> "torch.Tensor":
    """Magnitude scores (|x|, variances: non-negative, so +0.0, and NaN positive) as int32 keys that order as the
    values do (NaN above +inf): a view of the fp32 values, no copy."""
    if x.dtype != torch.float32:
        x = x.to(torch.float32)
    return x.contiguous().view(torch.int32)


@dataclass(frozen=True)
class Threshold:
    """Keep a score when it is above `value`, or equal to it with flat index <= `cutoff` (None: every equal)."""

    value_bits: int
    cutoff: int | None
    keep_none: bool = False
    keep_all: bool = False

    def mask(self, scores, offset: int) -> "torch.Tensor":
        """Bool mask of the kept elements of a band of scores starting at flat index `offset`."""
        if self.keep_all:
            return torch.ones(scores.shape, dtype=torch.bool, device=scores.device)
        if self.keep_none:
            return torch.zeros(scores.shape, dtype=torch.bool, device=scores.device)
        b = _bits(scores).reshape(-1)
        n = b.numel()
        if self.cutoff is None or self.cutoff >= offset + n - 1:  # every equal score of this band is kept
            keep = b >= self.value_bits
        elif self.cutoff < offset:  # none is
            keep = b > self.value_bits
        else:  # the band holding the last equal score kept
            keep = b > self.value_bits
            eq = b == self.value_bits
            eq[self.cutoff - offset + 1:] = False
            keep |= eq
        return keep.reshape(scores.shape)


def kth_largest(passes: Callable[[], Iterable[tuple[int, "torch.Tensor"]]], k: int, numel: int) -> Threshold:
    """The threshold keeping exactly the k largest of `numel` scores. `passes()` yields (flat offset, scores band)
    over the whole tensor, afresh on every call."""
    return select_many(lambda: ((off, [s]) for off, s in passes()), [k], numel)[0]


def select_many(passes: Callable[[], Iterable[tuple[int, list]]], ks: list[int], numel: int) -> list[Threshold]:
    """Several selections over one tensor's bands in the same passes (TIES: one per model; breadcrumbs: two):
    `passes()` yields (flat offset, [scores band per selection]); selection j keeps its ks[j] largest. Two passes
    for all of them, plus one where a tie at a threshold has to be cut, instead of two or three per selection."""
    out: list[Threshold | None] = [None] * len(ks)
    todo = []
    for j, k in enumerate(ks):
        if k >= numel:
            out[j] = Threshold(0, None, keep_all=True)
        elif k <= 0:
            out[j] = Threshold(0, None, keep_none=True)
        else:
            todo.append(j)
    if not todo:
        return out
    hi = {j: torch.zeros(BINS, dtype=torch.int64) for j in todo}
    for _, scores in passes():
        for j in todo:
            hi[j] += torch.bincount((_bits(scores[j]).reshape(-1) >> 16).cpu(), minlength=BINS)
    b1, need = {}, {}
    for j in todo:
        above = torch.flip(torch.cumsum(torch.flip(hi[j], [0]), 0), [0])  # above[i]: scores with top bits >= i
        b1[j] = int((above >= ks[j]).nonzero().max())
        need[j] = ks[j] - (int(above[b1[j] + 1]) if b1[j] + 1 < BINS else 0)
    lo = {j: torch.zeros(BINS, dtype=torch.int64) for j in todo}
    for _, scores in passes():
        for j in todo:
            b = _bits(scores[j]).reshape(-1)
            sel = b[(b >> 16) == b1[j]] & 0xFFFF
            if sel.numel():
                lo[j] += torch.bincount(sel.cpu(), minlength=BINS)
    value, take, cut = {}, {}, []
    for j in todo:
        above_lo = torch.flip(torch.cumsum(torch.flip(lo[j], [0]), 0), [0])
        b2 = int((above_lo >= need[j]).nonzero().max())
        value[j] = (b1[j] << 16) | b2
        take[j] = need[j] - (int(above_lo[b2 + 1]) if b2 + 1 < BINS else 0)  # scores equal to the value kept
        if take[j] >= int(lo[j][b2]):
            out[j] = Threshold(value[j], None)
        else:
            cut.append(j)
    if cut:
        seen = dict.fromkeys(cut, 0)
        for off, scores in passes():  # the index of the `take`-th equal score, in flat order
            for j in cut:
                if out[j] is not None:
                    continue
                eq = (_bits(scores[j]).reshape(-1) == value[j]).nonzero().reshape(-1)
                if seen[j] + eq.numel() >= take[j]:
                    out[j] = Threshold(value[j], off + int(eq[take[j] - seen[j] - 1]))
                seen[j] += eq.numel()
            if all(out[j] is not None for j in cut):
                break
        if any(out[j] is None for j in cut):
            raise RuntimeError("radix selection: the passes changed between reads")
    return out


def kth_smallest_keep(passes, k: int, numel: int) -> Threshold:
    """A threshold keeping exactly the numel - k largest: every score but the k smallest."""
    return kth_largest(passes, numel - k, numel)
