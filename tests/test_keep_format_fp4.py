"""`ckpt merge-lora BASE LORA --keep-format` into FP4 bases: compressed-tensors NVFP4, ModelOpt NVFP4 (`ckpt/quant/
fp4_encode.py`) and gpt-oss MXFP4 expert banks (`ckpt/quant/mxfp4.py`).

Each base is built by its decoder test's builder with the format's own library (compressed-tensors 0.20's
compressors via `helpers.ct_ref.build` with the NVFP4A16 scheme and min-max calibration; ModelOpt 0.47's
`NVFP4QTensor.quantize` via `helpers.modelopt_base.build`; gpt-oss banks via `helpers.mxfp4_ref.build`), and a PEFT
LoRA made with `save_pretrained` (`helpers.quant_llm_merge.peft_lora`; gpt-oss's on the expert banks through
`target_parameters`). The value each changed tensor is re-encoded from is ckpt's own fp32 merge (`merge-lora --to
fp32`, checked against PEFT in tests/test_merge_quant_llm.py). Oracle: the library's own quantizer run here on that
value (ModelOpt: `NVFP4QTensor.quantize` on the fp32 merge; MXFP4: see its test). compressed-tensors: what a user
gets from the libraries (`helpers.ct_ref.peft_recompressed`): transformers' dequantized bf16 load, PEFT's
`merge_and_unload`, `generate_gparam` + `calculate_qparams` on the merged bf16 weight as llm-compressor's min-max
observer calls them (so in bf16), `ModelCompressor.compress_model`.

Asserted: config.json unchanged; every stored key the LoRA does not touch byte-identical to the base; each changed
tensor's stored keys (codes, block scales, per-tensor scale) equal the oracle's bytes bit for bit; the report lists
each changed tensor's requantization error, equal to the relative RMS of ckpt's decode of the written bytes against
the fp32 merge.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from helpers import quant_llm_merge as qm  # noqa: E402
from helpers.keep_format import recording_value, rel_rms, reported  # noqa: E402

TARGETS = ["q_proj", "v_proj", "down_proj"]


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.dtype == b.dtype and tuple(a.shape) == tuple(b.shape)
            and torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8)))


def load_dir(folder) -> dict[str, torch.Tensor]:
    return {k: v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(f).items()}


def keep_format(run_ckpt, base, lora, tmp_path):
    """(ckpt's fp32 merge, the --keep-format output, the reported errors, the run's text)."""
    code, _, err = run_ckpt("merge-lora", base, lora, "--to", "fp32", "-o", tmp_path / "m32", "-q")
    assert code == 0, err
    merged = load_dir(tmp_path / "m32")
    code, out, err = run_ckpt("merge-lora", base, lora, "--keep-format", "-o", tmp_path / "kf",
                              "--report", tmp_path / "r.json")
    assert code == 0, err
    assert json.loads((tmp_path / "kf" / "config.json").read_text()) == json.loads((base / "config.json").read_text())
    return merged, load_dir(tmp_path / "kf"), reported(tmp_path / "r.json"), out + err


def check(base: dict, kept: dict, want: dict, text: str):
    """Unchanged keys byte-identical to the base, changed ones the oracle's bytes; the run reports the error."""
    assert set(kept) == set(base)
    for k, v in base.items():
        if k in want:
            assert same_bytes(kept[k], want[k]), f"{k}: not the oracle's bytes"
        else:
            assert same_bytes(kept[k], v), f"{k} is not the base's bytes"
    assert "requantization error" in text, text


# ---- compressed-tensors NVFP4 -----------------------------------------------------------------------------


def ct_quantize(w: torch.Tensor) -> dict[str, torch.Tensor]:
    """compressed-tensors 0.20 on a weight in its own dtype, as llm-compressor's min-max observer calibrates NVFP4:
    the global scale from the tensor's min/max (`generate_gparam`), block scales from each group's min/max
    (`calculate_qparams`), then `NVFP4PackedCompressor.compress` (quantize + pack)."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationScheme
    from compressed_tensors.quantization.quant_scheme import NVFP4A16
    from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam

    scheme = QuantizationScheme(targets=["Linear"], **NVFP4A16)
    n, _ = w.shape
    g = generate_gparam(w.amin(), w.amax())
    groups = w.reshape(n, -1, 16)
    scale, _ = calculate_qparams(groups.amin(-1), groups.amax(-1), scheme.weights, global_scale=g)
    comp = BaseCompressor.get_value_from_registry("nvfp4-pack-quantized")
    out = comp.compress({"weight": w, "weight_scale": scale, "weight_global_scale": g}, scheme)
    return {"weight_packed": out["weight_packed"], "weight_scale": out["weight_scale"],
            "weight_global_scale": out["weight_global_scale"].to(torch.float32)}


@pytest.fixture(scope="module")
def ct_base(tmp_path_factory):
    pytest.importorskip("compressed_tensors", reason="compressed-tensors is not installed (the oracle)")
    pytest.importorskip("loguru")
    from compressed_tensors.quantization import QuantizationScheme
    from compressed_tensors.quantization.quant_scheme import NVFP4A16
    from helpers import ct_ref

    root = tmp_path_factory.mktemp("ct_nvfp4")
    ct_ref.build(root / "q", {"group_0": QuantizationScheme(targets=["Linear"], **NVFP4A16)}, ignore=["lm_head"])
    config = qm.plain_config(root / "q", transformers.LlamaConfig)
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, lora_dropout=0.0)
    qm.peft_lora(root / "lora", config, transformers.LlamaForCausalLM, lora)
    return root


def test_ct_nvfp4_keep_format_equals_compressed_tensors(ct_base, run_ckpt, tmp_path):
    """Code for code, scale for scale what the libraries give (`ct_ref.peft_recompressed`); the fp32 merge
    quantized in fp32 would not be (the global scale of a bf16 observer has 8 significant bits)."""
    from helpers import ct_ref

    root = ct_base
    base = load_dir(root / "q")
    merged, kept, errors, text = keep_format(run_ckpt, root / "q", root / "lora", tmp_path)
    ref = ct_ref.peft_recompressed(root / "q", root / "lora")
    layers = sorted({k[: -len(".weight")] for k in merged if k.rsplit(".", 2)[-2] in TARGETS})
    assert len(layers) == 2 * len(TARGETS)  # two decoder layers
    want, fp32_codes = {}, 0
    for layer in layers:
        for key in ("weight_packed", "weight_scale", "weight_global_scale"):
            want[f"{layer}.{key}"] = ref[f"{layer}.{key}"].reshape(base[f"{layer}.{key}"].shape)
        assert not same_bytes(want[f"{layer}.weight_packed"], base[f"{layer}.weight_packed"]), layer
        fp32 = ct_quantize(merged[f"{layer}.weight"])["weight_packed"]
        fp32_codes += int(((fp32 & 15) != (kept[f"{layer}.weight_packed"] & 15)).sum())
    check(base, kept, want, text)
    assert fp32_codes > 0
    # the reported error: ckpt's decode of the written bytes against the fp32 merge (the package's decompress
    # of the same bytes, as the decoder tests assert)
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationScheme
    from compressed_tensors.quantization.quant_scheme import NVFP4A16

    scheme = QuantizationScheme(targets=["Linear"], **NVFP4A16)
    comp = BaseCompressor.get_value_from_registry("nvfp4-pack-quantized")
    for layer in layers:
        local = {k: kept[f"{layer}.{k}"] for k in ("weight_packed", "weight_scale", "weight_global_scale")}
        dec = comp.decompress(local, scheme)["weight"]
        assert errors[f"{layer}.weight"] == pytest.approx(rel_rms(dec, merged[f"{layer}.weight"]), rel=1e-9)
        assert 0 < errors[f"{layer}.weight"] < 0.2


def edge_weight() -> torch.Tensor:
    """Values that hit every e2m1 tie (block 1: amax 4, so x / step = x * 6 / 4 lands on the bounds), signed zeros,
    an all-zero block, a block whose scale underflows e4m3, and one large value."""
    g = torch.Generator().manual_seed(1)
    w = torch.randn(32, 64, generator=g)
    w[0, :16] = 0.0
    w[1, :16] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, -0.25, -0.75, -1.25, -1.75, -2.5, -3.5,
                              -5.0, -0.0]) / 6 * 4.0
    w[2, :16] = 1e-12
    w[3, 0] = 40.0
    w[4, :16] = -0.0
    w[5, :16] = -1e-3
    w[5, 0] = 1.0
    return w


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ct_nvfp4_rule_matches_the_package_on_edge_values(dtype):
    """The encoder's arithmetic against the package's quantize + pack on values that hit every e2m1 tie, signed
    zeros, an all-zero block (scale 0.125) and a block whose scale underflows e4m3; in float32 and in a bf16
    model's dtype (the observer's min/max, and so both scale computations, in bf16)."""
    pytest.importorskip("compressed_tensors")
    from ckpt.quant import fp4_encode as fe

    w = edge_weight().to(dtype)
    want = ct_quantize(w)
    gs = fe.global_scale(fe.CT, w.abs().amax())
    s = fe.block_scales(fe.CT, w, gs)
    assert same_bytes(gs.reshape(1), want["weight_global_scale"].reshape(1))
    assert same_bytes(s.to(torch.float8_e4m3fn), want["weight_scale"])
    assert same_bytes(fe.codes(fe.CT, w, gs, s), want["weight_packed"])


# ---- ModelOpt NVFP4 ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def mo_base(tmp_path_factory):
    from helpers import modelopt_base

    modelopt_base._nvfp4()
    root = tmp_path_factory.mktemp("modelopt_nvfp4")
    modelopt_base.build(root / "q")
    config = qm.plain_config(root / "q", transformers.LlamaConfig)
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, lora_dropout=0.0)
    qm.peft_lora(root / "lora", config, transformers.LlamaForCausalLM, lora)
    return root


def test_modelopt_nvfp4_keep_format_equals_modelopt(mo_base, run_ckpt, tmp_path):
    from helpers import modelopt_base

    Q = modelopt_base._nvfp4()
    root = mo_base
    base = load_dir(root / "q")
    merged, kept, errors, text = keep_format(run_ckpt, root / "q", root / "lora", tmp_path)
    layers = sorted({k[: -len(".weight")] for k in merged if k.rsplit(".", 2)[-2] in TARGETS})
    assert len(layers) == len(TARGETS)
    want = {}
    for layer in layers:
        w = merged[f"{layer}.weight"]
        qt, scale, scale_2 = Q.quantize(w.clone(), 16)
        want[f"{layer}.weight"] = qt._quantized_data
        want[f"{layer}.weight_scale"] = scale
        want[f"{layer}.weight_scale_2"] = scale_2.to(torch.float32).reshape(base[f"{layer}.weight_scale_2"].shape)
        assert not same_bytes(want[f"{layer}.weight"], base[f"{layer}.weight"]), layer
        dec = qt.dequantize(dtype=torch.float32, scale=scale, double_scale=scale_2, block_sizes={-1: 16})
        assert errors[f"{layer}.weight"] == pytest.approx(rel_rms(dec, w), rel=1e-9)
    check(base, kept, want, text)


def test_modelopt_nvfp4_rule_matches_modelopt_on_edge_values():
    """The encoder's arithmetic against `NVFP4QTensor.quantize` on the same edge values (ModelOpt: an all-zero
    block's scale 1.0, an underflowing one clamped to 2^-9, -0.0 without a sign bit)."""
    from helpers import modelopt_base

    from ckpt.quant import fp4_encode as fe

    Q = modelopt_base._nvfp4()
    w = edge_weight()
    qt, scale, scale_2 = Q.quantize(w.clone(), 16)
    s2 = fe.global_scale(fe.MODELOPT, w.abs().amax())
    s = fe.block_scales(fe.MODELOPT, w, s2)
    assert same_bytes(s2.reshape(()), scale_2.to(torch.float32).reshape(()))
    assert same_bytes(s.to(torch.float8_e4m3fn), scale)
    assert same_bytes(fe.codes(fe.MODELOPT, w, s2, s), qt._quantized_data)


# ---- gpt-oss MXFP4 expert banks ---------------------------------------------------------------------------


def ct_mxfp4_bank(bank: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """compressed-tensors 0.20's MXFP4 (MXFP4A16 scheme) on each expert of an fp32 bank [E, K, N], quantized along
    K as gpt-oss stores it: group min/max -> `calculate_qparams` (`generate_mx_scales`), then
    `MXFP4PackedCompressor.compress`; returned as gpt-oss's (`_blocks` [E, N, K / 32, 16], `_scales` [E, N, K / 32])."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationScheme
    from compressed_tensors.quantization.quant_scheme import MXFP4A16
    from compressed_tensors.quantization.utils import calculate_qparams

    scheme = QuantizationScheme(targets=["Linear"], **MXFP4A16)
    comp = BaseCompressor.get_value_from_registry("mxfp4-pack-quantized")
    blocks, scales = [], []
    for w in bank:
        w2 = w.T.contiguous()  # [N, K]
        n, k = w2.shape
        groups = w2.reshape(n, -1, 32)
        scale, _ = calculate_qparams(groups.amin(-1), groups.amax(-1), scheme.weights)
        out = comp.compress({"weight": w2, "weight_scale": scale}, scheme)
        blocks.append(out["weight_packed"].reshape(n, k // 32, 16))
        scales.append(out["weight_scale"])
    return torch.stack(blocks), torch.stack(scales)


@pytest.fixture(scope="module")
def gptoss_base(tmp_path_factory):
    pytest.importorskip("transformers.integrations.mxfp4")
    pytest.importorskip("compressed_tensors", reason="compressed-tensors is not installed (the oracle)")
    pytest.importorskip("loguru")
    from helpers import mxfp4_ref

    if "target_parameters" not in peft.LoraConfig.__dataclass_fields__:
        pytest.skip(f"PEFT {peft.__version__} has no target_parameters (ParamWrapper LoRAs came in PEFT 0.17)")
    root = tmp_path_factory.mktemp("gptoss_mxfp4")
    mxfp4_ref.build(root / "q")
    config = qm.plain_config(root / "q", transformers.GptOssConfig)
    lora = peft.LoraConfig(r=2, lora_alpha=8, target_modules=["q_proj"],
                           target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    qm.peft_lora(root / "lora", config, transformers.GptOssForCausalLM, lora)
    return root


def test_gptoss_mxfp4_keep_format_equals_compressed_tensors_mx(gptoss_base, run_ckpt, tmp_path):
    """The changed banks' blocks and scales are compressed-tensors' MXFP4 quantization of ckpt's fp32 merge; the
    q_proj weights the LoRA also changes are plain bf16 in gpt-oss, written as the fp32 merge rounded once."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    root = gptoss_base
    base = load_dir(root / "q")
    merged, kept, errors, text = keep_format(run_ckpt, root / "q", root / "lora", tmp_path)
    stems = sorted(k for k in merged if k.endswith((".experts.gate_up_proj", ".experts.down_proj")))
    assert len(stems) == 4  # two layers, both banks
    want = {}
    for stem in stems:
        blocks, scales = ct_mxfp4_bank(merged[stem])
        want[f"{stem}_blocks"], want[f"{stem}_scales"] = blocks, scales
        assert not same_bytes(blocks, base[f"{stem}_blocks"]), stem
        dec = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
        assert errors[stem] == pytest.approx(rel_rms(dec, merged[stem]), rel=1e-9)
        assert 0 < errors[stem] < 0.2
    for k in merged:
        if k.endswith("q_proj.weight"):
            want[k] = merged[k].to(torch.bfloat16)
            assert not same_bytes(want[k], base[k]), k
    check(base, kept, want, text)


def test_gptoss_mx_rule_matches_compressed_tensors_on_edge_values():
    """`mx_exponents` / `mx_codes` against the package on blocks at the power-of-two rounding edge (amax 1.75 * 2^n
    and just below), e2m1 ties, signed zeros, an all-zero block and a huge / tiny block."""
    pytest.importorskip("compressed_tensors")
    from ckpt.quant import fp4_encode as fe

    g = torch.Generator().manual_seed(2)
    bank = torch.randn(2, 128, 8, generator=g)  # [E, K, N]: K = 4 blocks of 32
    x = bank.transpose(1, 2)  # [E, N, K] views
    x[0, 0, :32] = 0.0
    x[0, 1, :32] = torch.linspace(-1.75, 1.75, 32)
    x[0, 2, :32] = torch.linspace(-1.7499, 1.7499, 32)
    x[0, 3, :32] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0] * 4) * torch.tensor([1.0, -1.0] * 16)
    x[0, 4, :32] = -0.0
    x[0, 5, :32] = 1e-30
    x[0, 6, :32] = 3e30
    x[1, 0, :32] = -1e-4
    x[1, 0, 0] = 1.0
    want_blocks, want_scales = ct_mxfp4_bank(bank)
    xt = bank.transpose(1, 2).contiguous()
    exps = fe.mx_exponents(xt)
    assert same_bytes(exps, want_scales)
    assert same_bytes(fe.mx_codes(xt, exps).reshape(want_blocks.shape), want_blocks)


@pytest.mark.parametrize("fmt", ["ct", "modelopt", "gptoss"])
def test_encoded_band_by_band_and_bands_equal_the_whole(request, monkeypatch, fmt):
    """The value is read in bands of rows (NVFP4: output rows, after one streamed amax pass; MXFP4: experts), never
    whole, and every stored key written equals what one whole band gives; the measured error too."""
    import ckpt.io.output as output
    from ckpt.io.checkpoint import open_checkpoint
    from ckpt.io.tensors import read_rows
    from ckpt.quant.view import logical_view
    from ckpt.quant.encoding import ErrorMeter
    from ckpt.report import Report

    root = request.getfixturevalue({"ct": "ct_base", "modelopt": "mo_base", "gptoss": "gptoss_base"}[fmt])
    key = "model.layers.0.mlp.experts.down_proj" if fmt == "gptoss" else "model.layers.0.mlp.down_proj.weight"

    cpu = torch.device("cpu")
    with open_checkpoint(str(root / "q")) as ck:
        t = logical_view(ck.components[0]).tensors[key]
        x = t.read(0, t.shape[0], cpu).float()
        x = x + torch.randn(x.shape, generator=torch.Generator().manual_seed(0)) * x.abs().mean()
        outs, errs = {}, {}
        for band_elems in (10**9, 1000):
            monkeypatch.setattr(output, "BAND_ELEMS", band_elems)
            v = recording_value(x, t.home)
            meter = ErrorMeter("v", "x")
            got = {}
            for o in t.encoding.encode(v, Report(), meter):
                src = o.source
                if not src.shape:  # a scalar: read whole
                    got[o.name] = src.read(0, 1, cpu)
                    continue
                got[o.name] = torch.cat([read_rows(src, a, b, cpu) for a, b in output.bands(src)])
            outs[band_elems], errs[band_elems] = got, meter.rel_rms
            row = x[0].numel()
            if band_elems == 1000:
                assert len(v.reads) > 2 and all((b - a) * row <= max(1000, row) for a, b in v.reads)
            else:
                assert all((a, b) == (0, x.shape[0]) for a, b in v.reads)
        assert outs[10**9].keys() == outs[1000].keys() and len(outs[1000]) == (2 if fmt == "gptoss" else 3)
        for k in outs[1000]:
            assert same_bytes(outs[10**9][k], outs[1000][k]), k
        assert errs[1000] == pytest.approx(errs[10**9], rel=1e-9) and errs[1000] > 0
