"""`ckpt batch`: discovery rules, outputs against torch's own casts, resume, failure isolation, Ctrl-C,
parallel worker processes and the memory check."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from helpers.batch import assert_fp16_of, bits, manifest_lines, no_temp_files, small_models, st
from ckpt.batch.discover import discover


# ------------------------------------------------------------------------------------------- discovery


def make_tree(root: Path) -> None:
    st(root / "loras" / "a.safetensors")
    torch.save({"w": torch.randn(2, 2)}, root / "loras" / "b.pt")
    (root / "loras" / "notes.txt").write_text("not weights")
    # a sharded model: one job
    sh = root / "sharded"
    st(sh / "model-00001-of-00002.safetensors", w=(2, 2))
    st(sh / "model-00002-of-00002.safetensors", v=(2, 2))
    (sh / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": 32}, "weight_map": {"w": "model-00001-of-00002.safetensors",
                                                        "v": "model-00002-of-00002.safetensors"}}))
    (sh / "config.json").write_text("{}")
    # a diffusers pipeline: one job including its subfolders
    (root / "pipe").mkdir()
    (root / "pipe" / "model_index.json").write_text('{"_class_name": "X"}')
    st(root / "pipe" / "unet" / "diffusion_pytorch_model.safetensors")
    (root / "pipe" / "unet" / "config.json").write_text("{}")
    # a SimpleTuner-style training checkpoint: LoRA file and a model folder; trainer state is not weights
    ck = root / "run" / "checkpoint-10"
    st(ck / "pytorch_lora_weights.safetensors")
    st(ck / "transformer" / "diffusion_pytorch_model.safetensors")
    (ck / "transformer" / "config.json").write_text("{}")
    for name in ("optimizer.bin", "scheduler.pt"):
        torch.save({"state": {}}, ck / name)
    (ck / "random_states_0.pkl").write_bytes(b"x")
    # a LoRA-only training checkpoint: no model subfolder, so its LoRA file is the job
    st(root / "run" / "checkpoint-20" / "pytorch_lora_weights.safetensors")
    torch.save({"state": {}}, root / "run" / "checkpoint-20" / "optimizer.bin")
    # an HF Trainer output: config + weights at the top and checkpoint-* runs below: each is its own job
    tr = root / "trainer_out"
    st(tr / "model.safetensors")
    (tr / "config.json").write_text("{}")
    st(tr / "checkpoint-5" / "model.safetensors")
    (tr / "checkpoint-5" / "config.json").write_text("{}")
    torch.save({}, tr / "checkpoint-5" / "optimizer.pt")
    # config without weights, hidden folders, an earlier ckpt output
    (root / "empty_model").mkdir()
    (root / "empty_model" / "config.json").write_text("{}")
    st(root / ".trash" / "x.safetensors")
    st(root / "prev-fp16.safetensors", metadata={"ckpt_operation": "convert --to fp16"})
    # Hugging Face cache: only the snapshot refs/main points at; files are symlinks into blobs/
    repo = root / "hub" / "models--org--name"
    (repo / "blobs").mkdir(parents=True)
    st(repo / "blobs" / "abc123")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("1111")
    for sha in ("0000", "1111"):
        snap = repo / "snapshots" / sha
        snap.mkdir(parents=True)
        (snap / "model.safetensors").symlink_to(repo / "blobs" / "abc123")
        (snap / "config.json").write_text("{}")


def test_discovery_counts_each_checkpoint_once(tmp_path):
    root = tmp_path / "models"
    make_tree(root)
    st(root / "out" / "old.safetensors")  # the batch's own output folder
    d = discover(root, exclude=[root / "out"])
    assert sorted((f.rel, f.is_folder) for f in d.found) == [
        ("hub/org--name", True),
        ("loras/a.safetensors", False),
        ("loras/b.pt", False),
        ("pipe", True),
        ("run/checkpoint-10", True),  # a training checkpoint with a model subfolder: one job, as `ckpt dequant` sees it
        ("run/checkpoint-20/pytorch_lora_weights.safetensors", False),
        ("sharded", True),
        ("trainer_out/checkpoint-5", True),
        ("trainer_out/model.safetensors", False),
    ]
    assert [f.path for f in d.found if f.rel == "hub/org--name"] == [root / "hub/models--org--name/snapshots/1111"]
    why = dict(d.ignored)
    assert "ckpt convert --to fp16" in why["prev-fp16.safetensors"]
    assert why["empty_model"] == "model folder without weight files"
    assert why["out"] == "the batch's output folder"
    assert why["run/checkpoint-20/optimizer.bin"] == "training state, not weights"
    # inspect reads ckpt's own outputs too
    assert "prev-fp16.safetensors" in {f.rel for f in discover(root, skip_ckpt_outputs=False).found}


def test_discovery_glob(tmp_path):
    root = tmp_path / "models"
    make_tree(root)
    rels = {f.rel for f in discover(root, pattern="checkpoint-*").found}
    assert rels == {"run/checkpoint-10", "run/checkpoint-20/pytorch_lora_weights.safetensors",
                    "trainer_out/checkpoint-5"}
    assert {f.rel for f in discover(root, pattern="loras/*.pt").found} == {"loras/b.pt"}
    assert {f.rel for f in discover(root, pattern="*.safetensors").found} == {
        "loras/a.safetensors", "run/checkpoint-20/pytorch_lora_weights.safetensors", "trainer_out/model.safetensors"}


def test_hf_cache_with_two_refs_gives_two_named_jobs(tmp_path):
    repo = tmp_path / "hub" / "models--org--m"
    for sha in ("aa", "bb"):
        st(repo / "snapshots" / sha / "model.safetensors")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("aa\n")
    (repo / "refs" / "dev").write_text("bb")
    assert sorted(f.rel for f in discover(tmp_path / "hub").found) == ["org--m@dev/model.safetensors",
                                                                      "org--m@main/model.safetensors"]


# ----------------------------------------------------------------------------------- convert, end to end


def test_batch_convert_mirrors_tree_and_matches_torch(tmp_path, run_ckpt):
    root, out = tmp_path / "models", tmp_path / "out"
    made = small_models(root)
    torch.save({"state_dict": {"w": torch.randn(3, 3, generator=torch.Generator().manual_seed(9))}}, root / "p.ckpt")
    code, stdout, err = run_ckpt("batch", "convert", root, "--to", "fp16", "-o", out, "-q")
    assert code == 0, err
    for rel, tensors in made.items():
        assert_fp16_of(out / rel, tensors)
    assert_fp16_of(out / "p.safetensors", torch.load(root / "p.ckpt")["state_dict"])
    recs = manifest_lines(out / "ckpt-batch.jsonl")
    assert {r["status"] for r in recs} == {"ok"} and len(recs) == 4
    assert {Path(r["input"]).name for r in recs} == {"a.safetensors", "b.safetensors", "c.safetensors", "p.ckpt"}
    assert all(r["operation"] == "convert --to fp16" and r["seconds"] >= 0 for r in recs)
    assert "4 ok, 0 skipped, 0 failed" in stdout


def test_batch_convert_beside_inputs_with_default_names(tmp_path, run_ckpt):
    root = tmp_path / "models"
    made = small_models(root)
    code, stdout, err = run_ckpt("batch", "convert", root, "--to", "fp16", "-q")
    assert code == 0, err
    for rel, tensors in made.items():
        p = root / rel
        assert_fp16_of(p.with_name(p.stem + "-fp16.safetensors"), tensors)
    assert (root / ".ckpt-batch.jsonl").is_file()
    # the outputs beside the inputs are not inputs of the next run: everything is skipped
    code, stdout, err = run_ckpt("batch", "convert", root, "--to", "fp16")
    assert code == 0 and "0 ok, 3 skipped, 0 failed" in stdout
    assert "ignored  a-fp16.safetensors" in stdout


def test_dry_run_writes_nothing(tmp_path, run_ckpt):
    root, out = tmp_path / "models", tmp_path / "out"
    small_models(root)
    code, stdout, err = run_ckpt("batch", "convert", root, "--to", "bf16", "-o", out, "--dry-run")
    assert code == 0, err
    assert "would run  sub/b.safetensors -> " in stdout and "3 to run" in stdout
    assert not out.exists() and not (root / ".ckpt-batch.jsonl").exists()


# ------------------------------------------------------------------------------------------------ resume


def test_resume_skips_done_redoes_changed_and_missing(tmp_path, run_ckpt):
    root, out = tmp_path / "models", tmp_path / "out"
    made = small_models(root)
    assert run_ckpt("batch", "convert", root, "--to", "fp16", "-o", out, "-q")[0] == 0
    stamp = {rel: (out / rel).stat().st_mtime_ns for rel in made}

    code, stdout, _ = run_ckpt("batch", "convert", root, "--to", "fp16", "-o", out)
    assert code == 0 and "0 ok, 3 skipped, 0 failed" in stdout
    assert {rel: (out / rel).stat().st_mtime_ns for rel in made} == stamp

    new_b = st(root / "sub" / "b.safetensors", 42)  # input changed since
    os.utime(root / "sub" / "b.safetensors", ns=(1, 1))  # a different mtime whatever the clock does
    (out / "a.safetensors").unlink()  # output gone
    code, stdout, err = run_ckpt("batch", "convert", root, "--to", "fp16", "-o", out)
    assert code == 0, err
    assert "2 ok, 1 skipped, 0 failed" in stdout and "skipped  sub/c.safetensors" in stdout
    assert_fp16_of(out / "sub" / "b.safetensors", new_b)
    assert_fp16_of(out / "a.safetensors", made["a.safetensors"])
    assert (out / "sub" / "c.safetensors").stat().st_mtime_ns == stamp["sub/c.safetensors"]

    # other options are another operation: nothing skipped, separate manifest records
    code, stdout, err = run_ckpt("batch", "convert", root, "--to", "bf16", "-o", tmp_path / "out_bf16", "-q")
    assert code == 0 and "3 ok" in stdout


def test_existing_output_not_from_the_manifest_is_not_replaced(tmp_path, run_ckpt):
    root, out = tmp_path / "models", tmp_path / "out"
    made = small_models(root)
    st(out / "a.safetensors", 99)
    code, stdout, err = run_ckpt("batch", "convert", root, "--to", "fp16", "-o", out, "-q")
    assert code == 1 and "failed   a.safetensors" in stdout and "already exists" in stdout
    code, stdout, err = run_ckpt("batch", "convert", root, "--to", "fp16", "-o", out, "-q", "--overwrite")
    assert code == 0, err
    assert_fp16_of(out / "a.safetensors", made["a.safetensors"])


# ------------------------------------------------------------------------------------- failure isolation


def test_one_bad_checkpoint_does_not_stop_the_others(tmp_path, run_ckpt):
    root, out = tmp_path / "models", tmp_path / "out"
    made = small_models(root)
    (root / "sub" / "broken.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}xxxxxx")
    code, stdout, err = run_ckpt("batch", "convert", root, "--to", "fp16", "-o", out, "-q")
    assert code == 1
    assert "3 ok, 0 skipped, 1 failed" in stdout
    assert f"failed   sub/broken.safetensors: {root / 'sub' / 'broken.safetensors'}:" in stdout
    assert "1 of 4 checkpoints failed" in err
    for rel, tensors in made.items():
        assert_fp16_of(out / rel, tensors)
    assert not (out / "sub" / "broken.safetensors").exists() and no_temp_files(out, root)
    rec = [r for r in manifest_lines(out / "ckpt-batch.jsonl") if r["input"].endswith("broken.safetensors")]
    assert rec[0]["status"] == "failed" and "broken.safetensors" in rec[0]["error"] and rec[0]["output"] is None

    # fixed input: the failed one is retried, the rest skipped
    fixed = st(root / "sub" / "broken.safetensors", 7)
    code, stdout, err = run_ckpt("batch", "convert", root, "--to", "fp16", "-o", out, "-q")
    assert code == 0 and "1 ok, 3 skipped, 0 failed" in stdout, stdout + err
    assert_fp16_of(out / "sub" / "broken.safetensors", fixed)


def test_bad_command_lines_exit_2_and_write_nothing(tmp_path, run_ckpt):
    root = tmp_path / "models"
    small_models(root)
    code, _, err = run_ckpt("batch", "convert", tmp_path / "nope", "--to", "fp16")
    assert code == 2 and "nope: no such file or directory" in err
    code, _, err = run_ckpt("batch", "convert", root / "sub", "--to", "fp16", "-o", root)
    assert code == 2 and "contains the input folder" in err
    code, _, err = run_ckpt("batch", "convert", root, "--to", "fp16", "--jobs", "0")
    assert code == 2 and "--jobs 0" in err
    assert sorted(p.name for p in root.rglob("*")) == ["a.safetensors", "b.safetensors", "c.safetensors", "sub"]


# ------------------------------------------------------------------------------------------------ Ctrl-C


def test_ctrl_c_keeps_finished_outputs_and_leaves_no_partial_one(tmp_path, run_ckpt, monkeypatch):
    import ckpt.io.output as output

    root, out = tmp_path / "models", tmp_path / "out"
    made = small_models(root)
    real = output._stream_tensor
    calls = {"n": 0}

    def interrupt_in_second_file(t, w, *a):
        calls["n"] += 1
        if calls["n"] == 3:  # 2 tensors per file: the first tensor of the second file
            raise KeyboardInterrupt
        return real(t, w, *a)

    monkeypatch.setattr(output, "_stream_tensor", interrupt_in_second_file)
    code, stdout, err = run_ckpt("batch", "convert", root, "--to", "fp16", "-o", out, "-q")
    assert code == 130 and "interrupted" in err and "1 ok, 0 skipped, 0 failed, 2 not run" in stdout
    assert_fp16_of(out / "a.safetensors", made["a.safetensors"])
    assert not (out / "sub" / "b.safetensors").exists() and no_temp_files(out)
    assert [r["status"] for r in manifest_lines(out / "ckpt-batch.jsonl")] == ["ok"]

    monkeypatch.setattr(output, "_stream_tensor", real)
    code, stdout, err = run_ckpt("batch", "convert", root, "--to", "fp16", "-o", out, "-q")
    assert code == 0 and "2 ok, 1 skipped, 0 failed" in stdout
    for rel, tensors in made.items():
        assert_fp16_of(out / rel, tensors)


# ------------------------------------------------------------------------------------ parallel processes


def test_parallel_jobs_match_serial_and_isolate_failures(tmp_path, run_ckpt):
    root = tmp_path / "models"
    made = small_models(root)
    (root / "bad.safetensors").write_bytes(b"")
    code, stdout, err = run_ckpt("batch", "convert", root, "--to", "bf16", "-o", tmp_path / "par", "--jobs", "2", "-q")
    assert code == 1, err
    assert "3 ok, 0 skipped, 1 failed" in stdout and "bad.safetensors: empty file" in stdout
    code, stdout, err = run_ckpt("batch", "convert", root, "--to", "bf16", "-o", tmp_path / "ser", "-q")
    assert code == 1
    for rel, tensors in made.items():
        assert (tmp_path / "par" / rel).read_bytes() == (tmp_path / "ser" / rel).read_bytes()
        got = load_file(tmp_path / "par" / rel)
        assert all(torch.equal(bits(got[k]), bits(v.to(torch.bfloat16))) for k, v in tensors.items())
    assert len(manifest_lines(tmp_path / "par" / "ckpt-batch.jsonl")) == 4 and no_temp_files(tmp_path)


def test_jobs_refused_when_estimated_peak_exceeds_available_ram(tmp_path, run_ckpt, monkeypatch):
    import ckpt.batch.runner as runner
    from ckpt.batch.operations import FIXED_BYTES

    root, out = tmp_path / "models", tmp_path / "out"
    st(root / "big.safetensors", w=(1000, 250))  # 1 MB fp32: est = 2 x 1 MB + buffers
    small_models(root)
    monkeypatch.setattr(runner, "mem_available", lambda: 3 * FIXED_BYTES)
    code, _, err = run_ckpt("batch", "convert", root, "--to", "fp16", "-o", out, "--jobs", "4")
    assert code == 2 and "--jobs 4: estimated peak memory" in err and "use --jobs 2" in err
    assert not out.exists()
    # the estimate comes from the plan: largest tensor x 2 + fixed buffers
    from ckpt.batch.discover import Found
    from ckpt.batch.operations import make_operation

    op = make_operation("convert", {"to": "fp16"})
    assert op.estimate(Found(root / "big.safetensors", "big.safetensors", False)) == 2 * 1000 * 250 * 4 + FIXED_BYTES


SLOW_WRITES = '''
import time
import ckpt.io.output as o

_write_file, _stream_tensor, _current = o._write_file, o._stream_tensor, [""]


def write_file(path, *a):
    _current[0] = str(path)
    return _write_file(path, *a)


def stream_tensor(*a):
    if "slow" in _current[0]:
        time.sleep(300)  # stands for a long write; interrupted by the test
    return _stream_tensor(*a)


o._write_file, o._stream_tensor = write_file, stream_tensor
'''


def test_ctrl_c_with_parallel_workers(tmp_path):
    """The real thing: SIGINT to `ckpt batch --jobs 2` while two workers are mid-write (made slow through a
    sitecustomize that every process of the run loads): finished outputs stay, partial ones vanish."""
    import signal
    import subprocess
    import sys
    import time

    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(SLOW_WRITES)
    root, out = tmp_path / "models", tmp_path / "out"
    made = {"a.safetensors": st(root / "a.safetensors", 1)}
    st(root / "slow1.safetensors", 2)
    st(root / "slow2.safetensors", 3)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(hook), str(Path(__file__).parents[1])])}
    p = subprocess.Popen([sys.executable, "-m", "ckpt.cli", "batch", "convert", str(root), "--to", "fp16", "-o",
                          str(out), "--jobs", "2", "-q"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            temps = list(out.glob(".slow*.ckpt-tmp-*")) if out.exists() else []
            if len(temps) == 2 and (out / "ckpt-batch.jsonl").exists() and \
                    (out / "ckpt-batch.jsonl").read_text().count('"status": "ok"') == 1:
                break
            assert p.poll() is None, p.communicate()
            time.sleep(0.1)
        else:
            pytest.fail("the two slow jobs never started")
        p.send_signal(signal.SIGINT)
        stdout, stderr = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 130, stderr
    assert "1 ok, 0 skipped, 0 failed, 2 not run (interrupted)" in stdout
    assert_fp16_of(out / "a.safetensors", made["a.safetensors"])
    assert sorted(x.name for x in out.iterdir()) == ["a.safetensors", "ckpt-batch.jsonl"]
    assert [r["status"] for r in manifest_lines(out / "ckpt-batch.jsonl")] == ["ok"]


# ------------------------------------------------------------------------------ dequant, merge-lora, inspect


def quanto_folder(folder: Path, seed: int) -> dict[str, torch.Tensor]:
    """A diffusers-style model folder quantized by optimum-quanto (qint8); returns the oracle: each
    weight's own `.dequantize()` and the plain tensors."""
    from optimum.quanto import freeze, qint8, quantization_map, quantize

    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.Linear(8, 4))
    quantize(m, weights=qint8)
    freeze(m)
    folder.mkdir(parents=True)
    save_file(m.state_dict(), folder / "diffusion_pytorch_model.safetensors")
    (folder / "quanto_qmap.json").write_text(json.dumps(quantization_map(m)))
    (folder / "config.json").write_text(json.dumps({"_class_name": "Tiny"}))
    return {"0.weight": m[0].weight.dequantize(), "1.weight": m[1].weight.dequantize(),
            "0.bias": m[0].bias.detach(), "1.bias": m[1].bias.detach()}


def training_checkpoint(folder: Path, seed: int, lora: bool = True) -> dict[str, torch.Tensor]:
    """A SimpleTuner-style `checkpoint-N/`: a quanto-quantized transformer/, maybe a LoRA, trainer state."""
    want = quanto_folder(folder / "transformer", seed)
    if lora:
        st(folder / "pytorch_lora_weights.safetensors", seed)
    for name in ("optimizer.bin", "scheduler.bin"):
        torch.save({"state": {}}, folder / name)
    (folder / "random_states_0.pkl").write_bytes(b"rng")
    (folder / "training_state.json").write_text('{"global_step": 100}')
    return want


def files_under(p: Path) -> list[str]:
    return sorted(str(x.relative_to(p)) for x in p.rglob("*") if x.is_file())


def test_batch_dequant_of_training_checkpoints_matches_single_dequant_and_quanto(tmp_path, run_ckpt):
    run, out = tmp_path / "run", tmp_path / "out"
    want = {"checkpoint-100": training_checkpoint(run / "checkpoint-100", 0),
            "checkpoint-200": training_checkpoint(run / "checkpoint-200", 1, lora=False)}
    # a LoRA-only checkpoint: nothing quantized, reported, nothing written (not even an empty folder)
    st(run / "checkpoint-300" / "pytorch_lora_weights.safetensors")
    (run / "checkpoint-300" / "training_state.json").write_text("{}")
    st(run / "samples" / "other.safetensors")  # not selected by --glob
    code, stdout, err = run_ckpt("batch", "dequant", run, "--glob", "checkpoint-*", "-o", out)
    assert code == 0, err
    assert "3 ok, 0 skipped, 0 failed" in stdout
    assert "checkpoint-300/pytorch_lora_weights.safetensors (nothing to do; nothing written)" in stdout
    for name, tensors in want.items():
        got = load_file(out / name / "transformer" / "diffusion_pytorch_model.safetensors")
        assert set(got) == set(tensors)
        for k, v in tensors.items():
            assert got[k].dtype == v.dtype and torch.equal(bits(got[k]), bits(v)), (name, k)
    # the whole checkpoint is one job: its LoRA travels with transformer/, trainer state never does
    assert files_under(out / "checkpoint-100") == [
        "pytorch_lora_weights.safetensors", "transformer/config.json", "transformer/diffusion_pytorch_model.safetensors"]
    assert not (out / "checkpoint-300").exists() and not (out / "samples").exists()

    # the single command on one checkpoint writes the same files, byte for byte, under a name no trainer
    # takes for one of its checkpoints
    code, stdout, err = run_ckpt("dequant", run / "checkpoint-100")
    assert code == 0, err
    single = run / "dequant-checkpoint-100"
    assert files_under(single) == files_under(out / "checkpoint-100")
    for rel in files_under(single):
        assert (single / rel).read_bytes() == (out / "checkpoint-100" / rel).read_bytes(), rel
    for state in ("optimizer.bin", "scheduler.bin", "random_states_0.pkl", "training_state.json"):
        assert f"{state}: training state, not copied" in err

    code, stdout, _ = run_ckpt("batch", "dequant", run, "--glob", "checkpoint-*", "-o", out)
    assert code == 0 and "0 ok, 3 skipped, 0 failed" in stdout
    # without -o each output goes beside its checkpoint, under the single command's name
    code, stdout, err = run_ckpt("batch", "dequant", run, "--glob", "checkpoint-2*", "-q")
    assert code == 0, err
    assert (run / "dequant-checkpoint-200" / "transformer" / "diffusion_pytorch_model.safetensors").is_file()
    assert sorted(p.name for p in run.iterdir() if p.name.startswith("checkpoint")) == [
        "checkpoint-100", "checkpoint-200", "checkpoint-300"]


def peft_lora(path: Path, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    t = {"base_model.model.lin.lora_A.weight": torch.randn(2, 4, generator=g),
         "base_model.model.lin.lora_B.weight": torch.randn(8, 2, generator=g)}
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(t, path)
    return t


def merged(base: dict, lora: dict, ratio: float) -> torch.Tensor:
    """PEFT's definition with no alpha anywhere (scale 1): W + ratio * B @ A, in fp32."""
    return base["lin.weight"] + ratio * (lora["base_model.model.lin.lora_B.weight"]
                                         @ lora["base_model.model.lin.lora_A.weight"])


def test_batch_merge_one_lora_into_many_bases(tmp_path, run_ckpt):
    bases, out = tmp_path / "checkpoints", tmp_path / "out"
    b = {rel: st(bases / rel, i, **{"lin.weight": (8, 4), "lin.bias": (8,)})
         for i, rel in enumerate(["a.safetensors", "sdxl/b.safetensors"])}
    lora = peft_lora(tmp_path / "style.safetensors", 5)
    code, stdout, err = run_ckpt("batch", "merge-lora", bases, "--lora", tmp_path / "style.safetensors",
                                 "--ratio", "0.5", "-o", out, "-q")
    assert code == 0, err
    for rel, base in b.items():
        got = load_file(out / rel)
        torch.testing.assert_close(got["lin.weight"], merged(base, lora, 0.5), rtol=0, atol=1e-6)
        assert torch.equal(got["lin.bias"], base["lin.bias"])
    # a changed LoRA is another operation: every base is merged again
    lora = peft_lora(tmp_path / "style.safetensors", 6)
    os.utime(tmp_path / "style.safetensors", ns=(2, 2))
    code, stdout, err = run_ckpt("batch", "merge-lora", bases, "--lora", tmp_path / "style.safetensors",
                                 "--ratio", "0.5", "-o", out, "-q", "--overwrite")
    assert code == 0 and "2 ok, 0 skipped" in stdout, stdout + err
    torch.testing.assert_close(load_file(out / "a.safetensors")["lin.weight"], merged(b["a.safetensors"], lora, 0.5),
                               rtol=0, atol=1e-6)


def test_batch_merge_many_loras_into_one_base(tmp_path, run_ckpt):
    loras = tmp_path / "loras"
    base = st(tmp_path / "base.safetensors", 1, **{"lin.weight": (8, 4)})
    ls = {n: peft_lora(loras / f"{n}.safetensors", i) for i, n in enumerate(["x", "y"])}
    code, stdout, err = run_ckpt("batch", "merge-lora", loras, "--base", tmp_path / "base.safetensors", "-q")
    assert code == 0, err
    for n, lora in ls.items():
        got = load_file(loras / f"base+{n}.safetensors")
        torch.testing.assert_close(got["lin.weight"], merged(base, lora, 1.0), rtol=0, atol=1e-6)
    code, stdout, err = run_ckpt("batch", "merge-lora", loras, "--base", tmp_path / "base.safetensors")
    assert code == 0 and "0 ok, 2 skipped, 0 failed" in stdout
    code, _, err = run_ckpt("batch", "merge-lora", loras)
    assert code == 2 and "exactly one of --lora" in err


def test_batch_inspect_csv_matches_inspect(tmp_path, run_ckpt):
    import csv

    from ckpt.inspect import inspect

    root = tmp_path / "models"
    small_models(root)
    peft_lora(root / "loras" / "l.safetensors", 1)
    st(root / "prev-fp16.safetensors", metadata={"ckpt_operation": "convert --to fp16"})  # inspected too
    (root / "broken.safetensors").write_bytes(b"")
    code, stdout, err = run_ckpt("batch", "inspect", root, "--csv", tmp_path / "models.csv")
    assert code == 1 and "5 ok, 0 skipped, 1 failed" in stdout
    rows = {r["input"]: r for r in csv.DictReader(open(tmp_path / "models.csv"))}
    assert sorted(rows) == ["a.safetensors", "broken.safetensors", "loras/l.safetensors", "prev-fp16.safetensors",
                            "sub/b.safetensors", "sub/c.safetensors"]
    assert rows["broken.safetensors"]["status"] == "failed" and "empty file" in rows["broken.safetensors"]["error"]
    for rel in ("a.safetensors", "loras/l.safetensors"):
        rep = inspect(str(root / rel))
        assert rows[rel]["status"] == "ok"
        assert int(rows[rel]["parameters"]) == rep["totals"]["parameters"]
        assert int(rows[rel]["tensors"]) == rep["totals"]["tensors"]
    assert rows["loras/l.safetensors"]["model_kind"] == "lora" and rows["a.safetensors"]["model_kind"] == "model"
    assert int(rows["a.safetensors"]["parameters"]) == 8 * 4 + 4
    assert not (root / ".ckpt-batch.jsonl").exists()  # inspect keeps no manifest


def test_pickle_and_safetensors_of_one_name_get_distinct_outputs(tmp_path, run_ckpt):
    root, out = tmp_path / "models", tmp_path / "out"
    s = st(root / "x.safetensors", 1)
    p = {"w": torch.randn(3, 2, generator=torch.Generator().manual_seed(2))}
    torch.save(p, root / "x.ckpt")
    code, stdout, err = run_ckpt("batch", "convert", root, "--to", "fp16", "-o", out, "-q")
    assert code == 0, err
    assert_fp16_of(out / "x.safetensors", s)
    assert_fp16_of(out / "x-ckpt.safetensors", p)


def test_manifest_lock_refuses_a_concurrent_batch_and_ignores_torn_lines(tmp_path):
    from ckpt.batch.manifest import Manifest, ManifestRecord
    from ckpt.errors import CkptError

    first = Manifest(tmp_path / "ckpt-batch.jsonl")
    first.open_for_append()
    first.append(ManifestRecord("/x", 1, 2, "convert --to fp16", "/o", "ok"))
    with pytest.raises(CkptError, match="another `ckpt batch` is running"):
        Manifest(tmp_path / "ckpt-batch.jsonl").open_for_append()
    first.close()
    with open(tmp_path / "ckpt-batch.jsonl", "a") as f:
        f.write('{"input": "/y", "size": 1')  # torn by a power loss
    again = Manifest(tmp_path / "ckpt-batch.jsonl")
    assert again.last("/x", "convert --to fp16").status == "ok" and again.last("/y", "convert --to fp16") is None
    again.open_for_append()
    again.append(ManifestRecord("/z", 1, 2, "convert --to fp16", "/o2", "ok"))
    again.close()
    assert Manifest(tmp_path / "ckpt-batch.jsonl").last("/z", "convert --to fp16").output == "/o2"
