"""Writing GGUF (`convert --to gguf-*`): the bytes gguf's own GGUFWriter writes for the same tensors and
metadata, ComfyUI-GGUF's per-tensor type rules, round trips equal to gguf's dequantize(quantize(W)) bit
for bit, and diffusers' GGUF loader reading the result into a tiny Wan transformer."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from safetensors.torch import load_file, save_file
from helpers.flux_names import rnd, tiny_flux
from families_util import wan_original_layout

TARGETS = {"gguf-q8_0": T.Q8_0, "gguf-q4_0": T.Q4_0, "gguf-q4_1": T.Q4_1, "gguf-q5_0": T.Q5_0, "gguf-q5_1": T.Q5_1,
           "gguf-bf16": T.BF16, "gguf-f16": T.F16}


def expected_types(target):
    """ComfyUI-GGUF's two steps for tiny_flux (bf16 source), by hand."""
    q = target not in (T.BF16, T.F16)
    base = target if not q else T.BF16
    return {"img_in.weight": base, "img_in.bias": T.F32, "time_in.in_layer.weight": base,
            "double_blocks.0.img_attn.qkv.weight": target if q else base,
            "double_blocks.0.img_attn.qkv.bias": T.F32, "double_blocks.0.img_attn.norm.query_norm.scale": T.F32,
            "double_blocks.0.img_attn.proj.weight": target if q else base,
            "double_blocks.0.img_mod.lin.weight": target if q else base,
            "single_blocks.0.linear2.weight": base,  # rows of 80: not a whole number of blocks
            "single_blocks.0.modulation.lin.weight": target if q else T.F32,
            "final_layer.linear.weight": base}


def reader_tensors(path):
    r = gguf.GGUFReader(path)
    return r, {t.name: t for t in r.tensors}


@pytest.mark.parametrize("to", list(TARGETS))
def test_types_bytes_and_round_trip(tmp_path, run_ckpt, monkeypatch, to):
    import ckpt.io.output as output
    from ckpt import __version__

    monkeypatch.setattr(output, "BAND_ELEMS", 700)  # quantized band by band
    src = tiny_flux()
    save_file(src, tmp_path / "flux.safetensors")
    code, out, err = run_ckpt("convert", tmp_path / "flux.safetensors", "--to", to, "-q")
    assert code == 0, err
    name = {T.BF16: "BF16", T.F16: "F16"}.get(TARGETS[to], TARGETS[to].name)
    dst = tmp_path / f"flux-{name}.gguf"
    r, tensors = reader_tensors(dst)
    assert r.fields["general.architecture"].contents() == "flux"
    assert r.fields["general.quantization_version"].contents() == gguf.GGML_QUANT_VERSION
    want = expected_types(TARGETS[to])
    assert {n: t.tensor_type for n, t in tensors.items()} == want
    for n, t in tensors.items():
        assert tuple(reversed(t.shape.tolist())) == tuple(src[n].shape), n

    # the same file, written by gguf's own writer from gguf's own quantize of the fp32 values
    ref = tmp_path / "ref.gguf"
    w = gguf.GGUFWriter(str(ref), arch="flux")
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    w.add_file_type(r.fields["general.file_type"].contents())
    w.add_string("ckpt.version", __version__)
    w.add_string("ckpt.operation", f"convert --to {to}")
    for n in tensors:
        x = src[n].float().numpy()
        w.add_tensor(n, gguf.quants.quantize(x, want[n]), raw_dtype=want[n])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert dst.read_bytes() == ref.read_bytes()

    # decode(encode(W)) == gguf's dequantize(quantize(W)), bit for bit
    code, out, err = run_ckpt("convert", dst, "--to", "fp32", "-q", "-o", tmp_path / "back.safetensors")
    assert code == 0, err
    back = load_file(tmp_path / "back.safetensors")
    for n, t in want.items():
        x = src[n].float().numpy()
        exp = gguf.quants.dequantize(gguf.quants.quantize(x, t), t).reshape(x.shape)
        assert torch.equal(back[n], torch.from_numpy(exp.astype(np.float32))), n


def test_single_call_reencodes_one_tensor(tmp_path):
    """`ckpt.quant.gguf.encode` is the whole encoder: one tensor, any writable type, gguf's bytes."""
    from ckpt.quant.gguf import can_encode, dequantize, encode

    x = torch.randn(6, 96)
    for t in (T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.BF16):
        got = encode(x, t).reshape(-1).view(torch.uint8)  # BF16 comes back as torch.bfloat16: same bytes
        assert np.array_equal(got.numpy(), gguf.quants.quantize(x.numpy(), t).reshape(-1).view(np.uint8)), t.name
        assert torch.equal(dequantize(got, t, 96).reshape(6, 96),
                           torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(x.numpy(), t), t))), t.name
    assert can_encode(T.Q8_0) and can_encode(T.F16) and can_encode(T.Q4_K) and can_encode(T.IQ4_XS)
    # IQ3_S has a static encoder; IQ2_XS only one with an importance (ggml asserts one), so a stored IQ2_XS tensor
    # re-encoded without an imatrix goes to `nearest_writable`
    assert can_encode(T.IQ3_S) and not can_encode(T.IQ2_XS)


def test_sdxl_rows_of_256_with_orig_shape(tmp_path, run_ckpt):
    """SD1/SDXL conv weights become rows of 256 + comfy.gguf.orig_shape (INT32 array); the input conv
    and time embedding stay unquantized; reading the file back restores every shape."""
    src = {"label_emb.0.0.weight": rnd(64, 96), "input_blocks.0.0.weight": rnd(32, 4, 3, 3),
           "input_blocks.1.0.in_layers.2.weight": rnd(320, 4, 3, 3), "input_blocks.1.0.in_layers.2.bias": rnd(320),
           "time_embed.0.weight": rnd(64, 256), "input_blocks.1.1.proj_in.weight": rnd(64, 64, 1, 1)}
    save_file(src, tmp_path / "sdxl.safetensors")
    code, out, err = run_ckpt("convert", tmp_path / "sdxl.safetensors", "--to", "gguf-q8_0", "-o", tmp_path / "x.gguf")
    assert code == 0, err
    r, t = reader_tensors(tmp_path / "x.gguf")
    assert r.fields["general.architecture"].contents() == "sdxl"
    conv = "input_blocks.1.0.in_layers.2.weight"
    assert t[conv].tensor_type == T.Q8_0 and tuple(reversed(t[conv].shape.tolist())) == (45, 256)
    f = r.fields[f"comfy.gguf.orig_shape.{conv}"]
    assert f.types == [gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.INT32] and f.contents() == [320, 4, 3, 3]
    assert t["input_blocks.0.0.weight"].tensor_type == T.BF16  # kept by name (and 4-D: 1152 values)
    assert t["time_embed.0.weight"].tensor_type == T.BF16 and t["label_emb.0.0.weight"].tensor_type == T.BF16
    assert t["input_blocks.1.1.proj_in.weight"].tensor_type == T.Q8_0  # 4096 values -> rows of 256, 2-D
    code, out, err = run_ckpt("convert", tmp_path / "x.gguf", "--to", "fp32", "-q", "-o", tmp_path / "b.safetensors")
    assert code == 0, err
    back = load_file(tmp_path / "b.safetensors")
    assert {k: tuple(v.shape) for k, v in back.items()} == {k: tuple(v.shape) for k, v in src.items()}
    x = src[conv].float().numpy().reshape(45, 256)
    exp = gguf.quants.dequantize(gguf.quants.quantize(x, T.Q8_0), T.Q8_0).reshape(320, 4, 3, 3)
    assert torch.equal(back[conv], torch.from_numpy(exp))


def test_gguf_to_gguf_and_prefix(tmp_path, run_ckpt):
    """A ComfyUI all-in-one file: the diffusion model is kept (prefix stripped), the rest left out with a
    note; an F16 GGUF re-quantized to Q8_0 equals quantizing the F16 values."""
    src = {f"model.diffusion_model.{k}": v for k, v in tiny_flux(torch.float16).items()}
    src["vae.decoder.conv_in.weight"] = rnd(4, 4, 3, 3)
    save_file(src, tmp_path / "aio.safetensors")
    code, out, err = run_ckpt("convert", tmp_path / "aio.safetensors", "--to", "gguf-f16", "-o", tmp_path / "f16.gguf")
    assert code == 0, err
    assert "1 tensor outside 'model.diffusion_model.' left out" in err
    code, out, err = run_ckpt("convert", tmp_path / "f16.gguf", "--to", "gguf-q8_0", "-o", tmp_path / "q8.gguf", "-q")
    assert code == 0, err
    r, t = reader_tensors(tmp_path / "q8.gguf")
    w = src["model.diffusion_model.double_blocks.0.img_attn.proj.weight"].float().numpy()
    assert np.array_equal(t["double_blocks.0.img_attn.proj.weight"].data, gguf.quants.quantize(w, T.Q8_0))
    assert t["img_in.weight"].tensor_type == T.F16  # F16 model: unquantized layers stay F16


def test_wan_gguf_loads_in_diffusers(tmp_path, run_ckpt):
    """diffusers' own GGUF loader (from_single_file + GGUFQuantizationConfig) reads the written file into a
    tiny WanTransformer3DModel: every parameter present, the 5-D patch embedding and the (1, 6, dim)
    modulations in shape; values equal ckpt's reading of the same file (diffusers dequantizes Q8_0 as
    fp16 products, so its Q8_0 values are ckpt's exact fp32 values rounded to fp16)."""
    diffusers = pytest.importorskip("diffusers")
    from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers
    from diffusers.quantizers.gguf.utils import GGUFParameter, dequantize_gguf_tensor

    torch.manual_seed(0)
    model = diffusers.WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=32,
                                            in_channels=4, out_channels=4, text_dim=32, freq_dim=256, ffn_dim=96,
                                            num_layers=2, cross_attn_norm=True, rope_max_seq_len=32)
    model.save_config(tmp_path / "config")
    original = wan_original_layout(model)
    assert set(convert_wan_transformer_to_diffusers(dict(original))) == set(model.state_dict())
    save_file(original, tmp_path / "wan.safetensors")
    code, out, err = run_ckpt("convert", tmp_path / "wan.safetensors", "--to", "gguf-q8_0", "-o", tmp_path / "wan.gguf")
    assert code == 0, err
    _, t = reader_tensors(tmp_path / "wan.gguf")
    assert t["patch_embedding.weight"].tensor_type == T.F32 and len(t["patch_embedding.weight"].shape) == 5
    assert t["blocks.0.self_attn.q.weight"].tensor_type == T.Q8_0 and t["blocks.0.modulation"].tensor_type == T.F32
    assert t["text_embedding.0.weight"].tensor_type == T.BF16  # kept: an input layer
    run_ckpt("convert", tmp_path / "wan.gguf", "--to", "fp32", "-q", "-o", tmp_path / "ours.safetensors")
    ours = convert_wan_transformer_to_diffusers(load_file(tmp_path / "ours.safetensors"))
    loaded = diffusers.WanTransformer3DModel.from_single_file(
        str(tmp_path / "wan.gguf"), config=str(tmp_path / "config"), torch_dtype=torch.float32,
        quantization_config=diffusers.GGUFQuantizationConfig(compute_dtype=torch.float32))
    got = loaded.state_dict()
    assert set(got) == set(model.state_dict()) and not any(v.is_meta for v in got.values())
    for k, v in got.items():
        if isinstance(v, GGUFParameter):
            want = ours[k].half() if v.quant_type == T.Q8_0 else ours[k]  # BF16 blocks: exact
            assert torch.equal(dequantize_gguf_tensor(v).reshape(ours[k].shape), want), k
        else:
            assert torch.equal(v.float(), ours[k]), k


def test_gguf_rewritten_byte_for_byte(tmp_path):
    """Every metadata value type and tensor type of a read GGUF written again by ckpt's writer
    (`fields_from` + `stored_output`, what a format-keeping output needs) gives the same bytes."""
    from ckpt.io.checkpoint import open_checkpoint
    from ckpt.io.gguf_writer import fields_from
    from ckpt.io.output import execute
    from ckpt.io.plan import OutFile, Plan
    from ckpt.quant.gguf import stored_output

    V = gguf.GGUFValueType
    src = tmp_path / "m.gguf"
    w = gguf.GGUFWriter(str(src), arch="llama")
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    w.add_array("tokenizer.ggml.tokens", ["<s>", "héllo", "", "x" * 300])
    w.add_array("tokenizer.ggml.scores", [0.5, -1.25, 3e-8, 7.0])
    w.add_array("tokenizer.ggml.token_type", [1, 2, 3, 4])
    w.add_key_value("some.flags", [True, False], V.ARRAY, sub_type=V.BOOL)
    w.add_float32("llama.rope.freq_base", 500000.0)
    w.add_float64("x.f64", 1 / 3)
    w.add_bool("x.bool", True)
    w.add_uint64("x.u64", 2**40 + 3)
    w.add_int8("x.i8", -5)
    w.add_uint16("x.u16", 65535)
    w.add_int64("x.i64", -(2**40))
    w.add_string("general.name", "tiny ünïcode")
    rng = np.random.default_rng(1)
    blocks = rng.integers(0, 256, size=(4, 144), dtype=np.uint8)
    blocks[:, :4] = np.array([0x00, 0x3C, 0x00, 0x38], dtype=np.uint8)  # Q4_K d = 1.0, dmin = 0.5
    tensors = {"a": (gguf.quants.quantize(rng.standard_normal((8, 64)).astype(np.float32), T.Q8_0), T.Q8_0),
               "k": (blocks, T.Q4_K), "h": (rng.standard_normal((3, 5)).astype(np.float16), None),
               "b": (gguf.quants.quantize(rng.standard_normal((2, 7)).astype(np.float32), T.BF16), T.BF16),
               "f": (rng.standard_normal(33).astype(np.float32), None), "i": (np.arange(6, dtype=np.int32), None),
               "patch": (rng.standard_normal((4, 2, 1, 2, 2)).astype(np.float32), None)}
    for n, (data, t) in tensors.items():
        w.add_tensor(n, data, raw_dtype=t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with open_checkpoint(str(src)) as ckpt:
        f = ckpt.components[0].files[0]
        outs = [stored_output(ckpt.components[0].tensors[n]) for n in f.names]
        execute(Plan(True, [OutFile("", {}, outs, "gguf", fields=fields_from(f.gguf))]), tmp_path / "copy.gguf",
                inputs=ckpt.inputs)
    assert (tmp_path / "copy.gguf").read_bytes() == src.read_bytes()


# ---- refusals: one line, exit 2, nothing written


def test_refusals(tmp_path, run_ckpt):
    save_file(tiny_flux(), tmp_path / "flux.safetensors")
    save_file({"transformer_blocks.0.attn.to_q.weight": rnd(64, 64),
               "single_transformer_blocks.0.attn.norm_k.weight": rnd(16)}, tmp_path / "diffusers.safetensors")
    save_file({"encoder.layers.0.weight": rnd(64, 64)}, tmp_path / "other.safetensors")
    cases = [
        (("flux.safetensors", "--to", "gguf-iq4_xs"), "ComfyUI-GGUF does not quantize image models to IQ4_XS"),
        (("flux.safetensors", "--to", "gguf-iq2_xs"), "ComfyUI-GGUF does not quantize image models to IQ2_XS"),
        (("flux.safetensors", "--to", "gguf-q4_k_xl"), "unknown GGUF type (choose gguf-q8_0, gguf-q6_k"),
        (("flux.safetensors", "--to", "gguf-f16", "--pure"), "--pure does not apply to --to gguf-f16"),
        (("flux.safetensors", "--to", "bf16", "--pure"), "--pure applies to --to gguf-* only"),
        (("flux.safetensors", "--to", "gguf-q7_7"), "unknown GGUF type"),
        (("flux.safetensors", "--to", "gguf-q8_0", "-o", "x.safetensors"), "writes a GGUF file; name it .gguf"),
        (("flux.safetensors", "--to", "bf16", "-o", "x.gguf"), "add --to gguf-TYPE to write GGUF"),
        (("flux.safetensors", "--to", "gguf-q8_0", "--keep", "*norm*"), "--keep does not apply"),
        (("flux.safetensors", "--to", "gguf-q8_0", "--format", "torch"), "--format torch with --to gguf-q8_0: the output is a GGUF file"),
        (("diffusers.safetensors", "--to", "gguf-q8_0"), "ComfyUI-GGUF loads the original layout: run `ckpt convert SRC --layout original` first"),
        (("other.safetensors", "--to", "gguf-q8_0"), "not a diffusion model ComfyUI-GGUF knows"),
    ]
    before = sorted(p.name for p in tmp_path.iterdir())
    for args, problem in cases:
        code, out, err = run_ckpt("convert", *[tmp_path / a if a.endswith((".safetensors", ".gguf")) else a
                                               for a in args])
        assert code == 2, (args, err)
        assert len(err.strip().splitlines()) == 1 and err.startswith("error: ") and problem in err, (args, err)
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_pipeline_folder_is_refused(tmp_path, run_ckpt):
    for sub in ("transformer", "vae"):
        (tmp_path / "pipe" / sub).mkdir(parents=True)
        save_file(tiny_flux(), tmp_path / "pipe" / sub / "diffusion_pytorch_model.safetensors")
    code, out, err = run_ckpt("convert", tmp_path / "pipe", "--to", "gguf-q8_0")
    assert code == 2 and "a GGUF file holds one model; this has 2 components" in err
    code, out, err = run_ckpt("convert", tmp_path / "pipe" / "transformer", "--to", "gguf-q8_0", "-q")
    assert code == 0, err
    assert (tmp_path / "pipe" / "transformer-Q8_0.gguf").is_file()
