"""`torch` (and numpy), imported on first use.

Planning modules (headers, checkpoints, decoders, inspect) write `from ckpt.lazy import torch` and use
`torch.x` as usual; the real import happens at the first attribute access, i.e. when a command first does
tensor math. So `--help`, every error that needs no tensor (a mistyped path, a bad header) and `ckpt inspect`
of headers never pay torch's start-up (1.5-2 s on a 2-core machine). tests/test_startup.py holds that line.
The import runs with SIGINT/SIGTERM held back (`ckpt.interrupts.load`), as the commands' own imports do.
"""

from __future__ import annotations


class LazyModule:
    """A module proxy: the module is imported when an attribute is first read; each attribute is then
    cached on the proxy, so later reads cost what a module attribute read costs."""

    def __init__(self, name: str):
        self._lazy_name = name

    def __getattr__(self, attr: str):
        if attr.startswith("__"):  # copy/pickle/inspect probing the proxy itself
            raise AttributeError(attr)
        from ckpt.interrupts import load

        value = getattr(load(self._lazy_name), attr)
        setattr(self, attr, value)
        return value

    def __repr__(self):
        return f"<lazy module {self._lazy_name!r}>"


torch = LazyModule("torch")
numpy = LazyModule("numpy")


def resolve(proxy: LazyModule):
    """The module itself behind a proxy (imported now): for code that needs the real module object, such as the
    globals numba compiles kernels against (`ckpt.quant.kquants.jit`)."""
    from ckpt.interrupts import load

    return load(proxy._lazy_name)
