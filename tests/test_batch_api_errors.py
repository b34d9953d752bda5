"""`ckpt.batch.runner.run_batch`, called from Python (no CLI callback has checked its paths): a folder that
cannot be entered or listed, an -o that cannot be looked at or written, an output folder of -o's tree that
cannot be entered, all are one CkptError line naming the path (or, for one output, that job's one-line
failure), never a raw PermissionError; nothing is written.

Permissions do not bind root: run as root (CI containers), each case runs in a forked child as uid 65534."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from ckpt.batch.operations import make_operation
from ckpt.batch.runner import run_batch
from ckpt.errors import CkptError

ROOT = hasattr(os, "geteuid") and os.geteuid() == 0


def _one(folder: Path, name: str = "in.safetensors") -> None:
    folder.mkdir(parents=True, exist_ok=True)
    save_file({"w": torch.arange(4.0).reshape(2, 2)}, folder / name)


@pytest.fixture
def perm():
    """perm/{locked/ro (mode 700 above), open/{a,b}.safetensors, ro (mode 555), outsub/sub (mode 700),
    hub/models--o--n/snapshots (mode 700)}, in a folder every user may enter. Made by the test's user; the
    calls run as an unprivileged user (uid 65534 when the tests run as root)."""
    top = Path(tempfile.mkdtemp(prefix="ckpt-api-perm-"))
    base = top / "perm"
    _one(base / "locked" / "ro")
    _one(base / "open", "a.safetensors")
    _one(base / "open", "b.safetensors")
    (base / "ro").mkdir()
    (base / "outsub" / "sub").mkdir(parents=True)
    hub = base / "hub" / "models--o--n"
    _one(hub / "snapshots" / "aa")
    (hub / "refs").mkdir()
    (hub / "refs" / "main").write_text("aa")
    for p in [top, *top.rglob("*")]:
        p.chmod(0o777 if p.is_dir() else 0o666)
    for p, mode in ((base / "locked", 0o700), (base / "ro", 0o555), (base / "outsub" / "sub", 0o700),
                    (hub / "snapshots", 0o700)):
        p.chmod(mode if ROOT else mode & 0o500 if mode == 0o555 else 0)
    yield base
    for p in top.rglob("*"):
        if p.is_dir() and not p.is_symlink():
            p.chmod(0o777)
    shutil.rmtree(top)


def _call(cwd: Path, folder, outdir) -> dict:
    """run_batch(convert --to fp16) in `cwd` as an unprivileged user: {"error": line} or {"outcomes": [...]},
    or {"raised": "TypeName: message"} for anything but a CkptError."""
    def call() -> dict:
        os.chdir(cwd)
        try:
            r = run_batch(make_operation("convert", {"to": "fp16"}), folder, outdir, quiet=True)
            return {"outcomes": sorted([o.job.item.rel, o.status, o.error] for o in r.outcomes)}
        except CkptError as e:
            return {"error": str(e)}
        except BaseException as e:  # what the test must never see
            return {"raised": f"{type(e).__name__}: {e}"}

    here = os.getcwd()
    if not ROOT:
        try:
            return call()
        finally:
            os.chdir(here)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        res = {"raised": "child failed"}
        try:
            os.close(r)
            os.setgroups([])
            os.setgid(65534)
            os.setuid(65534)
            res = call()
        finally:
            os.write(w, json.dumps(res).encode())
            os._exit(0)
    os.close(w)
    data = b""
    while chunk := os.read(r, 1 << 16):
        data += chunk
    os.close(r)
    os.waitpid(pid, 0)
    return json.loads(data)


def _tree(base: Path) -> list[str]:
    return sorted(str(p.relative_to(base)) for p in base.rglob("*") if "locked/" not in str(p.relative_to(base))
                  and "sub/" not in str(p.relative_to(base)) and "snapshots/" not in str(p.relative_to(base)))


@pytest.mark.parametrize("folder, outdir, line", [
    ("locked/ro/in.safetensors", None, "locked/ro/in.safetensors: permission denied (cannot enter {locked})"),
    ("locked/ro", "open-out", "locked/ro: permission denied (cannot enter {locked})"),
    ("open", "locked/ro/out", "-o locked/ro/out: permission denied (cannot enter {locked})"),
    ("open", "ro", "ro/ckpt-batch.jsonl: cannot write the batch manifest (Permission denied); choose another -o"),
    ("open", "ro/out", "ro/out/ckpt-batch.jsonl: cannot write the batch manifest (Permission denied); choose another -o"),
    ("hub", "open-out", "hub/models--o--n/snapshots: permission denied (cannot list it)"),
    ("missing", None, "missing: no such file or directory"),
], ids=["folder-locked", "folder-in-locked", "o-in-locked", "o-read-only", "o-under-read-only", "hub-snapshots", "missing"])
def test_run_batch_api_refuses_in_one_ckpt_error(perm, folder, outdir, line):
    before = _tree(perm)
    res = _call(perm, folder, outdir)
    assert res == {"error": line.format(locked=perm / "locked")}, res
    assert _tree(perm) == before


def test_an_output_folder_that_cannot_be_entered_fails_its_jobs_alone(perm):
    """-o's tree already holds a folder the user cannot enter: the jobs whose outputs go there fail, each in
    one line, the others are written (compared with torch's own cast)."""
    _one(perm / "in" / "sub", "x.safetensors")
    _one(perm / "in", "y.safetensors")
    for p in [perm / "in", *(perm / "in").rglob("*")]:
        p.chmod(0o777 if p.is_dir() else 0o666)
    res = _call(perm, "in", "outsub")
    where = perm / "outsub" / "sub"
    assert res == {"outcomes": [["sub/x.safetensors", "failed",
                                 f"outsub/sub/x.safetensors: permission denied (cannot enter {where})"],
                                ["y.safetensors", "ok", None]]}, res
    got = load_file(perm / "outsub" / "y.safetensors")["w"]
    assert got.dtype == torch.float16 and torch.equal(got, torch.arange(4.0).reshape(2, 2).half())
