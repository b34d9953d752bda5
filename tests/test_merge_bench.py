"""Keeps scripts/bench_merge.py working at a tiny size: it must run end to end, meet its own
correctness check (ckpt's output within one bf16 ulp of the naive load-everything merge, computed from
the LoRA formula with torch) and write its JSON summary."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"


def test_bench_merge_tiny_run(tmp_path):
    out = tmp_path / "r.json"
    p = subprocess.run([sys.executable, str(SCRIPTS / "bench_merge.py"), "--size-gb", "0.01", "--rank", "8",
                        "--workdir", str(tmp_path), "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:] + p.stdout[-3000:]
    res = json.loads(out.read_text())
    assert res["verify"]["ok"] and res["verify"]["elements"] > 1_000_000
    assert set(res["runs"]) == {"convert", "ckpt", "naive", "cp"}
    assert res["vs_cp"] > 0 and res["rss_bound"] > res["import_baseline_rss"] and res["device"] == "cpu"
    assert "x cp + sync" in p.stdout
    assert "| ckpt" in p.stdout and "target peak RSS" in p.stdout
    assert [x for x in tmp_path.iterdir() if x.name != "r.json"] == []  # cleaned up


def test_bench_merge_folder_base_with_merge_args(tmp_path):
    """`--folder` (the base a model folder with config.json, so is the output) and `--merge-args`: the same check
    against the naive merge, the options and the first-MiB figure in the summary, nothing left behind."""
    out = tmp_path / "r.json"
    p = subprocess.run([sys.executable, str(SCRIPTS / "bench_merge.py"), "--size-gb", "0.01", "--rank", "8", "--folder",
                        "--merge-args=--to bf16", "--workdir", str(tmp_path), "--json", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:] + p.stdout[-3000:]
    res = json.loads(out.read_text())
    assert res["verify"]["ok"] and res["folder"] and res["merge_args"] == "--to bf16"
    assert "ckpt merge-lora of a model folder --to bf16: first MiB of the output" in p.stdout
    assert [x for x in tmp_path.iterdir() if x.name != "r.json"] == []  # cleaned up
