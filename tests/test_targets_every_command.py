"""One output side for every writing command (`ckpt.targets`): convert, dequant, merge-lora and merge take every
`--to` target, and a command's output in a target is what `convert --to TARGET` writes from the same values.

The same values: `X --to T` quantizes in one pass what `X --to fp32` would write, so it equals
`convert (X --to fp32) --to T` byte for byte, for a GGUF type (ComfyUI-GGUF's rules), a ComfyUI quantized format
and a dtype; and the default targets and --keep-format refuse what does not apply to them in one line."""

from __future__ import annotations

import gguf
import pytest
import torch
from safetensors.torch import load_file, save_file

from helpers.flux_names import tiny_flux
from helpers.keep_format import kohya_lora
from helpers.refusals import assert_refused


@pytest.fixture
def inputs(tmp_path):
    a, b = tiny_flux(torch.float32), tiny_flux(torch.float32)
    save_file(a, tmp_path / "a.safetensors")
    g = torch.Generator().manual_seed(3)
    save_file({k: v + 0.01 * torch.randn(v.shape, generator=g) for k, v in b.items()}, tmp_path / "b.safetensors")
    kohya_lora(tmp_path / "l.safetensors", {"double_blocks.0.img_attn.proj": (64, 64)})
    return tmp_path


def _run(run_ckpt, *args):
    code, out, err = run_ckpt(*args, "-q")
    assert code == 0, err


def _same_gguf(a, b):
    ra, rb = gguf.GGUFReader(a), gguf.GGUFReader(b)
    ta, tb = {t.name: t for t in ra.tensors}, {t.name: t for t in rb.tensors}
    assert set(ta) == set(tb)
    for k in ta:
        assert ta[k].tensor_type == tb[k].tensor_type and bytes(ta[k].data) == bytes(tb[k].data), k


def _same_safetensors(a, b):
    x, y = load_file(a), load_file(b)
    assert set(x) == set(y)
    for k in x:
        assert x[k].dtype == y[k].dtype and torch.equal(x[k].reshape(-1).view(torch.uint8),
                                                        y[k].reshape(-1).view(torch.uint8)), k


@pytest.mark.parametrize("to", ["gguf-q4_k_m", "nvfp4", "bf16"])
def test_merge_to_a_target_is_convert_of_the_fp32_merge(inputs, run_ckpt, to):
    d = inputs
    ext = ".gguf" if to.startswith("gguf") else ".safetensors"
    merge = ["merge", d / "a.safetensors", d / "b.safetensors", "--alpha", "0.3"]
    _run(run_ckpt, *merge, "--to", to, "-o", d / f"m{ext}")
    _run(run_ckpt, *merge, "--to", "fp32", "-o", d / "m32.safetensors")
    _run(run_ckpt, "convert", d / "m32.safetensors", "--to", to, "-o", d / f"c{ext}")
    (_same_gguf if ext == ".gguf" else _same_safetensors)(d / f"m{ext}", d / f"c{ext}")


@pytest.mark.parametrize("to", ["gguf-q8_0", "int8"])
def test_merge_lora_to_a_target_is_convert_of_the_fp32_merge(inputs, run_ckpt, to):
    d = inputs
    ext = ".gguf" if to.startswith("gguf") else ".safetensors"
    _run(run_ckpt, "merge-lora", d / "a.safetensors", d / "l.safetensors", "--to", to, "-o", d / f"m{ext}")
    _run(run_ckpt, "merge-lora", d / "a.safetensors", d / "l.safetensors", "--to", "fp32", "-o", d / "m32.safetensors")
    _run(run_ckpt, "convert", d / "m32.safetensors", "--to", to, "-o", d / f"c{ext}")
    (_same_gguf if ext == ".gguf" else _same_safetensors)(d / f"m{ext}", d / f"c{ext}")


def test_dequant_to_gguf_is_convert_to_gguf(inputs, run_ckpt):
    d = inputs
    _run(run_ckpt, "convert", d / "a.safetensors", "--to", "nvfp4", "-o", d / "q.safetensors")
    _run(run_ckpt, "dequant", d / "q.safetensors", "--to", "gguf-q8_0", "-o", d / "dq.gguf")
    _run(run_ckpt, "convert", d / "q.safetensors", "--to", "gguf-q8_0", "-o", d / "cq.gguf")
    _same_gguf(d / "dq.gguf", d / "cq.gguf")
    assert gguf.GGUFReader(d / "dq.gguf").fields["ckpt.operation"].contents() == "dequant --to gguf-q8_0"


def test_default_names_follow_the_target(inputs, run_ckpt):
    d = inputs
    _run(run_ckpt, "merge-lora", d / "a.safetensors", d / "l.safetensors", "--to", "gguf-q8_0")
    _run(run_ckpt, "merge", d / "a.safetensors", d / "b.safetensors", "--to", "gguf-q8_0")
    assert (d / "a-merged-Q8_0.gguf").exists() and (d / "a-weighted_sum-Q8_0.gguf").exists()


@pytest.mark.parametrize("args, problem", [
    (["merge", "a.safetensors", "b.safetensors", "--keep-format", "--to", "bf16"], "choose one"),
    (["merge", "a.safetensors", "b.safetensors", "--to", "gguf-q8_0", "--format", "torch"], "the output is a GGUF file"),
    (["merge-lora", "a.safetensors", "l.safetensors", "--to", "bf16", "--pure", "-o", "o.safetensors"],
     "--pure applies to --to gguf-* only"),
    (["merge", "a.safetensors", "b.safetensors", "--to", "gguf-nonesuch"], "unknown GGUF type"),
    (["dequant", "a.safetensors", "--to", "nonesuch"], "'nonesuch' is not one of"),
])
def test_what_does_not_apply_is_refused(inputs, run_ckpt, args, problem):
    d = inputs
    args = [str(d / a) if a.endswith(".safetensors") else a for a in args]
    out = [] if "-o" in args else ["-o", d / "o.gguf"]
    args = [str(d / a) if a == "o.safetensors" else a for a in args]
    assert_refused(run_ckpt, d, [*args, *out], "", problem)


def test_keep_format_is_for_the_merges_only(inputs):
    """convert and dequant offer no --keep-format; their Python APIs refuse it in one line."""
    from ckpt.convert import ConvertOptions, convert
    from ckpt.dequant.command import DequantOptions, dequant
    from ckpt.errors import CkptError

    d = inputs
    with pytest.raises(CkptError, match="convert changes no value"):
        convert(str(d / "a.safetensors"), d / "o.safetensors", ConvertOptions(keep_format=True, to="fp16"))
    with pytest.raises(CkptError, match="dequant writes plain tensors"):
        dequant(str(d / "a.safetensors"), d / "o.safetensors", DequantOptions(keep_format=True))
    assert sorted(p.name for p in d.iterdir()) == ["a.safetensors", "b.safetensors", "l.safetensors"]
