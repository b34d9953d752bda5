"""Byte-for-byte comparison of what two checkouts of ckpt write, for refactors that must not change behaviour.

    python scripts/compare_outputs.py BASELINE_COMMIT [--workdir DIR] [--keep]

Builds a set of tiny inputs once (a Flux.1 transformer in both layouts, a plain fp32 file, a sharded model
folder, a quanto checkpoint, a kohya LoRA, a PEFT LoRA for an LLM-shaped model, tiny Llamas to merge, a GPTQ
folder, a Llama folder with a tokenizer and its GGUF, PEFT LoRAs for those), then runs the same
representative commands (every convert target, --layout both ways, dequant, merge-lora plain, --keep-format and
to GGUF, ckpt merge in every output mode, the four lora commands, HF LLM -> GGUF and back, batch, inspect --json) with the BASELINE checkout (a `git worktree` of the
commit, made and removed here) and with this checkout, each in a fresh folder, and compares exit codes,
stdout/stderr (paths normalised) and every output file byte for byte. Prints one line per command and
exits 1 on any difference. Needs the test extras (diffusers, optimum-quanto) to build the inputs.
"""

from __future__ import annotations

import argparse
import filecmp
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# (name, argv after `ckpt`); inputs are named relative to the run folder, outputs land in it
COMMANDS = [
    ("convert fp16", ["convert", "in/plain.safetensors", "--to", "fp16", "-o", "out.safetensors"]),
    ("convert bf16 torch", ["convert", "in/plain.safetensors", "--to", "bf16", "--format", "torch", "-o", "out.pth"]),
    ("convert fp8 scaled", ["convert", "in/plain.safetensors", "--to", "fp8_e4m3fn", "--scaled", "-o", "out.safetensors"]),
    ("convert nvfp4", ["convert", "in/flux1.safetensors", "--to", "nvfp4", "-o", "out.safetensors"]),
    ("convert mxfp8", ["convert", "in/flux1.safetensors", "--to", "mxfp8", "-o", "out.safetensors"]),
    ("convert int8_rowwise", ["convert", "in/flux1.safetensors", "--to", "int8_rowwise", "-o", "out.safetensors"]),
    ("convert gguf-q8_0", ["convert", "in/flux1.safetensors", "--to", "gguf-q8_0", "-o", "out.gguf"]),
    ("convert gguf-q4_0", ["convert", "in/flux1.safetensors", "--to", "gguf-q4_0", "-o", "out.gguf"]),
    ("convert folder resharded", ["convert", "in/sharded", "--to", "bf16", "--max-shard-size", "4KB", "-o", "out"]),
    ("convert folder torch", ["convert", "in/sharded", "--to", "fp16", "--format", "torch", "-o", "out"]),
    ("layout diffusers", ["convert", "in/flux1.safetensors", "--layout", "diffusers", "--config",
                          "in/flux1-diffusers", "-o", "out"]),
    ("layout diffusers refused", ["convert", "in/flux1.safetensors", "--layout", "diffusers", "-o", "out"]),
    ("layout original", ["convert", "in/flux1-diffusers", "--layout", "original", "-o", "out.safetensors"]),
    ("layout original nvfp4", ["convert", "in/flux1-diffusers", "--layout", "original", "--to", "nvfp4",
                               "-o", "out.safetensors"]),
    ("convert fp8 back", ["convert", "in/flux1-fp8.safetensors", "--to", "bf16", "-o", "out.safetensors"]),
    ("dequant quanto", ["dequant", "in/quanto", "-o", "out"]),
    ("merge-lora kohya", ["merge-lora", "in/flux1.safetensors", "in/kohya.safetensors", "--ratio", "0.7",
                          "-o", "out.safetensors"]),
    ("merge-lora diffusers base", ["merge-lora", "in/flux1-diffusers", "in/kohya.safetensors", "-o", "out"]),
    ("merge-lora keep gguf", ["merge-lora", "in/flux1-q8_0.gguf", "in/kohya.safetensors", "--keep-format",
                              "-o", "out.gguf"]),
    ("merge-lora keep fp8", ["merge-lora", "in/flux1-fp8.safetensors", "in/kohya.safetensors", "--keep-format",
                             "-o", "out.safetensors"]),
    ("merge-lora peft llm", ["merge-lora", "in/llm", "in/peft", "--to", "bf16", "-o", "out"]),
    ("lora extract", ["lora", "extract", "in/flux1.safetensors", "in/flux1-tuned.safetensors", "--rank", "4",
                      "-o", "out.safetensors"]),
    ("lora extract diffusers", ["lora", "extract", "in/flux1.safetensors", "in/flux1-tuned.safetensors", "--rank",
                                "4", "--format", "diffusers", "-o", "out.safetensors"]),
    ("lora resize", ["lora", "resize", "in/kohya.safetensors", "--rank", "2", "-o", "out.safetensors"]),
    ("lora merge concat", ["lora", "merge", "in/kohya.safetensors", "in/kohya.safetensors", "--ratio", "0.5",
                           "--ratio", "0.25", "-o", "out.safetensors"]),
    ("lora merge svd", ["lora", "merge", "in/kohya.safetensors", "in/kohya.safetensors", "--svd", "--rank", "3",
                        "-o", "out.safetensors"]),
    ("lora convert diffusers", ["lora", "convert", "in/kohya.safetensors", "--format", "diffusers",
                                "--base", "in/flux1.safetensors", "-o", "out.safetensors"]),
    ("bad input", ["convert", "in/kohya.safetensors", "--layout", "diffusers", "-o", "out"]),
    ("lora convert peft", ["lora", "convert", "in/kohya.safetensors", "--format", "peft",
                           "--base", "in/flux1-diffusers", "-o", "out"]),
    ("inspect json", ["inspect", "in/flux1-fp8.safetensors", "--json"]),
    ("inspect gguf", ["inspect", "in/flux1-q8_0.gguf"]),
    # ckpt merge: plain, a method with statistics, the reference's encoding kept, the other layout, flags
    ("merge linear", ["merge", "in/merge-linear.yaml", "-o", "out"]),
    ("merge ties bf16", ["merge", "in/merge-ties.yaml", "--to", "bf16", "-o", "out"]),
    ("merge flags fp8 keep", ["merge", "in/flux1-fp8.safetensors", "in/flux1-tuned.safetensors", "--alpha", "0.3",
                              "--keep-format", "-o", "out.safetensors"]),
    ("merge flags layout", ["merge", "in/flux1.safetensors", "in/flux1-tuned.safetensors", "--alpha", "0.3",
                            "--layout", "diffusers", "--config", "in/flux1-diffusers", "-o", "out"]),
    ("merge gguf keep", ["merge", "in/flux1-q8_0.gguf", "in/flux1-tuned.safetensors", "--keep-format",
                         "-o", "out.gguf"]),
    # quantized LLMs: decode, inspect, keep-format merge; HF LLM folders to GGUF and back
    ("dequant gptq", ["dequant", "in/gptq", "-o", "out"]),
    ("dequant gptq fp32", ["dequant", "in/gptq", "--to", "fp32", "-o", "out"]),
    ("dequant comfy nvfp4", ["dequant", "in/flux1-nvfp4.safetensors", "-o", "out.safetensors"]),
    ("inspect gptq", ["inspect", "in/gptq", "--json"]),
    ("convert gptq bf16", ["convert", "in/gptq", "--to", "bf16", "-o", "out"]),
    ("merge-lora gptq keep", ["merge-lora", "in/gptq", "in/peft-gptq", "--keep-format", "-o", "out"]),
    ("merge-lora gptq plain", ["merge-lora", "in/gptq", "in/peft-gptq", "-o", "out"]),
    ("convert llm gguf q4_k_m", ["convert", "in/llama", "--to", "gguf-q4_k_m", "-o", "out.gguf"]),
    ("convert llm gguf f16 split", ["convert", "in/llama", "--to", "gguf-f16", "--max-shard-size", "200KB",
                                    "-o", "out.gguf"]),
    ("merge-lora llm gguf", ["merge-lora", "in/llama", "in/peft-llama", "--to", "gguf-q8_0", "-o", "out.gguf"]),
    ("convert gguf back", ["convert", "in/llama-f16.gguf", "--to", "bf16", "-o", "out"]),
    ("batch convert", ["batch", "convert", "in/sharded", "--to", "fp16", "-o", "out"]),
    ("refused dequant gguf -o", ["dequant", "in/gptq", "-o", "out.gguf"]),
    ("refused lora gguf -o", ["lora", "resize", "in/kohya.safetensors", "--rank", "2", "-o", "out.gguf"]),
    ("merge to nvfp4", ["merge", "in/flux1.safetensors", "in/flux1-tuned.safetensors", "--alpha", "0.3", "--to",
                        "nvfp4", "-o", "out.safetensors"]),
    ("merge to gguf", ["merge", "in/merge-linear.yaml", "--to", "gguf-q4_k_m", "-o", "out.gguf"]),
    ("dequant to gguf", ["dequant", "in/flux1-nvfp4.safetensors", "--to", "gguf-q8_0", "-o", "out.gguf"]),
]


def build_inputs(d: Path, ckpt_python: str, checkout: Path) -> None:
    """The tiny inputs, made with the test helpers (diffusers models) and this checkout's ckpt."""
    sys.path.insert(0, str(REPO / "tests"))
    import torch
    from safetensors.torch import save_file
    from huggingface_hub import save_torch_state_dict

    from families_util import original_from_pairs, state_dict, tiny_flux1
    from ckpt.families import get

    d.mkdir(parents=True)
    g = torch.Generator().manual_seed(0)
    save_file({f"w{i}": torch.randn(64, 32, generator=g) * 10 ** (i - 2) for i in range(4)} | {"b": torch.randn(32)},
              d / "plain.safetensors")
    torch.manual_seed(0)
    model = tiny_flux1()
    diffusers_sd = state_dict(model)
    original = original_from_pairs(get("flux1"), diffusers_sd)
    save_file(original, d / "flux1.safetensors")
    model.save_pretrained(d / "flux1-diffusers")
    tuned = {k: v + 0.01 * torch.randn(v.shape, generator=g) if v.ndim == 2 else v for k, v in original.items()}
    save_file(tuned, d / "flux1-tuned.safetensors")
    lora = {}
    for m, k in [("lora_unet_double_blocks_0_img_attn_qkv", "double_blocks.0.img_attn.qkv.weight"),
                 ("lora_unet_single_blocks_1_linear2", "single_blocks.1.linear2.weight")]:
        out_f, in_f = original[k].shape
        lora[f"{m}.lora_down.weight"] = torch.randn(4, in_f, generator=g) * 0.1
        lora[f"{m}.lora_up.weight"] = torch.randn(out_f, 4, generator=g) * 0.1
        lora[f"{m}.alpha"] = torch.tensor(2.0)
    save_file(lora, d / "kohya.safetensors")
    (d / "sharded").mkdir()
    save_torch_state_dict({f"l{i}.weight": torch.randn(16, 16, generator=g) for i in range(6)}, d / "sharded",
                          max_shard_size=3000)
    (d / "sharded" / "config.json").write_text("{}")

    from optimum.quanto import freeze, qint8, quantization_map, quantize

    lin = torch.nn.Sequential(torch.nn.Linear(32, 16), torch.nn.Linear(16, 8))
    quantize(lin, weights=qint8)
    freeze(lin)
    (d / "quanto").mkdir()
    save_file(lin.state_dict(), d / "quanto" / "diffusion_pytorch_model.safetensors")
    (d / "quanto" / "quanto_qmap.json").write_text(json.dumps(quantization_map(lin)))
    (d / "quanto" / "config.json").write_text("{}")

    (d / "llm").mkdir()
    save_file({f"model.layers.0.self_attn.{p}_proj.weight": torch.randn(16, 16, generator=g) for p in "qkvo"},
              d / "llm" / "model.safetensors")
    (d / "llm" / "config.json").write_text("{}")
    (d / "peft").mkdir()
    save_file({"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.randn(2, 16, generator=g),
               "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": torch.randn(16, 2, generator=g)},
              d / "peft" / "adapter_model.safetensors")
    (d / "peft" / "adapter_config.json").write_text(json.dumps({"r": 2, "lora_alpha": 4, "peft_type": "LORA"}))

    from helpers import gptq_base, hf_llm
    from helpers.merge_oracle import variants

    ms = variants(d / "llms", 3)
    (d / "merge-linear.yaml").write_text(f"merge_method: linear\nmodels:\n  - model: {ms[1]}\n    parameters: "
                                         f"{{weight: 0.7}}\n  - model: {ms[2]}\n    parameters: {{weight: 0.3}}\n"
                                         "dtype: float32\n")
    (d / "merge-ties.yaml").write_text(f"merge_method: ties\nbase_model: {ms[0]}\nmodels:\n  - model: {ms[1]}\n"
                                       f"    parameters: {{weight: 1, density: 0.5}}\n  - model: {ms[2]}\n"
                                       "    parameters: {weight: 1, density: 0.5}\ndtype: float32\n")
    gptq_base.build(d / "gptq", bits=4, group=32)
    hf_llm.model_folder(d / "llama", "llama")
    for name, folder in (("peft-gptq", d / "gptq"), ("peft-llama", d / "llama")):
        cfg = json.loads((folder / "config.json").read_text())
        h = cfg["hidden_size"]
        (d / name).mkdir()
        save_file({f"base_model.model.model.layers.0.self_attn.{p}_proj.lora_{ab}.weight":
                   torch.randn(*((2, h) if ab == "A" else (h if p == "q" else cfg.get("num_key_value_heads",
                               cfg["num_attention_heads"]) * (h // cfg["num_attention_heads"]), 2)),
                               generator=g) * 0.05
                   for p in "qv" for ab in "AB"}, d / name / "adapter_model.safetensors")
        (d / name / "adapter_config.json").write_text(json.dumps({"r": 2, "lora_alpha": 4, "peft_type": "LORA",
                                                                  "target_modules": ["q_proj", "v_proj"]}))

    env = {**os.environ, "PYTHONPATH": str(checkout)}
    for argv, name in ((["convert", "flux1.safetensors", "--to", "fp8_e4m3fn", "--scaled", "-o",
                         "flux1-fp8.safetensors", "-q"], "fp8"),
                       (["convert", "flux1.safetensors", "--to", "gguf-q8_0", "-o", "flux1-q8_0.gguf", "-q"], "gguf"),
                       (["convert", "flux1.safetensors", "--to", "nvfp4", "-o", "flux1-nvfp4.safetensors", "-q"],
                        "nvfp4"),
                       (["convert", "llama", "--to", "gguf-f16", "-o", "llama-f16.gguf", "-q"], "llm gguf")):
        r = subprocess.run([ckpt_python, "-m", "ckpt.cli", *argv], cwd=d, env=env, capture_output=True, text=True)
        if r.returncode:
            raise SystemExit(f"building the {name} input failed: {r.stderr.strip()}")


def run(checkout: Path, python: str, inputs: Path, work: Path, argv: list[str]) -> tuple:
    work.mkdir(parents=True)
    (work / "in").symlink_to(inputs)
    env = {**os.environ, "PYTHONPATH": str(checkout), "HF_HUB_OFFLINE": "1"}
    r = subprocess.run([python, "-m", "ckpt.cli", *argv, *(["-q"] if argv[0] != "inspect" else [])], cwd=work,
                       env=env, capture_output=True, text=True, timeout=600)
    norm = lambda s: s.replace(str(work), "RUN").replace(str(inputs), "IN")  # noqa: E731
    return r.returncode, norm(r.stdout), norm(r.stderr)


def same_tree(a: Path, b: Path) -> list[str]:
    """Relative paths that differ (content, or present on one side only), `in` excluded."""
    def files(root):
        return {p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file() and "in" != p.relative_to(root).parts[0]}
    fa, fb = files(a), files(b)
    diff = sorted(fa ^ fb)
    diff += [f for f in sorted(fa & fb) if not (filecmp.cmp(a / f, b / f, shallow=False) or _same_manifest(a / f, b / f))]
    return diff


VOLATILE = ("finished", "seconds", "started_ns", "mtime_ns", "input", "output")  # when and where a batch job ran


def _same_manifest(a: Path, b: Path) -> bool:
    """Two batch manifests (`ckpt-batch.jsonl`) that record the same jobs, times and run folders aside."""
    if a.name != "ckpt-batch.jsonl":
        return False
    def jobs(p):
        return [{k: v for k, v in json.loads(line).items() if k not in VOLATILE} | {
                 "input": Path(json.loads(line)["input"]).name, "output": Path(json.loads(line)["output"] or "").name}
                for line in p.read_text().splitlines()]
    return jobs(a) == jobs(b)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("baseline", help="the commit whose outputs are the reference (e.g. the commit before a refactor)")
    ap.add_argument("--workdir", type=Path, help="where inputs and outputs go (default: a temp folder)")
    ap.add_argument("--keep", action="store_true", help="keep the work folder")
    args = ap.parse_args()
    work = args.workdir or Path(tempfile.mkdtemp(prefix="ckpt-compare-"))
    work.mkdir(parents=True, exist_ok=True)
    base = work / "baseline-checkout"
    subprocess.run(["git", "-C", str(REPO), "worktree", "add", "-q", "--detach", str(base), args.baseline], check=True)
    failures = 0
    try:
        inputs = work / "inputs"
        build_inputs(inputs, sys.executable, REPO)
        for name, argv in COMMANDS:
            slug = name.replace(" ", "_")
            ra = run(base, sys.executable, inputs, work / "a" / slug, argv)
            rb = run(REPO, sys.executable, inputs, work / "b" / slug, argv)
            problems = []
            if ra[0] != rb[0]:
                problems.append(f"exit {ra[0]} vs {rb[0]}")
            if ra[1:] != rb[1:]:
                problems.append("messages differ")
            problems += [f"{f} differs" for f in same_tree(work / "a" / slug, work / "b" / slug)]
            status = "same" if not problems else "DIFFERENT: " + "; ".join(problems[:5])
            failures += bool(problems)
            print(f"{name:28s} exit {rb[0]}  {status}")
            if problems and ra[1:] != rb[1:]:
                print(f"    baseline stderr: {ra[2].strip()[:300]}\n    this     stderr: {rb[2].strip()[:300]}")
    finally:
        subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(base)], check=False)
        if not args.keep and not args.workdir:
            shutil.rmtree(work, ignore_errors=True)
    print(f"{len(COMMANDS) - failures} of {len(COMMANDS)} commands write the same bytes and messages")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
