"""`ckpt batch --executor ray` on a local Ray instance (2 CPUs, loopback only, no dashboard, no usage
stats, its files under the test's tmp): outputs byte-identical to the local executor's, the same manifest,
a failing job isolated, resume, Ctrl-C leaving no partial output, resource requests from the plan, the
driver's cwd never imported by the workers, and the one-line error without Ray.

One instance serves the module (started once: ~3 s); the CLI uses it as the Python API would.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from helpers.batch import assert_fp16_of, manifest_lines, no_temp_files, small_models, st

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # read as ray is imported: loopback addresses only
ray = pytest.importorskip("ray")

ROOT = Path(__file__).resolve().parents[1]
# no usage reports; a single-node instance on the loopback address (Ray's rule for a desktop instance)
QUIET_RAY = {"RAY_USAGE_STATS_ENABLED": "0", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}

# Loaded in every Ray worker of the module's instance: a job whose output name holds "slow" waits at its
# first tensor while the flag file exists (a long write, stopped by the test); one whose name holds
# "stubborn" waits there too and ignores KeyboardInterrupt (Ray's cancel).
HOOK = '''
import os, time


def setup():
    import ckpt.io.output as o

    write_file, stream_tensor, current = o._write_file, o._stream_tensor, [""]

    def _write_file(path, *a):
        current[0] = str(path)
        return write_file(path, *a)

    def _stream_tensor(*a):
        while "slow" in current[0] and os.path.exists(os.environ["CKPT_TEST_HOLD"]):
            time.sleep(0.05)
        while "stubborn" in current[0] and os.path.exists(os.environ["CKPT_TEST_HOLD"]):
            try:
                time.sleep(0.05)
            except KeyboardInterrupt:  # a task that ignores Ray's cancel: only a kill stops it
                pass
        return stream_tensor(*a)

    o._write_file, o._stream_tensor = _write_file, _stream_tensor
'''


@pytest.fixture(scope="module")
def hold(tmp_path_factory):
    """The flag file: while it exists, "slow" jobs wait."""
    return tmp_path_factory.mktemp("hold") / "hold"


@pytest.fixture(scope="module", autouse=True)
def ray_instance(tmp_path_factory, hold):
    base = tmp_path_factory.mktemp("ray")
    (base / "hook").mkdir()
    (base / "hook" / "ckpt_ray_test_hook.py").write_text(HOOK)
    saved = dict(os.environ)
    os.environ.update(QUIET_RAY, CKPT_TEST_HOLD=str(hold),
                      PYTHONPATH=os.pathsep.join(filter(None, [str(base / "hook"), os.environ.get("PYTHONPATH")])))
    t0 = time.monotonic()
    ray.init(num_cpus=2, num_gpus=0, include_dashboard=False, object_store_memory=100 << 20, _temp_dir=str(base / "t"), log_to_driver=False,
             runtime_env={"worker_process_setup_hook": "ckpt_ray_test_hook.setup"})
    print(f"ray.init: {time.monotonic() - t0:.1f} s", file=sys.stderr)
    try:
        yield
    finally:
        ray.shutdown()
        os.environ.clear()
        os.environ.update(saved)


def outputs(out: Path) -> dict[str, bytes]:
    return {p.relative_to(out).as_posix(): p.read_bytes() for p in sorted(out.rglob("*"))
            if p.is_file() and p.name != "ckpt-batch.jsonl"}


def content(manifest: Path, out: Path, started: bool = False) -> dict[str, dict]:
    """Each input's result line (and how many "started" lines), without timings, outputs relative to OUT."""
    lines = manifest_lines(manifest, started=True)
    rows = {}
    for r in lines:
        if r["status"] == "started":
            continue
        rows[r["input"]] = {k: v for k, v in r.items() if k not in ("seconds", "finished", "started_ns")}
        if r["output"]:
            rows[r["input"]]["output"] = Path(r["output"]).relative_to(out.resolve()).as_posix()
    if started:
        for r in rows:
            rows[r]["started"] = sum(1 for x in lines if x["input"] == r and x["status"] == "started")
    return rows


# -------------------------------------------------------------------------------------- the same results


def test_ray_matches_local_isolates_failures_and_resumes(tmp_path, run_ckpt):
    root = tmp_path / "models"
    made = small_models(root)
    torch.save({"state_dict": {"w": torch.randn(3, 3, generator=torch.Generator().manual_seed(9))}}, root / "p.ckpt")
    st(root / "pipe" / "unet" / "diffusion_pytorch_model.safetensors", 5)  # a folder job
    (root / "pipe" / "model_index.json").write_text('{"_class_name": "X"}')
    (root / "pipe" / "unet" / "config.json").write_text("{}")
    (root / "sub" / "broken.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}xxxxxx")
    local, viaray = tmp_path / "local", tmp_path / "ray"

    code, stdout, err = run_ckpt("batch", "convert", root, "--to", "fp16", "-o", local, "-q")
    assert code == 1 and "5 ok, 0 skipped, 1 failed" in stdout, stdout + err
    code, stdout, err = run_ckpt("batch", "convert", root, "--to", "fp16", "-o", viaray, "--executor", "ray")
    assert code == 1 and "5 ok, 0 skipped, 1 failed" in stdout, stdout + err
    assert f"failed   sub/broken.safetensors: {root / 'sub' / 'broken.safetensors'}:" in stdout
    assert "1 of 6 checkpoints failed" in err

    assert outputs(viaray) == outputs(local) and len(outputs(local)) == 7  # 5 checkpoints, 2 configs
    for rel, tensors in made.items():
        assert_fp16_of(viaray / rel, tensors)
    assert content(viaray / "ckpt-batch.jsonl", viaray, started=True) == \
        content(local / "ckpt-batch.jsonl", local, started=True)
    assert not (viaray / "sub" / "broken.safetensors").exists() and no_temp_files(viaray, root)

    stamp = {p: p.stat().st_mtime_ns for p in viaray.rglob("*.safetensors")}
    code, stdout, err = run_ckpt("batch", "convert", root, "--to", "fp16", "-o", viaray, "--executor", "ray")
    assert code == 1 and "0 ok, 5 skipped, 1 failed" in stdout, stdout + err
    assert {p: p.stat().st_mtime_ns for p in viaray.rglob("*.safetensors")} == stamp

    fixed = st(root / "sub" / "broken.safetensors", 7)
    code, stdout, err = run_ckpt("batch", "convert", root, "--to", "fp16", "-o", viaray, "--executor", "ray",
                                 "--jobs", "1", "-q")
    assert code == 0 and "1 ok, 5 skipped, 0 failed" in stdout, stdout + err
    assert_fp16_of(viaray / "sub" / "broken.safetensors", fixed)
    code, stdout, err = run_ckpt("batch", "convert", root, "--to", "fp16", "-o", local, "-q")
    assert code == 0 and outputs(viaray) == outputs(local)
    assert content(viaray / "ckpt-batch.jsonl", viaray) == content(local / "ckpt-batch.jsonl", local)


def batch_interrupted_while(temps_glob: str, count: int, root, out, run_ckpt, hold):
    """`ckpt batch convert --executor ray` over ROOT, Ctrl-C'd (SIGINT to this process: the CLI's handler
    raises KeyboardInterrupt in the driver) once `count` temp outputs matching `temps_glob` exist and one job
    is recorded ok; the "slow"/"stubborn" jobs wait while the hold file exists. Returns the CLI's result."""
    hold.touch()
    seen = []

    def interrupt_when_they_write():
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            temps = list(out.glob(temps_glob)) if out.exists() else []
            man = out / "ckpt-batch.jsonl"
            if len(temps) == count and man.exists() and '"status": "ok"' in man.read_text():
                seen.extend(temps)
                os.kill(os.getpid(), signal.SIGINT)
                return
            time.sleep(0.05)

    watcher = threading.Thread(target=interrupt_when_they_write, daemon=True)
    watcher.start()
    try:
        result = run_ckpt("batch", "convert", root, "--to", "fp16", "-o", out, "--executor", "ray", "-q")
    finally:
        watcher.join(timeout=5)
        hold.unlink(missing_ok=True)
    assert seen, f"never {count} jobs writing at once"
    return result


def test_ray_ctrl_c_cancels_outstanding_tasks_and_keeps_finished_outputs(tmp_path, run_ckpt, hold):
    root, out = tmp_path / "models", tmp_path / "out"
    made = {"a.safetensors": st(root / "a.safetensors", 1)}
    for i in (1, 2, 3):  # two run (2 CPUs), one waits in Ray's queue
        made[f"slow{i}.safetensors"] = st(root / f"slow{i}.safetensors", 10 + i)
    code, stdout, err = batch_interrupted_while(".slow*.ckpt-tmp-*", 2, root, out, run_ckpt, hold)
    assert code == 130 and "1 ok, 0 skipped, 0 failed, 3 not run (interrupted)" in stdout, stdout + err
    assert sorted(p.name for p in out.iterdir()) == ["a.safetensors", "ckpt-batch.jsonl"]  # no partial output
    assert_fp16_of(out / "a.safetensors", made["a.safetensors"])
    assert [r["status"] for r in manifest_lines(out / "ckpt-batch.jsonl")] == ["ok"]

    code, stdout, err = run_ckpt("batch", "convert", root, "--to", "fp16", "-o", out, "--executor", "ray", "-q")
    assert code == 0 and "3 ok, 1 skipped, 0 failed" in stdout, stdout + err
    for rel, tensors in made.items():
        assert_fp16_of(out / rel, tensors)
    assert no_temp_files(out)


def test_ray_ctrl_c_kills_a_task_that_ignores_the_cancel_and_removes_its_temp_output(tmp_path, run_ckpt, hold,
                                                                                      monkeypatch):
    from ckpt.batch import ray_pool

    monkeypatch.setattr(ray_pool, "STOP_TIMEOUT_S", 2)
    root, out = tmp_path / "models", tmp_path / "out"
    made = {"a.safetensors": st(root / "a.safetensors", 1), "stubborn.safetensors": st(root / "stubborn.safetensors", 2)}
    code, stdout, err = batch_interrupted_while(".stubborn*.ckpt-tmp-*", 1, root, out, run_ckpt, hold)
    assert code == 130 and "1 ok, 0 skipped, 0 failed, 1 not run (interrupted)" in stdout, stdout + err
    # killed after STOP_TIMEOUT_S; once its process is gone, its temp output is removed by the driver
    assert sorted(p.name for p in out.iterdir()) == ["a.safetensors", "ckpt-batch.jsonl"]
    assert_fp16_of(out / "a.safetensors", made["a.safetensors"])

    code, stdout, err = run_ckpt("batch", "convert", root, "--to", "fp16", "-o", out, "--executor", "ray", "-q")
    assert code == 0 and "1 ok, 1 skipped, 0 failed" in stdout, stdout + err
    assert_fp16_of(out / "stubborn.safetensors", made["stubborn.safetensors"])
    assert no_temp_files(out)


# -------------------------------------------------------------------------------- what Ray is asked for


def test_task_resources_come_from_the_plan_and_gpu_jobs_need_a_gpu_node(tmp_path, run_ckpt):
    from ckpt.batch.discover import Found
    from ckpt.batch.operations import make_operation
    from ckpt.batch.ray_pool import task_options
    from ckpt.batch.runner import BatchJob

    root, out = tmp_path / "models", tmp_path / "out"
    st(root / "big.safetensors", w=(1000, 250))
    small_models(root)
    for device, gpus in (("cpu", 0), ("cuda", 1), ("auto", 0)):
        op = make_operation("convert", {"to": "fp16", "device": device})
        item = Found(root / "big.safetensors", "big.safetensors", False)
        job = BatchJob(item, out / "big.safetensors", 0, 0, "new", estimate=op.estimate(item))
        opts = task_options(op, job)
        assert opts["memory"] == op.estimate(item) == job.estimate and opts["num_gpus"] == gpus
        assert opts["num_cpus"] == 1 and opts["max_retries"] == 0
    # this test process started the instance (one node, 2 CPUs, no GPU): a GPU job could never run here
    code, stdout, err = run_ckpt("batch", "convert", root, "--to", "fp16", "-o", out, "--executor", "ray",
                                 "--device", "cuda")
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    assert f"big.safetensors needs {job.estimate / 1e9:.2f} GB of memory and 1 GPU; the largest node offers" in err
    assert "and 0 GPUs (this local Ray instance; pass --ray-address to use a cluster, or --device cpu)" in err
    assert not out.exists()


def test_ray_missing_is_one_line_with_the_install_command(tmp_path, run_ckpt, monkeypatch):
    root = tmp_path / "models"
    small_models(root)
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` fails as where it is not installed
    code, stdout, err = run_ckpt("batch", "convert", root, "--to", "fp16", "-o", tmp_path / "out", "--executor", "ray")
    assert code == 2 and err == "error: --executor ray needs Ray: pip install ray (the ckpt-toolkit[ray] extra) " \
                                "on every node\n", err
    assert not (tmp_path / "out").exists()
    for bad, why in ((["--ray-address", "x:1"], "--ray-address: only with --executor ray"),
                     (["--executor", "ray", "--plan-only"], "--plan-only: the jobs run elsewhere")):
        code, _, err = run_ckpt("batch", "convert", root, "--to", "fp16", *bad)
        assert code == 2 and why in err and err.count("\n") == 1, err
    assert sorted(p.name for p in root.rglob("*")) == ["a.safetensors", "b.safetensors", "c.safetensors", "sub"]


# ------------------------------------------------------------------------- a Ray instance of its own


def test_ckpt_starts_its_own_instance_and_workers_never_import_the_cwd(tmp_path, tmp_path_factory):
    """The plain command line: no cluster around, so ckpt starts a local instance for the batch and stops
    it after. Ray puts the driver's cwd first on its workers' sys.path: a planted ./ckpt there never runs."""
    work, marker = tmp_path / "work", tmp_path / "MARKER"
    (work / "ckpt" / "batch").mkdir(parents=True)
    plant = f"open({str(marker)!r}, 'a').write(__name__ + '\\n')\n"
    for rel in ("__init__.py", "batch/__init__.py", "batch/ray_pool.py", "batch/worker.py"):
        (work / "ckpt" / rel).write_text(plant)
    root, out = tmp_path / "models", tmp_path / "out"
    made = small_models(root)
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    rt = tmp_path_factory.mktemp("rt")  # short: Ray's sockets live under it (107-byte limit)
    env.update(QUIET_RAY, RAY_TMPDIR=str(rt), PYTHONPATH=str(ROOT))
    boot = "import sys; sys.path.remove(''); from ckpt.cli import main; main()"
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-c", boot, "batch", "convert", str(root), "--to", "fp16", "-o", str(out),
                        "--executor", "ray", "-q"], cwd=work, capture_output=True, text=True, timeout=300, env=env)
    print(f"own instance, whole run: {time.monotonic() - t0:.1f} s", file=sys.stderr)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "3 ok, 0 skipped, 0 failed" in r.stdout and not marker.exists()
    for rel, tensors in made.items():
        assert_fp16_of(out / rel, tensors)
    assert json.loads((out / "ckpt-batch.jsonl").read_text().splitlines()[-1])["status"] == "ok"
    assert load_file(out / "a.safetensors")["w"].dtype == torch.float16
