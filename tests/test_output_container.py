"""The suffix of -o picks the container, or is refused: one rule for every writing command
(`ckpt.io.output.check_container`). `-o NAME.gguf` without a GGUF target is refused in one line (exit 2, nothing
written) saying to add --to gguf-TYPE, or, for a command that never writes GGUF (the lora commands), that it
writes safetensors; the same -o with --to gguf-TYPE writes a GGUF file gguf's reader reads."""

from __future__ import annotations

import gguf
import pytest
import torch
from safetensors.torch import save_file

from helpers.flux_names import tiny_flux
from helpers.keep_format import kohya_lora
from helpers.refusals import assert_refused

HINT = "add --to gguf-TYPE (or --keep-format on a GGUF base) to write GGUF"
MERGE_HINT = "add --to gguf-TYPE (or --keep-format on a GGUF reference) to write GGUF"
NEVER = "never GGUF"


def _inputs(tmp_path):
    """A tiny Flux model twice (GGUF knows the family), a kohya LoRA on it, ComfyUI scaled fp8, and plain
    LoRA-extraction inputs."""
    a, b = tiny_flux(torch.float32), tiny_flux(torch.float32)
    save_file(a, tmp_path / "a.safetensors")
    save_file({k: v + 0.01 for k, v in b.items()}, tmp_path / "b.safetensors")
    kohya_lora(tmp_path / "l.safetensors", {"double_blocks.0.img_attn.proj": (64, 64)})
    g = torch.Generator().manual_seed(2)
    save_file({"scaled_fp8": torch.zeros(0, dtype=torch.float8_e4m3fn),
               "blocks.0.a.weight": (torch.randn(32, 32, generator=g) * 20).to(torch.float8_e4m3fn),
               "blocks.0.a.scale_weight": torch.tensor(0.01)}, tmp_path / "q.safetensors")
    save_file({"x.weight": torch.randn(8, 8, generator=g)}, tmp_path / "base.safetensors")
    save_file({"x.weight": torch.randn(8, 8, generator=g)}, tmp_path / "tuned.safetensors")


CASES = {
    # command line (names in tmp_path), what it says
    "merge": (["merge", "a.safetensors", "b.safetensors"], MERGE_HINT + ", or name it x.safetensors"),
    "merge --format torch": (["merge", "a.safetensors", "b.safetensors", "--format", "torch"],
                             "ckpt merge writes torch here; " + MERGE_HINT + ", or name it x.pth"),
    "merge --to bf16": (["merge", "a.safetensors", "b.safetensors", "--to", "bf16"], MERGE_HINT),
    "merge-lora": (["merge-lora", "a.safetensors", "l.safetensors"], HINT + ", or name it x.safetensors"),
    "merge-lora --to fp16": (["merge-lora", "a.safetensors", "l.safetensors", "--to", "fp16"], HINT),
    "dequant": (["dequant", "q.safetensors"], "ckpt dequant writes safetensors here; add --to gguf-TYPE to write "
                                              "GGUF, or name it x.safetensors"),
    "convert": (["convert", "a.safetensors", "--to", "fp16"], "ckpt convert writes safetensors here; add --to gguf-TYPE "
                                                              "to write GGUF, or name it x.safetensors"),
    "lora extract": (["lora", "extract", "base.safetensors", "tuned.safetensors", "--rank", "2"], NEVER),
    "lora resize": (["lora", "resize", "l.safetensors", "--rank", "2"], NEVER),
    "lora merge": (["lora", "merge", "l.safetensors", "l.safetensors"], NEVER),
    # lora convert writes GGUF with --format gguf (a llama.cpp LoRA adapter), so its hint names that
    "lora convert": (["lora", "convert", "l.safetensors", "--format", "diffusers", "--base", "a.safetensors"],
                     "writes safetensors here; add --format gguf --base HF_FOLDER to write GGUF, or name it "
                     "x.safetensors"),
    "lora convert --format peft": (["lora", "convert", "l.safetensors", "--format", "peft", "--base", "a.safetensors"],
                                   "writes a folder here; add --format gguf --base HF_FOLDER to write GGUF, or name "
                                   "a folder"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_gguf_name_without_a_gguf_target_is_refused(tmp_path, run_ckpt, case):
    _inputs(tmp_path)
    args, says = CASES[case]
    args = [str(tmp_path / a) if a.endswith(".safetensors") else a for a in args]
    assert_refused(run_ckpt, tmp_path, [*args, "-o", tmp_path / "x.gguf", "-q"], f"-o {tmp_path / 'x.gguf'}", says)


def test_the_same_name_with_a_gguf_target_writes_gguf(tmp_path, run_ckpt):
    _inputs(tmp_path)
    code, _, err = run_ckpt("merge-lora", tmp_path / "a.safetensors", tmp_path / "l.safetensors", "--to", "gguf-q8_0",
                            "-o", tmp_path / "x.gguf", "-q")
    assert code == 0, err
    r = gguf.GGUFReader(tmp_path / "x.gguf")
    assert r.fields["general.architecture"].contents() == "flux"
    assert {t.name for t in r.tensors} == set(tiny_flux())


def test_batch_refuses_an_input_folder_named_like_a_gguf_file(tmp_path, run_ckpt):
    """batch names its outputs after its inputs: a model folder `m.gguf/` would become an output folder of that
    name; that entry is refused alone (one line), the others are converted."""
    root, out = tmp_path / "in", tmp_path / "out"
    (root / "m.gguf").mkdir(parents=True)
    save_file({"w": torch.ones(2, 2)}, root / "m.gguf" / "model.safetensors")
    (root / "m.gguf" / "config.json").write_text("{}")
    save_file({"w": torch.ones(2, 2)}, root / "ok.safetensors")
    code, stdout, err = run_ckpt("batch", "dequant", root, "-o", out)
    assert code == 1, err
    failed = [line for line in stdout.splitlines() if line.startswith("  failed")]
    assert failed == [f"  failed   m.gguf: {out / 'm.gguf'}: names a GGUF file, but ckpt batch dequant writes a "
                      "folder, never GGUF; rename the input folder (its output folder takes its name)"], stdout
    assert not (out / "m.gguf").exists()
