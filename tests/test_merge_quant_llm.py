"""`ckpt merge-lora BASE LORA` into the quantized LLM bases ckpt decodes (GPTQ, AWQ GEMM, compressed-tensors int4
group and NVFP4, ModelOpt NVFP4, HQQ 4-bit), plain output, against PEFT's own `merge_and_unload()`.

Each base is built by its decoder test's builder with the format's own library (AutoGPTQ's `QuantLinear.pack`,
AutoAWQ's `WQLinear_GEMM.from_linear`, the compressed-tensors compressors, ModelOpt's `NVFP4QTensor.quantize`,
hqq's `HQQLinear`), which also returns the library's dequantized weights. The LoRA is a PEFT adapter made on the
unquantized `LlamaForCausalLM` of the same config (non-zero B) and saved with `save_pretrained`. The oracle is
PEFT's `merge_and_unload()` on an fp32 `LlamaForCausalLM` holding the library's dequantized weights
(`helpers.quant_llm_merge`).

- `--to fp32`: equal to PEFT's merge. Tensors the LoRA does not touch are bit-equal (the library's value widened
  once); merged ones agree within rtol 1e-5 / atol 1e-6, a few fp32 ulps: PEFT forms (B @ A) * scaling and adds it,
  ckpt adds scale * B @ A with one addmm, so the two round in a different order.
- no `--to` (issue 24's rule for these bases): every floating tensor written in bf16, each the fp32 merge rounded
  once (bit-equal to the `--to fp32` output cast to bf16), config.json `torch_dtype` bfloat16 and no
  `quantization_config`, loading strictly with `from_pretrained`; the run says so in a note.
- `--keep-format` on a format whose encoder ckpt does not have yet: one line naming the format, exit 2, nothing
  written (formats with an encoder, NVFP4 and gpt-oss MXFP4 included, are covered by the keep-format tests;
  gpt-oss's output is checked here to keep its stored layout).
- gpt-oss MXFP4 (a tiny `GptOssForCausalLM`, banks packed by helpers/mxfp4_ref, transformers'
  `convert_moe_packed_tensors` the oracle's dequantization): a PEFT LoRA with `target_parameters` on
  `mlp.experts.gate_up_proj` / `mlp.experts.down_proj` (PEFT's `lora.ParamWrapper`) lands on the expert banks as
  PEFT's `merge_and_unload` merges it.

Oracles missing on the machine skip their case, saying which.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from helpers.llm import load_strict
from helpers import quant_llm_merge as qm  # noqa: E402

TOL = dict(rtol=1e-5, atol=1e-6)
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _gptq(folder):
    from helpers import gptq_base

    expected, _ = gptq_base.build(folder, 4, 32, desc_act=True, sym=False)
    return expected


def _awq(folder):
    from helpers import awq_base

    return {k: oracle for k, (oracle, _) in awq_base.build(folder, "gemm", 32).items()}


def _ct(scheme):
    def build(folder):
        pytest.importorskip("compressed_tensors", reason="compressed-tensors is not installed (the oracle)")
        pytest.importorskip("loguru")
        from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
        from compressed_tensors.quantization.quant_scheme import NVFP4A16
        from helpers import ct_ref

        if scheme == "int4":
            args = QuantizationArgs(num_bits=4, type="int", strategy="group", group_size=32, symmetric=False)
            group = QuantizationScheme(targets=["Linear"], weights=args)
        else:
            group = QuantizationScheme(targets=["Linear"], **NVFP4A16)
        schemes = ct_ref.build(folder, {"group_0": group}, ignore=["lm_head"])
        return ct_ref.oracle(folder, schemes)

    return build


def _modelopt(folder):
    from helpers import modelopt_base

    return modelopt_base.build(folder)


def _hqq(folder):
    from helpers import hqq_base

    return hqq_base.build(folder, 4, 64, 1, torch.bfloat16)


FORMATS = {  # case -> (builder, the format as ckpt names it)
    "gptq 4-bit act-order asym": (_gptq, "GPTQ"),
    "awq gemm": (_awq, "AWQ"),
    "compressed-tensors int4 group": (_ct("int4"), "compressed-tensors"),
    "compressed-tensors nvfp4": (_ct("nvfp4"), "compressed-tensors"),
    "modelopt nvfp4": (_modelopt, "ModelOpt NVFP4"),
    "hqq 4-bit": (_hqq, "HQQ"),
}


@pytest.fixture(params=list(FORMATS), scope="module")
def made(request, tmp_path_factory):
    """(base folder, adapter folder, the oracle's dequantized weights, format name) for one format."""
    build, name = FORMATS[request.param]
    root = tmp_path_factory.mktemp(request.param.replace(" ", "_"))
    dequantized = build(root / "q")
    config = qm.plain_config(root / "q", transformers.LlamaConfig)
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, lora_dropout=0.0)
    qm.peft_lora(root / "lora", config, transformers.LlamaForCausalLM, lora)
    return root, dequantized, name


def _dtypes(config: dict) -> set[str]:
    """The dtype(s) config.json declares (none where the base's config named none and has no architectures:
    compressed-tensors' builder saves a bare config, and ckpt adds no key it did not have)."""
    return {config[k] for k in ("torch_dtype", "dtype") if k in config}


def _merge(run_ckpt, root, out, *extra):
    code, stdout, err = run_ckpt("merge-lora", root / "q", root / "lora", "-o", out, *extra)
    assert code == 0, err
    return stdout + err, load_file(out / "model.safetensors")


def test_fp32_merge_equals_peft_on_the_oracles_dequantized_model(made, run_ckpt, tmp_path):
    root, dequantized, name = made
    want = qm.peft_merged(root / "q", dequantized, root / "lora", transformers.LlamaForCausalLM,
                          transformers.LlamaConfig)
    text, got = _merge(run_ckpt, root, tmp_path / "m32", "--to", "fp32")
    assert set(got) == set(want) - ({"lm_head.weight"} - set(got))
    changed = 0
    for k, v in got.items():
        assert v.dtype == torch.float32, k
        if k in dequantized and k.rsplit(".", 2)[-2] in TARGETS:
            torch.testing.assert_close(v, want[k], **TOL, msg=lambda m: f"{k}: {m}")
            assert not torch.equal(v, dequantized[k].float()), k
            changed += 1
        else:  # untouched: the library's value (or the stored one) widened once
            assert torch.equal(v, want[k]), k
    assert changed == len(dequantized) and f"base tensors changed: {changed}" in text
    config = json.loads((tmp_path / "m32" / "config.json").read_text())
    assert "quantization_config" not in config and _dtypes(config) <= {"float32"}


def test_default_output_is_bf16_rounded_once_and_loads_strictly(made, run_ckpt, tmp_path):
    root, dequantized, name = made
    _, got32 = _merge(run_ckpt, root, tmp_path / "m32", "--to", "fp32", "-q")
    text, got = _merge(run_ckpt, root, tmp_path / "m")
    assert f"{name} base: merged in fp32 and written as bf16 (pass --to to choose)" in text
    assert set(got) == set(got32)
    for k, v in got.items():
        assert v.dtype == torch.bfloat16, k
        assert torch.equal(v.view(torch.int16), got32[k].to(torch.bfloat16).view(torch.int16)), k
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    assert "quantization_config" not in config and _dtypes(config) <= {"bfloat16"}
    assert not (tmp_path / "m" / "hf_quant_config.json").exists()
    model = load_strict(tmp_path / "m", transformers.LlamaForCausalLM)
    assert not getattr(model, "is_quantized", False) and model.dtype == torch.bfloat16
    for k, v in got.items():
        assert torch.equal(model.state_dict()[k], v), k


def _no_encoder(folder, key="model.layers.0.self_attn.q_proj.weight") -> str | None:
    """Why ckpt cannot re-encode this base's decoded weights (None: an encoder exists)."""
    from ckpt.io.checkpoint import open_checkpoint
    from ckpt.quant.view import logical_view
    from ckpt.quant.encoding import encoding_of

    with open_checkpoint(str(folder)) as ck:
        t = logical_view(ck.components[0]).tensors[key]
        enc = encoding_of(t)
        return "no encoding" if enc is None else enc.why_not()


def test_keep_format_without_an_encoder_is_one_line_exit_2(made, run_ckpt, tmp_path):
    root, _, name = made
    _refused_without_encoder(run_ckpt, tmp_path, root, root / "lora", name, "model.layers.0.self_attn.q_proj.weight")


def _refused_without_encoder(run_ckpt, tmp_path, root, lora, name, key):
    if _no_encoder(root / "q", key) is None:
        pytest.skip(f"{name} has a --keep-format encoder: its own keep-format tests cover it")
    before = sorted(p.name for p in tmp_path.rglob("*"))
    code, out, err = run_ckpt("merge-lora", root / "q", lora, "--keep-format", "-o", tmp_path / "kf")
    assert code == 2, (out, err)
    assert err.count("\n") == 1 and err.startswith("error: --keep-format: ") and name in err, err
    assert "nothing was written" in err
    assert sorted(p.name for p in tmp_path.rglob("*")) == before


# --- gpt-oss: a PEFT target_parameters LoRA (lora.ParamWrapper) on the MXFP4 expert banks ----------------------


@pytest.fixture(scope="module")
def gptoss(tmp_path_factory):
    """A gpt-oss MXFP4 folder (helpers.mxfp4_ref), transformers' own dequantization of its banks, and a PEFT LoRA
    on both expert banks (target_parameters) and the attention's q_proj (target_modules)."""
    root = tmp_path_factory.mktemp("gptoss")
    return root, qm.gptoss_with_loras(root)


@pytest.mark.parametrize("lora", ["lora", "down"])
def test_gptoss_expert_lora_equals_peft(gptoss, run_ckpt, tmp_path, lora):
    """PEFT saves a ParamWrapper under the experts module (`mlp.experts.lora_A.weight`, the first-registered
    gate_up_proj a `base_layer` deeper when both banks are targeted): each lands on its bank, expert e's delta
    PEFT's einsum of lora_B [out, r * E] and lora_A [r * E, in], scaled by alpha / r (alpha / sqrt(r) with rslora).
    ckpt runs the same einsum; PEFT scales the product before adding it, ckpt adds it with the scale as alpha,
    so the banks agree within a few fp32 ulps (bit-equal where the scale is a power of two, as in `lora`); q_proj
    too (addmm)."""
    root, dequantized = gptoss
    want = qm.peft_merged(root / "q", dequantized, root / lora, transformers.GptOssForCausalLM,
                          transformers.GptOssConfig)
    code, text, err = run_ckpt("merge-lora", root / "q", root / lora, "--to", "fp32", "-o", tmp_path / "m32")
    assert code == 0, err
    got = load_file(tmp_path / "m32" / "model.safetensors")
    assert set(got) == set(want)
    banks = [k for k in got if k.endswith(".down_proj") or (lora == "lora" and k.endswith(".gate_up_proj"))]
    assert len(banks) == (4 if lora == "lora" else 2) and f"base tensors changed: {len(banks) + 2 * (lora == 'lora')}" in text
    for k, v in got.items():
        if k in banks or (k.endswith("q_proj.weight") and lora == "lora"):
            torch.testing.assert_close(v, want[k], **TOL, msg=lambda m: f"{k}: {m}")
            assert k not in banks or not torch.equal(v, dequantized[k].float()), k
            assert lora != "lora" or k not in banks or torch.equal(v, want[k]), k  # scale 4: the same bits
        else:
            assert torch.equal(v, want[k]), k
    code, text, err = run_ckpt("merge-lora", root / "q", root / lora, "-o", tmp_path / "m")
    assert code == 0, err
    assert "gpt-oss MXFP4 base: merged in fp32 and written as bf16" in text + err
    got16 = load_file(tmp_path / "m" / "model.safetensors")
    for k, v in got16.items():
        assert torch.equal(v.view(torch.int16), got[k].to(torch.bfloat16).view(torch.int16)), k
    model = load_strict(tmp_path / "m", transformers.GptOssForCausalLM)
    assert torch.equal(model.state_dict()[banks[0]], got16[banks[0]])


def test_gptoss_keep_format_writes_the_mxfp4_layout_again(gptoss, run_ckpt, tmp_path):
    """gpt-oss MXFP4 has a --keep-format encoder (its bytes are checked in tests/test_keep_format_fp4.py): the
    output stores the base's keys, dtypes and shapes, and the run reports the requantization error."""
    root, _ = gptoss
    code, out, err = run_ckpt("merge-lora", root / "q", root / "lora", "--keep-format", "-o", tmp_path / "kf")
    assert code == 0, err
    base = load_file(root / "q" / "model.safetensors")
    got = load_file(tmp_path / "kf" / "model.safetensors")
    assert {k: (v.dtype, v.shape) for k, v in got.items()} == {k: (v.dtype, v.shape) for k, v in base.items()}
    assert "requantization error" in out + err
