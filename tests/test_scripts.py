"""Keeps scripts/ working: the convert benchmark at a tiny size (one case: the others differ only in
the CASES table), its helpers, and `make demo`.

Oracles: safetensors' own reader for the synthetic files; a child that provably touches N bytes for the
RSS measurement; the benchmark's bitwise check of ckpt's output against load_file + torch cast +
save_file; the demo's own formula check (it exits non-zero on any difference)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"
sys.path.insert(0, str(SCRIPTS))
import benchlib as bl  # noqa: E402


def test_model_specs_sizes_and_widths():
    small = bl.model_specs(5_000_000)
    assert small.blocks >= 4 and 0.5 < small.params / 5_000_000 < 1.5
    big = bl.model_specs(1_000_000_000)  # 4 GB in fp32: Flux width, the 18432 x 3072 modulation matrix
    assert big.hidden == 3072 and big.largest.shape == (6 * 3072, 3072)
    assert 0.7 < big.params / 1e9 < 1.3
    names = [s.name for s in big.specs]
    assert len(names) == len(set(names))


@pytest.mark.parametrize("dtype,layout", [("fp32", "plain"), ("bf16", "plain"), ("fp8_e4m3fn", "comfy-scaled-fp8")])
def test_generate_is_a_valid_safetensors_file(tmp_path, dtype, layout):
    path = tmp_path / "m.safetensors"
    params = 300_000
    info = bl._write_synthetic(str(path), params, dtype, layout, seed=0)  # in-process: torch is loaded here anyway
    model = bl.model_specs(params)
    assert info["bytes"] == path.stat().st_size and info["params"] == model.params
    expect = {n: (dt, shape) for n, dt, shape in bl.stored_entries(model, dtype, layout)}
    tdt = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp8_e4m3fn": torch.float8_e4m3fn}
    with safe_open(path, "pt") as f:  # safetensors' reader rejects bad offsets, gaps, misalignment
        assert set(f.keys()) == set(expect)
        for k in f.keys():
            t = f.get_tensor(k)
            assert (t.dtype, tuple(t.shape)) == (tdt[expect[k][0]], expect[k][1]), k
            if t.numel():
                v = t.float()
                assert torch.isfinite(v).all(), k
                if k.endswith(".scale_weight"):
                    assert 0 < v.item() < 1
                elif t.numel() > 100:
                    assert v.std() > 0, k  # random values, not zeros
    if layout == "comfy-scaled-fp8":
        assert "scaled_fp8" in expect
        assert sum(k.endswith(".scale_weight") for k in expect) == sum(s.role == "linear" for s in model.specs)


LEAN_MEASURE = """
import json, sys
sys.path.insert(0, sys.argv[1])
import benchlib as bl
assert "torch" not in sys.modules  # the launcher must stay small: children inherit its peak RSS
m = bl.measure([sys.executable, "-c", "import time; b = b'x' * (150 << 20); time.sleep(0.2)"])
try:
    bl.measure([sys.executable, "-c", "import sys; sys.exit(3)"])
    err = None
except bl.BenchError as e:
    err = str(e)
print(json.dumps({"seconds": m.seconds, "rss": m.peak_rss, "floor": bl.launcher_floor(), "err": err}))
"""


def test_measure_reports_wall_time_and_child_peak_rss():
    # run from a lean process: this pytest process has torch loaded, which any child would inherit
    p = subprocess.run([sys.executable, "-c", LEAN_MEASURE, str(SCRIPTS)], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    r = json.loads(p.stdout)
    touched = 150 << 20
    assert r["seconds"] >= 0.2
    assert touched <= r["rss"] < touched + 100e6
    assert 0 < r["floor"] < 60e6
    assert "exit 3" in r["err"]


def test_markdown_table_is_aligned():
    t = bl.markdown_table(["case", "GB/s"], [["fp32->fp16", 1.5], ["x", "12.25"]])
    lines = t.splitlines()
    assert len(lines) == 4 and len({len(x) for x in lines}) == 1
    assert lines[0].startswith("| case") and set(lines[1]) <= {"|", "-"}


def test_bench_convert_tiny_run(tmp_path):
    out_json = tmp_path / "r.json"
    work = tmp_path / "work"
    p = subprocess.run([sys.executable, str(SCRIPTS / "bench_convert.py"), "--size-gb", "0.02",
                        "--cases", "fp8->bf16", "--workdir", str(work), "--json", str(out_json)],
                       capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "| case" in p.stdout and "largest tensor:" in p.stdout and "machine:" in p.stdout
    res = json.loads(out_json.read_text())
    assert {(r["case"], r["variant"]) for r in res["rows"]} == {
        ("fp8->bf16", v) for v in ("ckpt", "naive", "cp")}
    for r in res["rows"]:
        assert r["seconds"] > 0 and r["peak_rss"] > 0
    for case, r in res["results"].items():
        assert r["verified"]["equal"] is True, (case, r["verified"])  # ckpt == load_file + cast + save_file
        assert r["targets"]["rss_bound"] > 300e6
    ck = next(r for r in res["rows"] if r["variant"] == "ckpt")
    params = res["results"]["fp8->bf16"]["info"]["params"]
    assert abs(ck["out_bytes"] - 2 * params) < 0.01 * ck["out_bytes"]  # every logical tensor in bf16
    assert list(work.iterdir()) == []  # sources and outputs cleaned up


def test_bench_convert_layout_case(tmp_path):
    """The layout row: a synthetic Flux.2 BFL file that the family registry recognises; ckpt's diffusers
    output equals diffusers' own converter's bit for bit."""
    from ckpt import families

    model = bl.flux2_specs(2_000_000)
    shapes = {s.name: s.shape for s in model.specs}
    m = families.detect(shapes, shapes)
    assert (m.family_id, m.layout) == ("flux2", "original") and model.largest.name.endswith("linear1.weight")
    out_json = tmp_path / "r.json"
    p = subprocess.run([sys.executable, str(SCRIPTS / "bench_convert.py"), "--size-gb", "0.02", "--cases",
                        "flux2->diffusers", "--workdir", str(tmp_path / "work"), "--json", str(out_json)],
                       capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads(out_json.read_text())["results"]["flux2->diffusers"]
    assert res["verified"]["equal"] is True, res["verified"]
    assert list((tmp_path / "work").iterdir()) == []


def test_bench_convert_rejects_unknown_case(tmp_path):
    p = subprocess.run([sys.executable, str(SCRIPTS / "bench_convert.py"), "--cases", "fp4->fp16"],
                       capture_output=True, text=True)
    assert p.returncode == 2 and "unknown case" in p.stderr


def test_demo_runs_and_checks_its_formulas():
    p = subprocess.run([sys.executable, str(SCRIPTS / "demo.py")], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "demo OK" in p.stdout and "max |output - (w.float() * scale_weight).half()| = 0" in p.stdout


def test_demo_keeps_its_files_when_asked(tmp_path):
    keep = tmp_path / "demo"
    p = subprocess.run([sys.executable, str(SCRIPTS / "demo.py"), "--keep", str(keep)], capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert sorted(f.name for f in keep.iterdir()) == ["encoder-fp16.safetensors", "encoder-fp32.safetensors",
                                                      "flux-fp8-scaled-fp16.safetensors", "flux-fp8-scaled.safetensors"]
    p = subprocess.run([sys.executable, str(SCRIPTS / "demo.py"), "--keep", str(keep)], capture_output=True, text=True,
                       timeout=120)
    assert p.returncode != 0 and p.stderr.strip() == f"error: --keep {keep}: already exists; name a new folder"


def test_benchlib_pipeline_constants_mirror_ckpt():
    """benchlib may not import ckpt (it must stay small: see its docstring); its copy of the pipeline's
    depth and band size, which the RSS bound uses, must follow ckpt's."""
    from ckpt.io.output import BAND_ELEMS
    from ckpt.io.write_stages import DEPTH

    assert (bl.PIPELINE_DEPTH, bl.BAND_ELEMS) == (DEPTH, BAND_ELEMS)


@pytest.mark.parametrize("bench", ["bench_merge.py", "bench_lora.py"])
def test_bench_device_cuda_without_a_gpu_is_one_line(tmp_path, bench):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is here")
    p = subprocess.run([sys.executable, str(SCRIPTS / bench), "--size-gb", "0.01", "--device", "cuda",
                        "--workdir", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert p.returncode == 1 and p.stderr.strip().splitlines()[-1].startswith("error: --device cuda")
    assert "Traceback" not in p.stderr
    assert list(tmp_path.iterdir()) == []  # stopped before generating anything
