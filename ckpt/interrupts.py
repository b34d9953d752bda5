"""Holding SIGINT/SIGTERM back where an interrupt would do harm.

The CLI turns both signals into KeyboardInterrupt, so that writers remove their temp output. Two kinds
of step must not be cut in half: publishing (a rename and its record, see `ckpt.io.publish`) and
removing a temp output, and importing torch/numpy, whose extension modules turn an interrupt during
their initialisation into a misleading ImportError, a "Fatal Python error" abort or an exit by SIGINT.
Held back, the signal is delivered (to the handler that was in place) right after the step.

Two things hold it back, because either alone leaves a hole:
- the thread's signal mask, so the OS delivers nothing to this thread during a C-level step;
- while the step runs, the Python-level handlers are replaced by one that only records. A masked thread
  is not enough where other threads exist (the write stages' threads, tqdm's monitor, a Ray worker's
  threads): the kernel hands a process-wide signal to an unmasked thread and CPython then runs the
  Python handler in the main thread all the same. And Ray cancels a running task with
  `_thread.interrupt_main()`, which calls the Python handler without any OS signal.
Imports nothing heavy.
"""

from __future__ import annotations

import contextlib
import importlib
import signal
import threading

_HELD = (signal.SIGINT, signal.SIGTERM)


def _deliver(signum: int, handler) -> None:
    """What the handler in place would have done had the signal arrived now."""
    if callable(handler):
        handler(signum, None)
    elif handler == signal.SIG_DFL:
        signal.raise_signal(signum)  # the default action (SIGINT: KeyboardInterrupt via CPython's own)
    # SIG_IGN, or None (set outside Python): nothing to do


@contextlib.contextmanager
def signals_deferred():
    """Hold SIGINT/SIGTERM back (main thread only: elsewhere neither a mask nor a handler applies);
    a signal that arrived meanwhile is delivered, once, on exit."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    arrived: list[int] = []

    def record(signum, frame):
        if signum not in arrived:
            arrived.append(signum)

    old = {}
    masked = hasattr(signal, "pthread_sigmask")
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, set(_HELD)) if masked else None
    try:
        for s in _HELD:
            if signal.getsignal(s) is not None:  # None: set outside Python, cannot be put back; masked only
                old[s] = signal.signal(s, record)
        yield
    finally:
        if masked:  # first, while `record` is in place: a signal pending under the mask is recorded too
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        for s, h in old.items():
            signal.signal(s, h)
        for s in arrived:
            _deliver(s, old.get(s))


def load(module: str):
    """Import a command's implementation (and torch, numpy with it) with signals held back."""
    with signals_deferred():
        return importlib.import_module(module)
