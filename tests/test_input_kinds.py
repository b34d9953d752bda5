"""Inputs that are not regular files or folders: a SRC (or a file inside an input folder: a weight file, a
shard, an index, config.json, a sidecar) that is a FIFO, a character device or a link to one is refused in one
line saying what it is (`ckpt.io.small_inputs.check_regular`'s kind names), by every command, without blocking
on it or reading it without end; in `ckpt batch` that entry fails alone. And a quantized folder whose
config.json `quant_method` names another format than its tensors is refused naming the contradiction, never
"nothing quantized" or packed bytes copied as weights."""

from __future__ import annotations

import json
import os
import shutil
import signal
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from helpers.keep_format import kohya_lora
from helpers.refusals import assert_refused, edit_saved

FIFO = "is a FIFO (named pipe), not a file ckpt can read"
DEVICE = "is a character device, not a file ckpt can read"


@contextmanager
def no_hang(seconds=60):
    """Fail, rather than hang the suite, if a command blocks on a FIFO."""
    def hung(signum, frame):
        raise AssertionError(f"blocked for {seconds} s (a FIFO opened for reading?)")

    old = signal.signal(signal.SIGALRM, hung)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def _model(path: Path, seed=0):
    g = torch.Generator().manual_seed(seed)
    save_file({"x.weight": torch.randn(8, 8, generator=g), "y.weight": torch.randn(8, 8, generator=g)}, path)


@pytest.fixture
def inputs(tmp_path):
    _model(tmp_path / "m.safetensors")
    kohya_lora(tmp_path / "l.safetensors", {"x": (8, 8)})
    os.mkfifo(tmp_path / "f.safetensors")
    os.symlink(tmp_path / "f.safetensors", tmp_path / "link-to-fifo.safetensors")
    os.symlink("/dev/zero", tmp_path / "zero.safetensors")
    return tmp_path


COMMANDS = {
    "inspect": lambda s: ["inspect", s],
    "convert": lambda s: ["convert", s, "--to", "fp16", "-o", "{tmp}/o.safetensors"],
    "dequant": lambda s: ["dequant", s, "-o", "{tmp}/o.safetensors"],
    "merge": lambda s: ["merge", s, "{tmp}/m.safetensors", "-o", "{tmp}/o.safetensors"],
    "merge-lora base": lambda s: ["merge-lora", s, "{tmp}/l.safetensors", "-o", "{tmp}/o.safetensors"],
    "merge-lora lora": lambda s: ["merge-lora", "{tmp}/m.safetensors", s, "-o", "{tmp}/o.safetensors"],
    "lora resize": lambda s: ["lora", "resize", s, "--rank", "2", "-o", "{tmp}/o.safetensors"],
    "batch convert": lambda s: ["batch", "convert", s, "--to", "fp16", "-o", "{tmp}/out"],
}


@pytest.mark.parametrize("src, says", [("f.safetensors", FIFO), ("link-to-fifo.safetensors", FIFO),
                                       ("zero.safetensors", DEVICE), ("/dev/zero", DEVICE)],
                         ids=["fifo", "link-to-fifo", "link-to-dev-zero", "dev-zero"])
@pytest.mark.parametrize("command", list(COMMANDS))
def test_a_src_that_is_no_file_is_one_line(inputs, run_ckpt, command, src, says):
    path = src if src.startswith("/") else str(inputs / src)
    args = [a.replace("{tmp}", str(inputs)) for a in COMMANDS[command](path)]
    culprit = "merge: models[0]: " if command == "merge" else ""  # merge names the recipe entry first
    with no_hang():
        assert_refused(run_ckpt, inputs, args, f"{culprit}{path}" if command != "merge" else culprit, says)


def _sharded(folder: Path) -> None:
    """A sharded model folder as huggingface_hub writes it, with config.json and a tokenizer file."""
    from huggingface_hub import save_torch_state_dict

    folder.mkdir()
    save_torch_state_dict({f"l{i}.weight": torch.randn(16, 16) for i in range(4)}, folder, max_shard_size=3000)
    (folder / "config.json").write_text("{}")
    (folder / "tokenizer.json").write_text("{}")


def _swap(path: Path, kind: str) -> None:
    path.unlink()
    if kind == "fifo":
        os.mkfifo(path)
    else:
        os.symlink("/dev/zero", path)


@pytest.mark.parametrize("member", ["model-00002-of-00002.safetensors", "model.safetensors.index.json",
                                    "config.json", "tokenizer.json"])
@pytest.mark.parametrize("kind", ["fifo", "device"])
def test_a_file_in_an_input_folder_that_is_no_file_is_one_line(tmp_path, run_ckpt, member, kind):
    folder = tmp_path / "model"
    _sharded(folder)
    assert (folder / member).exists(), sorted(p.name for p in folder.iterdir())
    _swap(folder / member, kind)
    says = FIFO if kind == "fifo" else DEVICE
    with no_hang():
        for args in (["inspect", folder], ["convert", folder, "--to", "fp16", "-o", tmp_path / "o"],
                     ["dequant", folder, "-o", tmp_path / "o"]):
            assert_refused(run_ckpt, tmp_path, args, str(folder / member), says)
        if member != "model.safetensors.index.json":  # the index named as SRC: its shards and sidecars checked too
            assert_refused(run_ckpt, tmp_path, ["inspect", folder / "model.safetensors.index.json"],
                           str(folder / member), says)


def test_a_loose_weight_file_that_is_a_fifo(tmp_path, run_ckpt):
    folder = tmp_path / "loras"
    folder.mkdir()
    _model(folder / "a.safetensors")
    os.mkfifo(folder / "b.safetensors")
    with no_hang():
        assert_refused(run_ckpt, tmp_path, ["inspect", folder], str(folder / "b.safetensors"), FIFO)


def test_batch_fails_such_entries_alone(tmp_path, run_ckpt):
    """A FIFO named like a weight file is a failed job of its own; a model folder whose config.json is a FIFO
    fails as one job; every other checkpoint is converted (compared with torch's own cast)."""
    root, out = tmp_path / "in", tmp_path / "out"
    root.mkdir()
    _model(root / "ok.safetensors")
    os.mkfifo(root / "pipe.safetensors")
    os.symlink("/dev/zero", root / "zero.safetensors")
    _sharded(root / "model")
    _swap(root / "model" / "config.json", "fifo")
    with no_hang():
        code, stdout, err = run_ckpt("batch", "convert", root, "--to", "fp16", "-o", out)
    assert code == 1 and "Traceback" not in err, err
    failed = sorted(line for line in stdout.splitlines() if line.startswith("  failed"))
    assert failed == [f"  failed   model: {root / 'model' / 'config.json'}: {FIFO}",
                      f"  failed   pipe.safetensors: {root / 'pipe.safetensors'}: {FIFO}",
                      f"  failed   zero.safetensors: {root / 'zero.safetensors'}: {DEVICE}"], stdout
    got, want = load_file(out / "ok.safetensors"), load_file(root / "ok.safetensors")
    assert all(torch.equal(got[k], want[k].half()) for k in want)
    assert sorted(p.name for p in out.iterdir()) == ["ckpt-batch.jsonl", "ok.safetensors"]


# ------------------------------------------------------------ a quant_method that contradicts the tensors


def _mxfp4(folder):
    from helpers import mxfp4_ref

    mxfp4_ref.build(folder)


def _awq(folder):
    from helpers import awq_base

    awq_base.build(folder)


def _gptq(folder):
    from helpers import gptq_base

    gptq_base.build(folder)


CONTRADICTIONS = {
    # built as, config.json says, what the refusal names
    "mxfp4 saying awq": (_mxfp4, "awq", "which are MXFP4 blocks"),
    "mxfp4 saying gptq": (_mxfp4, "gptq", "which are MXFP4 blocks"),
    "mxfp4 saying fp8": (_mxfp4, "fp8", "which are MXFP4 blocks"),  # once written with the packed bytes as weights
    "mxfp4 saying quanto": (_mxfp4, "quanto", "which are MXFP4 blocks"),
    "awq saying mxfp4": (_awq, "mxfp4", "which are GPTQ/AWQ int packs"),
    "gptq saying hqq": (_gptq, "hqq", "which are GPTQ/AWQ int packs"),
}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """Each quantized folder, built once."""
    root = tmp_path_factory.mktemp("quantized")
    out = {}
    for make in {c[0] for c in CONTRADICTIONS.values()}:
        make(root / make.__name__)
        out[make] = root / make.__name__
    return out


@pytest.mark.parametrize("case", list(CONTRADICTIONS))
def test_a_quant_method_naming_another_format_is_the_contradiction_in_one_line(tmp_path, run_ckpt, built, case):
    make, method, says = CONTRADICTIONS[case]
    folder = tmp_path / "q"
    shutil.copytree(built[make], folder)
    edit_saved(folder, qc={"quant_method": method})
    assert json.loads((folder / "config.json").read_text())["quantization_config"]["quant_method"] == method
    for args in (["dequant", folder, "-o", tmp_path / "o"], ["convert", folder, "--to", "bf16", "-o", tmp_path / "o"]):
        assert_refused(run_ckpt, tmp_path, args, str(folder / "model.safetensors"),
                       f"config.json's quant_method '{method}' contradicts the tensors, {says}")
    # the folder as built (quant_method as its tensors say) dequantizes
    code, _, err = run_ckpt("dequant", built[make], "-o", tmp_path / "plain", "--dry-run", "-q")
    assert code == 0, err
