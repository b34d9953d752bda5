"""The one interface every merge method implements, and the parameters it declares.

A method is one module in `ckpt.merge.methods` defining `METHODS = (Method(...), ...)`: several configurations of
one computation are several entries (mergekit builds TIES, DARE, DELLA and breadcrumbs from one generalized task
arithmetic; so does `ckpt.merge.methods.task_arithmetic`). The YAML loader, the flags, `--print-config` and the
merge itself all read the declared `params`.

How a method computes decides how it streams (`kind`):

- "rows": each output row depends on the same rows of the inputs only (elementwise methods, per-row statistics):
  `merge` is called band by band, memory is a few bands per input.
- "stats": it needs whole-tensor statistics (slerp's angle, TIES' magnitude threshold, DARE's L1 rescale):
  `stats(job)` makes them first by passing over the tensor's bands (`job.passes()`, as often as it needs), then
  `merge` applies them band by band. Memory stays a few bands per input.
- "whole": it genuinely needs every value at once (karcher's iterations): one band spanning the whole tensor, one
  tensor per input in memory.

`kind_of(job)`, where given, decides the kind per tensor (DELLA ranks within rows, but a 1-D tensor is one row).

`merge(job, xs, band, state)` gets the inputs' values of rows [band.start, band.stop) as `job.compute` tensors (fp32,
or fp64 for `dtype: float64`), in mergekit's input order (`job.inputs`: the models as listed, then the base when
it is not among them; `job.base` is its index or None), and returns the merged band in the same dtype.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

from ckpt.errors import CkptError
from ckpt.merge.shown import shown

SHARED, INPUT, NON_BASE = "shared", "input", "non_base"  # mergekit's ParameterScope
# The magnitude a number may have where its parameter declares no bound of its own: real configs use weights,
# scales and distances of a few units. A weight of 1e39 is infinite in fp32 and turns every merged value into
# NaN/Inf; with every factor within 1e6, products of a few of them times model weights stay far inside fp32.
MAGNITUDE = 1e6


@dataclass(frozen=True)
class Param:
    """A declared parameter: `scope` says where it binds (one value per tensor, one per input, one per non-base
    input), `default` None with `required` means the config must give it. `low`/`high` bound numeric values
    (`low_open`/`high_open`: the bound itself is refused); `why` says why, in the error. A number is finite, and
    within +-MAGNITUDE where no bound is declared."""

    name: str
    type: type = float  # bool, int or float (bools are no numbers: `weight: true` is refused)
    scope: str = SHARED
    default: object = None
    required: bool = False
    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    why: str = ""
    help: str = ""

    def cast(self, v):
        if self.type is bool:
            if isinstance(v, str):
                return v.strip().lower() in ("1", "true", "yes", "on")
            return bool(v)
        if self.type is int:
            return int(v) if isinstance(v, int) else int(float(v))
        if self.type is float:
            return float(v)
        return v

    @property
    def bounds(self) -> tuple[float, float]:
        """(low, high): the declared bounds, +-MAGNITUDE where none is declared."""
        low = self.low if self.low is not None else -MAGNITUDE
        high = self.high if self.high is not None else MAGNITUDE
        return low, high

    def validate(self, v, where: str) -> None:
        if self.type is bool:
            if not (isinstance(v, bool) or (isinstance(v, (int, float)) and v in (0, 1))
                    or (isinstance(v, str) and v.strip().lower() in ("true", "false", "yes", "no"))):
                raise CkptError(f"{where}: {self.name} is true or false, not {shown(v)}")
            return
        if self.type in (int, float):
            x = self._number(v, where)
            if self.type is int and math.isfinite(x) and not x.is_integer():
                raise CkptError(f"{where}: {self.name} is a whole number, not {shown(v)}")
            low, high = self.bounds
            open_lo, open_hi = self.low_open and self.low is not None, self.high_open and self.high is not None
            below = x < low or (open_lo and x == low)
            if not below and not (x > high or (open_hi and x == high)):
                return
            if (self.low if below else self.high) is None:  # past MAGNITUDE: say the whole range
                rng = "in " + ("(" if open_lo else "[") + f"{low:g}, {high:g}" + (")" if open_hi else "]")
                why = "a larger magnitude takes fp32 merges toward overflow"
            else:
                lo = "" if self.low is None else ("(" if open_lo else "[") + f"{self.low:g}"
                hi = "" if self.high is None else f"{self.high:g}" + (")" if open_hi else "]")
                rng = f"in {lo}, {hi}" if lo and hi else (f"> {self.low:g}" if open_lo else f">= {self.low:g}") if lo \
                    else (f"< {self.high:g}" if open_hi else f"<= {self.high:g}")
                why = self.why
            raise CkptError(f"{where}: {self.name} must be {rng}, got {shown(v)}" + (f" ({why})" if why else ""))

    def _number(self, v, where: str) -> float:
        """`v` as a finite float: a number or a string holding one (YAML reads 1e-3 as a string; mergekit takes it
        as a number), never a bool."""
        if isinstance(v, bool):
            raise CkptError(f"{where}: {self.name} is a number, not {str(v).lower()}")
        if not isinstance(v, (int, float, str)):
            raise CkptError(f"{where}: {self.name} is a number, not {shown(v)}")
        try:
            x = float(v)
        except ValueError:
            raise CkptError(f"{where}: {self.name} is a number, not {shown(v)}") from None
        except OverflowError:  # an int beyond fp64: out of every range
            return math.inf if v > 0 else -math.inf
        if not math.isfinite(x):
            raise CkptError(f"{where}: {self.name} must be a finite number, not {shown(v)}")
        return x


@dataclass(frozen=True)
class Band:
    start: int  # rows [start, stop) of the tensor
    stop: int
    row_numel: int  # elements per row: element offset of the band = start * row_numel

    @property
    def offset(self) -> int:
        return self.start * self.row_numel


@dataclass
class Job:
    """One output tensor's merge: its inputs (logical tensors, in mergekit's order), resolved parameters, and
    how to pass over its bands (for `stats`)."""

    name: str
    names: tuple[str, ...]  # output name, original-layout name (filters, RNG keys use names[0])
    shape: tuple[int, ...]
    inputs: list  # ckpt.io.tensors.Tensor, one per input model
    keys: list[str]  # each input's identity (its text in the config): RNG streams, messages
    base: int | None  # index of the base in `inputs`
    shared: dict  # shared parameters
    per_input: list[dict]  # per input (the base gets only INPUT-scope ones)
    seed: int | None
    compute: object  # torch dtype of the values merge() sees
    source: str = "merge"  # the config file (or "merge" for flags): what a refusal of this tensor names
    passes: Callable = None  # () -> iterator of (Band, [x per input]) over the whole tensor
    device: object = None

    @property
    def non_base(self) -> list[int]:
        return [i for i in range(len(self.inputs)) if i != self.base]


@dataclass(frozen=True)
class Method:
    name: str
    params: tuple[Param, ...] = ()
    base: str = "optional"  # "required" | "optional" | "none" | "primary" (the SD classics: models[0] is A)
    models: tuple[int, int | None] = (1, None)  # (min, max or None) inputs of each group, the base counted
    others: tuple[int, int | None] = (0, None)  # (min, max or None) inputs of each group besides its base
    kind: str = "rows"  # "rows" | "stats" | "whole"
    kind_of: Callable | None = None  # (job) -> kind, where it depends on the tensor (1-D vs 2-D, a parameter)
    randomized: bool = False
    merge: Callable | None = None  # (job, xs, band, state) -> tensor
    stats: Callable | None = None  # (job) -> state, for kind "stats"
    check: Callable | None = None  # (recipe, where) -> None: method-specific recipe checks
    # (job) -> None: refuses the parameters resolved for one tensor where they cannot merge it (weights that sum to
    # 0 and are divided by their sum); called as the tensor is planned, before any output exists
    check_job: Callable | None = None
    summary: str = ""
    extra: dict = field(default_factory=dict)

    def param(self, name: str) -> Param | None:
        return next((p for p in self.params if p.name == name), None)

    @property
    def shared_params(self) -> tuple[Param, ...]:
        return tuple(p for p in self.params if p.scope == SHARED)

    @property
    def input_params(self) -> tuple[Param, ...]:
        return tuple(p for p in self.params if p.scope != SHARED)

    def check_recipe(self, recipe, where: str) -> None:
        """The base policy and the input counts, per group of inputs one output tensor merges (the models, or each
        slice's sources with its base: mergekit checks them per tensor), then the method's own `check`."""
        if self.base == "none" and recipe.base_model is not None:
            raise CkptError(f"{where}: {self.name} takes no base_model")
        if self.base == "primary" and recipe.base_model is not None:
            raise CkptError(f"{where}: {self.name} takes models: [A, B{', C' if self.models[0] > 2 else ''}] in order "
                            "(A is the primary model), no base_model")
        counted = " (counting the base)" if self.base in ("required", "optional") else ""
        for at, order, base in recipe.groups():
            if self.base == "required" and base is None:
                raise CkptError(f"{where}: {at}{self.name} needs a base_model (the model the others' differences are "
                                "taken from)")
            n, others = len(order), len(order) - (base is not None)
            for have, (lo, hi), what in ((n, self.models, f"model{{s}}{counted}"),
                                         (others, self.others, "model{s} besides the base")):
                if have < lo or (hi is not None and have > hi):
                    want = f"exactly {lo}" if hi == lo else f"at least {lo}" if hi is None else f"{lo} to {hi}"
                    plural = "" if (hi if hi is not None else lo) == 1 else "s"
                    raise CkptError(f"{where}: {at}{self.name} merges {want} {what.format(s=plural)}, got {have}")
        if self.check is not None:
            self.check(recipe, where)


def weight_param(**kw) -> Param:
    return Param("weight", float, NON_BASE, **kw)


def density_param(default=1.0) -> Param:
    return Param("density", float, NON_BASE, default=default, low=0.0, high=1.0, low_open=True,
                 why="density 0 keeps nothing and returns the base; mergekit accepts it, ckpt takes it for the "
                     "mistake it almost always is")
