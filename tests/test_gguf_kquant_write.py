"""`convert --to gguf-q4_k_m` (and every llama-quantize mix) for a diffusion model: ComfyUI-GGUF's image mix
(`img_tensor_get_type` of its tools/lcpp.patch, transcribed by hand below from the patch, independently of
ckpt.targets.planners.gguf_mixes) picks each tensor's type, and every quantized tensor's bytes are what llama.cpp's own
quantizer (ggml-quants.c, compiled by the `ggml_lib` fixture) writes for the source's values."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from safetensors.torch import save_file

from families_util import wan_original_layout

pytest.importorskip("diffusers")

# the patch, by hand: (attention V: types for the 1st, 2nd, 3rd, 4th tensor in file order), FFN down, fused QKV
PATCH = {
    "q2_k": (("Q3_K",) * 4, "Q2_K"),
    "q3_k_s": (("Q3_K",) * 4, "Q3_K"),
    "q3_k_m": (("Q5_K", "Q5_K", "Q4_K", "Q4_K"), "Q4_K"),
    "q3_k_l": (("Q5_K",) * 4, "Q5_K"),
    "q4_k_s": (("Q5_K",) * 4, "Q5_K"),
    "q4_k_m": (("Q6_K",) * 4, "Q6_K"),
    "q5_k_s": (("Q5_K",) * 4, "Q5_K"),
    "q5_k_m": (("Q6_K",) * 4, "Q6_K"),
    "q6_k": (("Q6_K",) * 4, "Q6_K"),
    "q8_0": (("Q8_0",) * 4, "Q8_0"),
    "q4_0": (("Q4_0",) * 4, "Q4_1"),
    "q5_0": (("Q5_0",) * 4, "Q5_1"),
}
DEFAULT = {"q2_k": "Q2_K", "q3_k_s": "Q3_K", "q3_k_m": "Q3_K", "q3_k_l": "Q3_K", "q4_k_s": "Q4_K", "q4_k_m": "Q4_K",
           "q5_k_s": "Q5_K", "q5_k_m": "Q5_K", "q6_k": "Q6_K", "q8_0": "Q8_0", "q4_0": "Q4_0", "q5_0": "Q5_0"}
REF_NAME = {"Q2_K": "q2_K", "Q3_K": "q3_K", "Q4_K": "q4_K", "Q5_K": "q5_K", "Q6_K": "q6_K", "Q8_0": "q8_0",
            "Q4_0": "q4_0", "Q4_1": "q4_1", "Q5_0": "q5_0", "Q5_1": "q5_1"}


def wan(ffn: int):
    from diffusers import WanTransformer3DModel

    torch.manual_seed(0)
    m = WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=128, in_channels=4,
                              out_channels=4, text_dim=16, freq_dim=8, ffn_dim=ffn, num_layers=2)
    return wan_original_layout(m)


@pytest.fixture(scope="module")
def wan_file(tmp_path_factory):
    d = tmp_path_factory.mktemp("wan")
    sd = wan(512)
    save_file(sd, d / "wan.safetensors")
    return d / "wan.safetensors", sd


def expected(name: str, shape, mix: str, v_seen: list) -> str | None:
    """The patch's type for a block matrix (None: not a quantized block matrix, checked elsewhere)."""
    if not name.startswith("blocks.") or not name.endswith(".weight") or len(shape) != 2 or "norm" in name:
        return None
    v_types, down = PATCH[mix]
    if name.endswith(".v.weight"):
        v_seen.append(name)
        t = v_types[len(v_seen) - 1]
    elif ".ffn.2." in name:
        t = down
    else:
        t = DEFAULT[mix]
    if t.endswith("_K") and shape[-1] % 256:
        return "F16"
    return t


def read(path):
    r = gguf.GGUFReader(path)
    return r, {t.name: t for t in r.tensors}


@pytest.mark.parametrize("mix", list(PATCH))
def test_image_mix_types_and_bytes_equal_llama_cpp(tmp_path, run_ckpt, ggml_lib, wan_file, mix, monkeypatch):
    import ckpt.io.output as output
    from helpers import ggml_ref

    monkeypatch.setattr(output, "BAND_ELEMS", 256 * 96)  # several bands per matrix
    src, sd = wan_file
    out = tmp_path / "o.gguf"
    code, _, err = run_ckpt("convert", src, "--to", f"gguf-{mix}", "-o", out)
    assert code == 0, err
    r, tensors = read(out)
    assert r.fields["general.file_type"].contents() == gguf.LlamaFileType[f"MOSTLY_{mix.upper()}"]
    assert r.fields["general.architecture"].contents() == "wan"
    seen, checked = [], 0
    for name, t in sorted(tensors.items()):  # llama-quantize visits (and counts) the tensors by name
        want = expected(name, tuple(sd[name].shape), mix, seen)
        if want is None:
            assert t.tensor_type in (T.F32, T.BF16), name  # what the F16/BF16 step gives (test_gguf_write pins it)
            continue
        assert t.tensor_type.name == want, name
        ref = ggml_ref.quantize(REF_NAME[want], sd[name].float().numpy())
        assert np.asarray(t.data).tobytes() == ref, name
        checked += 1
    assert len(seen) == 4 and checked >= 12


def test_pure_alias_and_default_name(tmp_path, run_ckpt, ggml_lib, wan_file):
    """--pure: no bumps; `q4_k` is llama-quantize's alias of Q4_K_M; the default output is named SRC-Q4_K_M.gguf."""
    src, sd = wan_file
    code, _, err = run_ckpt("convert", src, "--to", "gguf-q4_k_m", "--pure", "-o", tmp_path / "p.gguf")
    assert code == 0, err
    _, pure = read(tmp_path / "p.gguf")
    assert pure["blocks.0.self_attn.v.weight"].tensor_type == T.Q4_K
    assert pure["blocks.0.ffn.2.weight"].tensor_type == T.Q4_K
    code, _, err = run_ckpt("convert", src, "--to", "gguf-q4_k", "-o", tmp_path / "a.gguf")
    assert code == 0, err
    code, _, err = run_ckpt("convert", src, "--to", "gguf-q4_k_m", "-o", tmp_path / "m.gguf")
    assert code == 0, err
    assert (tmp_path / "a.gguf").read_bytes() == (tmp_path / "m.gguf").read_bytes()
    copy = tmp_path / "w.safetensors"
    copy.write_bytes(src.read_bytes())
    code, _, err = run_ckpt("convert", copy, "--to", "gguf-q4_k")
    assert code == 0, err
    assert (tmp_path / "w-Q4_K_M.gguf").exists()


def test_rows_not_whole_k_blocks_fall_back_to_f16_and_are_counted(tmp_path, run_ckpt, ggml_lib):
    """ffn.2 rows of 320: not a multiple of 256, so K-types fall back to F16 as the patch does (counted in the
    summary); Q4_0 still fits (32) and gets the patch's FFN-down bump to Q4_1."""
    from helpers import ggml_ref

    sd = wan(320)
    save_file(sd, tmp_path / "wan.safetensors")
    code, _, err = run_ckpt("convert", tmp_path / "wan.safetensors", "--to", "gguf-q4_k_m", "-o", tmp_path / "k.gguf")
    assert code == 0, err
    assert "2 tensors fell back to another type (rows not a whole number of blocks): 2 Q6_K -> F16" in err
    _, k = read(tmp_path / "k.gguf")
    for i in (0, 1):
        t = k[f"blocks.{i}.ffn.2.weight"]
        assert t.tensor_type == T.F16
        assert np.array_equal(np.asarray(t.data), sd[f"blocks.{i}.ffn.2.weight"].float().numpy().astype(np.float16))
    code, _, err = run_ckpt("convert", tmp_path / "wan.safetensors", "--to", "gguf-q4_0", "-o", tmp_path / "l.gguf")
    assert code == 0, err
    assert "fell back" not in err
    _, leg = read(tmp_path / "l.gguf")
    t = leg["blocks.0.ffn.2.weight"]
    assert t.tensor_type == T.Q4_1
    assert np.asarray(t.data).tobytes() == ggml_ref.quantize("q4_1", sd["blocks.0.ffn.2.weight"].float().numpy())


def test_nonfinite_values_are_counted_not_fatal(tmp_path, run_ckpt):
    sd = wan(512)
    w = sd["blocks.0.self_attn.q.weight"]
    w[0, 0], w[1, 5], w[2, 7] = float("nan"), float("inf"), float("-inf")
    save_file(sd, tmp_path / "wan.safetensors")
    code, _, err = run_ckpt("convert", tmp_path / "wan.safetensors", "--to", "gguf-q4_k_m", "-o", tmp_path / "o.gguf")
    assert code == 0, err
    assert "warning: 3 NaN/Inf values were already in the input" in err
    _, t = read(tmp_path / "o.gguf")
    q = t["blocks.0.self_attn.q.weight"]
    dec = gguf.quants.dequantize(np.asarray(q.data), q.tensor_type)
    assert np.isfinite(dec[3:]).all()  # rows without a NaN/Inf keep their values


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_encodes_the_same_bytes(tmp_path, run_ckpt, wan_file):
    src, _ = wan_file
    for dev, out in (("cpu", "c.gguf"), ("cuda", "g.gguf")):
        code, _, err = run_ckpt("convert", src, "--to", "gguf-q4_k_m", "--device", dev, "-o", tmp_path / out)
        assert code == 0, err
    assert (tmp_path / "c.gguf").read_bytes() == (tmp_path / "g.gguf").read_bytes()


def test_merge_lora_to_gguf_merges_and_quantizes_in_one_pass(tmp_path, run_ckpt, ggml_lib, wan_file):
    """`merge-lora BASE LORA --to gguf-q4_k_m`: every tensor the types `convert --to gguf-q4_k_m` gives, the merged
    ones quantized from ckpt's own fp32 merge, bytes as llama.cpp's quantizer writes them."""
    from helpers import ggml_ref
    from helpers.keep_format import kohya_lora, plain_merge

    src, sd = wan_file
    lora = kohya_lora(tmp_path / "l.safetensors", {"blocks.0.self_attn.q": (256, 256), "blocks.1.ffn.2": (256, 512)})
    merged = plain_merge(run_ckpt, src, lora, tmp_path)
    code, _, err = run_ckpt("merge-lora", src, lora, "--to", "gguf-q4_k_m", "-o", tmp_path / "m.gguf")
    assert code == 0, err
    code, _, err = run_ckpt("convert", src, "--to", "gguf-q4_k_m", "-o", tmp_path / "c.gguf")
    assert code == 0, err
    _, m = read(tmp_path / "m.gguf")
    _, c = read(tmp_path / "c.gguf")
    assert {n: t.tensor_type for n, t in m.items()} == {n: t.tensor_type for n, t in c.items()}
    for name in ("blocks.0.self_attn.q.weight", "blocks.1.ffn.2.weight"):
        want = REF_NAME[m[name].tensor_type.name]
        assert np.asarray(m[name].data).tobytes() == ggml_ref.quantize(want, merged[name].numpy()), name
    same = [n for n in m if n not in ("blocks.0.self_attn.q.weight", "blocks.1.ffn.2.weight")]
    assert all(np.asarray(m[n].data).tobytes() == np.asarray(c[n].data).tobytes() for n in same)
    # bad input: a GGUF type and --keep-format, a GGUF type and --format: one line, nothing written
    for extra, problem in ((("--keep-format",), "choose one"), (("--format", "torch"), "the output is a GGUF file")):
        code, _, err = run_ckpt("merge-lora", src, lora, "--to", "gguf-q4_k_m", *extra, "-o", tmp_path / "x.gguf")
        assert code == 2 and problem in err and err.count("\n") == 1, err
        assert not (tmp_path / "x.gguf").exists()
