"""merge-lora plans without torch, so the kernel copies of untouched tensors start while torch imports.

What planning used to read through torch is read from the stored bytes instead: a LoRA's alpha
(`ckpt.io.scalars.first_float`) and whether a factor is all zero (`ckpt.io.stored_scan.all_zero`). Oracle: torch
itself, doing what the old path did (`float(t.float().reshape(-1)[0])`, `x.any()`), on values chosen to hit the
edges (-0.0, subnormals, NaN, Inf, the largest finite values), F32, F16 and BF16; other dtypes are left to torch
(None). Then the command: in a fresh interpreter, with torch's import held back on its prefetch thread
(`ckpt.lazy.prefetch`) until the early copies' thread exists, merge-lora completes with the same bytes as a
run where everything goes through one stream after torch (`early_copies.ENABLED = False`): for a one-file base,
model folders with config.json (transformers, sharded with an index; diffusers), `--to bf16` on a folder (its
config.json's dtype planned by name), `--device auto` (the CPU without torch where torch has no GPU backend), and
`ckpt merge` (dtype names in its jobs and default target; a copied integer buffer gives it early copies). Planning
alone (`--dry-run`, the prefetch thread emptied) imports no torch at all in every such case (and `convert --to` of
such a folder). `--device cuda` is resolved after planning (asking imports torch): refused there on a machine
without CUDA, nothing written; with CUDA, the same bytes as the stream run.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import save_file

from ckpt.devices import gpu_backend_named, torch_has_gpu_backend
from ckpt.io.checkpoint import open_checkpoint
from ckpt.io.scalars import first_float
from ckpt.io.stored_scan import all_zero
from helpers.refusals import assert_refused
from helpers.torch_free import run_fresh

EDGES = [0.0, -0.0, 1.0, -2.5, 16.0, 0.1, 1e-40, -1e-42, 6e-8, 3.4e38, 65504.0, 1e-5,
         float("inf"), float("-inf"), float("nan")]


def _stored(tmp_path, sd):
    from ckpt.quant.view import logical_view

    save_file(sd, str(tmp_path / "t.safetensors"))
    ckpt = open_checkpoint(str(tmp_path / "t.safetensors"))
    return ckpt, logical_view(ckpt.components[0]).tensors


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_first_float_is_what_torch_reads(tmp_path, dtype):
    sd = {f"a{i}": torch.tensor([v, 7.0], dtype=torch.float32).to(dtype) for i, v in enumerate(EDGES)}
    sd["scalar"] = torch.tensor(0.3, dtype=dtype)  # 0-d: an alpha as kohya stores it
    ckpt, tensors = _stored(tmp_path, sd)
    try:
        for name, x in sd.items():
            want = float(x.float().reshape(-1)[0])
            got = first_float(tensors[name])
            assert got is not None
            assert (got == want or (got != got and want != want)) and str(got) == str(want), name
    finally:
        ckpt.close()


@pytest.mark.parametrize("dtype", [torch.float64, torch.int8, torch.float8_e4m3fn])
def test_other_dtypes_are_left_to_torch(tmp_path, dtype):
    ckpt, tensors = _stored(tmp_path, {"a": torch.ones(3).to(dtype), "z": torch.zeros(3).to(dtype)})
    try:
        assert first_float(tensors["a"]) is None and all_zero(tensors["z"]) is None
    finally:
        ckpt.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_all_zero_is_what_torch_says(tmp_path, dtype):
    cases = {"zeros": torch.zeros(5, 3), "negzeros": -torch.zeros(5, 3), "empty": torch.zeros(0, 3)}
    for i, v in enumerate(EDGES):
        x = torch.zeros(5, 3)
        x[4, 2] = v
        cases[f"one{i}"] = x
    sd = {k: v.to(dtype) for k, v in cases.items()}
    ckpt, tensors = _stored(tmp_path, sd)
    try:
        for name, x in sd.items():
            assert all_zero(tensors[name]) == (not bool(x.any())), name
    finally:
        ckpt.close()


PROBE = """
import json, sys, threading
import ckpt.lazy as lazy
import ckpt.io.early_copies as early_copies

early_copies.MIN_BYTES = 4096
early_copies.ENABLED = sys.argv[1] != "stream"  # "unheld": early copies, torch not held back
seen = {}
started = threading.Event()
_import, _run = lazy._import_quietly, early_copies.EarlyCopies._run


def run(self):  # the copies' thread
    started.set()
    _run(self)


def held(name):  # torch's import waits for the copies' thread: they cannot need torch to start
    if sys.argv[1] == "early" and started.wait(20):
        seen["copies_before_torch"] = True
    _import(name)


early_copies.EarlyCopies._run = run
lazy._import_quietly = held
from ckpt.cli import main
try:
    main(sys.argv[2:])
    code = 0
except SystemExit as e:
    code = e.code
print(json.dumps({"code": code, **seen}))
"""


def _probe(tmp_path, argv: list, out, expect_early: bool = True) -> None:
    """Run `ckpt ARGV -o OUT` twice under the PROBE: early copies with torch held back (they must start first;
    `expect_early` False: not held, where the device check needs torch first), then in one stream; same bytes."""
    outs = {}
    for mode in ("early" if expect_early else "unheld", "stream"):
        o = tmp_path / f"{mode}-{out}"
        p = subprocess.run([sys.executable, "-c", PROBE, mode, *map(str, argv), "-o", o, "-q"], capture_output=True,
                           text=True, timeout=300)
        verdict = json.loads(p.stdout.strip().splitlines()[-1])
        assert verdict["code"] == 0, p.stderr
        if mode == "early":
            assert verdict.get("copies_before_torch"), p.stderr
        outs[mode] = {f.relative_to(o).as_posix(): f.read_bytes() for f in ([o] if o.is_file() else o.rglob("*"))
                      if f.is_file()}
    assert outs["early" if expect_early else "unheld"] == outs["stream"]


def _file_base(folder):
    g = torch.Generator().manual_seed(0)
    base = {"blocks.0.attn.qkv.weight": torch.randn(96, 64, generator=g).bfloat16(),
            "blocks.0.mlp.fc1.weight": torch.randn(300, 128, generator=g).bfloat16(),  # 77 kB: copied
            "blocks.0.mlp.fc2.weight": torch.randn(128, 300, generator=g).bfloat16()}
    save_file(base, str(folder / "base.safetensors"))
    lora = {"lora_unet_blocks_0_attn_qkv.lora_down.weight": torch.randn(4, 64, generator=g).bfloat16(),
            "lora_unet_blocks_0_attn_qkv.lora_up.weight": torch.randn(96, 4, generator=g).bfloat16(),
            "lora_unet_blocks_0_attn_qkv.alpha": torch.tensor(3.0).bfloat16()}
    save_file(lora, str(folder / "lora.safetensors"))
    return folder / "base.safetensors", folder / "lora.safetensors"


def test_copies_start_before_torch_is_imported(tmp_path):
    _probe(tmp_path, ["merge-lora", *_file_base(tmp_path)], "out.safetensors")


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    """The bases and adapters of the cases below, built once: a one-file base with a kohya LoRA, a transformers
    Llama folder (bf16, config.json, three shards and an index) with a PEFT LoRA (and a second such folder to merge
    with), a diffusers UNet folder with a kohya LoRA, an original-layout Flux.2 file with a kohya LoRA on a fused
    qkv, and two one-file models with an int64 buffer (`ckpt merge`
    copies the reference's: early copies)."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    d = tmp_path_factory.mktemp("inputs")
    _file_base(d)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2)
    for name in ("llm", "llm_b"):
        LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(d / name, max_shard_size="150KB")
    assert len(list((d / "llm").glob("*.safetensors"))) > 1 and (d / "llm" / "model.safetensors.index.json").exists()
    peft = get_peft_model(LlamaForCausalLM(cfg), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                           init_lora_weights=False))
    peft.save_pretrained(d / "peft")

    import families_util as fu

    unet = fu.tiny_unet().to(torch.bfloat16)
    unet.save_pretrained(d / "unet")
    g = torch.Generator().manual_seed(1)
    lora = {}
    for k, v in unet.state_dict().items():
        if k.endswith(("attn1.to_q.weight", "attn2.to_k.weight")):
            m = "lora_unet_" + k[: -len(".weight")].replace(".", "_")
            lora[m + ".lora_down.weight"] = torch.randn(4, v.shape[1], generator=g).half()
            lora[m + ".lora_up.weight"] = torch.randn(v.shape[0], 4, generator=g).half()
            lora[m + ".alpha"] = torch.tensor(2.0).half()
    save_file(lora, str(d / "unet_lora.safetensors"))
    _, flux2 = fu.flux2_bf16_original(path=d / "flux2.safetensors")
    qkv = "double_blocks.0.img_attn.qkv.weight"
    m = "lora_unet_" + qkv[: -len(".weight")].replace(".", "_")
    save_file({m + ".lora_down.weight": torch.randn(4, flux2[qkv].shape[1], generator=g).half(),
               m + ".lora_up.weight": torch.randn(flux2[qkv].shape[0], 4, generator=g).half(),
               m + ".alpha": torch.tensor(2.0).half()}, str(d / "flux2_lora.safetensors"))

    for name in ("a", "b"):
        save_file({"pos_ids": torch.arange(4096), "w1": torch.randn(96, 64, generator=g).bfloat16(),
                   "w2": torch.randn(300, 128, generator=g).bfloat16()}, str(d / f"{name}.safetensors"))
    for method, params in (("ties", "{weight: 0.5, density: 0.5}"), ("dare_ties", "{weight: 0.5, density: 0.5}")):
        (d / f"{method}.yaml").write_text(f"merge_method: {method}\nbase_model: {d / 'llm'}\nmodels:\n"
                                          f"  - model: {d / 'llm'}\n  - model: {d / 'llm_b'}\n    parameters: {params}\n"
                                          "dtype: bfloat16\n")
    (d / "slices.yaml").write_text(f"merge_method: passthrough\nslices:\n"
                                   f"  - sources: [{{model: {d / 'llm'}, layer_range: [0, 2]}}]\n"
                                   f"  - sources: [{{model: {d / 'llm_b'}, layer_range: [1, 2]}}]\n")
    return d


GPU_BUILD = torch_has_gpu_backend()  # `--device auto` is the CPU without torch only where torch has no GPU backend

PROBED = {  # id: (argv with {d} the inputs folder, output name, copies start before torch); a file: the test above
    "hf-folder": (["merge-lora", "{d}/llm", "{d}/peft"], "out", True),
    "hf-folder-to-bf16": (["merge-lora", "{d}/llm", "{d}/peft", "--to", "bf16"], "out", True),
    "diffusers-folder": (["merge-lora", "{d}/unet", "{d}/unet_lora.safetensors"], "out", True),
    "device-auto": (["merge-lora", "{d}/base.safetensors", "{d}/lora.safetensors", "--device", "auto"],
                    "out.safetensors", not GPU_BUILD),
    "merge": (["merge", "{d}/a.safetensors", "{d}/b.safetensors", "--alpha", "0.3"], "out.safetensors", True),
    "merge-device-auto": (["merge", "{d}/a.safetensors", "{d}/b.safetensors", "--alpha", "0.3", "--device", "auto"],
                          "out.safetensors", not GPU_BUILD),
}


@pytest.mark.parametrize("case", PROBED)
def test_copies_start_before_torch_for_folders_devices_and_merge(tmp_path, inputs, case):
    argv, out, early = PROBED[case]
    _probe(tmp_path, [a.format(d=inputs) for a in argv], out, early)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("command", ["merge-lora", "merge"])
def test_device_cuda_is_asked_after_planning_same_bytes(tmp_path, inputs, command):
    argv = (["merge-lora", "{d}/base.safetensors", "{d}/lora.safetensors"] if command == "merge-lora" else
            ["merge", "{d}/a.safetensors", "{d}/b.safetensors", "--alpha", "0.3"])
    _probe(tmp_path, [a.format(d=inputs) for a in argv] + ["--device", "cuda"], "out.safetensors", False)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is available")
@pytest.mark.parametrize("command", ["merge-lora", "merge"])
def test_device_cuda_without_one_is_refused_after_planning(tmp_path, inputs, run_ckpt, command):
    import shutil

    for f in ("base.safetensors", "lora.safetensors", "a.safetensors", "b.safetensors"):
        shutil.copy(inputs / f, tmp_path / f)
    argv = (["merge-lora", tmp_path / "base.safetensors", tmp_path / "lora.safetensors"] if command == "merge-lora"
            else ["merge", tmp_path / "a.safetensors", tmp_path / "b.safetensors", "--alpha", "0.3"])
    assert_refused(run_ckpt, tmp_path, [*argv, "-o", tmp_path / "o.safetensors", "--device", "cuda"], "--device cuda",
                   "no CUDA device is available")


PLANNED = {  # id: argv with {d} the inputs folder
    "merge-lora-file": ["merge-lora", "{d}/base.safetensors", "{d}/lora.safetensors"],
    "merge-lora-hf-folder": ["merge-lora", "{d}/llm", "{d}/peft"],
    "merge-lora-hf-folder-to-bf16": ["merge-lora", "{d}/llm", "{d}/peft", "--to", "bf16"],
    "merge-lora-hf-folder-to-fp16-keep": ["merge-lora", "{d}/llm", "{d}/peft", "--to", "fp16", "--keep", "*norm*"],
    "merge-lora-diffusers-folder": ["merge-lora", "{d}/unet", "{d}/unet_lora.safetensors"],
    # --layout: the merged fused qkv is split into q, k, v (row slices of a merged tensor)
    "merge-lora-layout-split": ["merge-lora", "{d}/flux2.safetensors", "{d}/flux2_lora.safetensors", "--layout",
                                "diffusers"],
    "merge-lora-device-auto": ["merge-lora", "{d}/base.safetensors", "{d}/lora.safetensors", "--device", "auto"],
    "merge-files": ["merge", "{d}/a.safetensors", "{d}/b.safetensors", "--alpha", "0.3"],
    "merge-folders-to-bf16": ["merge", "{d}/llm", "{d}/llm_b", "--alpha", "0.3", "--to", "bf16"],
    "merge-folders-fp64": ["merge", "{d}/llm", "{d}/llm_b", "--method", "task_arithmetic", "--base", "{d}/llm",
                           "--weight", "0.5", "--dtype", "fp64"],
    "merge-ties-yaml": ["merge", "{d}/ties.yaml"],
    "merge-dare-ties-yaml": ["merge", "{d}/dare_ties.yaml"],
    "merge-slices-yaml": ["merge", "{d}/slices.yaml"],
    "merge-device-auto": ["merge", "{d}/a.safetensors", "{d}/b.safetensors", "--alpha", "0.3", "--device", "auto"],
    # the methods whose per-tensor check sums the weights (`sums_to_zero`)
    "merge-linear": ["merge", "{d}/a.safetensors", "{d}/b.safetensors", "--method", "linear", "--weight", "0.3,0.7"],
    "merge-multislerp": ["merge", "{d}/a.safetensors", "{d}/b.safetensors", "--method", "multislerp", "--weight",
                         "0.3,0.7"],
    "convert-hf-folder-to-bf16": ["convert", "{d}/llm", "--to", "bf16"],  # the same config.json edit, every tensor copied
}


@pytest.mark.parametrize("case", PLANNED)
def test_planning_imports_no_torch(tmp_path, inputs, case):
    """A dry run (planning and its report) in a fresh interpreter whose prefetch thread imports nothing: torch is
    never imported, except `--device auto` where torch has a GPU backend (then asking CUDA needs it)."""
    argv = [a.format(d=inputs) for a in PLANNED[case]]
    verdict, err = run_fresh(*argv, "-o", tmp_path / "out", "--dry-run")
    assert verdict["code"] == 0, err
    assert verdict["torch"] == (GPU_BUILD and "auto" in argv), err
    assert not (tmp_path / "out").exists()


def test_gpu_backend_is_read_as_torch_reports_it():
    """`torch_has_gpu_backend` (read from torch/version.py, no import) against the imported torch's own answer; a
    CPU build's answer is what `torch.cuda.is_available()` must then say. A version file that does not assign both
    names a literal None counts as a GPU build (torch is asked)."""
    assert torch_has_gpu_backend() == (torch.version.cuda is not None or torch.version.hip is not None)
    if not torch_has_gpu_backend():
        assert not torch.cuda.is_available()
    cpu = "from typing import Optional\ncuda: Optional[str] = None\nhip: Optional[str] = None\n"
    assert not gpu_backend_named(cpu) and not gpu_backend_named("cuda = None\nhip = None\n")
    for text in (cpu.replace("cuda: Optional[str] = None", "cuda: Optional[str] = '12.8'"),
                 cpu.replace("hip: Optional[str] = None", "hip = '6.4.1'"), "cuda = None\n",
                 "cuda = hip = None\n", "cuda = get()\nhip = None\n", "cuda = None\nhip = None\n(", ""):
        assert gpu_backend_named(text), text
