"""Issue #20: paths, hub look-ups and options that used to end in a wrong guess, a long silence or a
traceback. Each is one line `error: ...`, exit 2, nothing written, inputs unchanged:

1. --max-shard-size without a unit (it meant 5 bytes: one shard per tensor);
2. hub look-ups: a local-looking path is a local "no such file" at once; a look-up says it is looking,
   gives up after CKPT_HUB_TIMEOUT seconds without huggingface_hub's retry lines, falls back to the cache,
   and offline says so;
3. a folder the user cannot enter is "permission denied" (run as uid 65534 in a forked child when the
   tests run as root, skipped otherwise);
4. --executor ray with an address where nothing listens (loopback only) fails at once, naming it, and
   Ray's usage errors are `error:` lines;
5. default output names carry the target and the format; a file without a suffix is read by its content.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from helpers.refusals import assert_refused

ROOT = Path(__file__).resolve().parents[1]


def tree(folder: Path) -> list[tuple[str, int]]:
    return sorted((str(p.relative_to(folder)), p.stat().st_size if p.is_file() else -1) for p in folder.rglob("*"))


def one_file(tmp_path: Path, name: str = "x.safetensors", n: int = 4) -> Path:
    src = tmp_path / name
    tmp_path.mkdir(parents=True, exist_ok=True)
    save_file({f"w{i}": torch.ones(8) * i for i in range(n)}, src)
    return src


# ----------------------------------------------------------------------------- 1. --max-shard-size

@pytest.mark.parametrize("command", [["convert", "{src}", "--to", "fp16"], ["dequant", "{src}"],
                                     ["batch", "convert", "{dir}", "--to", "fp16"]], ids=lambda c: " ".join(c[:2]))
@pytest.mark.parametrize("size", ["5", "5.5", " 40 "])
def test_max_shard_size_without_a_unit_is_refused(tmp_path, run_ckpt, command, size):
    src = one_file(tmp_path)
    args = [a.format(src=src, dir=tmp_path) for a in command] + ["--max-shard-size", size]
    assert_refused(run_ckpt, tmp_path, args, f"--max-shard-size {size}: no unit", "GB")


def test_max_shard_size_units_and_help(tmp_path, run_ckpt):
    from ckpt.io.plan import parse_size

    assert [parse_size(t) for t in ("5GB", "5gb", "2KiB", "1.5kb", "3tib", "40B")] == \
        [5 * 10**9, 5 * 10**9, 2048, 1500, 3 * 2**40, 40]
    assert parse_size(40) == 40  # the Python API's int is a count of bytes
    assert_refused(run_ckpt, tmp_path, ["convert", one_file(tmp_path), "--to", "fp16", "--max-shard-size", "5XB"],
                   "--max-shard-size 5XB: not a size", "KiB")
    src = one_file(tmp_path, "y.safetensors")
    code, out, err = run_ckpt("convert", src, "--to", "fp16", "--max-shard-size", "32b", "-o", tmp_path / "out", "-q")
    assert code == 0, err
    index = json.loads(next((tmp_path / "out").glob("*.index.json")).read_text())["weight_map"]
    assert len(index) == 4 and len(set(index.values())) == 2  # 16 bytes a tensor, 32 bytes a shard
    for cmd in (["convert"], ["dequant"], ["batch", "convert"], ["batch", "dequant"]):
        code, out, _ = run_ckpt(*cmd, "--help")
        assert code == 0 and "KiB" in out and "refused" in out, out


# ----------------------------------------------------------------------------- 2. hub look-ups

def test_local_looking_paths_are_local_errors_at_once(tmp_path, run_ckpt, monkeypatch):
    from ckpt.io.hub import looks_like_repo_id

    monkeypatch.chdir(tmp_path)
    (tmp_path / "models").mkdir()
    for spec in ("nothere/x.safetensors", "models/nothere", "models/a/b", "./owner/name", "../owner/name",
                 "~/owner/name", str(tmp_path / "owner" / "name"), "owner/name.ckpt", "owner/lit_model.pth.lora"):
        assert not looks_like_repo_id(spec), spec
        code, out, err = run_ckpt("convert", spec, "--to", "fp16")
        assert code == 2 and err == f"error: {spec}: no such file or directory\n", err
    for spec in ("owner/name", "owner/name@main/unet", "owner/name/model.safetensors", "owner/name.v2"):
        assert looks_like_repo_id(spec), spec
    assert sorted(p.name for p in tmp_path.iterdir()) == ["models"]


def _empty_cache(monkeypatch, tmp_path, offline: bool):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub-cache"))
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens there
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    if offline:
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    else:
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)


def test_offline_miss_says_offline_mode_and_not_cached(tmp_path, run_ckpt, monkeypatch):
    from ckpt.layout.relayout import load_config_ref
    from ckpt.errors import CkptError

    _empty_cache(monkeypatch, tmp_path, offline=True)
    src = one_file(tmp_path)
    for args, culprit in ((["convert", "owner/name", "--to", "fp16"], "owner/name"),
                          (["dequant", src, "--shapes-from", "owner/name"], "--shapes-from owner/name")):
        assert_refused(run_ckpt, tmp_path, args, f"{culprit}: not a local path, and not in the local Hugging Face "
                       "cache (offline mode: HF_HUB_OFFLINE is set", "the hub was not asked")
    with pytest.raises(CkptError, match=r"^--config owner/name: .*offline mode: HF_HUB_OFFLINE is set"):
        load_config_ref("owner/name")


class SlowHub:
    """A stand-in for the hub behind a network that hangs: `model_info` (the look-up given
    CKPT_HUB_TIMEOUT) logs the retry warning huggingface_hub would and waits until released (the test's
    end); `snapshot_download` answers from the "cache" (`cached`, or nothing)."""

    def __init__(self, monkeypatch, cached: Path | None = None):
        import huggingface_hub

        self.release, self.cached, self.downloads = threading.Event(), cached, []
        monkeypatch.setattr(huggingface_hub.HfApi, "model_info", self.model_info)
        monkeypatch.setattr(huggingface_hub, "snapshot_download", self.snapshot_download)

    def model_info(self, repo_id, revision=None, timeout=None):  # set on HfApi as a bound method: no `api`
        logging.getLogger("huggingface_hub.utils._http").warning("Retrying in 1s [Retry 1/5].")
        self.release.wait(30)
        raise OSError("gave up")

    def snapshot_download(self, repo_id, *args, local_files_only=False, **kw):
        from huggingface_hub.errors import LocalEntryNotFoundError

        self.downloads.append(local_files_only)
        if self.cached is None:
            raise LocalEntryNotFoundError("not cached")
        return str(self.cached)


@pytest.mark.parametrize("quiet", [False, True], ids=["", "quiet"])
def test_hub_lookup_says_so_and_gives_up_after_the_timeout(tmp_path, run_ckpt, monkeypatch, caplog, quiet):
    _empty_cache(monkeypatch, tmp_path, offline=False)
    monkeypatch.setenv("CKPT_HUB_TIMEOUT", "0.5")
    hub = SlowHub(monkeypatch)
    monkeypatch.chdir(tmp_path)
    before = tree(tmp_path)
    t0 = time.monotonic()
    try:
        code, out, err = run_ckpt("convert", "owner/name", "--to", "fp16", *(["-q"] if quiet else []))
    finally:
        hub.release.set()
    assert time.monotonic() - t0 < 10
    lines = err.splitlines()
    assert code == 2 and out == "" and len(lines) == (1 if quiet else 2), err
    if not quiet:
        assert lines[0] == ("note: owner/name: not a local path; looking it up on the Hugging Face hub (giving up "
                            "after 0.5 s, CKPT_HUB_TIMEOUT)")
    assert lines[-1] == ("error: owner/name: not a local path; the Hugging Face hub did not answer within 0.5 s "
                         "(set CKPT_HUB_TIMEOUT to wait longer), and it is not in the local cache")
    assert "Retrying" not in err and not any("Retrying" in r.getMessage() for r in caplog.records)
    assert hub.downloads == [True]  # the cache only: nothing is downloaded from a hub that did not answer
    assert tree(tmp_path) == before


def test_hub_timeout_falls_back_to_the_cache(tmp_path, run_ckpt, monkeypatch):
    _empty_cache(monkeypatch, tmp_path, offline=False)
    monkeypatch.setenv("CKPT_HUB_TIMEOUT", "0.3")
    snap = tmp_path / "snap"
    snap.mkdir()
    save_file({"w": torch.ones(3)}, snap / "model.safetensors")
    hub = SlowHub(monkeypatch, cached=snap)
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    try:
        code, out, err = run_ckpt("convert", "owner/tiny", "--to", "fp16")
    finally:
        hub.release.set()
    assert code == 0, err
    assert "note: owner/tiny: the Hugging Face hub did not answer within 0.3 s (set CKPT_HUB_TIMEOUT to wait " \
           "longer); using the copy in the local cache" in err
    assert load_file(work / "tiny-fp16" / "model.safetensors")["w"].dtype == torch.float16


def test_a_hub_that_answers_downloads_without_the_deadline(tmp_path, run_ckpt, monkeypatch):
    """The deadline is for the hub's answer, not for the download (weights take as long as they take)."""
    import huggingface_hub
    from types import SimpleNamespace

    _empty_cache(monkeypatch, tmp_path, offline=False)
    monkeypatch.setenv("CKPT_HUB_TIMEOUT", "0.2")
    snap = tmp_path / "snap"
    snap.mkdir()
    save_file({"w": torch.ones(3)}, snap / "model.safetensors")

    def download(repo_id, *args, local_files_only=False, **kw):
        time.sleep(0 if local_files_only else 0.6)  # longer than the deadline
        return str(snap)

    monkeypatch.setattr(huggingface_hub.HfApi, "model_info", lambda api, repo, revision=None, timeout=None:
                        SimpleNamespace(siblings=[]))
    monkeypatch.setattr(huggingface_hub, "snapshot_download", download)
    monkeypatch.chdir(tmp_path)
    code, out, err = run_ckpt("convert", "owner/tiny", "--to", "fp16", "-q")
    assert code == 0 and err == "", err
    assert (tmp_path / "tiny-fp16" / "model.safetensors").is_file()


def test_bad_hub_timeout_is_one_line(tmp_path, run_ckpt, monkeypatch):
    _empty_cache(monkeypatch, tmp_path, offline=False)
    monkeypatch.setenv("CKPT_HUB_TIMEOUT", "soon")
    assert_refused(run_ckpt, tmp_path, ["convert", "owner/name", "--to", "fp16"], "CKPT_HUB_TIMEOUT=soon",
                   "not a positive number of seconds")


@pytest.mark.parametrize("name", ["CKPT_HUB_TIMEOUT", "CKPT_RAY_TIMEOUT"])
@pytest.mark.parametrize("text", ["soon", "0", "-3", "nan", "inf"])
def test_timeout_variables_take_positive_finite_seconds(monkeypatch, name, text):
    from ckpt import env
    from ckpt.batch.ray_pool import connect_timeout
    from ckpt.io.hub import hub_timeout

    read = {"CKPT_HUB_TIMEOUT": hub_timeout, "CKPT_RAY_TIMEOUT": connect_timeout}[name]
    monkeypatch.setenv(name, text)
    with pytest.raises(env.CkptError, match=f"^{name}={text}: not a positive number of seconds$"):
        read()
    monkeypatch.setenv(name, " 2.5 ")
    assert read() == 2.5
    monkeypatch.delenv(name)
    assert read() == {"CKPT_HUB_TIMEOUT": 10.0, "CKPT_RAY_TIMEOUT": 30.0}[name]


@pytest.mark.slow
def test_hub_that_never_answers_end_to_end(tmp_path):
    """The real huggingface_hub against a loopback port that accepts and never answers: one note, one
    error, within the timeout (plus start-up), and none of huggingface_hub's retry lines."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(8)
        env = {**os.environ, "HF_ENDPOINT": f"http://127.0.0.1:{s.getsockname()[1]}", "CKPT_HUB_TIMEOUT": "2",
               "HF_HUB_CACHE": str(tmp_path / "hub-cache"), "PYTHONPATH": str(ROOT)}
        env.pop("HF_HUB_OFFLINE", None)
        t0 = time.monotonic()
        r = subprocess.run([sys.executable, "-m", "ckpt.cli", "convert", "owner/name", "--to", "fp16"], cwd=tmp_path,
                           capture_output=True, text=True, env=env, timeout=120)
        took = time.monotonic() - t0
    assert r.returncode == 2 and r.stdout == "", r.stderr
    lines = r.stderr.splitlines()
    assert len(lines) == 2 and lines[0].startswith("note: owner/name: not a local path; looking it up"), r.stderr
    assert lines[1].startswith("error: owner/name: not a local path; the Hugging Face hub did not answer within 2 s")
    assert took < 30, took
    assert not any(p.name.startswith("name") for p in tmp_path.iterdir())


# ----------------------------------------------------------------------------- 3. permission denied

PRELOAD = ("ckpt.cli", "ckpt.batch.runner", "ckpt.batch.operations", "ckpt.batch.worker", "ckpt.convert",
           "ckpt.dequant.command", "ckpt.merge_lora.command", "ckpt.inspect", "ckpt.io.output", "ckpt.io.publish",
           "huggingface_hub", "shlex", "tqdm")


def run_as_nobody(args, cwd) -> tuple[int, str, str]:
    """`ckpt ARGS` as uid/gid 65534 in a forked child (this interpreter lives under /root, which that
    user cannot read: every module the command needs is imported before the privileges are dropped)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        res = {"code": -1, "out": "", "err": ""}
        try:
            os.close(r)
            import importlib

            for name in PRELOAD:
                importlib.import_module(name)
            from ckpt.cli import main

            os.chdir(cwd)
            os.setgroups([])
            os.setgid(65534)
            os.setuid(65534)
            out, err = io.StringIO(), io.StringIO()
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                try:
                    main([str(a) for a in args])
                    res["code"] = 0
                except SystemExit as e:
                    res["code"] = e.code if isinstance(e.code, int) else 1
                except BaseException:
                    import traceback

                    traceback.print_exc()
            res["out"], res["err"] = out.getvalue(), err.getvalue()
        finally:
            os.write(w, json.dumps(res).encode())
            os._exit(0)
    os.close(w)
    data = b""
    while chunk := os.read(r, 1 << 16):
        data += chunk
    os.close(r)
    os.waitpid(pid, 0)
    res = json.loads(data)
    return res["code"], res["out"], res["err"]


@pytest.fixture
def locked():
    """perm/{locked/ro (root's, mode 700 above), open}, in a folder every user may enter (pytest's own
    tmp folders are root's, mode 700)."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        pytest.skip("needs root, to run a command as another user (uid 65534) against a folder it cannot enter")
    import shutil
    import tempfile

    top = Path(tempfile.mkdtemp(prefix="ckpt-perm-"))
    base = top / "perm"
    (base / "locked" / "ro").mkdir(parents=True)
    (base / "open").mkdir()
    one_file(base / "locked" / "ro", "in.safetensors")
    one_file(base / "open", "in.safetensors")
    save_file({"lora_unet_x.lora_down.weight": torch.ones(2, 8), "lora_unet_x.lora_up.weight": torch.ones(8, 2)},
              base / "locked" / "ro" / "lora.safetensors")
    one_file(base / "listed" / "rx", "in.safetensors")
    for p in (top, base, base / "open"):
        p.chmod(0o777)
    (base / "listed" / "rx").chmod(0o744)  # may be listed, not entered
    (base / "open" / "in.safetensors").chmod(0o644)
    (base / "locked").chmod(0o700)  # root's: uid 65534 cannot enter it
    yield base
    shutil.rmtree(top)


@pytest.mark.parametrize("args, culprit", [
    (["batch", "convert", "locked/ro/in.safetensors", "--to", "fp16", "-o", "locked/ro/out"], "-o locked/ro/out"),
    (["batch", "convert", "locked/ro/in.safetensors", "--to", "fp16"], "locked/ro/in.safetensors"),
    (["batch", "convert", "open", "--to", "fp16", "-o", "locked/ro/out"], "-o locked/ro/out"),
    (["batch", "merge-lora", "open", "--lora", "locked/ro/lora.safetensors"], "--lora locked/ro/lora.safetensors"),
    (["convert", "locked/ro/in.safetensors", "--to", "fp16"], "locked/ro/in.safetensors"),
    (["inspect", "locked/ro"], "locked/ro"),
    (["dequant", "open/in.safetensors", "--shapes-from", "locked/ro/in.safetensors"],
     "--shapes-from locked/ro/in.safetensors"),
    (["merge-lora", "open/in.safetensors", "locked/ro/lora.safetensors"], "locked/ro/lora.safetensors"),
    (["convert", "open/in.safetensors", "--to", "fp16", "-o", "locked/ro/out.safetensors"],
     "-o locked/ro/out.safetensors"),
    (["dequant", "open/in.safetensors", "-o", "locked/ro/out"], "-o locked/ro/out"),
    (["merge-lora", "open/in.safetensors", "open/in.safetensors", "-o", "locked/ro/m.safetensors"],
     "-o locked/ro/m.safetensors"),
    (["convert", "open/in.safetensors", "--layout", "diffusers", "--config", "locked/ro"], "--config locked/ro"),
    (["inspect", "open/in.safetensors", "--report", "locked/ro/r.json"], "--report locked/ro/r.json"),
], ids=lambda a: " ".join(a[:2]) if isinstance(a, list) else None)
def test_a_folder_that_cannot_be_entered_is_permission_denied(locked, args, culprit):
    before = tree(locked)
    code, out, err = run_as_nobody(args, locked)
    assert code == 2 and out == "", (code, out, err)
    assert err == f"error: {culprit}: permission denied (cannot enter {locked / 'locked'})\n", err
    assert tree(locked) == before


def test_batch_folder_that_can_be_listed_but_not_entered(locked):
    before = tree(locked)
    code, out, err = run_as_nobody(["batch", "convert", "listed", "--to", "fp16", "-o", "open/out"], locked)
    assert (code, out, err) == (2, "", "error: listed/rx: permission denied (cannot enter it)\n")
    assert tree(locked) == before


# ----------------------------------------------------------------------------- 4. Ray

needs_ray = pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="ray is not installed (pip install ray)")


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@needs_ray
def test_ray_address_where_nothing_listens_fails_at_once(tmp_path, run_ckpt):
    one_file(tmp_path / "models")
    port = _closed_port()
    t0 = time.monotonic()
    args = ["batch", "convert", tmp_path / "models", "--to", "fp16", "-o", tmp_path / "out", "--executor", "ray",
            "--ray-address", f"127.0.0.1:{port}"]
    assert_refused(run_ckpt, tmp_path, args, f"--ray-address 127.0.0.1:{port}: no Ray cluster answers at "
                   f"127.0.0.1:{port} (connection refused)", "ray start --head")
    assert time.monotonic() - t0 < 30


@needs_ray
def test_ray_option_errors_are_error_lines(tmp_path, run_ckpt, monkeypatch):
    one_file(tmp_path / "models")
    root = tmp_path / "models"
    for bad, says in ((["--executor", "rya"], "ckpt batch convert: Invalid value for '--executor'"),
                      (["--executor", "ray", "--ray-address"], "ckpt batch convert: Option '--ray-address' requires")):
        assert_refused(run_ckpt, tmp_path, ["batch", "convert", root, "--to", "fp16", *bad], says, says)
    monkeypatch.setenv("CKPT_RAY_TIMEOUT", "-3")
    assert_refused(run_ckpt, tmp_path, ["batch", "convert", root, "--to", "fp16", "--executor", "ray", "--ray-address",
                                        f"127.0.0.1:{_closed_port()}"], "CKPT_RAY_TIMEOUT=-3", "positive")


@needs_ray
@pytest.mark.slow
def test_ray_address_that_never_answers_is_given_up_on_in_time(tmp_path):
    """A loopback port that accepts connections but is no Ray cluster: Ray's own attempts are bounded by
    CKPT_RAY_TIMEOUT, and the lines Ray's core prints while trying are not shown."""
    one_file(tmp_path / "models")
    with socket.socket() as s:
        s.bind(("0.0.0.0", 0))  # Ray connects to this machine's address for 127.0.0.1: listen on all of them
        s.listen(8)
        port = s.getsockname()[1]
        env = {**{k: v for k, v in os.environ.items() if not k.startswith("RAY_")}, "CKPT_RAY_TIMEOUT": "10",
               "RAY_USAGE_STATS_ENABLED": "0", "PYTHONPATH": str(ROOT)}
        t0 = time.monotonic()
        r = subprocess.run([sys.executable, "-m", "ckpt.cli", "batch", "convert", "models", "--to", "fp16", "-o", "out",
                            "--executor", "ray", "--ray-address", f"127.0.0.1:{port}"], cwd=tmp_path,
                           capture_output=True, text=True, env=env, timeout=200)
        took = time.monotonic() - t0
    assert r.returncode == 2 and r.stdout == "", r.stderr
    assert r.stderr.startswith(f"error: --ray-address 127.0.0.1:{port}: cannot start or reach a Ray cluster"), r.stderr
    assert r.stderr.count("\n") == 1, r.stderr
    assert took < 40, took
    assert not (tmp_path / "out").exists()


# ----------------------------------------------------------------------------- 5. default names, no suffix

def test_default_names_carry_target_and_format(tmp_path, run_ckpt):
    src = one_file(tmp_path)
    folder = tmp_path / "d"
    one_file(folder, "model.safetensors")
    runs = [([src, "--to", "fp16"], "x-fp16.safetensors"),
            ([src, "--to", "fp16", "--format", "torch"], "x-fp16.pth"),
            ([src, "--to", "fp16", "--max-shard-size", "64B"], "x-fp16"),
            ([src, "--to", "fp16", "--max-shard-size", "64B", "--format", "torch"], "x-fp16-torch"),
            ([src, "--to", "bf16"], "x-bf16.safetensors"),
            ([folder, "--to", "fp16"], "d-fp16"),
            ([folder, "--to", "fp16", "--format", "torch"], "d-fp16-torch")]
    for args, name in runs:  # one after the other, as the README's examples run: no "already exists"
        code, out, err = run_ckpt("convert", *args, "-q")
        assert code == 0, (args, err)
        assert out == f"wrote {tmp_path / name}\n", (args, out)
    from ckpt.run import default_output

    # targets that need a model family to plan, named as convert names them
    from ckpt.targets.planners.gguf_out import default_suffix

    assert default_output(str(src), src, "nvfp4", folder=False).name == "x-nvfp4.safetensors"
    assert default_output(str(src), src, default_suffix("gguf-q8_0"), folder=False, ext=".gguf").name == "x-Q8_0.gguf"
    assert default_output(str(folder), folder, "merged", folder=True, ext=".pth").name == "d-merged-torch"


def test_a_file_without_a_suffix_is_read_by_its_content(tmp_path, run_ckpt):
    g = torch.Generator().manual_seed(0)
    fp8 = {"scaled_fp8": torch.zeros(0, dtype=torch.float8_e4m3fn),
           "x.weight": torch.randn(8, 6, generator=g).to(torch.float8_e4m3fn), "x.scale_weight": torch.tensor(0.5)}
    save_file(fp8, tmp_path / "q4")
    save_file(fp8, tmp_path / "q4.safetensors")
    for name, out in (("q4", "a"), ("q4.safetensors", "b")):
        code, _, err = run_ckpt("dequant", tmp_path / name, "-o", tmp_path / f"{out}.safetensors", "-q")
        assert code == 0, err
    a, b = load_file(tmp_path / "a.safetensors"), load_file(tmp_path / "b.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    code, out, err = run_ckpt("dequant", tmp_path / "q4", "--dry-run", "-q")
    assert code == 0 and out == f"would write {tmp_path / 'q4-dequant.safetensors'}\n", err
    torch.save({"w": torch.ones(3)}, tmp_path / "zipped")  # torch.save's zip
    torch.save({"w": torch.ones(3)}, tmp_path / "legacy", _use_new_zipfile_serialization=False)
    for name in ("zipped", "legacy"):
        code, out, err = run_ckpt("convert", tmp_path / name, "--to", "fp16", "-q")
        assert code == 0, err
        assert load_file(tmp_path / f"{name}-fp16.safetensors")["w"].dtype == torch.float16
    (tmp_path / "junk").write_bytes(b"not a checkpoint at all")
    assert_refused(run_ckpt, tmp_path, ["convert", tmp_path / "junk", "--to", "fp16"], f"{tmp_path / 'junk'}:",
                   "no file-name suffix, and its content is not safetensors, GGUF or a torch pickle")
