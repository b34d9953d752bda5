"""Start-up: what needs no tensor math runs without importing torch.

Each case runs the CLI in a fresh interpreter (an in-process run would find torch already imported by
the other tests) and reports the exit code and whether `torch` ended up in `sys.modules`. A regression
here (a module-level `import torch` on the CLI's path) costs every user 1.5-2 s per command, also for a
mistyped path; the timings themselves are measured by scripts/bench_startup.py, not here.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

PROBE = """
import json, sys
from ckpt.cli import main
code = 0
try:
    main(sys.argv[1:])
except SystemExit as e:
    code = e.code
print(json.dumps({"code": code, "torch": "torch" in sys.modules, "numpy": "numpy" in sys.modules}))
"""


def run_fresh(*args, cwd=None) -> tuple[dict, str]:
    """(the probe's verdict, stderr) of `ckpt ARGS` in a new interpreter."""
    p = subprocess.run([sys.executable, "-c", PROBE, *map(str, args)], capture_output=True, text=True, cwd=cwd)
    verdict = json.loads(p.stdout.strip().splitlines()[-1])
    return verdict, p.stderr


@pytest.mark.parametrize("args", [
    ["--help"], ["--version"], ["convert", "--help"], ["lora", "--help"], ["batch", "--help"],
])
def test_help_and_version_import_no_torch(args):
    verdict, err = run_fresh(*args)
    assert verdict == {"code": 0, "torch": False, "numpy": False}, err


SOURCE, LORA = "no such file or directory", "no such LoRA file or folder"


@pytest.mark.parametrize("args, what", [
    (["inspect", "{m}"], SOURCE),
    (["inspect", "{m}", "--json"], SOURCE),
    (["convert", "{m}", "--to", "fp16"], SOURCE),
    (["dequant", "{m}"], SOURCE),
    (["merge-lora", "{m}", "{f}"], SOURCE),
    (["merge-lora", "{f}", "{m}"], LORA),
    (["lora", "convert", "{m}", "--format", "kohya"], LORA),
    (["lora", "resize", "{m}", "--rank", "4"], LORA),
    (["lora", "merge", "{f}", "{m}"], LORA),
    (["lora", "extract", "{f}", "{m}", "--rank", "4"], SOURCE),
    (["batch", "convert", "{m}", "--to", "fp16"], SOURCE),
])
def test_missing_path_is_one_line_before_torch(tmp_path, args, what):
    """The same line the command's own check gives (ckpt.io.hub.check_source / check_lora), made before
    the command's implementation and torch are imported."""
    existing = tmp_path / "there.safetensors"
    existing.write_bytes(b"")
    missing = tmp_path / "missing.safetensors"
    args = [a.format(m=missing, f=existing) for a in args]
    verdict, err = run_fresh(*args)
    assert verdict["code"] == 2 and not verdict["torch"], err
    assert err.splitlines() == [f"error: {missing}: {what}"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["there.safetensors"]  # nothing written


@pytest.mark.parametrize("args, message", [
    (["convert", "x", "--to", "fp16", "--report", "{d}/no/r.json"], "--report {d}/no/r.json: folder {d}/no does not exist"),
    (["lora", "convert", "x"], "ckpt lora convert: Missing option '--format'. Choose from: kohya, peft, diffusers, comfy, gguf"),
])
def test_usage_errors_before_torch(tmp_path, args, message):
    verdict, err = run_fresh(*[a.format(d=tmp_path) for a in args])
    assert verdict["code"] == 2 and not verdict["torch"], err
    assert err.splitlines() == ["error: " + message.format(d=tmp_path)], err


def _inputs(root):
    """One of each input kind `ckpt inspect` reads from headers alone (built here, where torch is loaded)."""
    import numpy as np
    import torch
    from gguf import GGMLQuantizationType as T
    from safetensors.torch import save_file

    from gguf_helpers import quantized, write_gguf

    save_file({"a.weight": torch.randn(300, 250), "b.weight": torch.randn(10).half()}, root / "mixed.safetensors",
              metadata={"ss_network_module": "networks.lora"})
    save_file({"a.weight": torch.randn(8, 8).to(torch.float8_e4m3fn), "a.bias": torch.randn(8)},
              root / "fp8.safetensors")
    shard = root / "sharded"
    shard.mkdir()
    save_file({"a.weight": torch.randn(8, 8)}, shard / "model-00001-of-00002.safetensors")
    save_file({"b.weight": torch.randn(8, 8).half()}, shard / "model-00002-of-00002.safetensors")
    (shard / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": 384}, "weight_map": {
        "a.weight": "model-00001-of-00002.safetensors", "b.weight": "model-00002-of-00002.safetensors"}}))
    pipe = root / "pipeline"
    for sub, cls, key in (("unet", "UNet2DConditionModel", "conv_in.weight"),
                          ("vae", "AutoencoderKL", "encoder.conv_in.weight")):
        (pipe / sub).mkdir(parents=True)
        save_file({key: torch.randn(4, 4, 3, 3)}, pipe / sub / "diffusion_pytorch_model.safetensors")
        (pipe / sub / "config.json").write_text(json.dumps({"_class_name": cls}))
    (pipe / "model_index.json").write_text(json.dumps({"_class_name": "StableDiffusionPipeline"}))
    q, _ = quantized(np.random.randn(64, 64).astype(np.float32), T.Q8_0)
    write_gguf(root / "flux.gguf", "flux", {"double_blocks.0.img_attn.qkv.weight": (q, T.Q8_0),
                                            "img_in.bias": np.zeros(64, np.float32)})
    from helpers.llm import tiny
    from gguf_helpers import hf_to_gguf

    hf_to_gguf(tiny("llama"), "llama", root / "llm.gguf", qtype=T.Q8_0, permute=True)
    return ["mixed.safetensors", "fp8.safetensors", "sharded", "sharded/model.safetensors.index.json", "pipeline",
            "flux.gguf", "llm.gguf"]


def test_inspect_of_headers_imports_no_torch(tmp_path, run_ckpt, monkeypatch):
    """safetensors (any dtype, sharded, diffusers folders) and GGUF: the same report as an in-process run
    (where torch is loaded), from a process that never imports torch."""
    monkeypatch.chdir(tmp_path)  # the report names SRC as given: both runs are given the same
    for name in _inputs(tmp_path):
        verdict, err = run_fresh("inspect", name, "--json", "--report", "r.json", cwd=tmp_path)
        assert verdict["code"] == 0 and not verdict["torch"], (name, err)
        fresh = json.loads((tmp_path / "r.json").read_text())
        code, out, _ = run_ckpt("inspect", name, "--json")
        assert code == 0
        expected = json.loads(out)
        assert fresh["inspect"]["components"] == expected["components"], name
        assert fresh["inspect"]["warnings"] == expected["warnings"] and fresh["inspect"]["totals"] == expected["totals"]


def test_bad_header_is_one_line_before_torch(tmp_path):
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes((8).to_bytes(8, "little") + b"not json")
    verdict, err = run_fresh("convert", bad, "--to", "fp16")
    assert verdict["code"] == 2, err
    assert err.splitlines() == [f"error: {bad}: header is not valid JSON (Expecting value: line 1 column 1 (char 0))"]
    verdict, err = run_fresh("inspect", bad)
    assert verdict == {"code": 2, "torch": False, "numpy": False}, err


def test_layout_conversion_imports_no_torch(tmp_path, run_ckpt):
    """A layout conversion changes no byte (every tensor is a stored range, `ckpt.io.byte_copy`): both ways,
    with the single-file prefix, it runs without torch and writes what an in-process run writes."""
    pytest.importorskip("diffusers")
    from families_util import flux2_bf16_original

    flux2_bf16_original(tmp_path / "f2.safetensors", prefix="model.diffusion_model.")
    steps = [("f2.safetensors", "diffusers", "dif"), ("ref/dif", "original", "back.safetensors")]
    for src, layout, out in steps:
        verdict, err = run_fresh("convert", tmp_path / src, "--layout", layout, "-o", tmp_path / "fresh" / out)
        assert verdict == {"code": 0, "torch": False, "numpy": False}, err
        code, _, err = run_ckpt("convert", tmp_path / src, "--layout", layout, "-o", tmp_path / "ref" / out, "-q")
        assert code == 0, err
    for p in sorted((tmp_path / "ref").rglob("*")):
        if p.is_file():
            assert (tmp_path / "fresh" / p.relative_to(tmp_path / "ref")).read_bytes() == p.read_bytes(), p


def test_a_cast_to_the_dtype_a_file_already_has_imports_no_torch(tmp_path, run_ckpt):
    """`--to bf16` of a file already in bf16 (integer buffers beside): nothing is cast, every tensor copied."""
    import torch
    from safetensors.torch import save_file

    save_file({"a.weight": torch.randn(64, 32).bfloat16(), "ids": torch.arange(5)}, tmp_path / "m.safetensors")
    verdict, err = run_fresh("convert", tmp_path / "m.safetensors", "--to", "bf16", "-o", tmp_path / "fresh.safetensors")
    assert verdict == {"code": 0, "torch": False, "numpy": False}, err
    code, _, err = run_ckpt("convert", tmp_path / "m.safetensors", "--to", "bf16", "-o", tmp_path / "ref.safetensors")
    assert code == 0, err
    assert (tmp_path / "fresh.safetensors").read_bytes() == (tmp_path / "ref.safetensors").read_bytes()
