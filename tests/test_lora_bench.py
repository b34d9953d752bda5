"""Keeps scripts/bench_lora.py working at a tiny size: it must run end to end, pass its own correctness
check (ckpt's measured error on the largest weights at most kohya-style's, and equal to what ckpt
reported) and write its JSON summary; `--device cpu` times the CPU rows only, GPU or not."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"


def test_bench_lora_tiny_run(tmp_path):
    out = tmp_path / "r.json"
    p = subprocess.run([sys.executable, str(SCRIPTS / "bench_lora.py"), "--size-gb", "0.004", "--rank", "4",
                        "--delta-rank", "8", "--device", "cpu", "--workdir", str(tmp_path), "--json", str(out)],
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:] + p.stdout[-3000:]
    res = json.loads(out.read_text())
    assert set(res["runs"]) == {"ckpt", "cp", "ckpt-lowrank", "kohya"}
    assert res["device"] == "cpu" and res["devices"] == ["cpu"] and set(res["verdicts"]) == {"ckpt", "ckpt-lowrank"}
    assert all(v["vs_cp"] > 0 and v["rss_bound"] > v["import_baseline_rss"] for v in res["verdicts"].values())
    assert res["verify"] and all(e[0] <= e[1] + 1e-4 for e in res["verify"].values())
    assert "| ckpt" in p.stdout and "target peak RSS" in p.stdout and "x cp + sync" in p.stdout
    assert [x for x in tmp_path.iterdir() if x.name != "r.json"] == []  # cleaned up
