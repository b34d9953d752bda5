"""Generalized task arithmetic (mergekit): `task_arithmetic`, `ties`, `dare_linear`, `dare_ties`, `della`,
`della_linear`, `breadcrumbs`, `breadcrumbs_ties`. One computation; each method is a row of `CONFIGS` (which
sparsification, which consensus, the default `normalize` and `rescale`), as mergekit builds them.

Per tensor, with the base B and the other models X_i (weights w_i, densities p_i):

1. delta d_i = X_i - B;
2. sparsification keeps part of each d_i (a model whose density is 1 keeps all of it, untouched):
   - "magnitude" (ties): the k = max(1, int(p_i * numel)) largest |d_i| of the whole tensor;
   - "random" (DARE): each element with probability p_i;
   - "magnitude_outliers" (breadcrumbs): sorted by |d_i| ascending, positions [n_bot, n_bot + int(p_i * numel)),
     n_bot = max(0, numel - int(p_i * numel) - int(gamma * numel)): the smallest and the gamma largest go;
   - "della_magprune" (DELLA): each element with probability p_i - epsilon + 2 epsilon r, r its magnitude rank in
     its row scaled to [0, 1] (rows along dim 1, as mergekit ranks; a 1-D tensor is one row);
   with `rescale`, the kept delta is multiplied by sum|d_i| / sum|kept d_i| over the whole tensor (L1, skipped
   when either is below 1e-7);
3. times w_i; with consensus "sum" (the TIES sign election) only the elements whose sign is the sign of
   sum_i w_i d_i' (>= 0: positive) are added, and `normalize` divides by the sum of their weights (1 where none);
   without, every delta is added and `normalize` divides by sum w_i (1 when |sum| < 1e-8);
4. times `lambda`, plus B.

Streaming: the deltas are made band by band from the inputs' bands. Selection by magnitude over the whole tensor
(ties, breadcrumbs) is the exact radix selection of `ckpt.merge.select` over |d_i| (a few passes over the bands
per model: one threshold for ties, two for breadcrumbs' window), and the L1 rescale is one more pass summing
|d_i| and |kept d_i| (in fp64); the thresholds and scale factors are a few numbers per model, kept for the
tensor; then the bands are merged. DARE and DELLA draw their masks per band; DELLA's ranks need whole rows (every
band has them), and a 1-D tensor, one row, is read whole; DELLA's masks of the rescale pass are kept, a bit per
element, for the merge pass (`ckpt.merge.mask_store`, within a budget). Memory: a few bands per input.

Determinism: the drop mask of a (seed, model, tensor) is `ckpt.merge.rng.uniform(seed, model's text in the
config, tensor name, element)` < keep probability: a function of those alone, the same whatever the band size,
the order bands are read in, the device, or the other models in the config (mergekit draws from torch's global
generator, so its masks depend on everything merged before; they differ from ckpt's, their statistics agree).
On the CPU the masks come from compiled kernels (`ckpt.merge.masks_cpu`: the hash and DELLA's row ranks in one pass,
the same bits as the torch ops, which run on CUDA and where numba is missing).
Ties at a magnitude threshold keep the first elements in flat (row-major) order (`ckpt.merge.select`; mergekit's
argsort leaves them unspecified); DELLA's ranks break ties the same way.

Differences from mergekit 0.1.5: `density` outside (0, 1] is refused (mergekit takes 0 and returns the base);
DELLA's `epsilon` must leave density +- epsilon in (0, 1), as mergekit demands, but it is checked when the config
is read where the values are plain numbers, else when each tensor is planned (mergekit fails mid-merge) and a
negative epsilon (which would favour small magnitudes) is refused; `gamma` is a fraction in [0, 1]; a DELLA row of
one element (a 0-d tensor, a [n, 1] weight) keeps with probability `density` (mergekit's rank scaling divides by
zero there and fails). `task_arithmetic` takes neither `density` nor `rescale` (mergekit accepts and ignores
them; ckpt refuses by name what it would not use). `int8_mask` is accepted and changes nothing (it chose the
dtype of mergekit's sign mask, a memory saving; ckpt's mask is bool).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ckpt.errors import CkptError
from ckpt.merge.mask_store import MaskStore
from ckpt.merge.methods.base import NON_BASE, SHARED, Band, Method, Param, density_param, weight_param
from ckpt.lazy import torch

RESCALE_EPS = 1e-7  # mergekit's rescaled_masked_tensor: no rescale when either L1 norm is below this
DIVISOR_EPS = 1e-8  # without consensus, a |sum of weights| below this does not divide


@dataclass(frozen=True)
class Config:
    """One configuration of the computation: mergekit's GeneralizedTaskArithmeticMerge arguments."""

    name: str
    sparsify: str | None  # None | "magnitude" | "random" | "magnitude_outliers" | "della_magprune"
    consensus: str | None  # None | "sum" (the TIES sign election)
    normalize: bool  # default of `normalize`
    rescale: bool  # default of `rescale`
    summary: str


CONFIGS = (
    Config("task_arithmetic", None, None, False, False, "base + weighted sum of the models' deltas from the base"),
    Config("ties", "magnitude", "sum", True, False,
           "each delta's top-density magnitudes, sign election, mean of the agreeing deltas"),
    Config("dare_linear", "random", None, False, True, "each delta's elements kept at random (density), L1-rescaled, "
                                                       "weighted sum"),
    Config("dare_ties", "random", "sum", False, True, "DARE's random drop, then the TIES sign election"),
    Config("della", "della_magprune", "sum", True, True, "random drop with keep probability rising with magnitude "
                                                         "rank in each row, L1-rescaled, TIES sign election"),
    Config("della_linear", "della_magprune", None, False, True, "DELLA's magnitude-ranked random drop, weighted sum"),
    Config("breadcrumbs", "magnitude_outliers", None, False, False,
           "each delta without its smallest and its gamma largest magnitudes, weighted sum"),
    Config("breadcrumbs_ties", "magnitude_outliers", "sum", False, False,
           "breadcrumbs' outlier-and-small drop, then the TIES sign election"),
)


# --- per-tensor bookkeeping ---------------------------------------------------------------------------------------

def _density(job, i) -> float:
    return job.per_input[i].get("density", 1.0)


def _sparse(c: Config, job) -> list[int]:
    """The non-base inputs whose deltas this tensor sparsifies (density 1 keeps a delta untouched, as mergekit)."""
    if c.sparsify is None:
        return []
    return [i for i in job.non_base if _density(job, i) < 1]


def _della_bad(density: float, epsilon: float) -> bool:
    return density < 1 and not (density - epsilon > 0 and density + epsilon < 1)


def _della_message(density, epsilon) -> str:
    return (f"epsilon {epsilon:g} with density {density:g} gives keep probabilities {density - epsilon:g} to "
            f"{density + epsilon:g}; density +- epsilon must lie in (0, 1)")


def _kind(c: Config, job) -> str:
    """How this tensor streams. Runs when the tensor is planned, so it also refuses DELLA's epsilon for the values
    resolved for this tensor (gradients and filters the config check could not evaluate)."""
    if c.sparsify == "della_magprune":
        for i in job.non_base:
            d, e = _density(job, i), job.per_input[i]["epsilon"]
            if _della_bad(d, e):
                raise CkptError(f"parameters ({job.keys[i]}): {c.name} on {job.names[0]}: {_della_message(d, e)}")
    if not _sparse(c, job):
        return "rows"
    if c.sparsify == "della_magprune" and len(job.shape) < 2:
        return "whole"  # ranks within one row: the whole tensor
    if c.sparsify in ("magnitude", "magnitude_outliers") or job.shared["rescale"]:
        return "stats"
    return "rows"


# --- sparsification ----------------------------------------------------------------------------------------------

def _uniform(job, i, d, band):
    from ckpt.merge.rng import uniform

    return uniform(job.seed, job.keys[i], job.names[0], band.offset, d.numel(), d.device).reshape(d.shape)


def _rank_probs(n: int, density: float, epsilon: float, device):
    """DELLA's keep probability of each rank 0 .. n - 1 of a row of n >= 2 elements, fp32: density - epsilon +
    2 epsilon * rank / (n - 1). One table serves every row (a probability depends on the rank alone)."""
    ranks = torch.arange(n, dtype=torch.float32, device=device)
    return (density - epsilon) + (ranks / (n - 1)) * 2 * epsilon


def _rows(d):
    """`d` with its rows along dim 1, as DELLA ranks them: a tensor of fewer than 2 dims is one row."""
    return d.reshape(1, -1) if d.dim() < 2 else d


def _della_probs(d, density: float, epsilon: float):
    """Keep probability per element: `_rank_probs` of its rank in its row along dim 1, ranks ascending by |d|,
    equal magnitudes ranked in flat order; a row of one element: `density`."""
    m = _rows(d)
    mag = m.abs().to(torch.float32)
    n = mag.shape[1]
    if n < 2:
        return torch.full(d.shape, density, dtype=torch.float32, device=d.device)
    order = torch.argsort(mag, dim=1, stable=True)
    shape = [1] * mag.dim()
    shape[1] = n
    table = _rank_probs(n, density, epsilon, d.device).reshape(shape).expand_as(mag).contiguous()
    return torch.empty_like(mag).scatter_(1, order, table).reshape(d.shape)


def _compiled_masks(d) -> bool:
    """Whether the compiled CPU kernels make this band's random masks (`ckpt.merge.masks_cpu`: the same bits as the
    torch formulation, several times faster); elsewhere (CUDA, no numba) the torch ops do."""
    from ckpt.merge import masks_cpu

    return d.device.type == "cpu" and masks_cpu.available()


def _random_keep(c: Config, job, i, d, band: Band, mag=None):
    """DARE's or DELLA's mask of model i's delta band `d`: rng.uniform(element) < keep probability (`mag`: |d|
    where the caller has it)."""
    from ckpt.merge import masks_cpu

    density = _density(job, i)
    n = _rows(d).shape[1]
    if not _compiled_masks(d) or c.sparsify != "random" and n > masks_cpu.MAX_ROW:
        if c.sparsify == "random":
            return _uniform(job, i, d, band) < density
        return _uniform(job, i, d, band) < _della_probs(d, density, job.per_input[i]["epsilon"])
    from ckpt.merge.rng import keys

    k0, k1 = keys(job.seed, job.keys[i], job.names[0])
    if c.sparsify == "random" or n < 2:  # a DELLA row of one element keeps with probability `density`
        return masks_cpu.dare_keep(k0, k1, band.offset, d.shape, density)
    mag = _rows(d.abs() if mag is None else mag).to(torch.float32)
    probs = _rank_probs(n, density, job.per_input[i]["epsilon"], d.device)
    return masks_cpu.della_keep(k0, k1, band.offset, mag, probs).reshape(d.shape)


def _keep(c: Config, job, i, d, band: Band, select, mag=None):
    """Bool mask of the kept elements of model i's delta band `d` (`mag`: |d| where the caller has it)."""
    if c.sparsify in ("magnitude", "magnitude_outliers"):
        return select[i](d.abs() if mag is None else mag, band.offset)
    if c.sparsify in ("random", "della_magprune"):
        return _random_keep(c, job, i, d, band, mag)
    raise AssertionError(c.sparsify)


def _selectors(c: Config, job, passes) -> dict:
    """Per sparsified model, (scores band, flat offset) -> kept mask from exact whole-tensor thresholds, all
    models' thresholds found in the same passes over the bands (`select_many`)."""
    import math

    from ckpt.merge.select import select_many

    if c.sparsify not in ("magnitude", "magnitude_outliers"):
        return {}
    b = job.base
    numel = math.prod(job.shape)
    models = list(_sparse(c, job))
    ks: list[int] = []
    for i in models:
        p = _density(job, i)
        if c.sparsify == "magnitude":
            ks.append(max(1, int(p * numel)))
            continue
        target = int(p * numel)
        n_top = int(job.per_input[i]["gamma"] * numel)
        n_bot = max(0, numel - target - n_top)
        ks += [numel - n_bot, numel - n_bot - target]  # sorted ascending: positions >= n_bot, >= n_bot + target
    per = 1 if c.sparsify == "magnitude" else 2

    def scores():
        for band, xs in passes():
            ds = [(xs[i] - xs[b]).abs() for i in models]
            yield band.offset, [d for d in ds for _ in range(per)]

    found = select_many(scores, ks, numel)
    out = {}
    for n, i in enumerate(models):
        if per == 1:
            out[i] = found[n].mask
            continue
        upto, above = found[2 * n], found[2 * n + 1]

        def window(s, offset, upto=upto, above=above):
            return upto.mask(s, offset) & ~above.mask(s, offset)

        out[i] = window
    return out


def _stats(c: Config, job, passes) -> dict:
    """The tensor's thresholds and L1 rescale factors; `passes()` yields (Band, xs) over the whole tensor."""
    select = _selectors(c, job, passes)
    ratio = {}
    sparse = _sparse(c, job)
    masks = None
    if job.shared["rescale"] and sparse:
        before = dict.fromkeys(sparse, 0.0)
        after = dict.fromkeys(sparse, 0.0)
        for band, xs in passes():
            for i in sparse:
                d = xs[i] - xs[job.base]
                a = d.abs()
                keep = _keep(c, job, i, d, band, select, a)
                if masks is None and c.sparsify == "della_magprune" and _compiled_masks(d):
                    masks = MaskStore.reserve(math.prod(job.shape), len(sparse)) or False
                if masks:  # DELLA's masks cost a sort per row: kept for the merge pass (`ckpt.merge.mask_store`)
                    masks.put(i, band.offset, keep)
                before[i] += float(a.sum(dtype=torch.float64))
                after[i] += float(a.mul_(keep).sum(dtype=torch.float64))
        for i in sparse:
            if before[i] >= RESCALE_EPS and after[i] >= RESCALE_EPS:
                ratio[i] = before[i] / after[i]
    return {"select": select, "ratio": ratio, "masks": masks or None}


# --- the merge ---------------------------------------------------------------------------------------------------

def _merge(c: Config, job, xs, band, state):
    base = xs[job.base]
    others = job.non_base
    if not others:
        return base
    if state is None:  # "rows": no whole-tensor statistics; "whole": this band is the whole tensor
        state = _stats(c, job, lambda: [(band, xs)]) if _kind(c, job) == "whole" else {"select": {}, "ratio": {}}
    sparse = set(_sparse(c, job))
    deltas = []
    for i in others:
        d = xs[i] - base
        if i in sparse:
            keep = state["masks"].get(i, band.offset, d.shape) if state.get("masks") else None
            if keep is None:
                keep = _keep(c, job, i, d, band, state["select"])
            d.mul_(keep)  # d is this band's own: x1 or x0, as d * mask
            if i in state["ratio"]:
                d.mul_(torch.tensor(state["ratio"][i], dtype=d.dtype, device=d.device))
        deltas.append(d)
    deltas = torch.stack(deltas)
    weights = torch.tensor([job.per_input[i]["weight"] for i in others], dtype=deltas.dtype, device=deltas.device)
    weights = weights.reshape((len(others),) + (1,) * base.dim())
    deltas.mul_(weights)
    if c.consensus == "sum":
        majority = (deltas.sum(dim=0) >= 0).to(deltas.dtype) * 2 - 1
        agree = deltas.sign() == majority
        mixed = (deltas * agree).sum(dim=0)
        divisor = (weights * agree).sum(dim=0)
        divisor[divisor == 0] = 1
    else:
        mixed = deltas.sum(dim=0)
        divisor = weights.sum(dim=0)
        divisor[divisor.abs() < DIVISOR_EPS] = 1
    if job.shared["normalize"]:
        mixed /= divisor
    lam = job.shared["lambda"]
    if lam != 1:
        mixed *= lam
    return base + mixed


# --- declarations ------------------------------------------------------------------------------------------------

def _params(c: Config) -> tuple[Param, ...]:
    ps = [Param("int8_mask", bool, SHARED, default=False,
                help="accepted for mergekit configs; changes nothing (mergekit's sign-mask dtype)"),
          Param("normalize", bool, SHARED, default=c.normalize,
                help="divide the summed deltas by the sum of the (agreeing) weights"),
          ]
    if c.sparsify is not None:
        ps.append(Param("rescale", bool, SHARED, default=c.rescale,
                        help="scale each kept delta back to the L1 norm of the whole delta"))
    ps += [Param("lambda", float, SHARED, default=1.0, help="scale of the merged delta"),
           weight_param(required=True, help="each model's weight (its delta's)")]
    if c.sparsify is not None:
        ps.append(density_param(1.0))
    if c.sparsify == "magnitude_outliers":
        ps.append(Param("gamma", float, NON_BASE, default=0.01, low=0.0, high=1.0,
                        why="a fraction of the elements", help="fraction of the largest magnitudes dropped"))
    if c.sparsify == "della_magprune":
        ps.append(Param("epsilon", float, NON_BASE, default=0.15, low=0.0,
                        why="the keep probability rises with magnitude by 2 * epsilon across a row",
                        help="keep probabilities span density +- epsilon by magnitude rank"))
    return tuple(ps)


def _known(chain, name, default):
    """The value of `name` the first settings dict giving it has, when it is a plain number; None when it is a
    gradient or a filter list (known per tensor only)."""
    for settings in chain:
        if settings and name in settings:
            v = settings[name]
            return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None
    return default


def _check_della(recipe, where: str) -> None:
    """density +- epsilon in (0, 1) for every non-base model whose values are plain numbers."""
    base = recipe.base_model.text if recipe.base_model is not None else None
    chains = []
    if recipe.slices is None:
        for i, m in enumerate(recipe.models):
            if m.model.text != base:
                chains.append((f"models[{i}] ({m.model.text})", [m.parameters, recipe.parameters]))
    else:
        for si, s in enumerate(recipe.slices):
            b = s.base_model.text if s.base_model is not None else base
            for j, x in enumerate(s.sources):
                if x.model.text != b:
                    chains.append((f"slices[{si}].sources[{j}] ({x.model.text})",
                                   [x.parameters, s.parameters, recipe.parameters]))
    for at, chain in chains:
        d, e = _known(chain, "density", 1.0), _known(chain, "epsilon", 0.15)
        if d is not None and e is not None and _della_bad(d, e):
            raise CkptError(f"{where}: {at}: {recipe.method}: {_della_message(d, e)}")


def _method(c: Config) -> Method:
    return Method(
        c.name, _params(c), base="required", kind="stats",
        kind_of=lambda job: _kind(c, job),
        randomized=c.sparsify in ("random", "della_magprune"),
        merge=lambda job, xs, band, state: _merge(c, job, xs, band, state),
        stats=lambda job: _stats(c, job, job.passes),
        check=_check_della if c.sparsify == "della_magprune" else None,
        summary=c.summary, extra={"sparsify": c.sparsify, "consensus": c.consensus})


METHODS = tuple(_method(c) for c in CONFIGS)
