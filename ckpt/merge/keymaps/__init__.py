"""Per-family name translations used by the LoRA key map (`ckpt.merge.keymap`).

A base stores a model under one naming scheme (LDM `input_blocks`, BFL `double_blocks`, OpenCLIP
`resblocks`, diffusers `transformer_blocks`...), while LoRAs are trained on whichever scheme the trainer
used. Each family module looks at the base's own keys (relative to the model, file prefix stripped) and
returns `Alias`es: extra module names, in the other scheme, that address a base weight, a row slice of a
fused base weight, or several base weights at once. Everything is generated from keys that exist, so a
LoRA name is never parsed or split on `_`.

Families that relate two schemes tensor by tensor (Flux, SD3) describe the relation once as `Pair`s;
`pair_aliases` turns them into aliases in whichever direction the base needs.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from ckpt.merge.targets import Target

Shapes = dict[str, tuple[int, ...]]

# Parameter suffixes that name a module's main tensor; a LoRA module name is the key without them.
PARAM_SUFFIXES = (".weight", ".scale")


@dataclass(frozen=True)
class Alias:
    """Module `name` (family scheme, relative to the model) lands on `targets` (keys relative too)."""

    name: str
    targets: tuple[Target, ...]


@dataclass(frozen=True)
class Pair:
    """One tensor of a native layout (BFL/SAI) and the diffusers tensor made from it.

    `rows` is the [start, stop) slice of the native tensor that the diffusers tensor is; `transform`
    is what turns the native rows into the diffusers tensor ("swap_halves" is its own inverse).
    """

    native: str
    diffusers: str
    rows: tuple[int, int] | None = None
    transform: str | None = None


def module_of(key: str) -> str:
    """`a.b.weight` -> `a.b`; keys without a parameter suffix are their own module name."""
    for suffix in PARAM_SUFFIXES:
        if key.endswith(suffix):
            return key[: -len(suffix)]
    return key


def prefixes_of(keys) -> set[str]:
    """Every dotted prefix of every key (`a`, `a.b`, `a.b.c` for `a.b.c`): cheap `has_module` tests."""
    out: set[str] = set()
    for k in keys:
        parts = k.split(".")
        for i in range(1, len(parts) + 1):
            out.add(".".join(parts[:i]))
    return out


def block_indices(keys, head: str) -> list[int]:
    """Sorted N of keys `head.N.…` (e.g. `double_blocks`)."""
    found = set()
    lead = head + "."
    for k in keys:
        if k.startswith(lead):
            rest = k[len(lead):].split(".", 1)[0]
            if rest.isdigit():
                found.add(int(rest))
    return sorted(found)


def pair_aliases(pairs: list[Pair], base: Shapes, native_base: bool) -> list[Alias]:
    """Aliases for a base stored natively (diffusers names -> native rows) or as diffusers (the reverse).

    In the reverse direction a native module fused from several diffusers tensors (qkv, linear1) becomes
    one alias with one Target per piece, each saying which rows of the LoRA delta it takes (`part`).
    A native module is only offered when every piece exists in the base.
    """
    out: list[Alias] = []
    pairs = [p for p in pairs if not p.native.endswith(".bias")]  # biases follow their weight's Target
    if native_base:
        for p in pairs:
            if p.native in base:
                out.append(Alias(module_of(p.diffusers), (Target(p.native, p.rows, p.transform),)))
        return out
    groups: dict[str, list[Pair]] = defaultdict(list)
    for p in pairs:
        groups[p.native].append(p)
    for native, group in groups.items():
        if not all(p.diffusers in base for p in group):
            continue
        if len(group) == 1 and group[0].rows is None:
            p = group[0]
            targets = (Target(p.diffusers, transform=p.transform),)
        else:
            targets = tuple(Target(p.diffusers, transform=p.transform, part=p.rows) for p in group)
        out.append(Alias(module_of(native), targets))
    return out


def thirds(start: int, width: int) -> list[tuple[int, int]]:
    """Row ranges of q, k, v in a fused qkv weight whose pieces are `width` rows each."""
    return [(start + i * width, start + (i + 1) * width) for i in range(3)]
