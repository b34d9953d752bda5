"""`convert LLM --to ct-*` and `merge-lora BASE LORA --to ct-*` (compressed-tensors for vLLM) in the main test stack:
the output loads strictly in transformers (compressed-tensors 0.20 decompresses it, `run_compressed=False`) and
ckpt's own decoder (`ckpt dequant`) gives the same weights bit for bit; merge-lora re-quantizes the merge exactly as
converting the plain merge does; every refusal is one line. That the tensors are llm-compressor's own bytes is
tests/serve/test_ct_write.py (llm-compressor 0.14 pins an older transformers: its own venv).
"""

from __future__ import annotations

import json

import pytest
import torch
from helpers.refusals import assert_refused
from safetensors.torch import load_file, save_file

pytest.importorskip("compressed_tensors", reason="compressed-tensors is not installed (the oracle)")
pytest.importorskip("loguru")

from helpers import ct_ref  # noqa: E402
from helpers.llm import load_strict  # noqa: E402

PRESETS = ("ct-fp8-dynamic", "ct-fp8-block", "ct-w4a16", "ct-w8a16", "ct-nvfp4a16")


def bits_equal(a, b):
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    view = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return torch.equal(a.contiguous().view(view), b.contiguous().view(view))


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A tiny bf16 Llama (inputs 128 and 256 wide: the presets' groups divide them)."""
    folder = tmp_path_factory.mktemp("ct") / "base"
    _, model = ct_ref.tiny_llama(hidden=128, inter=256, dtype=torch.bfloat16)
    model.save_pretrained(folder)
    return folder


def _quantized(folder):
    return {k for k in load_file(folder / "model.safetensors") if k.endswith(("weight_scale", "weight_packed"))}


@pytest.mark.parametrize("target", PRESETS)
def test_loads_in_transformers_and_decodes_to_its_values(tmp_path, run_ckpt, base, target):
    import transformers

    out = tmp_path / "q"
    code, _, err = run_ckpt("convert", base, "--to", target, "-o", out, "-q")
    assert code == 0, err
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors" and qc["ignore"] == ["lm_head"]
    stored = load_file(out / "model.safetensors")
    assert "lm_head.weight" in stored and "model.embed_tokens.weight" in stored  # kept plain
    model = load_strict(out, transformers.AutoModelForCausalLM,
                        quantization_config=transformers.CompressedTensorsConfig(run_compressed=False))
    theirs = model.state_dict()
    code, _, err = run_ckpt("dequant", out, "-o", tmp_path / "d", "-q")
    assert code == 0, err
    ours = load_file(tmp_path / "d" / "model.safetensors")
    assert set(ours) == set(theirs)
    for k, v in ours.items():
        assert bits_equal(v, theirs[k].contiguous()), k


@pytest.mark.parametrize("target", ["ct-w4a16", "ct-nvfp4a16"])
def test_merge_lora_to_ct_is_the_plain_merge_quantized(tmp_path, run_ckpt, base, target):
    """merge-lora --to ct-X = convert (merge-lora --to bf16) --to ct-X, byte for byte: the merge is rounded to the
    model's dtype before it is quantized, as llm-compressor sees PEFT's merged bf16 model."""
    g = torch.Generator().manual_seed(1)
    lora = {}
    for m in ("self_attn.q_proj", "mlp.down_proj"):
        k, n = (128, 128) if m.startswith("self") else (256, 128)
        lora[f"base_model.model.model.layers.0.{m}.lora_A.weight"] = torch.randn(4, k, generator=g) * 0.1
        lora[f"base_model.model.model.layers.0.{m}.lora_B.weight"] = torch.randn(n, 4, generator=g) * 0.1
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    save_file(lora, adapter / "adapter_model.safetensors")
    (adapter / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "down_proj"],
        "base_model_name_or_path": str(base), "task_type": "CAUSAL_LM"}))
    for args in (("merge-lora", base, adapter, "--to", target, "-o", tmp_path / "direct"),
                 ("merge-lora", base, adapter, "--to", "bf16", "-o", tmp_path / "plain"),
                 ("convert", tmp_path / "plain", "--to", target, "-o", tmp_path / "two")):
        code, _, err = run_ckpt(*args, "-q")
        assert code == 0, err
    a, b = load_file(tmp_path / "direct" / "model.safetensors"), load_file(tmp_path / "two" / "model.safetensors")
    assert set(a) == set(b) and all(bits_equal(a[k], b[k]) for k in a)
    before = load_file(tmp_path / "plain" / "model.safetensors")["model.layers.0.self_attn.q_proj.weight"]
    assert not torch.equal(before, load_file(base / "model.safetensors")["model.layers.0.self_attn.q_proj.weight"])


def test_keep_and_group_size(tmp_path, run_ckpt, base):
    out = tmp_path / "q"
    code, _, err = run_ckpt("convert", base, "--to", "ct-w4a16", "--group-size", "32", "--keep", "*.o_proj.weight",
                            "-o", out, "-q")
    assert code == 0, err
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["config_groups"]["W4A16"]["weights"]["group_size"] == 32
    assert qc["ignore"] == ["lm_head", "model.layers.0.self_attn.o_proj", "model.layers.1.self_attn.o_proj"]
    stored = load_file(out / "model.safetensors")
    assert stored["model.layers.0.mlp.down_proj.weight_scale"].shape == (128, 256 // 32)
    assert "model.layers.1.self_attn.o_proj.weight" in stored


REFUSALS = {
    "unknown scheme": (["--to", "ct-w3a16"], "--to ct-w3a16", "unknown compressed-tensors scheme"),
    "group size not offered": (["--to", "ct-w4a16", "--group-size", "48"], "--group-size 48", "takes 32, 64, 128"),
    "no group to choose": (["--to", "ct-fp8-dynamic", "--group-size", "64"], "--group-size", "quantizes in no groups"),
    "torch container": (["--to", "ct-fp8-block", "--format", "torch"], "--format torch", "are safetensors"),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_bad_options_refused(tmp_path, run_ckpt, base, case):
    args, culprit, problem = REFUSALS[case]
    assert_refused(run_ckpt, tmp_path, ["convert", base, *args, "-o", tmp_path / "out"], culprit, problem)


def test_group_that_does_not_divide_the_width_refused(tmp_path, run_ckpt, capsys):
    _, model = ct_ref.tiny_llama(hidden=128, inter=168, dtype=torch.bfloat16)  # down_proj: 168 inputs
    model.save_pretrained(tmp_path / "m")
    capsys.readouterr()
    for target in ("ct-w4a16", "ct-nvfp4a16"):
        group = 128 if target == "ct-w4a16" else 16
        assert_refused(run_ckpt, tmp_path, ["convert", tmp_path / "m", "--to", target, "-o", tmp_path / "out"],
                       "model.layers.0.mlp.down_proj.weight", f"168 inputs are not a multiple of the "
                       f"{target[3:].upper()} group size {group}")


def test_non_llm_input_refused(tmp_path, run_ckpt):
    f = tmp_path / "unet.safetensors"
    save_file({"double_blocks.0.img_attn.qkv.weight": torch.randn(96, 32)}, f)
    assert_refused(run_ckpt, tmp_path, ["convert", f, "--to", "ct-fp8-dynamic", "-o", tmp_path / "out"],
                   str(f), "writes a Hugging Face LLM folder")
