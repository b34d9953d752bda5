"""The registry of merge methods: every module of this package that defines `METHODS` (a tuple of
`ckpt.merge.methods.base.Method`). Adding a method is adding a module; its name is its registry key."""

from __future__ import annotations

from ckpt.errors import CkptError
from ckpt.merge.methods.base import Method
from ckpt.registry import entry_modules

_REGISTRY: dict[str, Method] | None = None


def methods() -> dict[str, Method]:
    global _REGISTRY
    if _REGISTRY is None:
        reg: dict[str, Method] = {}
        for mod in entry_modules(__name__, __path__, "METHODS"):
            for m in mod.METHODS:
                if m.name in reg:
                    raise RuntimeError(f"merge method {m.name!r} is defined twice")
                reg[m.name] = m
        _REGISTRY = reg
    return _REGISTRY


def get_method(name) -> Method:
    reg = methods()
    if not isinstance(name, str) or name not in reg:
        from ckpt.merge.shown import shown

        raise CkptError(f"merge_method: {shown(name)} is not a method ckpt has (it has {', '.join(sorted(reg))})")
    return reg[name]
