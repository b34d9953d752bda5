"""The user scripts in scripts/examples/ run with bash on a generated folder and do what they say.

`ckpt` on PATH is a shim for this interpreter (`python -m ckpt.cli`), so the test needs no installed
console script. Oracles: torch's own fp16 cast, optimum-quanto's `.dequantize()`, PEFT's merge formula
(W + ratio * B @ A, no alpha = scale 1) and `ckpt.inspect.inspect` for the CSV counts.
"""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = REPO / "scripts" / "examples"


@pytest.fixture
def sh(tmp_path):
    """Run an example script with bash; returns the CompletedProcess."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    shim = bindir / "ckpt"
    shim.write_text(f'#!/usr/bin/env bash\nexec "{sys.executable}" -m ckpt.cli "$@"\n')
    shim.chmod(0o755)
    env = {**os.environ, "PATH": f"{bindir}{os.pathsep}{os.environ.get('PATH', '')}",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}

    def run(script: str, *args, **extra_env):
        return subprocess.run(["bash", str(EXAMPLES / script), *map(str, args)], cwd=tmp_path, env={**env, **extra_env},
                              capture_output=True, text=True, timeout=300)

    return run


def tiny(path: Path, seed: int, **shapes) -> dict[str, torch.Tensor]:
    path.parent.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    t = {k: torch.randn(*s, generator=g) for k, s in shapes.items()}
    save_file(t, path)
    return t


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a.contiguous().view(-1).view(torch.uint8),
                                              b.contiguous().view(-1).view(torch.uint8))


def test_every_script_is_strict_documented_and_checks_its_arguments(sh):
    scripts = sorted(EXAMPLES.glob("*.sh"))
    assert {p.name for p in scripts} >= {"convert-folder-fp16.sh", "dequant-checkpoints.sh",
                                         "merge-lora-into-bases.sh", "inspect-to-csv.sh"}
    for p in scripts:
        text = p.read_text()
        assert text.startswith("#!/usr/bin/env bash\n# ") and "set -euo pipefail" in text and "usage:" in text, p
        r = sh(p.name)
        assert r.returncode == 2 and "usage:" in r.stderr, p


def test_convert_folder_fp16(tmp_path, sh):
    models = tmp_path / "models"
    made = {rel: tiny(models / rel, i, w=(6, 5), b=(5,))
            for i, rel in enumerate(["checkpoints/a.safetensors", "loras/b.safetensors"])}
    r = sh("convert-folder-fp16.sh", models)
    assert r.returncode == 0, r.stderr
    for rel, tensors in made.items():
        got = load_file(tmp_path / "models-fp16" / rel)
        assert all(same_bits(got[k], v.half()) for k, v in tensors.items())
    again = sh("convert-folder-fp16.sh", models)
    assert again.returncode == 0 and "0 ok, 2 skipped" in again.stdout


def test_dequant_every_checkpoint(tmp_path, sh):
    from optimum.quanto import freeze, qint8, quantization_map, quantize

    run = tmp_path / "run"
    want = {}
    for i, name in enumerate(["checkpoint-10", "checkpoint-20"]):
        torch.manual_seed(i)
        m = torch.nn.Sequential(torch.nn.Linear(8, 4))
        quantize(m, weights=qint8)
        freeze(m)
        folder = run / name / "transformer"
        folder.mkdir(parents=True)
        save_file(m.state_dict(), folder / "diffusion_pytorch_model.safetensors")
        (folder / "quanto_qmap.json").write_text(json.dumps(quantization_map(m)))
        (folder / "config.json").write_text("{}")
        torch.save({"state": {}}, run / name / "optimizer.bin")
        want[name] = m[0].weight.dequantize()
    r = sh("dequant-checkpoints.sh", run, tmp_path / "plain")
    assert r.returncode == 0, r.stderr
    assert "2 ok, 0 skipped, 0 failed" in r.stdout
    for name, w in want.items():
        got = load_file(tmp_path / "plain" / name / "transformer" / "diffusion_pytorch_model.safetensors")
        assert same_bits(got["0.weight"], w) and "0.weight._data" not in got


def test_merge_lora_into_bases(tmp_path, sh):
    bases = tmp_path / "bases"
    b = {rel: tiny(bases / rel, i, **{"lin.weight": (6, 4)})
         for i, rel in enumerate(["one.safetensors", "two.safetensors"])}
    lora = tiny(tmp_path / "style.safetensors", 9, **{"base_model.model.lin.lora_A.weight": (2, 4),
                                                       "base_model.model.lin.lora_B.weight": (6, 2)})
    tiny(bases / "unrelated.safetensors", 3, **{"other.weight": (3, 3)})  # the LoRA matches nothing here
    r = sh("merge-lora-into-bases.sh", tmp_path / "style.safetensors", bases, tmp_path / "merged", "0.75")
    assert r.returncode == 1 and "2 ok, 0 skipped, 1 failed" in r.stdout
    assert "failed   unrelated.safetensors" in r.stdout
    delta = lora["base_model.model.lin.lora_B.weight"] @ lora["base_model.model.lin.lora_A.weight"]
    for rel, base in b.items():
        got = load_file(tmp_path / "merged" / rel)["lin.weight"]
        torch.testing.assert_close(got, base["lin.weight"] + 0.75 * delta, rtol=0, atol=1e-6)
    assert not (tmp_path / "merged" / "unrelated.safetensors").exists()


def test_inspect_to_csv(tmp_path, sh):
    from ckpt.inspect import inspect

    models = tmp_path / "models"
    tiny(models / "a.safetensors", 0, w=(6, 5))
    tiny(models / "loras" / "l.safetensors", 1, **{"base_model.model.lin.lora_A.weight": (2, 4),
                                                    "base_model.model.lin.lora_B.weight": (6, 2)})
    r = sh("inspect-to-csv.sh", models)
    assert r.returncode == 0, r.stderr
    rows = {row["input"]: row for row in csv.DictReader(open(tmp_path / "checkpoints.csv"))}
    assert sorted(rows) == ["a.safetensors", "loras/l.safetensors"]
    for rel, row in rows.items():
        rep = inspect(str(models / rel))
        assert int(row["parameters"]) == rep["totals"]["parameters"] and int(row["bytes"]) == rep["totals"]["bytes"]
    assert rows["loras/l.safetensors"]["model_kind"] == "lora"


# A stand-in for Slurm's sbatch: records its arguments, runs an --array job's script once per index (with
# SLURM_ARRAY_TASK_ID set, a failing task does not stop the others) and any other job's script once, in
# order, their output going to a log file as --output sends it, and answers a job id as `sbatch --parsable` does.
FAKE_SBATCH = r'''#!/usr/bin/env bash
echo "$*" >> "$SBATCH_LOG"
array=""
while [[ $# -gt 0 ]]; do
    case $1 in
        --array=*) array=${1#--array=}; shift ;;
        --parsable|--*=*) shift ;;
        -*) shift 2 ;;
        *) break ;;
    esac
done
if [[ -n $array ]]; then
    for ((i = ${array%-*}; i <= ${array#*-}; i++)); do
        SLURM_ARRAY_TASK_ID=$i bash "$@" >> "$SBATCH_LOG.jobs" 2>&1 || true
    done
else
    bash "$@" >> "$SBATCH_LOG.jobs" 2>&1 || true
fi
echo $((RANDOM + 1000))
'''


def test_slurm_array_example(tmp_path, sh):
    """The script plans, submits an array (one task per job, the largest job's memory) and a collecting job;
    run through a stand-in sbatch, every output is torch's own cast and the manifest records each job
    (test_batch_joblist proves that manifest equal to a local run's)."""
    bindir = tmp_path / "bin"
    (bindir / "sbatch").write_text(FAKE_SBATCH)
    (bindir / "sbatch").chmod(0o755)
    models, log = tmp_path / "models", tmp_path / "sbatch.log"
    made = {rel: tiny(models / rel, i, w=(6, 5), b=(5,)) for i, rel in enumerate(["a.safetensors", "sub/b.safetensors"])}
    (models / "sub" / "broken.safetensors").write_bytes(b"")
    r = sh("slurm-convert-fp16.sh", models, tmp_path / "out", SBATCH_LOG=str(log), SBATCH_OPTS="-p cpu")
    assert r.returncode == 0, r.stderr
    assert "submitted 3 conversions as array job" in r.stdout
    calls = log.read_text().splitlines()
    assert len(calls) == 2 and "-p cpu" in calls[0] and "--array=0-2" in calls[0] and "--mem=" in calls[0]
    assert "--dependency=afterany:" in calls[1] and "--collect" in calls[1]
    jobs = [json.loads(line) for line in (tmp_path / "out" / "jobs.jsonl").read_text().splitlines()]
    assert f"--mem={max(j['memory'] for j in jobs) // 2**20 + 1}M" in calls[0]
    for rel, tensors in made.items():
        got = load_file(tmp_path / "out" / rel)
        assert all(same_bits(got[k], v.half()) for k, v in tensors.items())
    recs = {Path(x["input"]).name: x for x in map(json.loads, (tmp_path / "out" / "ckpt-batch.jsonl").read_text().splitlines())}
    assert {k: v["status"] for k, v in recs.items()} == {"a.safetensors": "ok", "b.safetensors": "ok",
                                                          "broken.safetensors": "failed"}
    assert "empty file" in recs["broken.safetensors"]["error"]

    # fixed, submitted again: only that one runs; then nothing is left to do
    tiny(models / "sub" / "broken.safetensors", 7, w=(2, 2))
    log.unlink()
    r = sh("slurm-convert-fp16.sh", models, tmp_path / "out", SBATCH_LOG=str(log))
    assert r.returncode == 0 and "submitted 1 conversions" in r.stdout and "--array=0-0" in log.read_text()
    r = sh("slurm-convert-fp16.sh", models, tmp_path / "out", SBATCH_LOG=str(log))
    assert r.returncode == 0 and r.stdout.startswith("nothing to do")
    # the per-task body outside an array job: one clear line
    r = sh("slurm-convert-fp16.sh", "--task", tmp_path / "out" / "jobs.jsonl")
    assert r.returncode != 0 and "not inside a Slurm array job" in r.stderr
