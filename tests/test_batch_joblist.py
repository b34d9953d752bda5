"""`ckpt batch ... --plan-only [--json]`, `ckpt batch run-job` and `--collect`: the jobs run one by one in
separate processes (as a Slurm array or any other scheduler would run them), and the manifest that
--collect writes is the one a local run writes; killed, stale and missing jobs; bad input."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

from helpers.batch import assert_fp16_of, manifest_lines, no_temp_files, small_models, st

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
CKPT = [sys.executable, "-m", "ckpt.cli"]


def run_argv(argv: list[str]) -> subprocess.CompletedProcess:
    assert argv[0] == "ckpt"
    return subprocess.run(CKPT + argv[1:], capture_output=True, text=True, timeout=300, env=ENV)


def outputs(out: Path) -> dict[str, bytes]:
    return {p.relative_to(out).as_posix(): p.read_bytes() for p in sorted(out.rglob("*"))
            if p.is_file() and p.name != "ckpt-batch.jsonl" and ".ckpt-batch-results" not in p.parts}


def content(out: Path) -> dict[str, dict]:
    """Each input's last result line without timings (outputs relative to OUT), and its "started" lines."""
    lines = manifest_lines(out / "ckpt-batch.jsonl", started=True)
    rows = {}
    for r in lines:
        if r["status"] != "started":
            rows[r["input"]] = {k: v for k, v in r.items() if k not in ("seconds", "finished", "started_ns")}
            if r["output"]:
                rows[r["input"]]["output"] = Path(r["output"]).relative_to(out.resolve()).as_posix()
    for key, row in rows.items():
        row["started"] = sum(1 for x in lines if x["input"] == key and x["status"] == "started")
    return rows


def plan(run_ckpt, root, out, *extra) -> list[dict]:
    code, stdout, err = run_ckpt("batch", "convert", root, "--to", "fp16", "-o", out, "--plan-only", "--json", *extra)
    assert code == 0, err
    return [json.loads(line) for line in stdout.splitlines()]


def test_job_list_run_line_by_line_then_collect_matches_a_local_run(tmp_path, run_ckpt):
    from ckpt.batch.discover import Found
    from ckpt.batch.operations import make_operation

    root, local, listed = tmp_path / "models", tmp_path / "local", tmp_path / "listed"
    made = small_models(root)
    (root / "sub" / "broken.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}xxxxxx")
    code, stdout, _ = run_ckpt("batch", "convert", root, "--to", "fp16", "-o", local, "-q")
    assert code == 1 and "3 ok, 0 skipped, 1 failed" in stdout

    jobs = plan(run_ckpt, root, listed)
    assert [Path(j["input"]).relative_to(root).as_posix() for j in jobs] == \
        ["a.safetensors", "sub/b.safetensors", "sub/broken.safetensors", "sub/c.safetensors"]
    op = make_operation("convert", {"to": "fp16"})
    for j in jobs:
        assert set(j) == {"argv", "input", "output", "memory", "device"} and j["device"] == "cpu"
        rel = Path(j["input"]).relative_to(root).as_posix()
        assert j["output"] == str(listed / rel) and j["argv"][:3] == ["ckpt", "batch", "run-job"]
        assert j["memory"] == op.estimate(Found(Path(j["input"]), rel, False))
    assert [r["status"] for r in manifest_lines(listed / "ckpt-batch.jsonl", started=True)] == ["started"] * 4

    for j in jobs:  # one process per job, as a Slurm array runs them
        r = run_argv(j["argv"])
        if "broken" in j["input"]:
            assert r.returncode == 1 and r.stderr.startswith("error: ") and r.stderr.count("\n") == 1, r.stderr
        else:
            assert r.returncode == 0 and r.stdout == f"wrote {j['output']}\n", r.stdout + r.stderr
    assert [r["status"] for r in manifest_lines(listed / "ckpt-batch.jsonl", started=True)] == ["started"] * 4

    code, stdout, err = run_ckpt("batch", "convert", root, "--to", "fp16", "-o", listed, "--collect")
    assert code == 1 and "3 ok, 0 skipped, 1 failed, 0 not reported yet" in stdout, stdout + err
    assert f"failed   sub/broken.safetensors: {root / 'sub' / 'broken.safetensors'}:" in stdout
    assert content(listed) == content(local) and outputs(listed) == outputs(local)
    for rel, tensors in made.items():
        assert_fp16_of(listed / rel, tensors)
    assert list((listed / ".ckpt-batch-results").iterdir()) == [] and no_temp_files(listed)

    # the failed job is listed again, the others are done; fixed, it runs and is collected
    fixed = st(root / "sub" / "broken.safetensors", 7)
    again = plan(run_ckpt, root, listed)
    assert [Path(j["input"]).name for j in again] == ["broken.safetensors"]
    assert run_argv(again[0]["argv"]).returncode == 0
    code, stdout, err = run_ckpt("batch", "convert", root, "--to", "fp16", "-o", listed, "--collect", "-q")
    assert code == 0 and "1 ok, 3 skipped, 0 failed, 0 not reported yet" in stdout, stdout + err
    assert_fp16_of(listed / "sub" / "broken.safetensors", fixed)
    assert plan(run_ckpt, root, listed) == []


def test_plan_only_without_json_prints_shell_commands(tmp_path, run_ckpt):
    root, out = tmp_path / "models", tmp_path / "out"
    made = small_models(root)
    code, stdout, err = run_ckpt("batch", "convert", root, "--to", "bf16", "-o", out, "--plan-only")
    assert code == 0 and len(stdout.splitlines()) == 3
    assert "3 jobs listed (0 done earlier), recorded as started in" in err and "--collect" in err
    line = stdout.splitlines()[0]
    r = subprocess.run(["bash", "-c", f"ckpt() {{ {shlex.join(CKPT)} \"$@\"; }}; {line}"], capture_output=True,
                       text=True, timeout=300, env=ENV)
    assert r.returncode == 0, r.stderr
    assert torch.equal(load_file(out / "a.safetensors")["w"], made["a.safetensors"]["w"].bfloat16())


def test_collect_recognises_a_job_killed_after_publishing_and_lists_missing_ones(tmp_path, run_ckpt):
    from ckpt.batch.joblist import parse_spec, run_spec_reporting

    root, out = tmp_path / "models", tmp_path / "out"
    made = small_models(root)
    jobs = {Path(j["input"]).name: j for j in plan(run_ckpt, root, out)}
    # a: ran and reported; b: published its output, then killed before writing its result; c: never ran
    run_spec_reporting(parse_spec(jobs["a.safetensors"]["argv"][3]))
    spec = parse_spec(jobs["b.safetensors"]["argv"][3])
    run_spec_reporting(spec)
    Path(spec["report"]["path"]).unlink()
    code, stdout, err = run_ckpt("batch", "convert", root, "--to", "fp16", "-o", out, "--collect")
    assert code == 1 and "1 ok, 1 skipped, 0 failed, 1 not reported yet" in stdout, stdout + err
    assert "skipped  sub/b.safetensors (done in an earlier run that was stopped before recording it)" in stdout
    assert "missing  sub/c.safetensors (no result from its job yet)" in stdout
    assert "1 job has not reported a result yet; run it, then --collect again" in err
    final = {Path(r["input"]).name: r["status"] for r in manifest_lines(out / "ckpt-batch.jsonl", started=True)}
    assert final == {"a.safetensors": "ok", "b.safetensors": "ok", "c.safetensors": "started"}
    for rel in ("a.safetensors", "sub/b.safetensors"):
        assert_fp16_of(out / rel, made[rel])

    # c runs, but its input changes before --collect: that result is stale and not recorded
    c = parse_spec(jobs["c.safetensors"]["argv"][3])
    run_spec_reporting(c)
    st(root / "sub" / "c.safetensors", 42)
    os.utime(root / "sub" / "c.safetensors", ns=(1, 1))
    code, stdout, err = run_ckpt("batch", "convert", root, "--to", "fp16", "-o", out, "--collect", "-q")
    assert code == 1 and "0 ok, 2 skipped, 0 failed, 1 not reported yet" in stdout, stdout + err
    assert not Path(c["report"]["path"]).exists()
    assert "c.safetensors" not in {Path(r["input"]).name for r in manifest_lines(out / "ckpt-batch.jsonl")}


def test_job_list_bad_input_is_one_line_exit_2(tmp_path, run_ckpt):
    root, out = tmp_path / "models", tmp_path / "out"
    small_models(root)
    jobs = plan(run_ckpt, root, out)
    (tmp_path / "jobs.jsonl").write_text("".join(json.dumps(j) + "\n" for j in jobs) + "not json\n")
    cases = [
        (["batch", "run-job"], "run-job: give SPEC, or --list FILE --index N"),
        (["batch", "run-job", "{nope"], "run-job: SPEC is not a job of `ckpt batch ... --plan-only`"),
        (["batch", "run-job", "--list", tmp_path / "jobs.jsonl"], "run-job: give SPEC, or --list FILE --index N"),
        (["batch", "run-job", "--list", tmp_path / "jobs.jsonl", "--index", "9"], "the job list"),
        (["batch", "run-job", "--list", tmp_path / "jobs.jsonl", "--index", "3"], "line 4 is not a job"),
        (["batch", "run-job", "--list", tmp_path / "none.jsonl", "--index", "0"], "cannot read the job list"),
        (["batch", "convert", root, "--to", "fp16", "--json"], "--json: only with --plan-only"),
        (["batch", "convert", root, "--to", "fp16", "--plan-only", "--collect"], "give one of them"),
        (["batch", "convert", root, "--to", "fp16", "--plan-only", "--dry-run"], "not with --executor ray or --dry-run"),
        (["batch", "inspect", root, "--plan-only"], "are for operations that write outputs"),
    ]
    for args, why in cases:
        code, stdout, err = run_ckpt(*args)
        assert code == 2 and why in err and err.count("\n") == 1 and "Traceback" not in err, (args, err)
    # a job whose input vanished: one line, nothing written
    (root / "a.safetensors").unlink()
    code, _, err = run_ckpt("batch", "run-job", "--list", tmp_path / "jobs.jsonl", "--index", "0")
    assert code == 2 and "a.safetensors: no such file or directory" in err
    assert sorted(p.name for p in out.iterdir()) == ["ckpt-batch.jsonl"]
