"""`ckpt batch` under attack and after accidents: a planted `./ckpt/` in the cwd never runs, output names
that would collide are refused before anything runs, a SIGKILL-ed batch resumes (recognising its own
finished outputs, removing its own stale temp files), an unwritable manifest is one line, and default
names never look like a trainer's `checkpoint-*`."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from helpers.batch import assert_fp16_of, manifest_lines, no_temp_files, small_models, st

ROOT = Path(__file__).resolve().parents[1]


# --------------------------------------------------------------------------- item 1: ./ckpt in the cwd


def test_workers_never_import_a_ckpt_folder_from_the_cwd(tmp_path):
    work, marker = tmp_path / "work", tmp_path / "MARKER"
    (work / "ckpt" / "batch").mkdir(parents=True)
    plant = f"open({str(marker)!r}, 'a').write(__name__ + '\\n')\n"
    (work / "ckpt" / "__init__.py").write_text(plant)
    (work / "ckpt" / "batch" / "__init__.py").write_text(plant)
    (work / "ckpt" / "batch" / "worker.py").write_text(plant)
    root, out = tmp_path / "models", tmp_path / "out"
    made = small_models(root)
    # the parent is the real ckpt (as the `ckpt` console script is); only the workers could be fooled
    boot = "import sys; sys.path.remove(''); from ckpt.cli import main; main()"
    r = subprocess.run([sys.executable, "-c", boot, "batch", "convert", str(root), "--to", "fp16", "-o", str(out),
                        "--jobs", "2", "-q"], cwd=work, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stdout + r.stderr
    assert not marker.exists(), marker.read_text()
    assert "3 ok, 0 skipped, 0 failed" in r.stdout
    for rel, tensors in made.items():
        assert_fp16_of(out / rel, tensors)


# ------------------------------------------------------------------------- item 4: colliding outputs


def test_colliding_output_names_are_refused_before_any_job(tmp_path, run_ckpt):
    root, out = tmp_path / "models", tmp_path / "out"
    st(root / "a.safetensors", 1)
    torch.save({"w": torch.randn(3, 2)}, root / "a.pt")
    st(root / "a-pt.safetensors", 3)
    for extra in ([], ["--overwrite"], ["--dry-run"], ["--jobs", "2"]):
        code, stdout, err = run_ckpt("batch", "convert", root, "--to", "fp16", "-o", out, *extra)
        assert code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
        assert "a-pt.safetensors and a.pt would both write" in err and str(out / "a-pt.safetensors") in err
        assert not out.exists()
    # a name taken once is still disambiguated as before (x.ckpt beside x.safetensors -> x-ckpt.safetensors)
    (root / "a-pt.safetensors").unlink()
    code, stdout, err = run_ckpt("batch", "convert", root, "--to", "fp16", "-o", out, "-q")
    assert code == 0, err
    assert sorted(p.name for p in out.iterdir()) == ["a-pt.safetensors", "a.safetensors", "ckpt-batch.jsonl"]
    assert torch.equal(load_file(out / "a-pt.safetensors")["w"], torch.load(root / "a.pt")["w"].half())


# --------------------------------------------------------------------- item 5: resume after SIGKILL

KILL_HOOK = '''
import os, signal
when, target = os.environ["CKPT_TEST_KILL"].split(":")
if when == "after-publish":  # the job's output is published, its "ok" line not yet written
    import ckpt.batch.manifest as m
    _append = m.Manifest.append

    def append(self, rec):
        if rec.status == "ok" and rec.input.endswith(target):
            os.killpg(os.getpgrp(), signal.SIGKILL)  # the whole group: parent and workers
        return _append(self, rec)

    m.Manifest.append = append
else:  # mid-write: the temp output is half written
    import ckpt.io.output as o
    _write_file, _stream = o._write_file, o._stream_tensor
    state = {"path": "", "n": 0}

    def write_file(path, *a):
        state["path"] = str(path)
        return _write_file(path, *a)

    def stream(*a):
        if target in state["path"]:
            state["n"] += 1
            if state["n"] == 2:
                os.killpg(os.getpgrp(), signal.SIGKILL)
        return _stream(*a)

    o._write_file, o._stream_tensor = write_file, stream
'''


def killed_batch(tmp_path: Path, how: str, *args) -> int:
    """Run `ckpt batch ...` in its own process group, which the hook SIGKILLs at the chosen moment; returns
    the parent's exit status once no process of the group is left."""
    import signal
    import time

    hook = tmp_path / "hook"
    hook.mkdir(exist_ok=True)
    (hook / "sitecustomize.py").write_text(KILL_HOOK)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(hook), str(ROOT)]), "CKPT_TEST_KILL": how,
           "TMPDIR": str(tmp_path / "scratch")}
    p = subprocess.Popen([sys.executable, "-m", "ckpt.cli", "batch", *map(str, args)], env=env,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        code = p.wait(timeout=300)
    finally:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                break
            time.sleep(0.05)
        p.wait()
    return code


def test_resume_after_sigkill_recognises_finished_outputs_and_removes_stale_temps(tmp_path, run_ckpt, monkeypatch):
    root, out = tmp_path / "models", tmp_path / "out"
    made = small_models(root)  # a.safetensors, sub/b.safetensors, sub/c.safetensors (run in that order)
    (tmp_path / "scratch").mkdir()
    # 1. killed while writing sub/b: its temp output stays behind, owned by a dead process
    assert killed_batch(tmp_path, "mid-write:b.safetensors", "convert", root, "--to", "fp16", "-o", out, "-q") == -9
    stale = list((out / "sub").iterdir())
    assert [p.name.split(".ckpt-tmp-")[0] for p in stale] == [".b.safetensors"]
    # 2. the whole group killed right after sub/b's output was published, before the manifest said so
    assert killed_batch(tmp_path, "after-publish:b.safetensors", "convert", root, "--to", "fp16", "-o", out,
                        "--jobs", "2", "-q") == -9
    assert (out / "sub" / "b.safetensors").is_file() and not stale[0].exists()  # the stale temp went first
    lines = manifest_lines(out / "ckpt-batch.jsonl", started=True)
    assert [r["status"] for r in lines if r["input"].endswith("b.safetensors")] == ["started", "started"]
    stale_scratch = [p for p in (tmp_path / "scratch").iterdir() if p.name.startswith("ckpt-batch-")]
    assert stale_scratch  # the killed parent's worker scratch folder
    # 3. the resume: b is recognised (not "already exists"), c runs, nothing is left over
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "scratch"))
    code, stdout, err = run_ckpt("batch", "convert", root, "--to", "fp16", "-o", out)
    assert code == 0, stdout + err
    assert "skipped  sub/b.safetensors (done in an earlier run that was stopped before recording it)" in stdout
    for rel, tensors in made.items():
        assert_fp16_of(out / rel, tensors)
    assert no_temp_files(out) and not any(p.exists() for p in stale_scratch)
    final = {Path(r["input"]).name: r["status"] for r in manifest_lines(out / "ckpt-batch.jsonl")}
    assert final == {"a.safetensors": "ok", "b.safetensors": "ok", "c.safetensors": "ok"}
    code, stdout, _ = run_ckpt("batch", "convert", root, "--to", "fp16", "-o", out)
    assert code == 0 and "0 ok, 3 skipped, 0 failed" in stdout


def test_an_output_not_made_by_the_started_job_is_not_taken_for_it(tmp_path, run_ckpt):
    """The "started" line names this input and output; the output must also carry ckpt's provenance for
    this very operation, else it is someone else's file and stays protected."""
    from ckpt.batch.manifest import Manifest, ManifestRecord

    root, out = tmp_path / "models", tmp_path / "out"
    src = root / "a.safetensors"
    st(src, 1)
    st(out / "a.safetensors", 9, metadata={"ckpt_operation": "convert --to bf16"})  # another operation's output
    m = Manifest(out / "ckpt-batch.jsonl")
    m.open_for_append()
    size, mtime = src.stat().st_size, src.stat().st_mtime_ns
    m.append(ManifestRecord(str(src.resolve()), size, mtime, "convert --to fp16", str((out / "a.safetensors").resolve()),
                    "started", started_ns=0))
    m.close()
    code, stdout, err = run_ckpt("batch", "convert", root, "--to", "fp16", "-o", out, "-q")
    assert code == 1 and "already exists" in stdout
    assert load_file(out / "a.safetensors")["w"].dtype == torch.float32  # untouched


# -------------------------------------------------------------------------- item 16: unwritable places


def test_unwritable_manifest_is_one_line_and_says_where_to_put_it(tmp_path, run_ckpt, monkeypatch):
    from ckpt.batch.manifest import Manifest

    root = tmp_path / "models"
    small_models(root)

    def refuse(self):
        raise PermissionError(13, "Permission denied", str(self.path))

    monkeypatch.setattr(Manifest, "open_for_append", refuse)
    code, _, err = run_ckpt("batch", "convert", root, "--to", "fp16")
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    assert f"{root / '.ckpt-batch.jsonl'}: cannot write the batch manifest (Permission denied); pass -o OUTDIR" in err
    code, _, err = run_ckpt("batch", "convert", root, "--to", "fp16", "-o", tmp_path / "out")
    assert code == 2 and "cannot write the batch manifest" in err and "choose another -o" in err
    assert sorted(p.name for p in root.rglob("*")) == ["a.safetensors", "b.safetensors", "c.safetensors", "sub"]


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0, reason="root writes into read-only folders")
def test_read_only_input_folder_for_real(tmp_path, run_ckpt):
    root = tmp_path / "models"
    small_models(root)
    for p in [root / "sub", root]:
        p.chmod(0o555)
    try:
        code, _, err = run_ckpt("batch", "convert", root, "--to", "fp16")
        ok = run_ckpt("batch", "convert", root, "--to", "fp16", "-o", tmp_path / "out", "-q")
    finally:
        for p in [root, root / "sub"]:
            p.chmod(0o755)
    assert code == 2 and err.count("\n") == 1 and "pass -o OUTDIR" in err, err
    assert ok[0] == 0, ok


# ------------------------------------------------------------------------------ item 6: default names


def test_default_names_never_start_with_checkpoint(tmp_path, run_ckpt):
    st(tmp_path / "checkpoint-500.safetensors", 1)
    st(tmp_path / "Checkpoint_best" / "model.safetensors", 2)
    st(tmp_path / "mycheckpoint.safetensors", 3)
    for src in ("checkpoint-500.safetensors", "Checkpoint_best", "mycheckpoint.safetensors"):
        code, _, err = run_ckpt("convert", tmp_path / src, "--to", "fp16", "-q")
        assert code == 0, err
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["Checkpoint_best", "checkpoint-500.safetensors", "fp16-Checkpoint_best",
                     "fp16-checkpoint-500.safetensors", "mycheckpoint-fp16.safetensors", "mycheckpoint.safetensors"]


def test_dry_run_reports_existing_outputs_and_writes_nothing(tmp_path, run_ckpt):
    root, out = tmp_path / "models", tmp_path / "out"
    small_models(root)
    st(out / "a.safetensors", 9)
    code, stdout, err = run_ckpt("batch", "convert", root, "--to", "fp16", "-o", out, "--dry-run")
    assert code == 0, err
    assert f"would run  a.safetensors -> {out / 'a.safetensors'} (new; {out / 'a.safetensors'} exists: needs --overwrite)" \
        in stdout
    code, stdout, err = run_ckpt("batch", "convert", root, "--to", "fp16", "-o", out, "--dry-run", "--overwrite")
    assert code == 0 and f"(new; {out / 'a.safetensors'} would be overwritten)" in stdout
    assert sorted(p.name for p in out.iterdir()) == ["a.safetensors"]
