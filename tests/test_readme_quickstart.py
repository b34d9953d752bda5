"""README's quick start runs as written: each `ckpt ...` line of its first code block, in order, in one
folder holding tiny files with the names it uses (a Flux.1 transformer in its original layout, the same
in plain fp8, a kohya LoRA for it, a quanto training checkpoint), exits 0 and writes what its comment says.
A tiny Mistral folder with a SentencePiece tokenizer stands for the LLM. Oracles: torch's fp8 -> bf16 cast, gguf's
reader, the kohya merge formula W + (alpha / rank) * up @ down,
optimum-quanto's `.dequantize()`."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from families_util import original_from_pairs, state_dict, tiny_flux1

REPO = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.slow


def quick_start_lines() -> list[str]:
    text = (REPO / "README.md").read_text()
    block = re.search(r"## Quick start\n\n```bash\n(.*?)```", text, re.S)
    assert block, "README has a Quick start code block"
    return [line.split("  #")[0].strip() for line in block[1].splitlines() if line.startswith("ckpt ")]


def make_inputs(d: Path) -> dict:
    from ckpt.families import get

    torch.manual_seed(0)
    original = original_from_pairs(get("flux1"), state_dict(tiny_flux1()))
    save_file(original, d / "flux1-dev.safetensors")
    fp8 = {k: v.to(torch.float8_e4m3fn) if v.ndim == 2 else v for k, v in original.items()}
    save_file(fp8, d / "flux1-dev-fp8.safetensors")
    w = original["double_blocks.0.img_attn.proj.weight"]
    down, up = torch.randn(16, w.shape[1]) * 0.1, torch.randn(w.shape[0], 16) * 0.1
    m = "lora_unet_double_blocks_0_img_attn_proj"
    save_file({f"{m}.lora_down.weight": down, f"{m}.lora_up.weight": up, f"{m}.alpha": torch.tensor(8.0)},
              d / "my_lora.safetensors")

    from optimum.quanto import freeze, qint8, quantization_map, quantize

    lin = torch.nn.Sequential(torch.nn.Linear(32, 16))
    quantize(lin, weights=qint8)
    freeze(lin)
    ck = d / "checkpoint-4000"
    ck.mkdir()
    save_file(lin.state_dict(), ck / "diffusion_pytorch_model.safetensors")
    (ck / "quanto_qmap.json").write_text(json.dumps(quantization_map(lin)))
    (ck / "config.json").write_text("{}")

    from helpers.hf_llm import model_folder

    model_folder(d / "Mistral-7B-v0.3", "mistral")  # tiny, with a SentencePiece tokenizer trained in the test
    return {"original": original, "fp8": fp8, "delta": 0.5 * up @ down, "quanto": lin[0].weight.dequantize()}


def test_quick_start_runs_as_written(tmp_path):
    want = make_inputs(tmp_path)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    lines = quick_start_lines()
    assert len(lines) >= 5
    for line in lines:
        args = shlex.split(line)[1:]
        r = subprocess.run([sys.executable, "-m", "ckpt.cli", *args], cwd=tmp_path, env=env, capture_output=True,
                           text=True, timeout=300)
        assert r.returncode == 0, (line, r.stderr)
    got = load_file(tmp_path / "flux1-dev-fp8-bf16.safetensors")
    assert all(torch.equal(got[k], v.to(torch.bfloat16)) for k, v in want["fp8"].items())

    import gguf

    names = {t.name for t in gguf.GGUFReader(tmp_path / "flux1-dev-Q4_K_M.gguf").tensors}
    assert names == set(want["original"])
    llm = gguf.GGUFReader(tmp_path / "Mistral-7B-v0.3-Q4_K_M.gguf")
    assert llm.fields["general.architecture"].contents() == "llama"
    assert llm.fields["general.file_type"].contents() == gguf.LlamaFileType.MOSTLY_Q4_K_M
    assert "tokenizer.ggml.tokens" in llm.fields
    merged = load_file(tmp_path / "flux1-dev-merged.safetensors")
    k = "double_blocks.0.img_attn.proj.weight"
    torch.testing.assert_close(merged[k], want["original"][k] + want["delta"], rtol=0, atol=1e-6)
    blend = load_file(tmp_path / "flux1-dev-weighted_sum.safetensors")
    assert all(torch.equal(blend[k], torch.lerp(v, want["fp8"][k].float(), torch.tensor(0.3)))
               for k, v in want["original"].items())
    resized = load_file(tmp_path / "my_lora-resized.safetensors")
    assert resized["lora_unet_double_blocks_0_img_attn_proj.lora_down.weight"].shape[0] == 8
    plain = load_file(tmp_path / "dequant-checkpoint-4000" / "diffusion_pytorch_model.safetensors")
    assert torch.equal(plain["0.weight"], want["quanto"])
