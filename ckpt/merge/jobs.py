"""One output tensor of `ckpt merge` as a method's `Job`: its parameters resolved from the recipe's settings and
the dtypes it computes in. Shared by the whole-model merge (`ckpt.merge.command`) and the slice merge
(`ckpt.merge.slices`), which is why it is neither's."""

from __future__ import annotations

from ckpt.merge.methods.base import INPUT, Job
from ckpt.merge.params import resolve
from ckpt.merge.recipe import Recipe


def compute_dtypes(recipe: Recipe):
    """(the dtype a merge computes in, the dtype its values are rounded to first or None): the recipe's `dtype`, by
    safetensors name, so that the merge is planned without torch (`MergedModelTensor` hands the method torch's)."""
    compute = "F64" if recipe.dtype == "fp64" else "F32"
    round_to = {"fp16": "F16", "bf16": "BF16"}.get(recipe.dtype or "")
    return compute, round_to


def make_job(method, name: str, names: tuple[str, ...], t: float, shape, inputs, keys, base, chains, shared_chain,
             recipe, compute) -> Job:
    """One output tensor's Job: its parameters resolved from the settings chains (shared, and per input: the base
    gets only INPUT-scope ones); a missing one is named with the recipe's source, as are values the method cannot
    merge this tensor with (`Method.check_job`)."""
    where = f"{recipe.source}: parameters"
    shared = {p.name: resolve(p, shared_chain, names, t, where) for p in method.shared_params}
    per_input = []
    for i, key in enumerate(keys):
        per_input.append({p.name: resolve(p, chains[i], names, t, f"{where} ({key})") for p in method.input_params
                          if i != base or p.scope == INPUT})
    job = Job(name=name, names=names, shape=tuple(shape), inputs=inputs, keys=list(keys), base=base, shared=shared,
              per_input=per_input, seed=recipe.seed, compute=compute, source=recipe.source)
    if method.check_job is not None:  # the compute dtype as planned (a name): a check imports torch only if it must
        method.check_job(job)
    return job
