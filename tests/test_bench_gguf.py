"""Keeps scripts/bench_gguf.py working at a tiny size: every case runs, and ckpt's outputs equal the baselines'
(Q8_0 both ways: gguf quantize + GGUFWriter, GGUFReader + dequantize + save_file; Q4_K_M: ComfyUI-GGUF's
convert step + llama.cpp's quantizer functions for a Flux shape, convert_hf_to_gguf.py + llama_model_quantize for
a Llama-shaped HF folder)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"


def test_bench_gguf_tiny_run(tmp_path):
    out_json = tmp_path / "r.json"
    p = subprocess.run([sys.executable, str(SCRIPTS / "bench_gguf.py"), "--size-gb", "0.02", "--work", str(tmp_path),
                        "--json", str(out_json)], capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads(out_json.read_text())
    flux, llm = "bf16 Flux -> GGUF Q4_K_M", "bf16 Llama HF folder -> GGUF Q4_K_M"
    moe, imx = "bf16 Mixtral HF folder -> GGUF Q4_K_M", "bf16 Llama HF folder -> GGUF Q4_K_M --imatrix"
    assert [(r[0], r[1]) for r in res["rows"]] == [
        (flux, "ckpt"), (flux, "cp + sync"), (flux, "baseline: convert.py step (BF16 GGUF)"),
        (flux, f"baseline: llama.cpp quantizer, {os.cpu_count()} threads"), (flux, "baseline: both steps"),
        (llm, "ckpt"), (llm, "cp + sync"), (llm, f"baseline: convert_hf_to_gguf + llama-quantize ({os.cpu_count()} threads)"),
        (imx, "ckpt"), (imx, "cp + sync"),
        (imx, f"baseline: convert_hf_to_gguf + llama-quantize --imatrix ({os.cpu_count()} threads)"),
        (moe, "ckpt"), (moe, "cp + sync"), (moe, f"baseline: convert_hf_to_gguf + llama-quantize ({os.cpu_count()} threads)"),
        ("bf16 -> GGUF Q8_0", "ckpt"), ("bf16 -> GGUF Q8_0", "cp + sync"),
                                                    ("bf16 -> GGUF Q8_0", "baseline"), ("GGUF Q8_0 -> bf16", "ckpt"),
                                                    ("GGUF Q8_0 -> bf16", "cp + sync"), ("GGUF Q8_0 -> bf16", "baseline")]
    assert all(v["vs_cp"] > 0 and v["rss_bound"] > v["import_baseline_rss"] for v in res["verdicts"].values())
    assert "x cp + sync" in p.stdout and "import baseline" in p.stdout
    assert res["checks"]["to_gguf"]["equal"] is True and res["checks"]["from_gguf"]["equal"] is True
    assert res["checks"]["flux_q4_k_m"]["equal"] is True and res["checks"]["llm_q4_k_m"]["equal"] is True
    assert res["checks"]["moe_q4_k_m"]["equal"] is True and res["checks"]["llm_q4_k_m_imatrix"]["equal"] is True
    assert res["source"]["tensors"] > 50 and res["source"]["bytes"] > 1e7
    assert [x for x in tmp_path.iterdir() if x.name != "r.json"] == []  # temporary files cleaned up
