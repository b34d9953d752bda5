"""gpt-oss MXFP4 expert banks decoded by `ckpt dequant` / `ckpt convert`, bit for bit with transformers.

A tiny `GptOssForCausalLM` is built here (no downloads); its expert banks are quantized by triton_kernels'
`downcast_to_mxfp_torch`, restated in `helpers/mxfp4_ref.py` (transformers' `quantize_to_mxfp4` calls it
through the `triton_kernels` hub package, which is not installable on the CPU machine), and saved as gpt-oss
checkpoints are (`*_blocks` / `*_scales`, config.json `quantization_config.quant_method: mxfp4`).

Oracles, both transformers 5.24's own CPU code: `integrations.mxfp4.convert_moe_packed_tensors` on the
stored blocks and scales, and `GptOssForCausalLM.from_pretrained` of the quantized folder (without Triton it
dequantizes the experts to bf16 while loading, through the same function and its key mapping).
"""

from __future__ import annotations

import json

import pytest
import torch
from helpers.llm import load_strict
from helpers import mxfp4_ref
from helpers.refusals import assert_refused, edit_saved
from safetensors.torch import load_file

transformers = pytest.importorskip("transformers")
convert_moe_packed_tensors = pytest.importorskip("transformers.integrations.mxfp4").convert_moe_packed_tensors

STEM = "model.layers.0.mlp.experts.gate_up_proj"


def same_bits(a, b):
    """Equal dtype, shape and bits (NaN payloads included)."""
    ints = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(ints[a.dtype]), b.view(ints[b.dtype]))


def test_every_byte_and_scale_decodes_as_transformers():
    """All 256 bytes under all 256 e8m0 codes (0: 2^-127, 255: inf, so NaN for the zero codes), in every
    output dtype transformers dequantizes to."""
    from ckpt.quant.mxfp4 import decode_blocks

    blocks = torch.arange(256, dtype=torch.uint8).reshape(16, 16).repeat(256, 1).reshape(1, 256, 16, 16)
    scales = torch.arange(256, dtype=torch.int32).repeat_interleave(16).reshape(1, 256, 16).to(torch.uint8)
    mine = decode_blocks(blocks, scales).reshape(1, 256, -1).transpose(1, 2)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        ref = convert_moe_packed_tensors(blocks, scales, dtype=dtype)
        got = mine.to(dtype)
        nan = ref.isnan()
        assert torch.equal(nan, got.isnan()), dtype
        assert same_bits(torch.where(nan, 0, got), torch.where(nan, 0, ref)), dtype


def test_dequant_equals_transformers_bit_for_bit(tmp_path, run_ckpt):
    packs, _ = mxfp4_ref.build(tmp_path / "q")
    stored = load_file(tmp_path / "q" / "model.safetensors")
    code, _, err = run_ckpt("dequant", tmp_path / "q", "-o", tmp_path / "plain", "-q")
    assert code == 0, err
    out = load_file(tmp_path / "plain" / "model.safetensors")
    assert not any(k.endswith(("_blocks", "_scales")) for k in out)
    for stem, (blocks, scales) in packs.items():
        assert same_bits(out[stem], convert_moe_packed_tensors(blocks, scales)), stem
    for k, v in stored.items():  # everything else (biases, attention, router, norms) unchanged
        if not k.endswith(("_blocks", "_scales")):
            assert same_bits(out[k], v), k
    assert set(out) == {k for k in stored if not k.endswith(("_blocks", "_scales"))} | set(packs)
    for to, dtype in (("fp32", torch.float32), ("fp16", torch.float16)):
        code, _, err = run_ckpt("dequant", tmp_path / "q", "--to", to, "-o", tmp_path / to, "-q")
        assert code == 0, err
        got = load_file(tmp_path / to / "model.safetensors")
        for stem, (blocks, scales) in packs.items():
            assert same_bits(got[stem], convert_moe_packed_tensors(blocks, scales, dtype=dtype)), (to, stem)


def test_output_equals_transformers_own_load_of_the_quantized_folder(tmp_path, run_ckpt):
    """The second oracle: transformers loading the MXFP4 folder itself (on CPU it dequantizes while loading). The
    strict load of the output and `convert` are the conformance test's (tests/test_quant_formats.py)."""
    mxfp4_ref.build(tmp_path / "q")
    code, _, err = run_ckpt("dequant", tmp_path / "q", "-o", tmp_path / "plain", "-q")
    assert code == 0, err
    model = load_strict(tmp_path / "plain", transformers.GptOssForCausalLM)
    oracle = transformers.GptOssForCausalLM.from_pretrained(tmp_path / "q")
    for name, p in oracle.state_dict().items():
        assert same_bits(model.get_parameter(name).data, p), name


def test_restated_packer_is_consistent():
    """The packer (the oracle's input, not the oracle) follows its stated rule: each block's e8m0 scale is
    ceil(log2(amax / 6)) + 127, and the decoded values stay within half the e2m1 spacing (at most 2^e) of
    the source."""
    from ckpt.quant.mxfp4 import decode_blocks

    g = torch.Generator().manual_seed(3)
    w = torch.randn(3, 64, 96, generator=g) * torch.exp2(torch.randint(-20, 10, (3, 64, 1), generator=g).float())
    blocks, scales = mxfp4_ref.quantize_bank(w)
    dec = decode_blocks(blocks, scales).reshape(3, 96, 64).transpose(1, 2)
    amax = w.transpose(1, 2).reshape(3, 96, 2, 32).abs().amax(-1)
    assert torch.equal(scales.to(torch.int32), torch.ceil(torch.log2(amax / 6)).to(torch.int32) + 127)
    step = torch.exp2(scales.float() - 127).repeat_interleave(32, -1).transpose(1, 2)  # e2m1 spacing <= 2^e
    assert bool(((dec - w).abs() <= step).all())


def test_gpt_oss_names_without_a_config_are_decoded(tmp_path, run_ckpt):
    packs, _ = mxfp4_ref.build(tmp_path / "q")
    cfg = json.loads((tmp_path / "q" / "config.json").read_text())
    del cfg["quantization_config"]
    (tmp_path / "q" / "config.json").write_text(json.dumps(cfg))
    code, _, err = run_ckpt("dequant", tmp_path / "q", "-o", tmp_path / "plain", "-q")
    assert code == 0, err
    out = load_file(tmp_path / "plain" / "model.safetensors")
    for stem, (blocks, scales) in packs.items():
        assert same_bits(out[stem], convert_moe_packed_tensors(blocks, scales)), stem


# --- bad input: one line, exit 2, nothing written -----------------------------------------------------


BAD = {
    "missing scales": (dict(drop=[f"{STEM}_scales"]), "is missing"),
    "orphan scales": (dict(drop=[f"{STEM}_blocks"]), "have no"),
    "scales shape": (dict(tensors={f"{STEM}_scales": torch.zeros(4, 128, 3, dtype=torch.uint8)}), "expected U8, shape"),
    "scales dtype": (dict(tensors={f"{STEM}_scales": torch.zeros(4, 128, 2)}), "expected U8"),
    "blocks dtype": (dict(tensors={f"{STEM}_blocks": torch.zeros(4, 128, 2, 16, dtype=torch.int8)}), "expected U8"),
    "blocks rank": (dict(tensors={f"{STEM}_blocks": torch.zeros(128, 2, 16, dtype=torch.uint8)}),
                    "expected [experts, out, blocks, 16]"),
    "plain and packed": (dict(tensors={STEM: torch.zeros(4, 64, 128)}), "stored both plain and as"),
    "config disagrees": (dict(config={"intermediate_size": 32}), "but config.json"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input_one_line_exit_2_nothing_written(tmp_path, run_ckpt, case):
    edit, needle = BAD[case]
    mxfp4_ref.build(tmp_path / "q")
    edit_saved(tmp_path / "q", **edit)
    for args in (("dequant", tmp_path / "q"), ("convert", tmp_path / "q", "--to", "bf16")):
        assert_refused(run_ckpt, tmp_path, (*args, "-o", tmp_path / "out", "-q"), "", needle)
