"""Holding SIGINT/SIGTERM back where an interrupt would do harm.

The CLI turns both signals into KeyboardInterrupt, so that writers remove their temp output. Two kinds
of step must not be cut in half: publishing (a rename and its record, see `ckpt.io.publish`) and
importing torch/numpy, whose extension modules turn an interrupt during their initialisation into a
misleading ImportError, a "Fatal Python error" abort or an exit by SIGINT. Held back, the signal is
delivered (as a plain KeyboardInterrupt) right after the step. Imports nothing heavy.
"""

from __future__ import annotations

import contextlib
import importlib
import signal
import threading


@contextlib.contextmanager
def signals_deferred():
    """Block SIGINT/SIGTERM (main thread only); pending ones are delivered on exit."""
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "pthread_sigmask"):
        yield
        return
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def load(module: str):
    """Import a command's implementation (and torch, numpy with it) with signals held back."""
    with signals_deferred():
        return importlib.import_module(module)
