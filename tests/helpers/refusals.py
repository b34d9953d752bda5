"""What a refused input looks like from the CLI: exit 2, one `error: CULPRIT...` line naming the problem,
and the folder's listing unchanged (nothing written, nothing removed)."""

from __future__ import annotations


def assert_refused(run_ckpt, tmp_path, args, culprit, problem):
    before = sorted(p.name for p in tmp_path.rglob("*"))
    code, out, err = run_ckpt(*args)
    assert code == 2, (code, out, err)
    assert err.count("\n") == 1 and err.startswith(f"error: {culprit}"), err
    assert problem in err, err
    assert sorted(p.name for p in tmp_path.rglob("*")) == before
