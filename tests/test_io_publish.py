"""Publishing an output (ckpt/io/publish.py): a temp output that vanishes or is replaced fails the run,
two runs racing for one -o never both succeed, an input folder never receives the output, stale temp
outputs of dead runs are removed (and only those), and signals around the publish tell the truth."""

from __future__ import annotations

import errno
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from huggingface_hub import save_torch_state_dict
from safetensors.torch import load_file, save_file

import ckpt.io.output as output
import ckpt.io.publish as publish

ROOT = Path(__file__).resolve().parents[1]


def sharded(tmp_path: Path) -> Path:
    """A model folder of 3 shards (2 tensors each), an index and a config."""
    src = tmp_path / "model"
    src.mkdir()
    save_torch_state_dict({f"l{i}": torch.randn(32, 32) for i in range(6)}, src, max_shard_size=9000)
    (src / "config.json").write_text("{}")
    return src


def one_file(tmp_path: Path) -> Path:
    src = tmp_path / "m.safetensors"
    save_file({f"t{i}": torch.randn(8, 8, generator=torch.Generator().manual_seed(i)) for i in range(4)}, src)
    return src


def temps(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.rglob("*") if ".ckpt-tmp-" in p.name or ".ckpt-old-" in p.name)


def during_write(monkeypatch, nth: int, action) -> None:
    """Run `action(temp_path)` when the nth tensor starts streaming."""
    real_write, real_stream, state = output._write_file, output._stream_tensor, {"n": 0, "path": None}

    def write_file(path, *a):
        if state["path"] is None:
            state["path"] = next(p for p in [Path(path), *Path(path).parents] if ".ckpt-tmp-" in p.name)
        return real_write(path, *a)

    def stream(*a):
        state["n"] += 1
        if state["n"] == nth:
            action(state["path"])
        return real_stream(*a)

    monkeypatch.setattr(output, "_write_file", write_file)
    monkeypatch.setattr(output, "_stream_tensor", stream)


# ------------------------------------------------------------------------- item 2: vanishing temp output


@pytest.mark.parametrize("how", ["rmtree", "rmtree-and-recreate", "a-finished-shard", "parent-replaced"])
def test_temp_output_that_vanishes_fails_the_run(tmp_path, monkeypatch, run_ckpt, how):
    src = sharded(tmp_path)
    out = tmp_path / "outs" / "model-fp16"
    out.parent.mkdir()

    def vanish(tmp: Path):
        if how == "rmtree":
            shutil.rmtree(tmp)
        elif how == "rmtree-and-recreate":
            shutil.rmtree(tmp)
            tmp.mkdir()
        elif how == "a-finished-shard":
            next(tmp.glob("*.safetensors")).unlink()
        else:
            os.rename(out.parent, tmp_path / "moved")
            (tmp_path / "outs").mkdir()

    during_write(monkeypatch, 3, vanish)  # the first tensor of the second shard
    code, stdout, err = run_ckpt("convert", src, "--to", "fp16", "-o", out)
    assert code == 2, err
    assert err.startswith("error: ") and err.count("\n") == 1 and "nothing written" in err, err
    assert "removed" in err
    assert not out.exists() and not (tmp_path / "moved" / out.name).exists() and stdout == ""
    assert temps(tmp_path) == []


# ------------------------------------------------------------------------------ item 3: racing for one -o


@pytest.mark.parametrize("fallback", [False, True], ids=["renameat2", "link-or-mkdir"])
@pytest.mark.parametrize("layout", ["file", "folder"])
def test_output_that_appears_during_the_run_is_never_replaced(tmp_path, monkeypatch, run_ckpt, layout, fallback):
    if fallback:
        monkeypatch.setattr(publish, "_renameat2_fn", None)
    src = one_file(tmp_path) if layout == "file" else sharded(tmp_path)
    out = tmp_path / ("o.safetensors" if layout == "file" else "o")

    def other_run(_tmp):  # another run (or anyone) publishes OUT meanwhile
        if layout == "file":
            out.write_bytes(b"the other run's output")
        else:
            out.mkdir()
            (out / "other.txt").write_text("the other run's output")

    during_write(monkeypatch, 2, other_run)
    code, _, err = run_ckpt("convert", src, "--to", "fp16", "-o", out)
    assert code == 2 and err.count("\n") == 1 and "already exists" in err, err
    if layout == "file":
        assert out.read_bytes() == b"the other run's output"
    else:
        assert [p.name for p in out.iterdir()] == ["other.txt"]
    assert temps(tmp_path) == []


@pytest.mark.parametrize("fallback", [False, True], ids=["renameat2", "two-renames"])
@pytest.mark.parametrize("layout", ["file", "folder"])
def test_overwrite_replaces_what_appeared(tmp_path, monkeypatch, run_ckpt, layout, fallback):
    if fallback:
        monkeypatch.setattr(publish, "_renameat2_fn", None)
    src = one_file(tmp_path) if layout == "file" else sharded(tmp_path)
    out = tmp_path / ("o.safetensors" if layout == "file" else "o")
    if layout == "folder":  # a previous ckpt output (foreign files are refused: test_output_paths.py)
        assert run_ckpt("convert", src, "--to", "bf16", "-o", out, "-q")[0] == 0
    code, _, err = run_ckpt("convert", src, "--to", "fp16", "-o", out, "--overwrite", "-q")
    assert code == 0, err
    if layout == "folder":
        assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in src.iterdir())
        assert torch.equal(load_file(out / "model-00001-of-00003.safetensors")["l0"],
                           load_file(src / "model-00001-of-00003.safetensors")["l0"].half())
    else:
        assert torch.equal(load_file(out)["t1"], load_file(src)["t1"].half())
    assert temps(tmp_path) == []


def test_two_real_runs_to_one_output_exactly_one_wins(tmp_path):
    src = tmp_path / "big.safetensors"
    save_file({f"t{i:02d}": torch.full((512, 1024), float(i)) for i in range(16)}, src)  # 32 MB
    out = tmp_path / "o.safetensors"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "ckpt.cli", "convert", str(src), "--to", "fp16", "-o", str(out), "-q"]
    procs = [subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    results = [(p.wait(timeout=120), p.stderr.read()) for p in procs]
    for p in procs:
        p.stdout.close(), p.stderr.close()
    codes = sorted(code for code, _ in results)
    assert codes == [0, 2], results
    loser = next(err for code, err in results if code == 2)
    assert "already exists" in loser and "Traceback" not in loser and loser.count("\n") == 1
    got = load_file(out)
    assert all(torch.equal(got[f"t{i:02d}"], torch.full((512, 1024), float(i), dtype=torch.float16)) for i in range(16))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["big.safetensors", "o.safetensors"]


# ------------------------------------------------------------------------ item 9: -o inside an input folder


def test_output_inside_an_input_folder_is_refused(tmp_path, run_ckpt):
    src = sharded(tmp_path)
    before = sorted(str(p) for p in tmp_path.rglob("*"))
    for out in (src / "sub", src / "a" / "b", src / "x.safetensors"):
        code, _, err = run_ckpt("convert", src, "--to", "fp16", "-o", out)
        assert code == 2 and err.count("\n") == 1 and "is inside the input folder" in err, err
    code, _, err = run_ckpt("convert", src / "model.safetensors.index.json", "--to", "fp16", "-o", src / "half")
    assert code == 2 and "is inside the input folder" in err
    assert sorted(str(p) for p in tmp_path.rglob("*")) == before
    # a file input: writing beside it is fine
    (tmp_path / "files").mkdir()
    f = one_file(tmp_path / "files")
    code, _, err = run_ckpt("convert", f, "--to", "fp16", "-o", f.parent / "half.safetensors", "-q")
    assert code == 0, err


# ---------------------------------------------------------------------- stale temp outputs (item 5)


def dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_stale_temp_outputs_of_dead_runs_are_removed_and_nothing_else(tmp_path, run_ckpt):
    src = one_file(tmp_path)
    pid = dead_pid()
    stale_file = tmp_path / f".m-fp16.safetensors.ckpt-tmp-{pid}-0123abcd"
    stale_dir = tmp_path / f".m-fp16.safetensors.ckpt-old-{pid}-89abcdef"
    stale_file.write_bytes(b"partial")
    (stale_dir / "sub").mkdir(parents=True)
    (stale_dir / "sub" / "x").write_bytes(b"partial")
    keep = [tmp_path / f".m-fp16.safetensors.ckpt-tmp-{os.getpid()}-aaaaaaaa",  # a live process
            tmp_path / f".m-fp16.safetensors.ckpt-tmp-{pid}-not-hex!",  # not ckpt's name
            tmp_path / f".other.safetensors.ckpt-tmp-{pid}-bbbbbbbb",  # another output's
            tmp_path / f".m-fp16.safetensors.ckpt-tmp-{pid}-cccccccc"]  # locked: its owner lives elsewhere
    for k in keep:
        k.write_bytes(b"x")
    fifo = tmp_path / f".m-fp16.safetensors.ckpt-tmp-{pid}-dddddddd"  # planted: never hangs the run
    os.mkfifo(fifo)
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import fcntl, os, sys, time
        fd = os.open({str(keep[-1])!r}, os.O_RDONLY)
        fcntl.flock(fd, fcntl.LOCK_EX)
        print("locked", flush=True)
        time.sleep(120)""")], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        code, _, err = run_ckpt("convert", src, "--to", "fp16", "-q")
    finally:
        holder.kill()
        holder.wait()
        holder.stdout.close()
    assert code == 0, err
    assert not stale_file.exists() and not stale_dir.exists()
    assert all(k.exists() for k in keep)
    assert (tmp_path / "m-fp16.safetensors").is_file()


def test_a_running_output_is_locked_and_named_after_its_pid(tmp_path, monkeypatch, run_ckpt):
    src = sharded(tmp_path)
    seen = {}

    def look(tmp: Path):
        seen["name"] = tmp.name
        seen["gone"] = publish._owner_gone(os.open(tmp.parent, os.O_RDONLY), tmp.name, dead_pid())

    during_write(monkeypatch, 2, look)
    assert run_ckpt("convert", src, "--to", "fp16", "-q")[0] == 0
    assert seen["name"].startswith(f".model-fp16.ckpt-tmp-{os.getpid()}-")
    assert seen["gone"] is False  # a dead PID in the name, but the lock is held: not stale


# ------------------------------------------------------------------------------ read-only and unwritable


def test_unwritable_output_folder_is_one_line(tmp_path, monkeypatch, run_ckpt):
    src = one_file(tmp_path)
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode, **k: False if Path(p) == tmp_path / "ro" else real_access(p, mode, **k))
    (tmp_path / "ro").mkdir()
    code, _, err = run_ckpt("convert", src, "--to", "fp16", "-o", tmp_path / "ro" / "x.safetensors")
    assert code == 2 and err.count("\n") == 1 and f"cannot write in {tmp_path / 'ro'}" in err, err
    # the check passes but the filesystem refuses when the temp output is made (EROFS), or in the cleanup
    monkeypatch.setattr(os, "access", real_access)
    real_open = os.open

    def erofs(path, flags, *a, **k):
        if ".ckpt-tmp-" in str(path):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS))
        return real_open(path, flags, *a, **k)

    monkeypatch.setattr(os, "open", erofs)
    code, _, err = run_ckpt("convert", src, "--to", "fp16", "-o", tmp_path / "ro" / "sub" / "x.safetensors")
    assert code == 2 and err.count("\n") == 1 and "Read-only file system" in err and "Traceback" not in err, err
    assert sorted(p.name for p in (tmp_path / "ro").iterdir()) == []  # sub/ was created, then removed


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0, reason="root writes into read-only folders")
def test_read_only_folder_for_real(tmp_path, run_ckpt):
    src = one_file(tmp_path)
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        code, _, err = run_ckpt("convert", src, "--to", "fp16", "-o", ro / "x.safetensors")
    finally:
        ro.chmod(0o755)
    assert code == 2 and err.count("\n") == 1 and "permission denied" in err, err


# ------------------------------------------------------------------------------------ item 17: signals

HOOK = '''
import atexit, os, signal
when, sig = os.environ["CKPT_TEST_WHEN"], getattr(signal, os.environ["CKPT_TEST_SIGNAL"])
if when == "after-publish":
    import ckpt.io.publish as p
    _publish = p.Staging.publish

    def publish(self, overwrite):
        _publish(self, overwrite)
        os.kill(os.getpid(), sig)

    p.Staging.publish = publish
elif when == "at-exit":
    atexit.register(lambda: os.kill(os.getpid(), sig))
elif when == "importing-numpy":
    import sys

    class Bomb:
        def find_spec(self, name, path=None, target=None):
            if name == "numpy":
                sys.meta_path.remove(self)
                os.kill(os.getpid(), sig)

    sys.meta_path.insert(0, Bomb())
'''


def run_with_hook(tmp_path: Path, when: str, sig: str, *args) -> subprocess.CompletedProcess:
    hook = tmp_path / "hook"
    hook.mkdir(exist_ok=True)
    (hook / "sitecustomize.py").write_text(HOOK)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(hook), str(ROOT)]), "CKPT_TEST_WHEN": when,
           "CKPT_TEST_SIGNAL": sig}
    return subprocess.run([sys.executable, "-m", "ckpt.cli", *map(str, args)], env=env, capture_output=True,
                          text=True, timeout=120, cwd=tmp_path)


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT"])
def test_signal_right_after_publish_says_it_was_written(tmp_path, sig):
    src = one_file(tmp_path)
    out = tmp_path / "o.safetensors"
    r = run_with_hook(tmp_path, "after-publish", sig, "convert", src, "--to", "fp16", "-o", out)
    assert r.returncode == 130, r.stderr
    assert f"interrupted after writing {out}" in r.stderr and "nothing was written" not in r.stderr
    assert "Traceback" not in r.stderr
    assert torch.equal(load_file(out)["t2"], load_file(src)["t2"].half())


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT"])
def test_signal_while_exiting_is_not_a_traceback_nor_a_kill(tmp_path, sig):
    src = one_file(tmp_path)
    r = run_with_hook(tmp_path, "at-exit", sig, "convert", src, "--to", "fp16", "-o", tmp_path / "o.safetensors")
    assert r.returncode == 0 and "Traceback" not in r.stderr and "Exception ignored" not in r.stderr, r.stderr
    assert r.stdout.startswith("wrote ") and (tmp_path / "o.safetensors").is_file()


def test_sigterm_while_importing_numpy_is_one_line(tmp_path):
    src = one_file(tmp_path)
    r = run_with_hook(tmp_path, "importing-numpy", "SIGTERM", "convert", src, "--to", "fp16", "-o",
                      tmp_path / "o.safetensors")
    assert r.returncode == 130, r.stderr
    assert r.stderr.strip() == "interrupted: nothing was written"
    assert not (tmp_path / "o.safetensors").exists()


def test_protocol_4_pickle_error_comes_without_torch_warning(tmp_path):
    import pickle

    src = tmp_path / "raw.pt"
    src.write_bytes(pickle.dumps({"w": torch.ones(2)}, protocol=4))
    r = subprocess.run([sys.executable, "-m", "ckpt.cli", "convert", str(src), "--to", "fp16"], capture_output=True,
                       text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 2 and r.stderr.startswith(f"error: {src}: ") and r.stderr.count("\n") == 1, r.stderr


# ------------------------------------------------ --overwrite deletes only what it checked (issue 31, item 17)


def previous_output(tmp_path: Path, run_ckpt) -> tuple[Path, Path, list[str]]:
    """(SRC, OUT, OUT's files): a folder ckpt wrote, which --overwrite may replace."""
    src = sharded(tmp_path)
    out = tmp_path / "o"
    code, _, err = run_ckpt("convert", src, "--to", "bf16", "-o", out, "-q")
    assert code == 0, err
    return src, out, sorted(p.name for p in out.iterdir())


def at_the_swap(monkeypatch, out: Path, fallback: bool, action) -> None:
    """Run `action()` in the publish itself: after the check of OUT, right before OUT is swapped out (renameat2's
    RENAME_EXCHANGE, or the first of the two renames where there is none)."""
    done = []
    if fallback:
        monkeypatch.setattr(publish, "_renameat2_fn", None)
        real = os.rename

        def rename(src, dst, **kw):
            if src == out.name and str(dst).startswith(f".{out.name}.ckpt-old-") and not done:
                done.append(action())
            return real(src, dst, **kw)

        monkeypatch.setattr(publish.os, "rename", rename)
        return
    real2 = publish._renameat2

    def renameat2(dfd, old, new, flags):
        if flags == publish._RENAME_EXCHANGE and not done:
            done.append(action())
        return real2(dfd, old, new, flags)

    monkeypatch.setattr(publish, "_renameat2", renameat2)


@pytest.mark.parametrize("fallback", [False, True], ids=["renameat2", "two-renames"])
@pytest.mark.parametrize("when", ["during-the-run", "at-the-swap"])
def test_overwrite_never_deletes_a_folder_swapped_in_by_a_race(tmp_path, monkeypatch, run_ckpt, when, fallback):
    """The folder --overwrite replaces is moved aside, then deleted: what is deleted is the folder ckpt checked
    (same device and inode), never one a race put at OUT meanwhile, whether during the run or between the check
    and the swap (then it is swapped back); the run fails, nothing written, both folders intact."""
    src, out, old = previous_output(tmp_path, run_ckpt)

    def race(*_):
        os.rename(out, tmp_path / "moved")
        out.mkdir()
        (out / "precious.txt").write_text("someone's")

    if fallback and when == "during-the-run":
        monkeypatch.setattr(publish, "_renameat2_fn", None)
    if when == "during-the-run":
        during_write(monkeypatch, 2, race)
    else:
        at_the_swap(monkeypatch, out, fallback, race)
    code, stdout, err = run_ckpt("convert", src, "--to", "fp16", "-o", out, "--overwrite")
    assert code == 2 and err.count("\n") == 1, err
    assert err.startswith(f"error: {out}: was replaced during the run by something ckpt did not check; it is left "
                          "as it is, nothing written"), err
    assert [p.name for p in out.iterdir()] == ["precious.txt"] and (out / "precious.txt").read_text() == "someone's"
    assert sorted(p.name for p in (tmp_path / "moved").iterdir()) == old
    assert temps(tmp_path) == [] and stdout == ""


@pytest.mark.parametrize("fallback", [False, True], ids=["renameat2", "two-renames"])
@pytest.mark.parametrize("when", ["during-the-run", "at-the-swap"])
def test_overwrite_never_deletes_files_put_into_the_old_folder(tmp_path, monkeypatch, run_ckpt, when, fallback):
    src, out, old = previous_output(tmp_path, run_ckpt)

    def put(*_):
        (out / "precious.txt").write_text("someone's")

    if fallback and when == "during-the-run":
        monkeypatch.setattr(publish, "_renameat2_fn", None)
    if when == "during-the-run":
        during_write(monkeypatch, 2, put)
    else:
        at_the_swap(monkeypatch, out, fallback, put)
    code, _, err = run_ckpt("convert", src, "--to", "fp16", "-o", out, "--overwrite")
    assert code == 2 and err.count("\n") == 1, err
    assert err.startswith(f"error: {out}: files ckpt did not write appeared in it during the run (precious.txt)"), err
    assert sorted(p.name for p in out.iterdir()) == sorted(old + ["precious.txt"])
    assert load_file(out / "model-00001-of-00003.safetensors")["l0"].dtype == torch.bfloat16  # the old output
    assert temps(tmp_path) == []


def test_overwrite_never_deletes_a_folder_that_appeared_during_the_run(tmp_path, monkeypatch, run_ckpt):
    src = sharded(tmp_path)
    out = tmp_path / "o"

    def appear(*_):
        out.mkdir()
        (out / "model-00001-of-00003.safetensors").write_text("someone's, named as ckpt names its files")

    during_write(monkeypatch, 2, appear)
    code, _, err = run_ckpt("convert", src, "--to", "fp16", "-o", out, "--overwrite")
    assert code == 2 and err.count("\n") == 1, err
    assert err.startswith(f"error: {out}: appeared during the run, so ckpt did not check it"), err
    assert [p.name for p in out.iterdir()] == ["model-00001-of-00003.safetensors"]
    assert temps(tmp_path) == []


def test_a_stale_temp_removed_is_said_in_the_summary(tmp_path, run_ckpt):
    src = one_file(tmp_path)
    stale = tmp_path / f".m-fp16.safetensors.ckpt-tmp-{dead_pid()}-0123abcd"
    stale.write_bytes(b"partial")
    code, _, err = run_ckpt("convert", src, "--to", "fp16")
    assert code == 0, err
    assert f"note: removed 1 temporary output that a stopped ckpt run left beside the output ({stale.name})" in err
    assert not stale.exists()
