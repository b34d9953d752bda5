"""bitsandbytes NF4 / FP4 / LLM.int8 decoded, against bitsandbytes' own CPU dequantize.

Files are made by bitsandbytes itself: `quantize_4bit` + `QuantState.as_dict(packed=True)` (what
`Params4bit` serializes, Forge NF4 files included) and transformers' `BitsAndBytesConfig` save of a tiny
Llama. The oracle is `dequantize_4bit` / `int8_vectorwise_dequant` with float32 output, which ckpt rounds
once to the target dtype.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

F = pytest.importorskip("bitsandbytes.functional")
from helpers.bnb_ref import bnb_4bit  # noqa: E402


def same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit, except the sign of zero: bitsandbytes' scalar CPU path decodes FP4 code 8 as -0.0,
    its AVX-512 path (and ckpt) as +0.0; which path runs depends on the CPU and the row length."""
    return same_bytes(a + 0.0, b + 0.0)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.dtype == b.dtype and tuple(a.shape) == tuple(b.shape)
            and torch.equal(a.reshape(-1).contiguous().view(torch.uint8), b.reshape(-1).contiguous().view(torch.uint8)))


def only(folder, *names):
    return sorted(p.name for p in folder.iterdir()) == sorted(names)


@pytest.fixture
def small_bands(monkeypatch):
    monkeypatch.setattr("ckpt.io.output.BAND_ELEMS", 300)  # bands start inside absmax blocks and bytes


# Row lengths a whole number of blocks, or not a multiple of 16 (bitsandbytes' scalar path): shapes on
# which every bitsandbytes CPU path agrees. Odd sizes, several bands, rows split across bands and bytes.
CASES = [("nf4", 64, True, (40, 72)), ("nf4", 64, False, (7, 9)), ("fp4", 128, False, (33, 130)),
         ("fp4", 64, True, (300, 64)), ("nf4", 256, True, (5, 3, 11)), ("fp4", 32, False, (24, 96))]


@pytest.mark.parametrize("quant_type,blocksize,nested,shape", CASES)
def test_4bit_matches_bitsandbytes(tmp_path, run_ckpt, small_bands, quant_type, blocksize, nested, shape):
    g = torch.Generator().manual_seed(len(shape) + blocksize)
    w = (torch.randn(shape, generator=g) * 0.1).to(torch.bfloat16)
    sd, want = bnb_4bit(w, quant_type, blocksize, nested, "m.weight")
    sd["m.bias"] = torch.ones(shape[0], dtype=torch.bfloat16)
    save_file(sd, tmp_path / "q.safetensors")
    for target, dt in (("fp32", torch.float32), ("bf16", torch.bfloat16), ("fp16", torch.float16)):
        out = tmp_path / f"o-{target}.safetensors"
        code, _, err = run_ckpt("convert", tmp_path / "q.safetensors", "--to", target, "-o", out, "-q")
        assert code == 0, err
        got = load_file(out)
        assert sorted(got) == ["m.bias", "m.weight"]
        assert same_values(got["m.weight"], want.to(dt)), target
    # the natural dtype is the quant state's: dequant writes bf16
    code, _, err = run_ckpt("dequant", tmp_path / "q.safetensors", "-o", tmp_path / "d.safetensors", "-q")
    assert code == 0, err
    assert same_values(load_file(tmp_path / "d.safetensors")["m.weight"], want.bfloat16())


def test_rows_shorter_than_a_block_use_the_flattened_blocks(tmp_path, run_ckpt):
    """Blocks run over the flattened tensor (quantize_4bit, the CUDA kernel and bitsandbytes' PyTorch
    reference agree); bitsandbytes 0.50.2's CPU C kernel indexes absmax per row when a row is shorter
    than a block (here 32 < 64) and decodes such files wrongly, so the reference is the oracle here."""
    from bitsandbytes.backends.default.ops import _dequantize_4bit_compute

    w = (torch.randn(16, 32, generator=torch.Generator().manual_seed(5)) * 0.1).bfloat16()
    q, st = F.quantize_4bit(w, blocksize=64, quant_type="nf4")
    sd = {"m.weight": q} | {f"m.weight.{k}": v for k, v in st.as_dict(packed=True).items()}
    save_file(sd, tmp_path / "q.safetensors")
    want = _dequantize_4bit_compute.__wrapped__(q.reshape(-1), st.absmax, st.code, 64, (16, 32), torch.float32)
    code, _, err = run_ckpt("convert", tmp_path / "q.safetensors", "--to", "fp32", "-o", tmp_path / "o.safetensors", "-q")
    assert code == 0, err
    assert same_bytes(load_file(tmp_path / "o.safetensors")["m.weight"], want)


def test_other_quant_storage_dtype_holds_the_same_bytes(tmp_path, run_ckpt):
    """`bnb_4bit_quant_storage=bfloat16` (FSDP/QLoRA saves): the packed bytes stored as a bf16 tensor."""
    w = (torch.randn(24, 64, generator=torch.Generator().manual_seed(7)) * 0.1).bfloat16()
    q, st = F.quantize_4bit(w, blocksize=64, quant_type="nf4", quant_storage=torch.bfloat16)
    assert q.dtype == torch.bfloat16
    save_file({"m.weight": q} | {f"m.weight.{k}": v for k, v in st.as_dict(packed=True).items()}, tmp_path / "q.safetensors")
    st.dtype = torch.float32
    code, _, err = run_ckpt("convert", tmp_path / "q.safetensors", "--to", "fp32", "-o", tmp_path / "o.safetensors", "-q")
    assert code == 0, err
    assert same_bytes(load_file(tmp_path / "o.safetensors")["m.weight"], F.dequantize_4bit(q, st))


def test_forge_style_nf4_single_file(tmp_path, run_ckpt):
    """Forge's NF4 Flux checkpoints: Params4bit keys under `model.diffusion_model.`, the rest bf16."""
    g = torch.Generator().manual_seed(3)
    sd, wants = {}, {}
    for name, shape in [("double_blocks.0.img_attn.qkv.weight", (96, 64)), ("final_layer.linear.weight", (16, 64))]:
        key = "model.diffusion_model." + name
        part, wants[key] = bnb_4bit((torch.randn(shape, generator=g) * 0.05).bfloat16(), "nf4", 64, True, key)
        sd |= part
    sd["model.diffusion_model.img_in.bias"] = torch.randn(32, generator=g).bfloat16()
    sd["vae.decoder.conv_in.weight"] = torch.randn(4, 4, 3, 3, generator=g).bfloat16()
    save_file(sd, tmp_path / "flux1-dev-bnb-nf4.safetensors")
    code, _, err = run_ckpt("convert", tmp_path / "flux1-dev-bnb-nf4.safetensors", "--to", "bf16",
                            "-o", tmp_path / "plain.safetensors")
    assert code == 0, err
    assert "decoded bitsandbytes nf4" in err
    got = load_file(tmp_path / "plain.safetensors")
    assert sorted(got) == sorted([*wants, "model.diffusion_model.img_in.bias", "vae.decoder.conv_in.weight"])
    for k, want in wants.items():
        assert same_bytes(got[k], want.bfloat16())


def _tiny_llama(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1, max_position_embeddings=64)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(tmp_path / "fp")
    return cfg


@pytest.mark.parametrize("kind", ["nf4-double", "fp4", "int8"])
def test_transformers_bitsandbytes_save_dequantizes_and_loads_strictly(tmp_path, run_ckpt, kind):
    transformers = pytest.importorskip("transformers")
    from bitsandbytes.nn import Int8Params, Params4bit

    cfg = _tiny_llama(tmp_path)
    kw = {"nf4-double": dict(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True),
          "fp4": dict(load_in_4bit=True, bnb_4bit_quant_type="fp4"), "int8": dict(load_in_8bit=True)}[kind]
    q = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "fp", quantization_config=transformers.BitsAndBytesConfig(**kw), device_map="cpu", dtype=torch.bfloat16)
    q.save_pretrained(tmp_path / "q")
    want = {}
    for name, p in q.named_parameters():
        if isinstance(p, Params4bit):
            st = p.quant_state
            st.dtype = torch.float32
            want[name] = F.dequantize_4bit(p.data, st).bfloat16()
        elif isinstance(p, Int8Params):
            want[name] = F.int8_vectorwise_dequant(p.data, p.SCB).bfloat16()
    assert want
    code, _, err = run_ckpt("dequant", tmp_path / "q", "-o", tmp_path / "plain", "-q")
    assert code == 0, err
    config = json.loads((tmp_path / "plain" / "config.json").read_text())
    assert "quantization_config" not in config
    plain = load_file(tmp_path / "plain" / "model.safetensors")
    model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.load_state_dict(plain, strict=False if cfg.tie_word_embeddings else True)
    assert set(plain) == set(model.state_dict()) - ({"lm_head.weight"} if cfg.tie_word_embeddings else set())
    for name, w in want.items():
        assert same_values(plain[name], w), name
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "plain")  # a plain model again
    assert not getattr(reloaded, "is_quantized", False)


# --- bad input: one line, exit 2, nothing written -----------------------------------------------------


def _bad_cases():
    sd, _ = bnb_4bit(torch.randn(16, 64).bfloat16(), "nf4", 64, True, "m.weight")
    qs = "m.weight.quant_state.bitsandbytes__nf4"
    return [
        ("missing quant_state", {k: v for k, v in sd.items() if k != qs}, "without the quant state"),
        ("quant_state not JSON", sd | {qs: torch.tensor([123, 1, 2], dtype=torch.uint8)}, "not a bitsandbytes quant state"),
        ("truncated packed data", sd | {"m.weight": sd["m.weight"][:100].contiguous()}, "truncated"),
        ("absmax count", sd | {"m.weight.absmax": sd["m.weight.absmax"][:3].contiguous()}, "absmax"),
        ("foreign code table", sd | {"m.weight.quant_map": torch.linspace(-1, 1, 16)}, "code table"),
        ("missing nested absmax", {k: v for k, v in sd.items() if k != "m.weight.nested_absmax"}, "nested"),
        ("SCB without int8 weight", {"m.weight": torch.zeros(4, 4), "m.SCB": torch.ones(4)}, "int8 matrix"),
        ("SCB count", {"m.weight": torch.zeros(4, 4, dtype=torch.int8), "m.SCB": torch.ones(3)}, "one value per row"),
    ]


@pytest.mark.parametrize("case", range(8))
def test_bad_input_one_line_exit_2_nothing_written(tmp_path, run_ckpt, case):
    what, sd, needle = _bad_cases()[case]
    save_file(sd, tmp_path / "bad.safetensors")
    for args in (("convert", "--to", "bf16"), ("dequant",)):
        code, out, err = run_ckpt(args[0], tmp_path / "bad.safetensors", *args[1:], "-q")
        assert code == 2, what
        assert err.startswith("error:") and err.count("\n") == 1 and needle in err, (what, err)
        assert only(tmp_path, "bad.safetensors"), what
