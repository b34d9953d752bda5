"""`ckpt convert --to`'s targets have one source, the registry `ckpt.targets`: the CLI's choices and
help, `ckpt batch convert`'s choices and output names, and the messages that list targets all read it, and
a new target is a new module in that package (no table to edit). The K-quant encoders and the GGUF LLM
exporter will arrive that way, so the last test adds a target from a module file alone and runs it."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from ckpt import targets
from helpers.refusals import assert_refused

# Every target, its default-name suffix and the file suffix it writes (None: safetensors, or torch by
# --format / -o). These names are users' file names: a change here is a change users see.
EXPECTED = {
    "fp32": ("fp32", None), "fp16": ("fp16", None), "bf16": ("bf16", None), "fp8_e4m3fn": ("fp8_e4m3fn", None),
    "nvfp4": ("nvfp4", None), "mxfp8": ("mxfp8", None), "int8": ("int8", None), "int8_rowwise": ("int8_rowwise", None),
    "int8_convrot": ("int8_convrot", None), "convrot_w4a4": ("convrot_w4a4", None),
    "asym_w4a8_int8": ("asym_w4a8_int8", None),
    # compressed-tensors checkpoints (llm-compressor's data-free presets)
    "ct-fp8-dynamic": ("ct-fp8-dynamic", None), "ct-fp8-block": ("ct-fp8-block", None),
    "ct-w4a16": ("ct-w4a16", None), "ct-w8a16": ("ct-w8a16", None), "ct-nvfp4a16": ("ct-nvfp4a16", None),
    "gguf-q8_0": ("Q8_0", ".gguf"), "gguf-q6_k": ("Q6_K", ".gguf"), "gguf-q5_k_m": ("Q5_K_M", ".gguf"),
    "gguf-q5_k_s": ("Q5_K_S", ".gguf"), "gguf-q4_k_m": ("Q4_K_M", ".gguf"), "gguf-q4_k_s": ("Q4_K_S", ".gguf"),
    "gguf-q3_k_l": ("Q3_K_L", ".gguf"), "gguf-q3_k_m": ("Q3_K_M", ".gguf"), "gguf-q3_k_s": ("Q3_K_S", ".gguf"),
    "gguf-q2_k": ("Q2_K", ".gguf"), "gguf-q2_k_s": ("Q2_K_S", ".gguf"), "gguf-iq4_xs": ("IQ4_XS", ".gguf"),
    "gguf-iq4_nl": ("IQ4_NL", ".gguf"), "gguf-iq3_m": ("IQ3_M", ".gguf"), "gguf-iq3_s": ("IQ3_S", ".gguf"),
    "gguf-iq3_xs": ("IQ3_XS", ".gguf"), "gguf-iq3_xxs": ("IQ3_XXS", ".gguf"), "gguf-iq2_m": ("IQ2_M", ".gguf"),
    "gguf-iq2_s": ("IQ2_S", ".gguf"), "gguf-iq2_xs": ("IQ2_XS", ".gguf"), "gguf-iq2_xxs": ("IQ2_XXS", ".gguf"),
    "gguf-iq1_m": ("IQ1_M", ".gguf"), "gguf-iq1_s": ("IQ1_S", ".gguf"), "gguf-tq2_0": ("TQ2_0", ".gguf"),
    "gguf-tq1_0": ("TQ1_0", ".gguf"), "gguf-mxfp4_moe": ("MXFP4_MOE", ".gguf"), "gguf-q2_0": ("Q2_0", ".gguf"),
    "gguf-q1_0": ("Q1_0", ".gguf"),
    "gguf-q5_1": ("Q5_1", ".gguf"), "gguf-q5_0": ("Q5_0", ".gguf"), "gguf-q4_1": ("Q4_1", ".gguf"),
    "gguf-q4_0": ("Q4_0", ".gguf"), "gguf-bf16": ("BF16", ".gguf"), "gguf-f16": ("F16", ".gguf"),
    "gguf-f32": ("F32", ".gguf"),
    # llama-quantize's aliases: the _M mixes, named as such in files
    "gguf-q5_k": ("Q5_K_M", ".gguf"), "gguf-q4_k": ("Q4_K_M", ".gguf"), "gguf-q3_k": ("Q3_K_M", ".gguf"),
    # MLX folders (mlx_lm.convert -q's affine bit widths)
    "mlx-q2": ("mlx-q2", None), "mlx-q3": ("mlx-q3", None), "mlx-q4": ("mlx-q4", None), "mlx-q5": ("mlx-q5", None),
    "mlx-q6": ("mlx-q6", None), "mlx-q8": ("mlx-q8", None),
}


def test_registry_names_suffixes_and_file_suffixes():
    assert {t.name: (t.suffix, t.ext) for t in targets.all_targets()} == EXPECTED
    assert targets.names() == list(EXPECTED)  # the order of the choices and of the messages
    assert targets.resolve("fp8_e4m3fn", scaled=True).suffix == "fp8_e4m3fn-scaled"
    assert targets.resolve("fp16", scaled=True).name == "fp16"  # refused by its check, not swapped
    assert targets.get("gguf-q4_k_xl").name == "gguf-q4_k_xl"  # claimed by the gguf kind, which refuses it
    assert targets.get("fp7") is None


def test_cli_and_batch_choices_are_the_registry():
    from ckpt.cli.batch import batch
    from ckpt.cli import cli
    from ckpt.cli.options import CONVERT_OR_GGUF

    to = {p.name: p for p in cli.commands["convert"].params}["to"]
    assert to.type is CONVERT_OR_GGUF and list(to.type.choices) == targets.names()
    # `ckpt batch convert` takes every target `ckpt convert` takes (GGUF ones included), with the same help
    batch_to = {p.name: p for p in batch.commands["convert"].params}["to"]
    assert batch_to.type is CONVERT_OR_GGUF and batch_to.help == to.help
    assert to.help.startswith(targets.help_text(batch=False))
    assert "gguf-*: a ComfyUI-GGUF file" in to.help


def test_default_output_names(tmp_path):
    """convert's and batch's default output names come from the target's suffix and file suffix."""
    from ckpt.batch.discover import Found
    from ckpt.batch.operations import ConvertOp
    from ckpt.run import default_output

    src = tmp_path / "x.safetensors"
    src.write_bytes(b"")  # only its name matters
    for name, (suffix, ext) in EXPECTED.items():
        t = targets.resolve(name)
        got = default_output(str(src), src, t.suffix, folder=False, ext=t.ext or ".safetensors")
        assert got.name == f"x-{suffix}{ext or '.safetensors'}", name
        op = ConvertOp({"to": name})
        assert (op.suffix, op.ext) == (suffix, ext or ".safetensors"), name
        assert op.default_output(Found(src, src.name, False)) == got, name
    assert ConvertOp({"to": "fp8_e4m3fn", "scaled": True}).suffix == "fp8_e4m3fn-scaled"
    assert ConvertOp({"to": "fp16", "scaled": True}).suffix == "fp16-scaled"  # as asked; the run refuses


FAKE = '''
"""A target from one file: bf16 under another name."""
from ckpt.targets.casts import Cast

ORDER = 99
HELP = "or fake16 (a test's target)"
TARGETS = (Cast("fake16", "bfloat16"),)
'''

PROBE = textwrap.dedent('''
    import json, sys
    import ckpt.targets as t
    t.__path__.append(sys.argv[1])  # the fake module's folder, as if it were in the package
    from ckpt.cli import main
    code = 0
    try:
        main(sys.argv[2:])
    except SystemExit as e:
        code = e.code
    print(json.dumps({"code": code, "torch": "torch" in sys.modules}))
''')


def _run(folder, *args):
    p = subprocess.run([sys.executable, "-c", PROBE, str(folder), *map(str, args)], capture_output=True, text=True)
    return json.loads(p.stdout.strip().splitlines()[-1]), p.stdout, p.stderr


@pytest.fixture
def fake_target(tmp_path):
    folder = tmp_path / "more_targets"
    folder.mkdir()
    (folder / "fake.py").write_text(FAKE)
    return folder


def test_a_new_target_is_a_new_module(tmp_path, fake_target):
    """Dropping one module in the package adds the name to convert's and batch's choices and help, without
    importing torch, and `ckpt convert --to` it writes its output under its own default name."""
    import torch
    from safetensors.torch import load_file, save_file

    verdict, out, err = _run(fake_target, "convert", "--help")
    assert verdict == {"code": 0, "torch": False}, err
    assert "fake16" in out and "(a test's target)" in " ".join(out.split())
    verdict, out, err = _run(fake_target, "batch", "convert", "--help")
    assert verdict == {"code": 0, "torch": False} and "fake16" in out, err

    src = tmp_path / "m.safetensors"
    save_file({"w": torch.randn(4, 4)}, src)
    verdict, out, err = _run(fake_target, "convert", src, "--to", "fake16", "-q")
    assert verdict["code"] == 0, err
    got = load_file(tmp_path / "m-fake16.safetensors")
    assert got["w"].dtype == torch.bfloat16

    verdict, _, err = _run(fake_target, "convert", src, "--to", "fake17")  # still a choice, refused by click
    assert verdict["code"] == 2 and "fake16" in err, err


@pytest.mark.parametrize("args,problem", [
    (["--to", "bf16"], "does not apply to --to bf16"),  # a cast has no group
    (["--to", "fp8_e4m3fn", "--scaled"], "does not apply to --to fp8_e4m3fn"),
    (["--to", "gguf-q4_k_m"], "does not apply to --to gguf-q4_k_m"),  # GGUF block sizes are the type's
    (["--to", "int8_convrot", "--group-size", "32"], "--to int8_convrot takes 16, 64, 256"),
])
def test_group_size_is_refused_where_the_target_has_no_such_group(run_ckpt, tmp_path, args, problem):
    """--group-size N (`Target.group_sizes`): refused in one line, before anything is read, by a target that
    quantizes in no groups or whose groups do not include N (the last --group-size given wins)."""
    import torch
    from safetensors.torch import save_file

    save_file({"blocks.0.attn.weight": torch.randn(8, 256)}, tmp_path / "m.safetensors")
    assert_refused(run_ckpt, tmp_path, ["convert", str(tmp_path / "m.safetensors"), "--group-size", "64", *args],
                   "--group-size", problem)


def test_group_size_is_refused_with_keep_format(run_ckpt, tmp_path):
    import torch
    from safetensors.torch import save_file

    save_file({"a.weight": torch.randn(4, 4)}, tmp_path / "p.safetensors")
    code, _, err = run_ckpt("convert", str(tmp_path / "p.safetensors"), "--to", "fp8_e4m3fn", "--scaled", "-o",
                            str(tmp_path / "b.safetensors"), "-q")  # a base with an encoding to keep
    assert code == 0, err
    save_file({"lora_unet_a.lora_down.weight": torch.randn(2, 4), "lora_unet_a.lora_up.weight": torch.randn(4, 2)},
              tmp_path / "l.safetensors")
    assert_refused(run_ckpt, tmp_path, ["merge-lora", str(tmp_path / "b.safetensors"), str(tmp_path / "l.safetensors"),
                                        "--keep-format", "--group-size", "64"], "--group-size", "--keep-format")
