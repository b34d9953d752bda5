"""MLX affine-quantized folders both ways, in the main suite (no mlx here: tests/helpers/mlx_ref.py restates
`mx.quantize` / `mx.dequantize`, and tests/serve/test_mlx.py holds that restatement and ckpt's outputs to mlx and
mlx-lm themselves): `dequant` gives mx.dequantize's values and a folder transformers loads strictly, `convert --to
mlx-qN` writes mx.quantize's codes of the source, the round trip, inspect's naming, a LoRA merge that keeps the
format, and every refusal in one line.
"""

from __future__ import annotations

import json

import pytest
import torch
from helpers import mlx_ref
from helpers.format_cases import assert_bands_equal_the_whole, same
from helpers.llm import load_strict, tiny
from helpers.refusals import assert_refused, edit_saved
from safetensors.torch import load_file, save_file

L = "model.layers.0.self_attn.q_proj"
DOWN = "model.layers.0.mlp.down_proj"


def _u32(t):
    return t.view(torch.int32) if t.dtype == torch.uint32 else t


def _hf(folder, kind="llama", dtype=torch.bfloat16, **cfg):
    model = tiny(kind, **cfg).to(dtype)
    model.save_pretrained(folder)
    return {k: v for k, v in model.state_dict().items()}


@pytest.mark.parametrize("bits,group,dtype", [(4, 32, torch.bfloat16), (3, 32, torch.float16), (8, 64, torch.bfloat16),
                                              (2, 32, torch.float32), (6, 32, torch.bfloat16), (5, 32, torch.float16)])
def test_dequant_is_mx_dequantize(tmp_path, run_ckpt, bits, group, dtype):
    import transformers

    oracle = mlx_ref.build(tmp_path / "q", bits, group, dtype, overrides={DOWN: {"bits": 8, "group_size": 32}})
    code, _, err = run_ckpt("dequant", tmp_path / "q", "-o", tmp_path / "plain", "-q")
    assert code == 0, err
    out = load_file(tmp_path / "plain" / "model.safetensors")
    assert not any(k.endswith((".scales", ".biases")) for k in out)
    for name, want in oracle.items():
        assert same(out[name], want), name
    cfg = json.loads((tmp_path / "plain" / "config.json").read_text())
    assert "quantization" not in cfg and "quantization_config" not in cfg
    load_strict(tmp_path / "plain", transformers.LlamaForCausalLM)
    assert_bands_equal_the_whole(tmp_path / "q", [f"{L}.weight", f"{DOWN}.weight"])


@pytest.mark.parametrize("bits,group", [(4, 64), (4, 32), (8, 128), (3, 32), (2, 64)])
def test_convert_writes_mx_quantize_of_the_source(tmp_path, run_ckpt, bits, group):
    src = _hf(tmp_path / "hf", hidden_size=128, intermediate_size=96)  # down_proj's width 96: kept at 64 and 128
    code, _, err = run_ckpt("convert", tmp_path / "hf", "--to", f"mlx-q{bits}", "--group-size", group,
                            "-o", tmp_path / "mlx")
    assert code == 0, err
    out = load_file(tmp_path / "mlx" / "model.safetensors")
    for name, t in src.items():
        layer = name[: -len(".weight")]
        if name.endswith(".weight") and t.dim() == 2 and t.shape[1] % group == 0:
            want = mlx_ref.quantize(t, group, bits)
            got = (out[name], out[f"{layer}.scales"], out[f"{layer}.biases"])
            assert all(same(_u32(g), _u32(w)) for g, w in zip(got, want)), name
        else:
            assert same(out[name], t), name
    cfg = json.loads((tmp_path / "mlx" / "config.json").read_text())
    assert cfg["quantization"] == cfg["quantization_config"] == {"group_size": group, "bits": bits, "mode": "affine"}
    index = json.loads((tmp_path / "mlx" / "model.safetensors.index.json").read_text())
    assert sorted(index["weight_map"]) == sorted(out)
    # and back: ckpt's decoder gives mx.dequantize of what it wrote
    code, _, err = run_ckpt("dequant", tmp_path / "mlx", "-o", tmp_path / "back", "-q")
    assert code == 0, err
    back = load_file(tmp_path / "back" / "model.safetensors")
    for name in src:
        if f"{name[:-len('.weight')]}.scales" in out:
            layer = name[: -len(".weight")]
            want = mlx_ref.dequantize(out[name], out[f"{layer}.scales"], out[f"{layer}.biases"], group, bits)
            assert same(back[name], want), name


def test_inspect_names_scheme_bits_and_group(tmp_path, run_ckpt):
    mlx_ref.build(tmp_path / "q", 4, 64, overrides={DOWN: {"bits": 8, "group_size": 32}, "lm_head": False})
    code, out, err = run_ckpt("inspect", tmp_path / "q")
    assert code == 0, err
    assert "MLX 4-bit, group 64" in out and "MLX 8-bit, group 32" in out and "lm_head.weight" in out


def test_merge_lora_keep_format_requantizes_the_changed_weights(tmp_path, run_ckpt):
    """A PEFT LoRA merged into an MLX base with --keep-format: each changed weight quantized again from the merged
    value (mx.quantize of it, fresh scales and biases, as mlx_lm fuse does); the rest copied as stored."""
    mlx_ref.build(tmp_path / "q", 4, 32)
    stored = load_file(tmp_path / "q" / "model.safetensors")
    torch.manual_seed(1)
    a, b = torch.randn(4, 64) * 0.1, torch.randn(64, 4) * 0.1
    lora = tmp_path / "lora"
    lora.mkdir()
    save_file({f"base_model.model.{L}.lora_A.weight": a, f"base_model.model.{L}.lora_B.weight": b},
              lora / "adapter_model.safetensors")
    (lora / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 8,
                                                          "target_modules": ["q_proj"]}))
    code, _, err = run_ckpt("merge-lora", tmp_path / "q", lora, "--keep-format", "-o", tmp_path / "m")
    assert code == 0, err
    out = load_file(tmp_path / "m" / "model.safetensors")
    assert set(out) == set(stored)
    w = mlx_ref.dequantize(stored[f"{L}.weight"], stored[f"{L}.scales"], stored[f"{L}.biases"], 32, 4)
    merged = (w.float() + 2.0 * (b @ a)).to(torch.bfloat16)
    want = mlx_ref.quantize(merged, 32, 4)
    assert all(same(_u32(out[k]), _u32(v)) for k, v in zip((f"{L}.weight", f"{L}.scales", f"{L}.biases"), want))
    for k, v in stored.items():
        if not k.startswith(L + "."):
            assert same(_u32(out[k]), _u32(v)), k


def _mlx(tmp_path):
    mlx_ref.build(tmp_path / "q", 4, 32)
    return tmp_path / "q"


def _qcfg(folder, **changes):
    cfg = json.loads((folder / "config.json").read_text())
    cfg["quantization"].update(changes)
    (folder / "config.json").write_text(json.dumps(cfg))


def test_refuses_an_unknown_bit_width_and_a_group_size_mlx_has_not(tmp_path, run_ckpt, capsys):
    _hf(tmp_path / "hf")
    capsys.readouterr()  # transformers' save progress
    assert_refused(run_ckpt, tmp_path, ["convert", tmp_path / "hf", "--to", "mlx-q7"], "ckpt convert",
                   "'mlx-q7' is not one of")
    assert_refused(run_ckpt, tmp_path, ["convert", tmp_path / "hf", "--to", "mlx-q4", "--group-size", 48],
                   "--group-size 48", "takes 32, 64, 128")


def test_refuses_what_is_not_an_llm_folder_mlx_lm_writes(tmp_path, run_ckpt, capsys):
    save_file({"double_blocks.0.img_attn.qkv.weight": torch.randn(64, 64)}, tmp_path / "flux.safetensors")
    assert_refused(run_ckpt, tmp_path, ["convert", tmp_path / "flux.safetensors", "--to", "mlx-q4"],
                   str(tmp_path / "flux.safetensors"), "not a Hugging Face LLM folder")
    _hf(tmp_path / "hf")
    capsys.readouterr()
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps(cfg | {"model_type": "gemma2"}))
    assert_refused(run_ckpt, tmp_path, ["convert", tmp_path / "hf", "--to", "mlx-q4"], str(tmp_path / "hf"),
                   "model_type 'gemma2' is not one --to mlx-* writes")
    assert_refused(run_ckpt, tmp_path, ["convert", tmp_path / "hf", "--to", "mlx-q4", "-o", tmp_path / "x.safetensors"],
                   str(tmp_path / "x.safetensors"), "writes an MLX model folder")


@pytest.mark.parametrize("case,culprit,problem", [
    ("bits", "model.safetensors", "config.json's quantization disagrees with the tensors"),
    ("mode", "model.safetensors", "MLX quantization mode 'mxfp4'"),
    ("bits7", "model.safetensors", "MLX quantization bits 7"),
    ("no_block", "model.safetensors", "has no MLX `quantization` block"),
    ("no_scales", "model.safetensors", f"MLX scales '{L}.scales' of uint32 codes"),
    ("kept", "model.safetensors", f"leaves '{L}' unquantized"),
    ("biases_dtype", "model.safetensors", f"MLX biases of '{L}'"),
])
def test_refuses_a_folder_whose_config_disagrees_with_its_tensors(tmp_path, run_ckpt, case, culprit, problem):
    q = _mlx(tmp_path)
    if case == "bits":
        _qcfg(q, bits=8)
    elif case == "mode":
        _qcfg(q, mode="mxfp4")
    elif case == "bits7":
        _qcfg(q, bits=7)
    elif case == "no_block":
        cfg = json.loads((q / "config.json").read_text())
        del cfg["quantization"], cfg["quantization_config"]
        (q / "config.json").write_text(json.dumps(cfg))
    elif case == "no_scales":
        edit_saved(q, drop=[f"{L}.scales"])
    elif case == "kept":
        _qcfg(q, **{L: False})
    elif case == "biases_dtype":
        sd = load_file(q / "model.safetensors")
        edit_saved(q, tensors={f"{L}.biases": sd[f"{L}.biases"].float()})
    assert_refused(run_ckpt, tmp_path, ["dequant", q, "-o", tmp_path / "out"], str(q / culprit), problem)
