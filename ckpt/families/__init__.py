"""Model families: one small declarative module each, read by merge-lora, inspect and convert --layout.

A family is what a set of tensor names is (Flux.1, Wan, SDXL UNet, CLIP text...), in which *layout*
("original": the reference implementation's names, as ComfyUI/kohya/musubi use them; "diffusers": the
diffusers model class's names, as diffusers/PEFT/SimpleTuner use them; None where there is one naming),
and how the two layouts correspond tensor by tensor. The knowledge sits here once; the commands import
`ckpt.families` and this package imports none of them.

Using it:

    from ckpt import families
    m = families.detect(keys, shapes)       # Match: family, family_id, layout, label; or None
    m.family.pairs(shapes, m.layout)        # [Pair(original, diffusers, rows, transform), ...]
    families.get("wan")                     # the Family for an id
    families.from_config(config_json)       # the Family a config.json `_class_name` names

Adding a family = adding one file `ckpt/families/<name>.py` that defines `FAMILY = Family(...)`
(`ckpt.families.spec` documents every field); the registry finds it, nothing else changes:

1. `family_id` (stable, lower case, listed in docs/families.md "The families"), `label`, `diffusers_class` and
   `config_classes` (regexes on config.json `_class_name` / `architectures[0]`).
2. `layouts`: one `Signature` per layout: a primary regex whose hits score the match (write `_.` where a
   name may use `.` or `_`, via `spec.at()`/`spec.start()`), `required`/`forbidden` regexes and an
   optional `check(keys, shapes)` that separate look-alikes (Flux.1 vs Flux.2 share `double_blocks`).
   The highest score wins; ties go to the more specific signature, then to `priority`. Signatures also
   see LoRA module names (kohya flattened, prefixes stripped) with the base shapes their factors imply.
3. `pairs(shapes, layout)`: the original <-> diffusers correspondence of the model whose keys and shapes
   are given, in that layout: renames, `rows` of fused original tensors (qkv, qkv+mlp), transforms
   (`spec.Transform`, written by name: `swap_halves`, `transpose`, `squeeze`), one-side-only tensors (a side None). Widths come from the
   shapes. Reference: diffusers' own converter (`loaders/single_file_utils.py convert_*_to_diffusers`);
   read it for the facts, write the table in our own words. Tables may list optional tensors (biases,
   I2V-only modules): `spec.present()` keeps the ones the file has.
4. LoRA facts: `kohya_layout` (which layout `lora_unet_<path>` names follow), `lora_aliases` (names in
   neither layout: XLabs, old diffusers processors), `lora_namings` (docs/families.md table).
5. `high_precision`: per layout, regexes of tensors a quantizing writer keeps in high precision;
   `gguf`: ComfyUI-GGUF's architecture name and F32 list for the family (`spec.GGUFStorage`).
6. Tests: build a tiny model with the diffusers class, make the original layout from it (diffusers'
   converter in reverse where it exists, else `tests/families_util.py` `original_from_pairs` checked
   by the forward converter), and add the family to the parametrised lists in
   `tests/test_families.py` (correspondence == converter, bit for bit) and `tests/test_merge_families.py`
   (diffusers/kohya LoRAs on both layouts against `fuse_lora`).

A module may answer for several ids that share one correspondence (`sd_unet`: sd1, sd2, sdxl); its
`identify(keys, shapes, layout)` says which, or None when the keys cannot tell.

What the loader reads: every top-level module of this package that defines `FAMILY`; a module without
one is imported and passed over, so a helper needs no listing anywhere. Helpers of that kind: `spec`
(the vocabulary), `lora_namings` (LoRA prefixes: kohya, PEFT...), `prefixes` (the file prefixes a single
file stores its diffusion model under), `flux_blocks` (the Flux-style block tables several families
share). Knowledge that is no `Family` (no tensor-name layouts to detect) sits in a subpackage, which the
loader does not enter: `llm` (llama.cpp LLM architectures: names, config fields, q/k permutation),
`pipelines` (which families make up an SD1/SDXL/SD3 single file, under which prefixes). A family's
knowledge goes in its module as data (signatures, pairs, `high_precision`, `gguf`), never in the command
that reads it.
"""

from __future__ import annotations

import re

from ckpt.registry import entry_modules
from ckpt.families.spec import (DIFFUSERS, LAYOUTS, ORIGINAL, Alias, Family, GGUFStorage, Match, Pair, Shapes,
                                Signature, Transform, module_of)

__all__ = ["Alias", "Family", "GGUFStorage", "Match", "Pair", "Shapes", "Signature", "Transform", "ORIGINAL",
           "DIFFUSERS", "LAYOUTS", "all_families", "detect", "from_config", "get", "module_of", "layout_name"]

_REGISTRY: dict[str, Family] | None = None


def _load() -> dict[str, Family]:
    global _REGISTRY
    if _REGISTRY is None:
        found: dict[str, Family] = {}
        for mod in entry_modules(__name__, __path__, "FAMILY"):  # subpackages hold knowledge that is no Family
            fam = mod.FAMILY
            if not isinstance(fam, Family):
                continue
            for fid in fam.all_ids:
                if fid in found:
                    raise RuntimeError(f"family id {fid!r} declared twice ({mod.__name__})")
                found[fid] = fam
        _REGISTRY = found
    return _REGISTRY


def all_families() -> list[Family]:
    """Every family module's Family, once each, ordered by id."""
    seen: dict[int, Family] = {}
    for fam in _load().values():
        seen.setdefault(id(fam), fam)
    return sorted(seen.values(), key=lambda f: f.family_id)


def get(family_id: str) -> Family | None:
    return _load().get(family_id)


def detect(keys, shapes: Shapes | None = None) -> Match | None:
    """The family and layout of `keys` (tensor names with any file prefix stripped, or LoRA module names),
    with `shapes` where known; None when no family recognises them."""
    keys = list(keys)
    shapes = shapes or {}
    best, best_rank = None, None
    for fam in all_families():
        for layout, sig in fam.layouts.items():
            hits = sig.score(keys, shapes)
            if not hits:
                continue
            rank = (hits, sig.specificity, fam.priority)
            if best_rank is None or rank > best_rank:
                best, best_rank = (fam, layout, hits), rank
    if best is None:
        return None
    fam, layout, hits = best
    family_id, label = fam.describe(keys, shapes, layout)
    return Match(fam, family_id, layout, label, hits)


def from_config(config: dict | None) -> Family | None:
    """The family a diffusers/transformers config.json names (`_class_name` or `architectures[0]`)."""
    if not isinstance(config, dict):
        return None
    names = []
    if isinstance(config.get("_class_name"), str):
        names.append(config["_class_name"])
    arch = config.get("architectures")
    if isinstance(arch, list) and arch and isinstance(arch[0], str):
        names.append(arch[0])
    for name in names:
        for fam in all_families():
            if name == fam.diffusers_class or any(re.fullmatch(p, name) for p in fam.config_classes):
                return fam
    return None


def layout_name(layout: str | None) -> str:
    """How messages name a layout: "original names", "diffusers layout"."""
    return {ORIGINAL: "original names", DIFFUSERS: "diffusers layout"}.get(layout or "", "its only naming")
