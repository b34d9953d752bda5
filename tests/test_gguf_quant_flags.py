"""llama-quantize's flags on `--to gguf-*` (`ckpt.targets.planners.gguf_quant_flags`): where they do not apply they
are refused in one line before anything is read or written (every command that writes a model takes them through
`writing_options`; the targets refuse them)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from helpers.refusals import assert_refused


@pytest.fixture()
def model(tmp_path):
    torch.manual_seed(0)
    sd = {f"blocks.{i}.attn.to_q.weight": torch.randn(256, 256, dtype=torch.bfloat16) for i in range(2)}
    save_file(sd, tmp_path / "m.safetensors")
    return tmp_path / "m.safetensors"


@pytest.mark.parametrize("args,culprit,problem", [
    (("--to", "bf16", "--imatrix", "x.gguf"), "--imatrix", "applies to --to gguf-* only"),
    (("--to", "fp8_e4m3fn", "--tensor-type", "attn=q8_0"), "--tensor-type", "applies to --to gguf-* only"),
    (("--to", "fp16", "--leave-output-tensor"), "--leave-output-tensor", "applies to --to gguf-* only"),
    (("--to", "gguf-f16", "--output-tensor-type", "q8_0"), "--output-tensor-type", "nothing is quantized"),
    (("--to", "gguf-bf16", "--imatrix", "x.gguf"), "--imatrix", "nothing is quantized"),
    (("--to", "gguf-q4_k_m", "--include-weights", "attn"), "--include-weights", "give --imatrix FILE"),
    (("--to", "gguf-q4_k_m", "--output-tensor-type", "q9_k"), "--output-tensor-type 'q9_k'", "unknown GGML type"),
    (("--to", "gguf-q4_k_m", "--token-embedding-type", "x" * 100), "--token-embedding-type", "unknown GGML type"),
])
def test_flags_refused_where_they_do_not_apply(args, culprit, problem, model, run_ckpt, tmp_path):
    out = tmp_path / ("out.gguf" if args[1].startswith("gguf-") else "out.safetensors")
    assert_refused(run_ckpt, tmp_path, ("convert", model, "-o", out, *args), culprit, problem)


def test_keep_format_takes_no_gguf_flag(model, run_ckpt, tmp_path):
    """merge-lora --keep-format writes the base's own encoding: llama-quantize's flags are refused with it."""
    diffusers = pytest.importorskip("diffusers")
    from families_util import wan_original_layout

    m = diffusers.WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=128,
                                        in_channels=4, out_channels=4, text_dim=16, freq_dim=8, ffn_dim=512,
                                        num_layers=1)
    save_file(wan_original_layout(m), tmp_path / "wan.safetensors")
    code, _, err = run_ckpt("convert", tmp_path / "wan.safetensors", "--to", "gguf-q8_0", "-o",
                            tmp_path / "m-Q8_0.gguf", "-q")
    assert code == 0, err
    lora = tmp_path / "lora.safetensors"
    save_file({"lora_unet_blocks_0_self_attn_q.lora_down.weight": torch.randn(4, 256),
               "lora_unet_blocks_0_self_attn_q.lora_up.weight": torch.randn(256, 4)}, lora)
    assert_refused(run_ckpt, tmp_path, ("merge-lora", tmp_path / "m-Q8_0.gguf", lora, "--keep-format",
                                        "--tensor-type", "attn=q8_0", "-o", tmp_path / "out.gguf"), "--tensor-type and --keep-format",
                   "choose one")


def test_a_type_ckpt_cannot_write_is_refused(model, run_ckpt, tmp_path):
    """llama-quantize takes NVFP4 in --tensor-type; ckpt has no NVFP4 GGUF encoder and says so before reading."""
    assert_refused(run_ckpt, tmp_path, ("convert", model, "--to", "gguf-q4_k_m", "--tensor-type", "attn=nvfp4",
                                        "-o", tmp_path / "o.gguf"), "--tensor-type NVFP4", "ckpt cannot write NVFP4")
