"""What the `ckpt lora` commands share: options, the per-module report, and the two-phase write
(decompose every module into the scratch store, then plan and write the output header-first)."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from ckpt.lazy import torch

from ckpt.errors import CkptError
from ckpt.io.output import check_target
from ckpt.lora.svd import DYNAMIC, RankRule, SvdOptions
from ckpt.options import RunOptions
from ckpt.adapters.checks import finite
from ckpt.report import Report, listed, plural

SAVE_DTYPES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}  # --save-dtype -> torch's name


@dataclass
class LoraOptions(RunOptions):
    rank: int | None = None
    conv_rank: int | None = None
    dynamic: str | None = None
    threshold: float | None = None
    clamp_quantile: float | None = None
    save_dtype: str = "fp32"
    format: str | None = None
    lowrank: bool = False
    niter: int = 2
    alphas: tuple[float, ...] = ()  # --alpha: for modules whose file gives none (ckpt.adapters.checks.alphas)
    skip_nonfinite: bool = False  # leave out (and count) modules with NaN/Inf instead of refusing them

    def check(self, rank_required: bool = True) -> None:
        """Usage errors, one line each, before any file is opened."""
        finite("--threshold", self.threshold)
        finite("--clamp-quantile", self.clamp_quantile)
        if self.rank is None and rank_required and self.dynamic is None:
            raise CkptError("give --rank R (or --dynamic METHOD --threshold X, with --rank as the cap)")
        for flag, v in (("--rank", self.rank), ("--conv-rank", self.conv_rank)):
            if v is not None and v < 1:
                raise CkptError(f"{flag} {v}: a rank is at least 1")
        if self.dynamic is not None and self.dynamic not in DYNAMIC:
            raise CkptError(f"--dynamic {self.dynamic}: choose one of {', '.join(DYNAMIC)}")
        if (self.dynamic is None) != (self.threshold is None):
            raise CkptError("--dynamic and --threshold go together (e.g. --dynamic sv_fro --threshold 0.9)")
        if self.dynamic == "sv_ratio" and not self.threshold > 1:
            raise CkptError(f"--threshold {self.threshold}: sv_ratio keeps singular values above max(S) / X, X > 1")
        if self.dynamic in ("sv_fro", "sv_cumulative") and not 0 < self.threshold <= 1:
            raise CkptError(f"--threshold {self.threshold}: {self.dynamic} takes a fraction in (0, 1]")
        if self.clamp_quantile is not None and not 0 < self.clamp_quantile <= 1:
            raise CkptError(f"--clamp-quantile {self.clamp_quantile}: a quantile in (0, 1]")
        if self.save_dtype not in SAVE_DTYPES:
            raise CkptError(f"--save-dtype {self.save_dtype}: choose one of {', '.join(SAVE_DTYPES)}")
        if self.niter < 0:
            raise CkptError(f"--niter {self.niter}: at least 0")
        if self.lowrank and self.dynamic == "sv_cumulative":
            raise CkptError("--lowrank cannot pick ranks by sv_cumulative (it needs every singular value); "
                            "use sv_fro or sv_ratio, or drop --lowrank")

    def rule(self, conv: bool, cap: int | None = None) -> RankRule:
        r = self.conv_rank if conv and self.conv_rank is not None else self.rank
        if r is None:
            r = cap if cap is not None else 1 << 30
        return RankRule(r, self.dynamic, self.threshold)

    @property
    def svd(self) -> SvdOptions:
        return SvdOptions(lowrank=self.lowrank, niter=self.niter)

    @property
    def dtype(self) -> torch.dtype:
        return getattr(torch, SAVE_DTYPES[self.save_dtype])


@dataclass
class ModuleResult:
    name: str
    shape: tuple[int, ...]  # the delta's 2-D shape (rows, flattened columns)
    rank: int
    cap: int
    error: float  # measured ||dW - up @ down||_F / ||dW||_F
    norm: float  # ||dW||_F
    from_rank: int | None = None  # resize / merge: the input rank(s) summed
    note: str = ""


@dataclass
class LoraReport(Report):
    """Report plus the lines every run prints on stdout: one per module (unless --quiet), a summary."""

    modules: list[ModuleResult] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)  # modules whose delta is below --min-diff
    capped: list[str] = field(default_factory=list)  # modules whose rank was capped by the layer
    kept: list[str] = field(default_factory=list)  # modules passed through unchanged
    noop: list[str] = field(default_factory=list)  # rank-0 / empty modules left out (they change nothing)
    nonfinite: list[str] = field(default_factory=list)  # modules left out for NaN/Inf (--skip-nonfinite)
    empty: list[str] = field(default_factory=list)  # extract: weights with no elements (nothing to extract)
    summary: list[str] = field(default_factory=list)

    def module_lines(self) -> list[str]:
        if not self.modules:
            return []
        w = max(len(m.name) for m in self.modules)
        out = [f"{'module':<{w}}  {'shape':>13}  {'rank':>5}  rel.error"]
        for m in self.modules:
            shape = f"{m.shape[0]}x{m.shape[1]}"
            rank = f"{m.rank}" if m.from_rank is None else f"{m.from_rank}->{m.rank}"
            out.append(f"{m.name:<{w}}  {shape:>13}  {rank:>5}  {m.error:.3e}" + (f"  ({m.note})" if m.note else ""))
        return out

    def finish(self, verb: str) -> None:
        """The summary lines: counts, ranks, errors (worst first), skipped and capped modules."""
        ms = self.modules
        if ms:
            ranks = [m.rank for m in ms]
            total = math.sqrt(sum((m.error * m.norm) ** 2 for m in ms))
            norm = math.sqrt(sum(m.norm ** 2 for m in ms))
            worst = sorted(ms, key=lambda m: -m.error)[:3]
            self.summary.append(
                f"{verb} {plural(len(ms), 'module')}: rank {min(ranks)}..{max(ranks)} "
                f"(median {statistics.median(ranks):g}); "
                f"relative error overall {total / norm if norm else 0.0:.3e}, worst "
                + ", ".join(f"{m.name} {m.error:.3e}" for m in worst))
        else:
            self.summary.append(f"{verb} 0 modules")
        if self.capped:
            self.summary.append(f"{plural(len(self.capped), 'module')} capped at min(out, in x kh x kw): "
                                f"{listed(self.capped)}")
        if self.skipped:
            self.summary.append(f"{plural(len(self.skipped), 'module')} skipped (delta at or below --min-diff): "
                                f"{listed(self.skipped)}")
        if self.kept:
            self.summary.append(f"{plural(len(self.kept), 'module')} passed through unchanged: {listed(self.kept)}")
        if self.nonfinite:
            self.summary.append(f"{plural(len(self.nonfinite), 'module')} left out for NaN/Inf values "
                                f"(--skip-nonfinite): {listed(self.nonfinite)}")
        if self.noop:
            n = len(self.noop)
            self.warn(f"{plural(n, 'module')} of rank 0 or with an empty factor change{'s' * (n == 1)} nothing and "
                      f"{'was' if n == 1 else 'were'} left out (loaders divide by the rank): {listed(self.noop)}")
        if self.empty:
            n = len(self.empty)
            self.note(f"{plural(n, 'weight')} with no elements {'has' if n == 1 else 'have'} no delta to extract "
                      f"(skipped): {listed(self.empty)}")


def is_noop(src) -> bool:
    """A module of rank 0, or whose delta has no rows or columns: it changes nothing (a trainer's leftover)."""
    if src.kind not in ("lora", "loha", "lokr", "full"):
        return False
    rows, cols = src.shape2d
    return src.rank == 0 or rows == 0 or cols == 0


def usable(src, name: str, opts: LoraOptions, report: LoraReport) -> bool:
    """Whether a module the command computes with (SVD, stacking, folding its scale) can be used: its
    factors and alpha finite. A NaN/Inf makes every SVD fail and every recut factor meaningless: a one-line
    error naming the tensor, or with --skip-nonfinite the module left out and its values counted. Modules
    written as stored are not checked here; the write counts their NaN/Inf as convert does."""
    bad = src.adapter.nonfinite()
    if not bad:
        return True
    if not opts.skip_nonfinite:
        key, n = next(iter(bad.items()))
        raise CkptError(f"{src.module.source}: {key} holds {plural(n, 'NaN/Inf value')}: module {name!r} cannot be "
                        "computed with; nothing written (pass --skip-nonfinite to leave such modules out)")
    for key, n in bad.items():
        report.count("nonfinite_skipped", key, n)
    if name not in report.nonfinite:
        report.nonfinite.append(name)
    return False


def nothing_left(spec: str, modules: list, report: LoraReport) -> None:
    """Every module left out (rank 0, NaN/Inf with --skip-nonfinite): an error, not an empty LoRA."""
    if not modules:
        why = "; ".join(x for x in (report.noop and "rank 0 or empty", report.nonfinite and "NaN/Inf") if x)
        raise CkptError(f"{spec}: every module was left out ({why or 'none usable'}); nothing written")


def early_target_check(out: Path, inputs: list[Path], overwrite: bool, single_file: bool,
                       dry_run: bool = False) -> None:
    """The output checks `write` makes, made before the (long) decomposition so a bad -o fails at once."""
    check_target(Path(out), inputs, overwrite, single_file, dry_run=dry_run)
