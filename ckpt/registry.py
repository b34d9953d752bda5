"""How ckpt's registries find their entries: every plain module of a package, imported in name order.

Model families (`ckpt.families`, `FAMILY`), output targets (`ckpt.targets`, `TARGETS`), merge methods
(`ckpt.merge.methods`, `METHODS`) and quantized formats (`ckpt.quant`, `FORMAT`) are each one small module that
declares its entry; adding one is adding a file.
Modules named `_private` or `base` (the package's own interface) and subpackages (knowledge that is no entry)
are not entries.
"""

from __future__ import annotations

import importlib
import pkgutil


def entry_modules(package: str, path, attr: str) -> list:
    """The modules of `package` (its `__path__` is `path`) that define `attr`, in name order."""
    mods = []
    for info in sorted(pkgutil.iter_modules(path), key=lambda i: i.name):
        if info.ispkg or info.name.startswith("_") or info.name == "base":
            continue
        mod = importlib.import_module(f"{package}.{info.name}")
        if hasattr(mod, attr):
            mods.append(mod)
    return mods
