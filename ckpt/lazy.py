"""`torch` (and numpy), imported on first use.

Planning modules (headers, checkpoints, decoders, inspect) write `from ckpt.lazy import torch` and use
`torch.x` as usual; the real import happens at the first attribute access, i.e. when a command first does
tensor math. So `--help`, every error that needs no tensor (a mistyped path, a bad header) and `ckpt inspect`
of headers never pay torch's start-up (1.5-2 s on a 2-core machine). tests/test_startup.py holds that line.
The import runs with SIGINT/SIGTERM held back (`ckpt.interrupts.load`), as the commands' own imports do.

`prefetch(torch)`: a command that will need torch (merge-lora) starts its import on a thread at its start,
so that it runs beside the planning and the kernel copies of untouched tensors (`ckpt.io.early_copies`), which
need none; the first real use joins that thread. A signal is never delivered on that thread (CPython runs
handlers on the main thread, and the thread masks both), so an interrupt cannot cut the import in half. The
thread is a daemon: a run that stops early (a refusal, Ctrl-C) exits without waiting for the import; joined at
exit instead, a Ctrl-C that left the main thread holding the import lock hung the process.
"""

from __future__ import annotations

import threading

_PREFETCH: dict[str, threading.Thread] = {}


class LazyModule:
    """A module proxy: the module is imported when an attribute is first read; each attribute is then
    cached on the proxy, so later reads cost what a module attribute read costs."""

    def __init__(self, name: str):
        self._lazy_name = name

    def __getattr__(self, attr: str):
        if attr.startswith("__"):  # copy/pickle/inspect probing the proxy itself
            raise AttributeError(attr)
        from ckpt.interrupts import load

        _join(self._lazy_name)
        value = getattr(load(self._lazy_name), attr)
        setattr(self, attr, value)
        return value

    def __repr__(self):
        return f"<lazy module {self._lazy_name!r}>"


torch = LazyModule("torch")
numpy = LazyModule("numpy")


def resolve(proxy: LazyModule):
    """The module itself behind a proxy (imported now): for code that needs the real module object, such as the
    globals numba compiles kernels against (`ckpt.jit`)."""
    from ckpt.interrupts import load

    _join(proxy._lazy_name)
    return load(proxy._lazy_name)


def prefetch(proxy: LazyModule) -> None:
    """Start importing the module behind `proxy` on a thread of its own (once; nothing if it is imported): the
    first use joins it. An import that fails there is simply made again by that use, which raises as before."""
    import sys

    name = proxy._lazy_name
    if name in sys.modules or name in _PREFETCH:
        return
    t = threading.Thread(target=_import_quietly, args=(name,), name=f"ckpt-import-{name}", daemon=True)
    _PREFETCH[name] = t
    t.start()


def _import_quietly(name: str) -> None:
    import importlib
    import signal

    if hasattr(signal, "pthread_sigmask"):  # the OS hands SIGINT/SIGTERM to the main thread
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    try:
        importlib.import_module(name)
    except BaseException:  # the first use imports again and raises on its own thread
        pass


def _join(name: str) -> None:
    t = _PREFETCH.get(name)
    if t is not None and t is not threading.current_thread():
        t.join()
