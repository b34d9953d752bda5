"""Keeps scripts/bench_gguf.py working at a tiny size: both cases run, and ckpt's outputs equal the
ComfyUI-GGUF / llama.cpp Python way's (gguf quantize + GGUFWriter; GGUFReader + dequantize + save_file)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"


def test_bench_gguf_tiny_run(tmp_path):
    out_json = tmp_path / "r.json"
    p = subprocess.run([sys.executable, str(SCRIPTS / "bench_gguf.py"), "--size-gb", "0.02", "--work", str(tmp_path),
                        "--json", str(out_json)], capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads(out_json.read_text())
    assert [(r[0], r[1]) for r in res["rows"]] == [("bf16 -> GGUF Q8_0", "ckpt"), ("bf16 -> GGUF Q8_0", "cp + sync"),
                                                    ("bf16 -> GGUF Q8_0", "baseline"), ("GGUF Q8_0 -> bf16", "ckpt"),
                                                    ("GGUF Q8_0 -> bf16", "cp + sync"), ("GGUF Q8_0 -> bf16", "baseline")]
    assert all(v["vs_cp"] > 0 and v["rss_bound"] > v["import_baseline_rss"] for v in res["verdicts"].values())
    assert "x cp + sync" in p.stdout and "import baseline" in p.stdout
    assert res["checks"]["to_gguf"]["equal"] is True and res["checks"]["from_gguf"]["equal"] is True
    assert res["source"]["tensors"] > 50 and res["source"]["bytes"] > 1e7
    assert [x for x in tmp_path.iterdir() if x.name != "r.json"] == []  # temporary files cleaned up
