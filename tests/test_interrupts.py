"""`ckpt.interrupts.signals_deferred`: an interrupt that arrives inside the held-back step is delivered
once, right after it, to the handler that was in place; whichever way it arrives: a signal while other
threads run (the kernel may hand it to any unmasked thread), or `_thread.interrupt_main()`, which is how
Ray cancels a running task and which no signal mask can hold back."""

from __future__ import annotations

import _thread
import os
import signal
import threading
import time

import pytest

from ckpt.interrupts import signals_deferred


@pytest.fixture(autouse=True)
def pythons_own_sigint_handler():
    """Python's default SIGINT handler in place, as in the CLI's process. In the test process a library another
    test loaded may have replaced it (with SIG_IGN, or with a C handler: `signal.getsignal` then says None), and
    `_thread.interrupt_main()` reaches only a Python handler; the SIGINT cases then never see KeyboardInterrupt.
    Restored afterwards where it was a Python-level one."""
    old = signal.getsignal(signal.SIGINT)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    if old is not None:
        signal.signal(signal.SIGINT, old)


def busy_threads(n=3):
    """Unmasked threads that sleep in short steps (as the write stages' threads wait for bands)."""
    stop = threading.Event()
    threads = [threading.Thread(target=lambda: [time.sleep(0.001) for _ in iter(stop.is_set, True)], daemon=True)
               for _ in range(n)]
    for t in threads:
        t.start()
    return stop


def step_with(arrive) -> list[str]:
    """Run a held-back step in which `arrive()` fires; what happened, in order."""
    seen = []
    with pytest.raises(KeyboardInterrupt):
        try:
            with signals_deferred():
                arrive()
                for _ in range(20):  # plenty of bytecode (and sleeps) for a pending handler to run
                    time.sleep(0.005)
                seen.append("step finished")
        finally:
            seen.append("after the step")
    return seen


def test_interrupt_main_is_held_until_the_step_ends():
    assert step_with(_thread.interrupt_main) == ["step finished", "after the step"]


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_with_other_threads_running_is_held_until_the_step_ends(sig):
    stop = busy_threads()
    old = signal.signal(signal.SIGTERM, lambda s, f: (_ for _ in ()).throw(KeyboardInterrupt()))
    try:
        assert step_with(lambda: os.kill(os.getpid(), sig)) == ["step finished", "after the step"]
    finally:
        signal.signal(signal.SIGTERM, old)
        stop.set()


def test_delivered_once_to_the_handler_in_place_and_handlers_restored():
    calls = []
    before = signal.signal(signal.SIGINT, lambda s, f: calls.append(s))
    try:
        with signals_deferred():
            _thread.interrupt_main()
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)
            assert calls == []
        assert calls == [signal.SIGINT]
        handler = signal.getsignal(signal.SIGINT)
        with signals_deferred():
            pass
        assert signal.getsignal(signal.SIGINT) is handler and calls == [signal.SIGINT]
    finally:
        signal.signal(signal.SIGINT, before)


def test_nested_steps_deliver_after_the_outer_one():
    seen = []
    with pytest.raises(KeyboardInterrupt):
        with signals_deferred():
            with signals_deferred():
                _thread.interrupt_main()
                time.sleep(0.01)
            seen.append("inner done")
            time.sleep(0.01)
            seen.append("outer done")
    assert seen == ["inner done", "outer done"]


def test_outside_the_main_thread_nothing_is_changed():
    out = {}

    def worker():
        with signals_deferred():
            out["handler"] = signal.getsignal(signal.SIGINT)

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    assert out["handler"] is signal.getsignal(signal.SIGINT)
