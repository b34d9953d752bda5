"""Where the compiled kernels are cached (`ckpt.jit._cache_dir`): the user's cache folder, else a folder of this
user's own under the temp folder (never one another user made or can write: compiled code is loaded from it), else
none, the kernels then compiled in each run (`_njit`: numba refuses `cache=True` where no folder is writable, as
for a batch job forked as another uid, tests/test_batch_api_errors.py). The kernels give the same bytes either way."""

from __future__ import annotations

import os
import stat

import numpy as np
import pytest

import ckpt.jit as jit


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    monkeypatch.setattr(jit, "_CACHE_DIR", None)
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    monkeypatch.setenv("NUMBA_CACHE_DIR", str(blocked / "numba"))  # under a file: cannot be made
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    return tmp_path / "tmp" / f"ckpt-numba-{os.getuid()}"


def test_the_users_folder_first(monkeypatch, tmp_path):
    monkeypatch.setattr(jit, "_CACHE_DIR", None)
    monkeypatch.setenv("NUMBA_CACHE_DIR", str(tmp_path / "cache"))
    got = jit._cache_dir()
    assert got is not None and os.path.dirname(got) == str(tmp_path / "cache") and os.path.isdir(got)


def test_an_unwritable_cache_folder_gives_way_to_a_private_temp_folder(fresh):
    got = jit._cache_dir()
    assert got is not None and os.path.dirname(got) == str(fresh)
    assert stat.S_IMODE(fresh.stat().st_mode) == 0o700


def test_a_temp_folder_others_can_write_is_not_used(fresh):
    fresh.mkdir(mode=0o777)
    fresh.chmod(0o777)
    assert jit._cache_dir() is None
    assert not any(fresh.iterdir())


def test_without_a_cache_the_kernels_are_compiled_in_the_run(monkeypatch):
    """numba's refusal to cache (no locator) falls back to an uncached dispatcher; other errors are raised."""
    import numba

    real = numba.njit

    def refusing(*a, **k):
        if k.get("cache"):
            raise RuntimeError("cannot cache function 'f': no locator available for file 'x.py'")
        return real(*a, **k)

    monkeypatch.setattr(numba, "njit", refusing)

    def f(x):
        return x + 1

    fn = jit._njit(numba, f, cache=True)
    assert fn(np.int64(2)) == 3

    def broken(*a, **k):
        raise RuntimeError("something else")

    monkeypatch.setattr(numba, "njit", broken)
    with pytest.raises(RuntimeError, match="something else"):
        jit._njit(numba, f, cache=True)
