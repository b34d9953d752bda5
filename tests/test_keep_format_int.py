"""`ckpt merge-lora --keep-format` on GPTQ, AWQ and compressed-tensors integer bases: the changed weights
re-encoded on the base's own grid (`ckpt/quant/int_pack_encode.py`).

Each test builds a tiny quantized Llama here (no downloads) with the libraries' own packers, as the decoder
tests do (tests/test_gptq.py, test_awq.py, test_compressed_tensors.py: AutoGPTQ 0.7.1's `QuantLinear.pack`,
AutoAWQ 0.2.9's `WQLinear_GEMM.from_linear`, compressed-tensors 0.20's `ModelCompressor` via
`helpers.ct_ref.build`), and a PEFT LoRA (adapter_config.json + adapter_model.safetensors, written directly)
on some of its Linear layers. The merged value is ckpt's own fp32 merge (`plain_merge`, checked against PEFT
elsewhere). Oracle for each changed layer: the expected codes are computed here by the rule the encoder
states, clamp(round(merged / scale) + zero, lo, hi) with the base's stored scales and zero points (the
libraries' packers do not clamp, so the clamp cannot come from them), then packed by the library's own
packer: AutoGPTQ `QuantLinear.pack` / AutoAWQ `from_linear` on a Linear holding (code - zero) * scale in
fp32 with the base's scales and zeros (they re-round: that gives back exactly these codes, as asserted),
compressed-tensors `pack_to_int32`. Asserted: every stored key but the changed codes byte-identical to the
base (scales, zeros, g_idx included); the changed codes equal the oracle's; `ckpt dequant` of the output
equals scale * (code - zero) of those codes in the decoder's dtype; the report's requantization error is
the one measured here; a delta past the grid is clamped (and counted), never spilled into the next field.

compressed-tensors bases are bf16, as llm-compressor saves them: the merge (plain and --keep-format alike) starts
from the decoded weight rounded once to bf16, as the package's decompression gives it (`strategies.as_computed`).
Their oracle is not a restated rule but what a user gets from the libraries (`helpers.ct_ref.peft_recompressed`):
transformers' dequantized load, PEFT's `merge_and_unload` on the bf16 model, compressed-tensors'
`ModelCompressor` on the base's stored scales and zero points; ckpt's codes must be its codes, code for code
(the package quantizes in bf16, zero point added before rounding: `int_pack_encode.requantize_in`).
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import load_file, save_file

from helpers import gptq_ref
from helpers.awq_base import build as awq_build, pack as awq_pack
from helpers.keep_format import plain_merge, recording_value, rel_rms, reported

LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
           "mlp.up_proj", "mlp.down_proj")
TARGETS = ("self_attn.q_proj", "self_attn.v_proj", "mlp.down_proj")  # the LoRA's layers (of layer 0)
CLAMPED = "values fell outside the base's integer grid and were clamped to its ends (its scales are kept)"


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.dtype == b.dtype and a.shape == b.shape
            and torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8)))


def _tiny(dtype=torch.float16, layers=1):
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    return cfg, transformers.LlamaForCausalLM(cfg).to(dtype)


def peft_lora(folder, shapes: dict[str, tuple[int, int]], scale=0.1, rank=4, alpha=8, seed=3):
    """A PEFT LoRA folder on modules {name: (out, in)}; B random (not PEFT's zero init) so the merge changes."""
    g = torch.Generator().manual_seed(seed)
    sd = {}
    for name, (out, inn) in shapes.items():
        sd[f"base_model.model.{name}.lora_A.weight"] = torch.randn(rank, inn, generator=g) * scale
        sd[f"base_model.model.{name}.lora_B.weight"] = torch.randn(out, rank, generator=g) * scale
    folder.mkdir(parents=True, exist_ok=True)
    save_file(sd, folder / "adapter_model.safetensors")
    (folder / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": alpha, "target_modules": sorted({n.rsplit(".", 1)[-1]
                                                                                         for n in shapes}),
        "task_type": "CAUSAL_LM", "bias": "none", "fan_in_fan_out": False}))
    return folder


def merge(run_ckpt, base, lora, tmp_path):
    """(ckpt's fp32 merge, the --keep-format output's tensors, the reported errors, stdout+stderr)."""
    merged = plain_merge(run_ckpt, base, lora, tmp_path, "plain")
    code, out, err = run_ckpt("merge-lora", base, lora, "--keep-format", "-o", tmp_path / "kf",
                              "--report", tmp_path / "r.json")
    assert code == 0, err
    kept = {k: v for f in sorted((tmp_path / "kf").glob("*.safetensors")) for k, v in load_file(f).items()}
    config = json.loads((tmp_path / "kf" / "config.json").read_text())
    assert config == json.loads((base / "config.json").read_text())  # quantization_config and all, unchanged
    return merged, kept, reported(tmp_path / "r.json"), out + err


def dequant(run_ckpt, folder, out):
    code, _, err = run_ckpt("dequant", folder, "-o", out, "-q")
    assert code == 0, err
    return load_file(out / "model.safetensors")


def check_common(base: dict, kept: dict, changed_keys: set[str]):
    assert list(kept) == list(base) or set(kept) == set(base)
    for k, v in base.items():
        if k in changed_keys:
            assert kept[k].dtype == v.dtype and kept[k].shape == v.shape, k
            assert not same_bytes(kept[k], v), f"{k}: the merge changed nothing"
        else:
            assert same_bytes(kept[k], v), f"{k} is not the base's bytes"


def codes_for(merged: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, lo: int, hi: int):
    """The rule the encoder states, restated: clamp(round(merged / scale) + zero, lo, hi); and how many clamped."""
    q = torch.round(merged.float() / scale.float())
    if zero is not None:
        q = q + zero
    return q.clamp(lo, hi).to(torch.int64), int(((q < lo) | (q > hi)).sum())


# ---- GPTQ -----------------------------------------------------------------------------------------------

def _qlinear():
    ql = gptq_ref.autogptq_quantlinear("cuda")
    if ql is None:
        pytest.skip("auto-gptq is not installed (pip install --no-deps auto-gptq): its QuantLinear.pack is the oracle")
    return ql


def gptq_base(folder, bits, group, desc_act, sym, seed=0, fmt=None, g_idx_stored=True):
    """A GPTQ folder packed by AutoGPTQ (v1 zero points; `fmt` "gptq_v2": zeros stored as they are; without
    `g_idx_stored` the g_idx keys are left out, as older AutoGPTQ files without act-order may be); returns
    (stored tensors, {layer: (scales fp16 [n, G], zeros int [n, G], g_idx)})."""
    QL = _qlinear()
    cfg, model = _tiny()
    gen = torch.Generator().manual_seed(seed + 1)
    sd, grids = dict(model.state_dict()), {}
    maxq = (1 << bits) - 1
    for lin_name in LINEARS:
        name = f"model.layers.0.{lin_name}"
        lin = model.get_submodule(name)
        n, k = lin.weight.shape
        gs = k if group == -1 else group
        G = math.ceil(k / gs)
        g_idx = torch.arange(k) // gs
        if desc_act:
            g_idx = g_idx[torch.randperm(k, generator=gen)]
        scales = torch.rand(n, G, generator=gen) * 0.01 + 0.002
        zeros = (torch.full((n, G), float((maxq + 1) // 2)) if sym
                 else torch.randint(1, maxq + 1, (n, G), generator=gen).float())
        q = torch.randint(0, maxq + 1, (n, k), generator=gen).float()
        noise = (torch.rand(n, k, generator=gen) - 0.5) * 0.5
        lin.weight.data = ((q - zeros[:, g_idx] + noise) * scales[:, g_idx]).half()
        ql = QL(bits, group, k, n, bias=False)
        ql.pack(lin, scales, zeros.clone(), g_idx.to(torch.int32))  # clone: pack's `zeros -= 1` may hit its input
        del sd[f"{name}.weight"]
        for key in ("qweight", "qzeros", "scales") + (("g_idx",) if g_idx_stored else ()):
            sd[f"{name}.{key}"] = getattr(ql, key).contiguous()
        if fmt == "gptq_v2":
            sd[f"{name}.qzeros"] = gptq_ref.pack_zeros(zeros, bits, offset=0)
        grids[name] = (ql.scales.t().contiguous(), zeros.long(), g_idx)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(sd, folder / "model.safetensors", metadata={"format": "pt"})
    qc = {"quant_method": "gptq", "bits": bits, "group_size": group, "desc_act": desc_act, "sym": sym}
    if fmt:
        qc["checkpoint_format"] = fmt
    (folder / "config.json").write_text(json.dumps(cfg.to_dict() | {"quantization_config": qc,
                                                                    "torch_dtype": "float16"}))
    return sd, grids


def gptq_oracle_pack(codes, scales16, zeros, g_idx, bits):
    """AutoGPTQ's own `QuantLinear.pack` of known codes: a Linear holding (code - zero) * scale in fp32."""
    QL = _qlinear()
    n, k = codes.shape
    lin = torch.nn.Linear(k, n, bias=False)
    s = scales16.float()[:, g_idx]
    lin.weight.data = (codes - zeros[:, g_idx]).float() * s
    ql = QL(bits, -1 if scales16.shape[1] == 1 else k // scales16.shape[1], k, n, bias=False)
    ql.pack(lin, scales16.float(), zeros.float(), g_idx.to(torch.int32))
    return ql.qweight


GPTQ_CASES = {  # bits, group, desc_act, sym, checkpoint_format, g_idx stored
    "4-bit group 32 asym v1": (4, 32, False, False, None, True),
    "3-bit act-order (codes cross words)": (3, 16, True, False, None, True),
    "8-bit sym, one group": (8, -1, False, True, None, True),
    "2-bit group 32 asym": (2, 32, False, False, None, True),
    "4-bit gptq_v2 zero points": (4, 32, False, False, "gptq_v2", True),
    "4-bit without g_idx keys": (4, 32, False, False, None, False),
}


@pytest.mark.parametrize("case", list(GPTQ_CASES))
def test_gptq_codes_requantized_on_the_base_grid(tmp_path, run_ckpt, monkeypatch, case):
    import ckpt.io.output as output

    monkeypatch.setattr(output, "BAND_ELEMS", 1000)  # several bands of output rows per tensor
    bits, group, desc_act, sym, fmt, g_idx_stored = GPTQ_CASES[case]
    base, grids = gptq_base(tmp_path / "q", bits, group, desc_act, sym, fmt=fmt, g_idx_stored=g_idx_stored)
    shapes = {f"model.layers.0.{t}": tuple(grids[f"model.layers.0.{t}"][1].shape[:1]) + (
        grids[f"model.layers.0.{t}"][2].numel(),) for t in TARGETS}
    lora = peft_lora(tmp_path / "lora", shapes, scale=0.1)
    merged, kept, errs, text = merge(run_ckpt, tmp_path / "q", lora, tmp_path)
    assert "re-encoded 3 changed tensors" in text and "requantization error" in text
    check_common(base, kept, {f"{m}.qweight" for m in shapes})
    dec = dequant(run_ckpt, tmp_path / "kf", tmp_path / "dq")
    maxq = (1 << bits) - 1
    for m in shapes:
        s16, z, g = grids[m]
        codes, _ = codes_for(merged[f"{m}.weight"], s16[:, g], z[:, g], 0, maxq)
        want = gptq_oracle_pack(codes, s16, z, g, bits)
        assert torch.equal(kept[f"{m}.qweight"], want), m
        value = (s16.float()[:, g] * (codes - z[:, g]).float()).half()
        assert same_bytes(dec[f"{m}.weight"], value), m
        assert errs[f"{m}.weight"] == pytest.approx(rel_rms(value, merged[f"{m}.weight"]), rel=1e-6), m


def test_gptq_big_delta_is_clamped_never_spilled(tmp_path, run_ckpt):
    bits = 4
    base, grids = gptq_base(tmp_path / "q", bits, 32, False, False)
    m = "model.layers.0.self_attn.q_proj"
    lora = peft_lora(tmp_path / "lora", {m: (64, 64)}, scale=1.0)  # deltas of many grid steps
    merged, kept, errs, text = merge(run_ckpt, tmp_path / "q", lora, tmp_path)
    s16, z, g = grids[m]
    codes, n_clamped = codes_for(merged[f"{m}.weight"], s16[:, g], z[:, g], 0, 15)
    assert n_clamped > 100
    assert torch.equal(kept[f"{m}.qweight"], gptq_oracle_pack(codes, s16, z, g, bits))
    unclamped = torch.round(merged[f"{m}.weight"].float() / s16.float()[:, g]) + z[:, g]
    assert float(unclamped.max()) > 15 and float(unclamped.min()) < 0
    QL = _qlinear()  # AutoGPTQ's pack on the merged weight itself does not clamp: its codes spill into their words
    lin = torch.nn.Linear(64, 64, bias=False)
    lin.weight.data = merged[f"{m}.weight"].float()
    ql = QL(bits, 32, 64, 64, bias=False)
    ql.pack(lin, s16.float(), z.float(), g.to(torch.int32))
    assert not torch.equal(ql.qweight, kept[f"{m}.qweight"])
    assert f"{n_clamped:,} {CLAMPED}" in text
    dec = dequant(run_ckpt, tmp_path / "kf", tmp_path / "dq")
    value = (s16.float()[:, g] * (codes - z[:, g]).float()).half()
    assert same_bytes(dec[f"{m}.weight"], value)
    assert errs[f"{m}.weight"] == pytest.approx(rel_rms(value, merged[f"{m}.weight"]), rel=1e-6)
    assert errs[f"{m}.weight"] > 0.1


def test_gptq_zero_delta_gives_back_the_base_bytes(tmp_path, run_ckpt):
    """A LoRA whose delta is zero on some rows re-encodes those rows to their own codes (fp16 decode is exact
    enough that round() finds them again)."""
    base, grids = gptq_base(tmp_path / "q", 8, 32, False, False)
    m = "model.layers.0.self_attn.q_proj"
    lora = peft_lora(tmp_path / "lora", {m: (64, 64)}, scale=0.1)
    sd = load_file(lora / "adapter_model.safetensors")
    sd[f"base_model.model.{m}.lora_B.weight"][::2] = 0  # even output rows unchanged
    save_file(sd, lora / "adapter_model.safetensors")
    _, kept, _, _ = merge(run_ckpt, tmp_path / "q", lora, tmp_path)
    assert torch.equal(kept[f"{m}.qweight"][:, ::2], base[f"{m}.qweight"][:, ::2])


# ---- AWQ ------------------------------------------------------------------------------------------------


def awq_base(folder, version, group=32, seed=1):
    """helpers.awq_base's folder: its stored tensors and each layer's grid."""
    grids = {}
    awq_build(folder, version, group, seed=seed, grids=grids)
    return load_file(folder / "model.safetensors"), grids


@pytest.mark.parametrize("version", ["gemm", "gemv"])
def test_awq_codes_requantized_on_the_base_grid(tmp_path, run_ckpt, monkeypatch, version):
    import ckpt.io.output as output

    monkeypatch.setattr(output, "BAND_ELEMS", 1000)
    base, grids = awq_base(tmp_path / "q", version)
    shapes = {f"model.layers.0.{t}": (grids[f"model.layers.0.{t}"][0].shape[0], grids[f"model.layers.0.{t}"][2].numel())
              for t in TARGETS}
    lora = peft_lora(tmp_path / "lora", shapes, scale=0.1)
    merged, kept, errs, text = merge(run_ckpt, tmp_path / "q", lora, tmp_path)
    assert "re-encoded 3 changed tensors" in text
    check_common(base, kept, {f"{m}.qweight" for m in shapes})
    dec = dequant(run_ckpt, tmp_path / "kf", tmp_path / "dq")
    for m in shapes:
        s16, z, g = grids[m]
        codes, _ = codes_for(merged[f"{m}.weight"], s16[:, g], z[:, g], 0, 15)
        n, k = codes.shape
        lin = torch.nn.Linear(k, n, bias=False)
        lin.weight.data = (codes - z[:, g]).float() * s16.float()[:, g]
        want = awq_pack(version, lin, s16.float(), z.float(), 32).qweight
        assert torch.equal(kept[f"{m}.qweight"], want), m
        value = (s16.float()[:, g] * (codes - z[:, g]).float()).half()
        assert same_bytes(dec[f"{m}.weight"], value), m
        assert errs[f"{m}.weight"] == pytest.approx(rel_rms(value, merged[f"{m}.weight"]), rel=1e-6), m


# ---- compressed-tensors ---------------------------------------------------------------------------------

CT_CASES = {"int4 group asym": (4, "group", 32, False, None, 0.1),
            "int8 channel sym": (8, "channel", None, True, None, 0.1),
            "int3 channel asym (codes straddle words)": (3, "channel", None, False, None, 0.1),
            "naive int8 group asym": (8, "group", 32, False, "naive-quantized", 0.1),
            "int2 tensor asym": (2, "tensor", None, False, None, 0.1),
            "int4 group asym, a delta past the grid": (4, "group", 32, False, None, 1.0)}


@pytest.mark.parametrize("case", list(CT_CASES))
def test_compressed_tensors_codes_equal_the_libraries_recompression(tmp_path, run_ckpt, monkeypatch, case):
    """Code for code what a user gets from the libraries (`ct_ref.peft_recompressed`: transformers' dequantized
    load, PEFT's merge_and_unload in the model's bf16, compressed-tensors' ModelCompressor on the base's stored
    scales and zero points); the package's decompression of the written codes is what `ckpt dequant` gives."""
    pytest.importorskip("compressed_tensors", reason="compressed-tensors is not installed (the oracle)")
    pytest.importorskip("loguru")
    pytest.importorskip("peft")
    import ckpt.io.output as output
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from compressed_tensors.quantization.lifecycle.forward import quantize

    from helpers import ct_ref

    monkeypatch.setattr(output, "BAND_ELEMS", 1000)
    bits, strategy, group, sym, fmt, lora_scale = CT_CASES[case]
    args = QuantizationArgs(num_bits=bits, type="int", strategy=strategy, group_size=group, symmetric=sym)
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    ct_ref.build(tmp_path / "q", {"group_0": scheme}, ignore=["lm_head"], fmt=fmt)  # bf16, as llm-compressor saves
    base = load_file(tmp_path / "q" / "model.safetensors")
    codes_key = "weight" if fmt else "weight_packed"
    mods = [f"model.layers.{i}.{t}" for i in (0, 1) for t in TARGETS[:2]]
    shapes = {m: (64 if m.endswith("q_proj") else 32, 64) for m in mods}
    lora = peft_lora(tmp_path / "lora", shapes, scale=lora_scale)
    merged, kept, errs, text = merge(run_ckpt, tmp_path / "q", lora, tmp_path)
    assert f"re-encoded {len(mods)} changed tensors" in text and "requantization error" in text
    check_common(base, kept, {f"{m}.{codes_key}" for m in mods})
    ref = ct_ref.peft_recompressed(tmp_path / "q", lora)
    dec = dequant(run_ckpt, tmp_path / "kf", tmp_path / "dq")
    compressor = BaseCompressor.get_value_from_registry(fmt or "pack-quantized")
    half, clamped = 1 << (bits - 1), 0
    for m in mods:
        local = {k[len(m) + 1:]: v for k, v in kept.items() if k.startswith(m + ".")}
        for k, v in local.items():  # the library kept the grid as stored, and wrote these codes
            assert same_bytes(ref[f"{m}.{k}"], v), f"{m}.{k}"
        value = compressor.decompress(dict(local), scheme)["weight"]
        assert same_bytes(dec[f"{m}.weight"], value), m
        assert errs[f"{m}.weight"] == pytest.approx(rel_rms(value, merged[f"{m}.weight"]), rel=1e-6), m
        if lora_scale > 0.5:  # how many fell past the grid: the package's own quantizer on a wider (int8) grid
            wide = QuantizationArgs(num_bits=8, type="int", strategy=strategy, group_size=group, symmetric=sym)
            s = base[f"{m}.weight_scale"]
            z = None if sym else compressor.decompress(dict(local), scheme).get("weight_zero_point")
            q = quantize(merged[f"{m}.weight"].to(s.dtype), s, z, wide, dtype=torch.int8)
            clamped += int(((q < -half) | (q > half - 1)).sum())
    # The modules the LoRA leaves alone, which ckpt copies byte for byte (check_common): the library's own
    # round trip (decompress to bf16, compress again) gives back their codes below 8 bits; 8-bit codes, whose
    # differences from the zero point need 9 significant bits, come back one code apart for a few values.
    for k in base:
        if any(k.startswith(m + ".") for m in mods):
            continue
        if k.endswith(f".{codes_key}") and bits == 8:
            mine, theirs = base[k].to(torch.int64), ref[k].to(torch.int64)
            if not fmt:
                from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

                shape = torch.Size(base[k[: -len("packed")] + "shape"].tolist())
                mine, theirs = (unpack_from_int32(x.to(torch.int32), bits, shape) for x in (mine, theirs))
            moved = int((mine != theirs).sum())
            assert int((mine - theirs).abs().max()) <= 1 and moved < 0.005 * mine.numel(), (k, moved)
        else:
            assert same_bytes(ref[k], base[k]), k
    if lora_scale > 0.5:
        assert clamped > 100 and f"{clamped:,} {CLAMPED}" in text


def test_compressed_tensors_bf16_rule_is_not_the_fp32_rule(tmp_path, run_ckpt):
    """Why the rule differs from GPTQ's: on the same merge, the fp32 rule (round(x / scale) + zero on the fp32
    merge) would write other codes than compressed-tensors does for a sizeable share of an int4 tensor."""
    pytest.importorskip("compressed_tensors", reason="compressed-tensors is not installed (the oracle)")
    pytest.importorskip("loguru")
    pytest.importorskip("peft")
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    from helpers import ct_ref

    args = QuantizationArgs(num_bits=4, type="int", strategy="group", group_size=32, symmetric=False)
    ct_ref.build(tmp_path / "q", {"g": QuantizationScheme(targets=["Linear"], weights=args)}, ignore=["lm_head"],
                 hidden=128, inter=256)
    base = load_file(tmp_path / "q" / "model.safetensors")
    m = "model.layers.0.self_attn.q_proj"
    lora = peft_lora(tmp_path / "lora", {m: (128, 128)}, scale=0.05)
    merged, kept, _, _ = merge(run_ckpt, tmp_path / "q", lora, tmp_path)
    ref = ct_ref.peft_recompressed(tmp_path / "q", lora)
    assert torch.equal(kept[f"{m}.weight_packed"], ref[f"{m}.weight_packed"])
    s = base[f"{m}.weight_scale"].float().repeat_interleave(32, 1)
    z = unpack_from_int32(base[f"{m}.weight_zero_point"], 4, torch.Size(base[f"{m}.weight_scale"].shape), packed_dim=0)
    fp32_rule, _ = codes_for(merged[f"{m}.weight"], s, z.to(torch.int64).repeat_interleave(32, 1), -8, 7)
    got = unpack_from_int32(kept[f"{m}.weight_packed"], 4, torch.Size((128, 128)))
    assert int((fp32_rule != got).sum()) > 50


# ---- streaming ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", ["gptq", "awq gemm", "awq gemv", "compressed-tensors"])
def test_codes_are_encoded_band_by_band_and_bands_equal_the_whole(tmp_path, monkeypatch, fmt):
    """The value is read in bands of output rows (aligned to AWQ GEMM's 8 outputs per word), never whole, and
    the codes written equal those of one whole band."""
    import ckpt.io.output as output
    from ckpt.io.checkpoint import open_checkpoint
    from ckpt.io.tensors import read_rows
    from ckpt.quant.view import logical_view
    from ckpt.quant.encoding import ErrorMeter
    from ckpt.report import Report

    if fmt == "gptq":
        gptq_base(tmp_path / "q", 3, 16, True, False)
    elif fmt.startswith("awq"):
        awq_base(tmp_path / "q", fmt.split()[1])
    else:
        pytest.importorskip("compressed_tensors")
        pytest.importorskip("loguru")
        from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

        from helpers import ct_ref

        args = QuantizationArgs(num_bits=4, type="int", strategy="group", group_size=32, symmetric=False)
        ct_ref.build(tmp_path / "q", {"g": QuantizationScheme(targets=["Linear"], weights=args)}, ignore=["lm_head"])

    cpu = torch.device("cpu")
    with open_checkpoint(str(tmp_path / "q")) as ck:
        t = logical_view(ck.components[0]).tensors["model.layers.0.mlp.down_proj.weight"]
        x = t.read(0, t.shape[0], cpu).float() + torch.randn(t.shape, generator=torch.Generator().manual_seed(0)) * 0.01
        outs = {}
        for band_elems in (10**9, 1000):
            monkeypatch.setattr(output, "BAND_ELEMS", band_elems)
            v = recording_value(x, t.home)
            (o,) = t.encoding.encode(v, Report(), ErrorMeter("v", "x"))
            src = o.source
            parts = [read_rows(src, a, b, cpu) for a, b in output.bands(src)]
            outs[band_elems] = torch.cat(parts) if src.shape else parts[0]
            if band_elems == 1000:
                assert len(v.reads) > 1 and all((b - a) * x.shape[1] <= max(1000, 8 * x.shape[1]) for a, b in v.reads)
                if fmt == "awq gemm":
                    assert all(a % 8 == 0 for a, _ in v.reads)
            else:
                assert v.reads == [(0, x.shape[0])]
        assert torch.equal(outs[10**9], outs[1000])
