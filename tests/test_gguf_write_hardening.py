"""GGUF writing at its edges (`convert --to gguf-*`, issue 31 item 11), for every gguf-* type:

- a tensor without values (a dim of 0): ComfyUI-GGUF's convert.py keeps it F32 (at most 1024 values) and llama-quantize
  cannot quantize it (it divides by the row length), so ckpt writes it F32: the file is the one gguf's own GGUFWriter
  writes for the same tensors and keys, and gguf's reader gives every shape back. The LLM exporter, whose reference
  (convert_hf_to_gguf.py) crashes on such a tensor for a block type, refuses it in one line.
- a finite value too large for its block's fp16 scale (1e7, 3e38): the bytes stay llama.cpp's (gguf's quantize for the
  legacy types, llama.cpp's own ggml-quants.c for the K-quants and IQ4), and every finite value that gguf's dequantize
  then reads as NaN/Inf is counted in a warning (`nonfinite_decoded`, F16's overflow as `overflow`), per tensor, as the
  NaN/Inf inputs are.
"""

from __future__ import annotations

import json

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf import GGUFValueType as V
from safetensors.torch import load_file, save_file

from helpers.flux_names import rnd, tiny_flux
from helpers.refusals import assert_refused

IMAGE_TYPES = ["gguf-q8_0", "gguf-q6_k", "gguf-q5_k_m", "gguf-q5_k_s", "gguf-q4_k_m", "gguf-q4_k_s", "gguf-q3_k_l",
               "gguf-q3_k_m", "gguf-q3_k_s", "gguf-q2_k", "gguf-q5_1", "gguf-q5_0", "gguf-q4_1", "gguf-q4_0",
               "gguf-bf16", "gguf-f16", "gguf-f32"]
LEGACY = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")
GGML_NAME = {"Q2_K": "q2_K", "Q3_K": "q3_K", "Q4_K": "q4_K", "Q5_K": "q5_K", "Q6_K": "q6_K", "IQ4_NL": "iq4_nl",
             "IQ4_XS": "iq4_xs", **{t: t.lower() for t in LEGACY}}
EMPTY = {"double_blocks.0.img_attn.empty.weight": (256, 0), "double_blocks.0.img_attn.norows.weight": (0, 256),
         "double_blocks.0.img_attn.empty.bias": (0,), "double_blocks.0.img_attn.cube.weight": (4, 0, 8)}


def read(path):
    r = gguf.GGUFReader(path)
    return r, {t.name: t for t in r.tensors}


def shape_of(t) -> tuple:
    return tuple(int(d) for d in reversed(t.shape.tolist()))


def rewritten_by_gguf(path, out):
    """The same key-values and tensors (types, shapes, bytes), written again by gguf's own GGUFWriter."""
    r = gguf.GGUFReader(path)
    w = gguf.GGUFWriter(str(out), arch=r.fields["general.architecture"].contents())
    for key, f in r.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        w.add_key_value(key, f.contents(), f.types[0], sub_type=f.types[-1] if f.types[0] == V.ARRAY else None)
    for t in r.tensors:
        data = np.asarray(t.data)
        if t.tensor_type in (T.F32, T.F16):  # gguf's writer takes their shape from the array
            data = data.reshape(shape_of(t))
        w.add_tensor(t.name, data, raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out.read_bytes()


def oracle_bytes(x: np.ndarray, type_name: str) -> bytes:
    """What llama.cpp writes for these fp32 values in this GGML type: gguf's quantize (the legacy and plain types,
    the code convert.py runs), llama.cpp's ggml-quants.c as its release builds compile it (K-quants, IQ4: what
    llama-quantize runs; a debug build aborts on rows too large for `nearest_int`)."""
    from helpers import ggml_ref

    rows = x.reshape(-1, x.shape[-1]) if x.ndim else x.reshape(1, 1)
    if type_name in GGML_NAME and type_name not in LEGACY:
        return ggml_ref.quantize(GGML_NAME[type_name], rows, release=True)
    with np.errstate(all="ignore"):
        return np.ascontiguousarray(gguf.quants.quantize(rows, T[type_name])).tobytes()


def decoded_nonfinite(t, x: np.ndarray) -> int:
    """Finite values of `x` that gguf's dequantize of the stored tensor `t` reads as NaN/Inf."""
    with np.errstate(all="ignore"):
        back = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type).reshape(x.shape)
    return int((np.isfinite(x) & ~np.isfinite(back)).sum())


def counts(path) -> dict:
    return json.loads(path.read_text())["counts"]


# ------------------------------------------------------------------------------------------ empty tensors


@pytest.mark.parametrize("to", IMAGE_TYPES)
def test_an_empty_tensor_is_written_f32_as_gguf_writes_it(tmp_path, run_ckpt, ggml_lib, to):
    sd = tiny_flux(torch.float32)
    sd["double_blocks.0.img_attn.proj.weight"] = rnd(64, 256, dtype=torch.float32)  # rows of whole K blocks
    sd.update({n: torch.zeros(s) for n, s in EMPTY.items()})
    save_file(sd, tmp_path / "flux.safetensors")
    code, _, err = run_ckpt("convert", tmp_path / "flux.safetensors", "--to", to, "-o", tmp_path / "o.gguf")
    assert code == 0, err
    r, tensors = read(tmp_path / "o.gguf")
    assert {n: shape_of(t) for n, t in tensors.items()} == {n: tuple(v.shape) for n, v in sd.items()}
    assert {n: tensors[n].tensor_type for n in EMPTY} == {n: T.F32 for n in EMPTY}
    assert all(np.asarray(tensors[n].data).size == 0 for n in EMPTY)
    if to not in ("gguf-bf16", "gguf-f16", "gguf-f32"):
        assert "F32 (no values to quantize)" in err, err
    # the container: what gguf's own writer writes for these key-values and tensors
    assert (tmp_path / "o.gguf").read_bytes() == rewritten_by_gguf(tmp_path / "o.gguf", tmp_path / "ref.gguf")
    # the values: every other tensor as llama.cpp writes it
    for n, t in tensors.items():
        if t.tensor_type.name in GGML_NAME and n not in EMPTY:
            assert np.asarray(t.data).tobytes() == oracle_bytes(sd[n].numpy(), t.tensor_type.name), n
    # and ckpt reads the file back, empty tensors included
    code, _, err = run_ckpt("convert", tmp_path / "o.gguf", "--to", "fp32", "-q", "-o", tmp_path / "back.safetensors")
    assert code == 0, err
    back = load_file(tmp_path / "back.safetensors")
    assert {n: tuple(back[n].shape) for n in EMPTY} == EMPTY


# ----------------------------------------------------------------------- values too large for a block scale


def big_rows_flux() -> dict:
    """Flux names, rows of 256 (whole blocks of every type) in the quantized matrices, finite rows of 1e7, 3e38
    and -1e5 (beyond fp16: Q4_1/Q5_1 store the block minimum itself) in two of them, a row of 6e4 (within fp16)."""
    sd = tiny_flux(torch.float32)
    sd["double_blocks.0.img_attn.proj.weight"] = rnd(64, 256, dtype=torch.float32)
    sd["double_blocks.0.img_mod.lin.weight"] = rnd(384, 256, dtype=torch.float32)
    sd["double_blocks.0.img_attn.proj.weight"][3] = 1e7
    sd["double_blocks.0.img_attn.proj.weight"][9, :40] = -1e5
    sd["double_blocks.0.img_mod.lin.weight"][5] = 3e38
    sd["double_blocks.0.img_mod.lin.weight"][7, 100:] = -3e38
    sd["double_blocks.0.img_mod.lin.weight"][11] = 6e4
    return sd


@pytest.mark.parametrize("to", IMAGE_TYPES)
def test_values_too_large_for_a_block_scale_keep_llama_cpp_bytes_and_are_counted(tmp_path, run_ckpt, ggml_lib, to):
    sd = big_rows_flux()
    save_file(sd, tmp_path / "flux.safetensors")
    code, _, err = run_ckpt("convert", tmp_path / "flux.safetensors", "--to", to, "-o", tmp_path / "o.gguf",
                            "--report", tmp_path / "r.json")
    assert code == 0, err
    _, tensors = read(tmp_path / "o.gguf")
    got = counts(tmp_path / "r.json")
    seen = {}
    for n, t in tensors.items():
        x = sd[n].numpy()
        if t.tensor_type.name in GGML_NAME:
            assert np.asarray(t.data).tobytes() == oracle_bytes(x, t.tensor_type.name), n
        elif t.tensor_type == T.F16:
            with np.errstate(over="ignore"):  # to inf, as numpy casts (and convert.py writes)
                assert np.array_equal(np.asarray(t.data).reshape(x.shape), x.astype(np.float16)), n
        bad = decoded_nonfinite(t, x)
        said = got.get("nonfinite_decoded", {}).get(n, 0) + got.get("overflow", {}).get(n, 0)
        assert said == bad, (n, t.tensor_type.name, said, bad)
        if bad:
            seen[n] = bad
    assert "nonfinite_input" not in got  # every input value is finite
    if to in ("gguf-q8_0", "gguf-q2_k", "gguf-q4_k_m", "gguf-q4_0", "gguf-q4_1", "gguf-q5_0", "gguf-q5_1", "gguf-f16"):
        assert seen, "the issue's rows decode as NaN/Inf in these types"
    if seen:
        kind = "values overflowed to inf" if to == "gguf-f16" else "finite values decode as NaN/Inf"
        line = next(w for w in err.splitlines() if kind in w)
        assert line.startswith(f"warning: {sum(seen.values()):,} ") and all(n in line for n in seen), line
    else:
        assert "warning:" not in err, err


def test_nan_and_inf_inputs_are_counted_apart_from_what_their_blocks_spread_to(tmp_path, run_ckpt):
    """A NaN makes gguf's whole Q8_0 block NaN: the NaN is a `nonfinite_input`, its 31 finite neighbours are
    `nonfinite_decoded`; both warnings name the tensor."""
    sd = tiny_flux(torch.float32)
    w = sd["double_blocks.0.img_attn.qkv.weight"]
    w[0, 3], w[1, 40] = float("nan"), float("inf")
    save_file(sd, tmp_path / "flux.safetensors")
    code, _, err = run_ckpt("convert", tmp_path / "flux.safetensors", "--to", "gguf-q8_0", "-o", tmp_path / "o.gguf",
                            "--report", tmp_path / "r.json")
    assert code == 0, err
    _, tensors = read(tmp_path / "o.gguf")
    t = tensors["double_blocks.0.img_attn.qkv.weight"]
    got = counts(tmp_path / "r.json")
    assert got["nonfinite_input"] == {"double_blocks.0.img_attn.qkv.weight": 2}
    assert got["nonfinite_decoded"] == {"double_blocks.0.img_attn.qkv.weight": decoded_nonfinite(t, w.numpy())} \
        == {"double_blocks.0.img_attn.qkv.weight": 62}
    assert "warning: 62 finite values decode as NaN/Inf" in err and "warning: 2 NaN/Inf values were already" in err


# ------------------------------------------------------------------------------------- the LLM exporter


@pytest.fixture(scope="module")
def llm_folder(tmp_path_factory):
    pytest.importorskip("sentencepiece")
    from helpers.hf_llm import model_folder

    return model_folder(tmp_path_factory.mktemp("hf") / "llama", "llama")


def _edit(folder, changes: dict):
    sd = load_file(folder / "model.safetensors")
    for name, fn in changes.items():
        sd[name] = fn(sd[name])
    save_file(sd, folder / "model.safetensors", metadata={"format": "pt"})
    return sd


def test_an_llm_tensor_without_values_is_refused_for_block_types(tmp_path, run_ckpt, llm_folder):
    """An HF folder cannot hold one (its config's sizes are checked); a GGUF LLM can: requantized to a block type it
    is one line (convert_hf_to_gguf.py crashes on it, llama-quantize divides by its row length), to F16 it is written
    as gguf's writer writes it."""
    code, _, err = run_ckpt("convert", llm_folder, "--to", "gguf-f32", "-q", "-o", tmp_path / "f32.gguf")
    assert code == 0, err
    r = gguf.GGUFReader(tmp_path / "f32.gguf")
    w = gguf.GGUFWriter(str(tmp_path / "e.gguf"), arch=r.fields["general.architecture"].contents())
    for key, f in r.fields.items():
        if not key.startswith("GGUF.") and key != "general.architecture":
            w.add_key_value(key, f.contents(), f.types[0], sub_type=f.types[-1] if f.types[0] == V.ARRAY else None)
    for t in r.tensors:
        data = np.asarray(t.data).reshape(shape_of(t))
        w.add_tensor(t.name, np.zeros((256, 0), np.float32) if t.name == "blk.0.attn_output.weight" else data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    (tmp_path / "f32.gguf").unlink()
    for to in ("gguf-q8_0", "gguf-q4_k_m", "gguf-iq4_nl"):
        assert_refused(run_ckpt, tmp_path, ["convert", tmp_path / "e.gguf", "--to", to, "-o", tmp_path / "o.gguf"],
                       "tensor 'blk.0.attn_output.weight' has no values (shape [256, 0])", "cannot quantize it")
    code, _, err = run_ckpt("convert", tmp_path / "e.gguf", "--to", "gguf-f16", "-q", "-o", tmp_path / "f.gguf")
    assert code == 0, err
    _, tensors = read(tmp_path / "f.gguf")
    t = tensors["blk.0.attn_output.weight"]
    assert (t.tensor_type, shape_of(t), np.asarray(t.data).size) == (T.F16, (256, 0), 0)


# the rows of up_proj and gate_proj. IQ4_XS: not 3e38, where ckpt's encoder and a release llama.cpp differ (its
# nearest_int is then far outside the range it rounds in; a debug build aborts there): that block decodes as zeros
# either way, and IQ4_XS's fp16 scale never overflows (6-bit sub-scales of a small one)
BIG = {"gguf-iq4_nl": (1e7, 3e38), "gguf-iq4_xs": (1e7, -2e7), "gguf-q8_0": (1e7, 3e38), "gguf-q4_k_m": (1e7, 3e38)}


@pytest.mark.parametrize("to", list(BIG))
def test_llm_rows_too_large_for_a_block_scale_are_counted(tmp_path, run_ckpt, ggml_lib, llm_folder, to):
    import shutil

    hf = tmp_path / "hf"
    shutil.copytree(llm_folder, hf)

    def big(v):
        def edit(w):
            w = w.clone()
            w[3] = v
            return w
        return edit

    up, gate = BIG[to]
    sd = _edit(hf, {"model.layers.0.mlp.up_proj.weight": big(up), "model.layers.0.mlp.gate_proj.weight": big(gate)})
    code, _, err = run_ckpt("convert", hf, "--to", to, "-o", tmp_path / "o.gguf", "--report", tmp_path / "r.json")
    assert code == 0, err
    _, tensors = read(tmp_path / "o.gguf")
    got = counts(tmp_path / "r.json").get("nonfinite_decoded", {})
    for hf_name, name in (("model.layers.0.mlp.up_proj.weight", "blk.0.ffn_up.weight"),
                          ("model.layers.0.mlp.gate_proj.weight", "blk.0.ffn_gate.weight")):
        t, x = tensors[name], sd[hf_name].numpy()
        assert np.asarray(t.data).tobytes() == oracle_bytes(x, t.tensor_type.name), (name, t.tensor_type.name)
        assert got.get(name, 0) == decoded_nonfinite(t, x), (name, t.tensor_type.name)
    if to != "gguf-iq4_xs":
        assert got and "finite values decode as NaN/Inf" in err, err
