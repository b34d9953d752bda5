"""Shared test helpers: run the real CLI in-process and get (exit code, stdout, stderr)."""

from __future__ import annotations

import pytest


@pytest.fixture
def run_ckpt(capsys):
    from ckpt.cli import main

    def run(*args):
        try:
            main([str(a) for a in args])
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        out, err = capsys.readouterr()
        return code, out, err

    return run
