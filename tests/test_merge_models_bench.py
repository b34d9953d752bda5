"""Keeps scripts/bench_merge_models.py working at a tiny size: it must generate its three Llama folders, run
`ckpt merge` (linear and ties) and cp + sync, meet its RSS target, write its JSON summary and clean up. mergekit and
sd-mecha are skipped here (`--no-mergekit --no-mecha`: their start-up alone takes several seconds per run); the
comparison they feed is tested on its own with hand-made outputs: 1 ulp and near-zero differences pass, larger ones
fail unless they sit at a fine-tune's density threshold (ties)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file


SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "bench_merge_models.py"


def _bench():
    sys.path.insert(0, str(SCRIPT.parent))
    spec = importlib.util.spec_from_file_location("bench_merge_models", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_bench_merge_models_tiny_run(tmp_path):
    out = tmp_path / "r.json"
    p = subprocess.run([sys.executable, str(SCRIPT), "--size-gb", "0.01", "--no-mergekit", "--no-mecha",
                        "--workdir", str(tmp_path), "--json", str(out)], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-3000:] + p.stdout[-3000:]
    res = json.loads(out.read_text())
    assert res["info"]["single_file"] and res["info"]["dims"]["num_hidden_layers"] >= 16
    assert 0.8e7 < 2 * res["info"]["params"] < 1.2e7
    for method in ("linear", "ties"):
        r = res["methods"][method]
        assert set(r["runs"]) == {"ckpt", "cp + sync"}
        assert r["rss_ok"] and r["rss_bound"] > res["import_baseline_rss"]
        assert r["out_bytes"] > 2 * res["info"]["params"]
    assert "| ckpt" in p.stdout and "RSS target" in p.stdout and "tolerance" in p.stdout
    assert [x for x in tmp_path.iterdir() if x.name != "r.json"] == []  # cleaned up


def test_generated_models_are_what_transformers_reads(tmp_path):
    bench = _bench()
    info = bench.generate(str(tmp_path), 2_000_000, int(0.001e9))  # small shards: the index path
    assert info["shards"] > 1
    d = info["dims"]
    for name in ("base", "ft1", "ft2"):
        folder = tmp_path / name
        cfg = json.loads((folder / "config.json").read_text())
        assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["hidden_size"] == d["hidden_size"]
        files = bench.tensor_files(str(folder))
        assert set(files) == {n for n, _ in bench.llama_tensors(d)}
    with safe_open(bench.tensor_files(str(tmp_path / "base"))["lm_head.weight"], "pt") as f:
        w = f.get_tensor("lm_head.weight")
    with safe_open(bench.tensor_files(str(tmp_path / "ft1"))["lm_head.weight"], "pt") as f:
        w1 = f.get_tensor("lm_head.weight")
    assert w.dtype == torch.bfloat16 and 0.015 < w.float().std() < 0.025
    assert 0.0005 < (w1.float() - w.float()).std() < 0.002  # a fine-tune: base + small noise


def test_compare_tolerance(tmp_path):
    bench = _bench()
    g = torch.Generator().manual_seed(0)
    base = (0.02 * torch.randn(64, 64, generator=g)).bfloat16()
    fts = [(base.float() + 0.001 * torch.randn(64, 64, generator=g)).bfloat16() for _ in range(2)]
    paths = []
    for name, t in (("base", base), ("ft1", fts[0]), ("ft2", fts[1])):
        paths.append(str(tmp_path / f"{name}.safetensors"))
        save_file({"w": t}, paths[-1])
    a = (base.float() + 0.5 * (fts[0].float() - base.float() + fts[1].float() - base.float())).bfloat16()
    a[0, 0] = 1e-8  # near zero: many ulps, tiny absolute difference

    def out(edit) -> str:
        b = a.clone()
        edit(b)
        path = tmp_path / "b.safetensors"
        save_file({"w": b}, str(path))
        save_file({"w": a}, str(tmp_path / "a.safetensors"))
        return str(path)

    def bump(b, i, j, ulps):
        b.view(torch.int16)[i, j] += ulps

    ok = bench.compare(str(tmp_path / "a.safetensors"), out(lambda b: (bump(b, 1, 1, 1), b.__setitem__((0, 0), 3e-8))))
    assert ok["ok"] and ok["one_ulp"] == 1 and ok["near_zero"] == 1
    bad = bench.compare(str(tmp_path / "a.safetensors"), out(lambda b: bump(b, 1, 1, 5)))
    assert not bad["ok"] and bad["over_one_ulp"] == 1
    # ties: a difference where ft1's |delta| equals its threshold is explained, one elsewhere is not
    d = (fts[0].float() - base.float()).abs().reshape(-1)
    thr = torch.kthvalue(d, d.numel() - int(0.5 * d.numel()) + 1).values
    at = int((d == thr)[1:].nonzero()[0]) + 1
    d2 = (fts[1].float() - base.float()).abs().reshape(-1)
    thr2 = torch.kthvalue(d2, d2.numel() - int(0.5 * d2.numel()) + 1).values
    away = int(((d != thr) & (d2 != thr2))[1:].nonzero()[0]) + 1  # not [0, 0], near zero
    tied = bench.compare(str(tmp_path / "a.safetensors"), out(lambda b: bump(b, at // 64, at % 64, 5)), paths, 0.5)
    assert tied["ok"] and tied["at_threshold"] == 1
    untied = bench.compare(str(tmp_path / "a.safetensors"), out(lambda b: bump(b, away // 64, away % 64, 5)), paths,
                           0.5)
    assert not untied["ok"] and untied["unexplained"] == 1
