"""Compiled CPU kernels: plain Python over scalars and numpy arrays, compiled by numba (LLVM) on first use.

Used where torch's vectorized ops cannot reach C's speed or bytes: ggml's quantizers (`ckpt.quant.kquants`), DARE's
and DELLA's masks (`ckpt.merge.masks_cpu`), the casts between fp32, fp16 and bf16 (`ckpt.cast_cpu`). numba ships
wheels for every platform torch does, needs no compiler on the user's machine, and compiles to the same
arithmetic as C when fast-math is off (no FMA contraction, no reassociation).

A kernel module keeps the import rule of the package (importing it imports neither numba nor numpy,
tests/test_layering.py): its kernels are plain functions marked `@kernel`, written against `np` (`from ckpt.lazy
import numpy as np`) and calling each other by name; `compiled(module_name)` builds them the first time they run:
one copy of the module's globals in which `np` is numpy itself and every `@kernel` function is its numba
dispatcher (so kernels call kernels compiled), `cache=True` (compiled once per machine, under numba's cache dir),
`nogil=True` (they run on threads beside others). Constant tables (ggml's grids) are declared as
`JIT_TABLES = {"NAME": lambda np: np.array(DATA, dtype=np.uint64)}`: built with numpy at compile time and put in
the kernels' globals under NAME, where numba freezes them into the compiled code. An LLVM instruction numba has no
Python spelling for is declared as `JIT_INTRINSICS = {"NAME": make}`, `make()` returning a `numba.extending.intrinsic`
(made at compile time, so the module still imports without numba; `ckpt.cast_cpu`'s half conversions).
"""

from __future__ import annotations

import threading
import types

from ckpt.lazy import numpy as np

_BUILT: dict[str, types.SimpleNamespace] = {}
_LOCK = threading.RLock()  # a module's kernels may call another module's (built first, same thread)


def kernel(fn):
    """Mark `fn` as a kernel of its module (compiled by `compiled`)."""
    fn._ckpt_kernel = True
    return fn


def available() -> bool:
    """numba imports here (it is a dependency; a platform without its wheels falls back to the torch formulations)."""
    try:
        import numba  # noqa: F401
    except Exception:
        return False
    return True


def compiled(module_name: str) -> types.SimpleNamespace:
    """The compiled kernels of `module_name`, as attributes (built on first call; thread-safe)."""
    with _LOCK:
        ns = _BUILT.get(module_name)
        if ns is None:
            ns = _BUILT[module_name] = _build(module_name)
        return ns


def _build(module_name: str) -> types.SimpleNamespace:
    import importlib

    import numba  # noqa: F401

    from ckpt.lazy import resolve

    numpy = resolve(np)
    _llvm_options()
    mod = importlib.import_module(module_name)
    cache_dir = _cache_dir()
    g = dict(vars(mod))
    g["np"] = numpy
    g["numpy"] = numpy
    for name, make in getattr(mod, "JIT_TABLES", {}).items():  # constant arrays the kernels read as globals
        g[name] = make(numpy)
    for name, make in getattr(mod, "JIT_INTRINSICS", {}).items():  # numba intrinsics (LLVM instructions) by name
        g[name] = make()
    out = {}
    for name, f in vars(mod).items():
        if isinstance(f, types.FunctionType) and getattr(f, "_ckpt_kernel", False):
            if f.__module__ != module_name:  # imported from another kernel module: its own compiled one
                g[name] = getattr(compiled(f.__module__), f.__name__)
                continue
            copy = types.FunctionType(f.__code__, g, f.__name__, f.__defaults__, f.__closure__)
            copy.__module__, copy.__qualname__ = f.__module__, f.__qualname__
            before = numba.config.CACHE_DIR  # read when caching is enabled
            numba.config.CACHE_DIR = cache_dir or before
            try:
                g[name] = out[name] = _njit(numba, copy, cache_dir is not None)
            finally:
                numba.config.CACHE_DIR = before
    return types.SimpleNamespace(**out)


def _njit(numba, fn, cache: bool):
    """numba's dispatcher of `fn`, cached on disk where it can be (numba raises "cannot cache function ... no
    locator available" where neither the cache folder nor the source's is writable: compiled each run then)."""
    options = dict(nogil=True, fastmath=False, error_model="numpy")
    if cache:
        try:
            return numba.njit(cache=True, **options)(fn)
        except RuntimeError as e:
            if "cannot cache" not in str(e):
                raise
    return numba.njit(**options)(fn)


def _cache_dir() -> str | None:
    """Where the compiled kernels are kept: numba's cache (NUMBA_CACHE_DIR where set) under a folder named by a hash
    of the encoders' sources (ckpt/quant/kquants, where the grids live) and this file. numba keys a cached kernel by its own module's file only, so a kernel whose tables
    come from another module (`JIT_TABLES` over grids) would keep stale tables when that module changes; a new
    hash is a new cache. The setting is ckpt's alone (put back after each kernel is made). A folder this user
    cannot write (a read-only or foreign home: a container, another uid) gives way to one under the temp folder;
    None where that fails too (the kernels are then compiled in each run, `_njit`)."""
    import hashlib
    import os
    from pathlib import Path

    global _CACHE_DIR
    if _CACHE_DIR is None:
        h = hashlib.sha256()
        for f in sorted((Path(__file__).parent / "quant" / "kquants").glob("*.py")) + [Path(__file__)]:
            h.update(f.name.encode() + b"\0" + f.read_bytes())
        root = os.environ.get("NUMBA_CACHE_DIR") or os.path.join(
            os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "ckpt", "numba")
        import tempfile

        uid = os.getuid() if hasattr(os, "getuid") else None
        temp = Path(tempfile.gettempdir()) / f"ckpt-numba-{uid}"
        _CACHE_DIR = ""
        for base in (Path(root), temp):
            folder = base / h.hexdigest()[:16]
            try:
                if base == temp:  # a shared folder: ours alone, or not used (compiled code is loaded from it)
                    base.mkdir(mode=0o700, exist_ok=True)
                    st = base.stat()
                    if uid is None or st.st_uid != uid or st.st_mode & 0o077:
                        continue
                folder.mkdir(parents=True, exist_ok=True)
            except OSError:
                continue
            if os.access(folder, os.W_OK | os.X_OK):
                _CACHE_DIR = str(folder)
                break
    return _CACHE_DIR or None


_CACHE_DIR: str | None = None


def _llvm_options():
    """Once per process, before the first kernel compiles: x86's cmov-converter pass off. It turns the clamps of
    the quantizer loops (`MAX(0, MIN(nmax, nearest_int(...)))`, data-dependent and unpredictable) back into
    branches, where gcc keeps them as conditional moves: with it on, Q2_K and Q3_K run at 70 % of the C code's
    speed, with it off at par. A code-generation heuristic only: the bytes do not change."""
    global _LLVM_SET
    if not _LLVM_SET:
        _LLVM_SET = True
        import platform

        if platform.machine().lower() in ("x86_64", "amd64"):
            import llvmlite.binding as llvm

            llvm.set_option("", "-x86-cmov-converter=false")


_LLVM_SET = False
