"""`ckpt convert --executor ray`: one model's tensors written by several Ray workers into the driver's temp files
(`ckpt.batch.ray_shares`, `ckpt.io.shares`). Bytes equal the local run's (GGUF Q4_K_M in one file and split, a bf16
cast, a sharded safetensors folder, fp8); a worker killed mid-share is retried and the bytes still equal; Ctrl-C and
a lost cluster leave nothing at OUT and no temp file; the refusals are one line.

One local Ray instance (2 CPUs, loopback, no dashboard, its files under the test's tmp) serves the module; a hook
loaded in its workers records which process wrote which share, kills the worker that claims the kill flag file at
its second tensor, and holds every share at its first tensor while the hold file exists.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path

import pytest

from helpers.refusals import assert_refused

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
ray = pytest.importorskip("ray")
pytest.importorskip("transformers")

QUIET_RAY = {"RAY_USAGE_STATS_ENABLED": "0", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}

HOOK = '''
import json, os, time, uuid


def setup():
    import ckpt.io.output as o
    import ckpt.io.shares as s

    write_share, stream_tensor, seen = s.write_share, o._stream_tensor, [0]

    def _write_share(plan, staged, names, expected, device=None):
        seen[0] = 0
        n = write_share(plan, staged, names, expected, device)
        log = os.environ["CKPT_TEST_LOG"]
        with open(os.path.join(log, uuid.uuid4().hex), "w") as f:
            json.dump({"pid": os.getpid(), "names": list(names)}, f)
        return n

    def _stream_tensor(*a):
        seen[0] += 1
        while os.path.exists(os.environ["CKPT_TEST_HOLD"]):
            time.sleep(0.05)  # Ray's cancel interrupts it
        if seen[0] == 2:
            try:
                os.unlink(os.environ["CKPT_TEST_KILL"])  # the one worker that claims the flag dies
            except FileNotFoundError:
                pass
            else:
                os.kill(os.getpid(), 9)
        return stream_tensor(*a)

    s.write_share, o._stream_tensor = _write_share, _stream_tensor
'''


@pytest.fixture(scope="module")
def flags(tmp_path_factory):
    base = tmp_path_factory.mktemp("flags")
    (base / "log").mkdir()
    return {"hold": base / "hold", "kill": base / "kill", "log": base / "log"}


@pytest.fixture(scope="module")
def ray_instance(tmp_path_factory, flags):
    base = tmp_path_factory.mktemp("ray")
    (base / "hook").mkdir()
    (base / "hook" / "ckpt_convert_ray_hook.py").write_text(HOOK)
    saved = dict(os.environ)
    os.environ.update(QUIET_RAY, CKPT_TEST_HOLD=str(flags["hold"]), CKPT_TEST_KILL=str(flags["kill"]),
                      CKPT_TEST_LOG=str(flags["log"]),
                      PYTHONPATH=os.pathsep.join(filter(None, [str(base / "hook"), os.environ.get("PYTHONPATH")])))
    ray.init(num_cpus=2, num_gpus=0, include_dashboard=False, object_store_memory=100 << 20,
             _temp_dir=str(base / "t"), log_to_driver=False,
             runtime_env={"worker_process_setup_hook": "ckpt_convert_ray_hook.setup"})
    try:
        yield
    finally:
        ray.shutdown()
        os.environ.clear()
        os.environ.update(saved)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    import torch

    from helpers.hf_llm import model_folder

    return model_folder(tmp_path_factory.mktemp("llama") / "llama", "llama", tokenizer="spm", dtype=torch.float32)


def files(out: Path) -> dict[str, bytes]:
    if out.is_file():
        return {out.name: out.read_bytes()}
    return {p.relative_to(out).as_posix(): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}


def listing(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def shares_logged(log: Path) -> list[dict]:
    out = [json.loads(p.read_text()) for p in log.iterdir()]
    for p in log.iterdir():
        p.unlink()
    return out


# ------------------------------------------------------------------------------- refusals (before any Ray)


def test_torch_format_and_ray_address_without_ray_are_refused_in_one_line(tmp_path, run_ckpt, llama):
    assert_refused(run_ckpt, tmp_path, ("convert", llama / "model.safetensors", "--to", "bf16", "--format", "torch", "-o",
                                        tmp_path / "o.pth", "--executor", "ray"),
                   "--executor ray: a torch file (--format torch)", "written in order by one process")
    assert_refused(run_ckpt, tmp_path, ("convert", llama / "model.safetensors", "--to", "bf16", "-o", tmp_path / "o.safetensors",
                                        "--ray-address", "127.0.0.1:1"),
                   "--ray-address: only with --executor ray", "only with")


def test_an_address_where_no_cluster_listens_is_one_line(tmp_path, run_ckpt, llama):
    if ray.is_initialized():
        pytest.skip("a Ray instance is already connected in this process")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert_refused(run_ckpt, tmp_path, ("convert", llama / "model.safetensors", "--to", "bf16", "-o", tmp_path / "o.safetensors",
                                        "--executor", "ray", "--ray-address", f"127.0.0.1:{port}"),
                   f"--ray-address 127.0.0.1:{port}: no Ray cluster answers", "ray start --head")


# ------------------------------------------------------------------------------------------ same bytes


@pytest.mark.parametrize("args", [("--to", "gguf-q4_k_m"), ("--to", "gguf-q4_k_m", "--max-shard-size", "200KB"),
                                  ("--to", "bf16"), ("--to", "bf16", "--max-shard-size", "1MB"),
                                  ("--to", "fp8_e4m3fn",)],
                         ids=["q4_k_m", "q4_k_m-split", "bf16", "bf16-sharded", "fp8"])
def test_ray_writes_the_bytes_of_the_local_run(tmp_path, run_ckpt, llama, ray_instance, flags, args):
    gguf = args[1].startswith("gguf")
    single = not (not gguf and "--max-shard-size" in args)
    name = "m.gguf" if gguf else ("m.safetensors" if single else "m")
    src = llama if gguf or not single else llama / "model.safetensors"  # a folder gives a folder
    local, viaray = tmp_path / "local", tmp_path / "ray"
    shares_logged(flags["log"])
    code, _, err = run_ckpt("convert", src, *args, "-o", local / name, "-q")
    assert code == 0, err
    code, _, err = run_ckpt("convert", src, *args, "-o", viaray / name, "-q", "--executor", "ray")
    assert code == 0, err
    assert listing(viaray) == listing(local)
    for n in listing(local):
        assert files(viaray / n) == files(local / n), n
    if "--max-shard-size" in args:
        weights = [n for x in listing(local) for n in files(local / x) if n.endswith((".gguf", ".safetensors"))]
        assert len(weights) > 1
    logged = shares_logged(flags["log"])
    assert len(logged) > 1 and len({x["pid"] for x in logged}) > 1  # several shares, several workers
    names = [n for x in logged for n in x["names"]]
    assert len(names) == len(set(names))
    if gguf:
        import gguf as gguf_py

        total = sum(len(gguf_py.GGUFReader(local / n).tensors) for n in listing(local))
        assert sorted(names) and len(names) == total  # every tensor once, by one share
        gguf_py.GGUFReader(viaray / listing(viaray)[0])  # the oracle reads it


def test_a_worker_killed_mid_share_is_retried_and_the_bytes_still_equal(tmp_path, run_ckpt, llama, ray_instance,
                                                                        flags):
    local, viaray = tmp_path / "local.gguf", tmp_path / "ray.gguf"
    code, _, err = run_ckpt("convert", llama, "--to", "gguf-q4_k_m", "-o", local, "-q")
    assert code == 0, err
    flags["kill"].touch()
    code, _, err = run_ckpt("convert", llama, "--to", "gguf-q4_k_m", "-o", viaray, "-q", "--executor", "ray")
    assert code == 0, err
    assert not flags["kill"].exists()  # a worker did claim it, and died
    assert viaray.read_bytes() == local.read_bytes()
    assert listing(tmp_path) == ["local.gguf", "ray.gguf"]


# --------------------------------------------------------------------------------- nothing published


def interrupted(run_ckpt, args, watch: Path, flags) -> tuple:
    """Run `args` while every share is held at its first tensor; SIGINT this process once a temp output exists."""
    flags["hold"].touch()
    seen, done, lock = [], threading.Event(), threading.Lock()

    def interrupt_when_staged():
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not done.is_set():
            if any(".ckpt-tmp-" in n for n in os.listdir(watch)):
                if done.wait(1.0):  # the shares are out; a run that already ended is not interrupted
                    return
                with lock:
                    if not done.is_set():
                        seen.append(1)
                        os.kill(os.getpid(), signal.SIGINT)
                return
            time.sleep(0.05)

    watcher = threading.Thread(target=interrupt_when_staged, daemon=True)
    watcher.start()
    result = None
    try:
        result = run_ckpt(*args)
        with lock:  # after this, no SIGINT can reach pytest itself
            done.set()
    finally:
        done.set()
        watcher.join(timeout=5)
        flags["hold"].unlink(missing_ok=True)
    assert seen, f"the run ended before it was interrupted: {result}"
    return result


@pytest.mark.parametrize("split", [False, True], ids=["one-file", "split"])
def test_ctrl_c_leaves_nothing_published_and_no_temp_files(tmp_path, run_ckpt, llama, ray_instance, flags, split):
    out = tmp_path / "out"
    out.mkdir()
    args = ("convert", llama, "--to", "gguf-q4_k_m", "-o", out / "m.gguf", "-q", "--executor", "ray") + \
        (("--max-shard-size", "200KB") if split else ())
    t0 = time.monotonic()
    code, _, err = interrupted(run_ckpt, args, out, flags)
    assert code == 130, err
    assert listing(out) == []
    assert time.monotonic() - t0 < 60  # cancelled shares stop at once, not after a kill timeout


def test_a_lost_cluster_leaves_nothing_published(tmp_path, run_ckpt, llama, ray_instance, monkeypatch):
    out = tmp_path / "out"
    out.mkdir()
    wait, calls = ray.wait, [0]

    def lost(*a, **kw):
        calls[0] += 1
        if calls[0] > 1:
            raise ray.exceptions.RaySystemError("the GCS at 127.0.0.1:6379 is gone")
        return wait(*a, **kw)

    monkeypatch.setattr(ray, "wait", lost)
    code, _, err = run_ckpt("convert", llama, "--to", "bf16", "-o", out / "m", "-q", "--executor", "ray")
    monkeypatch.undo()
    assert code == 2 and err.count("\n") == 1, err
    assert err.startswith("error: --executor ray: lost the Ray cluster (") and "nothing written" in err
    assert listing(out) == []
