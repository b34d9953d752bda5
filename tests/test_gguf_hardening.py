"""GGUF input that llama.cpp's reader and ckpt once took on trust (issue #20): each is one line
`error: FILE: ...`, exit 2, nothing written, the input's bytes unchanged, and fast (no hang, no growing RSS).

1. LLM metadata checked for type and range against the tensors it describes;
2. header counts and lengths checked against the file's size before gguf's GGUFReader runs;
3. a tensor with a zero dimension is read as the empty tensor it is (gguf reads it so; ggml allows ne = 0);
4. NaN/Inf values re-encoded into GGUF blocks are counted in the report, with no numpy warnings on stderr.
"""

from __future__ import annotations

import json
import struct
import time
import warnings

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf import GGUFValueType as V
from safetensors.torch import load_file, save_file

from gguf_helpers import quantized, tiny_llm_gguf, write_gguf
from helpers.refusals import assert_refused

RNG = np.random.default_rng(20)


def refused(run_ckpt, tmp_path, src, problem, command="convert"):
    """The CLI refuses `src` in one line naming it, exit 2, within seconds; nothing written; bytes unchanged."""
    before = src.read_bytes()
    args = {"convert": ["convert", src, "--to", "bf16", "-o", tmp_path / "out"],
            "inspect": ["inspect", src]}[command]
    t0 = time.monotonic()
    assert_refused(run_ckpt, tmp_path, args, f"{src}: ", problem)
    assert time.monotonic() - t0 < 10
    assert src.read_bytes() == before


# ---- 1. llama.cpp metadata -------------------------------------------------------------------------

HC = "'qwen2.attention.head_count'"
META = {
    "head_count 0": ({"attention__head_count": 0}, f"metadata {HC} is 0, not an integer of at least 1"),
    "head_count 'four'": ({"attention__head_count": "four"}, f"metadata {HC} is 'four', not an integer of at least 1"),
    "head_count 3": ({"attention__head_count": 3},
                     f"metadata {HC} is 3, which does not divide the 32 rows of blk.0.attn_q.weight into heads"),
    "head_count -4": ({"attention__head_count": (-4, V.INT32)}, f"metadata {HC} is -4, not an integer of at least 1"),
    "head_count 2.0": ({"attention__head_count": 2.0}, f"metadata {HC} is 2.0, not an integer of at least 1"),
    "head_count true": ({"attention__head_count": True}, f"metadata {HC} is True, not an integer of at least 1"),
    "head_count_kv 4 (k rows)": ({"attention__head_count": 4, "attention__head_count_kv": 4},
                                 "'qwen2.attention.head_count_kv' is 4, but blk.0.attn_k.weight has 16 rows, not 4 "
                                 "heads of 8"),
    "head_count_kv 3": ({"attention__head_count_kv": 3},
                        "metadata 'qwen2.attention.head_count_kv' is 3, which does not divide "
                        "qwen2.attention.head_count (2)"),
    "rope.freq_base 'x'": ({"rope__freq_base": "x"},
                           "metadata 'qwen2.rope.freq_base' is 'x', not a finite number above 0"),
    "rope.freq_base nan": ({"rope__freq_base": float("nan")}, "metadata 'qwen2.rope.freq_base' is nan, not a finite"),
    "rms eps 'x'": ({"attention__layer_norm_rms_epsilon": "x"},
                    "metadata 'qwen2.attention.layer_norm_rms_epsilon' is 'x', not a finite number above 0"),
    "rope.scaling.factor 'x'": ({"rope__scaling__type": "linear", "rope__scaling__factor": "x"},
                                "metadata 'qwen2.rope.scaling.factor' is 'x', not a finite number above 0"),
    "rope.scaling.type 3": ({"rope__scaling__type": 3}, "metadata 'qwen2.rope.scaling.type' is 3, not a string"),
    "context_length 'x'": ({"context_length": "x"},
                           "metadata 'qwen2.context_length' is 'x', not an integer of at least 1"),
    "block_count 2^31": ({"block_count": 2 ** 31},
                         "metadata 'qwen2.block_count' is 2147483648, but the file has tensors for 1 block (0-0)"),
    "block_count 0": ({"block_count": 0}, "metadata 'qwen2.block_count' is 0, not an integer of at least 1"),
    "embedding_length 48": ({"embedding_length": 48},
                            "metadata 'qwen2.embedding_length' is 48, but token_embd.weight has rows of 32"),
    "feed_forward_length 'x'": ({"feed_forward_length": "x"},
                                "metadata 'qwen2.feed_forward_length' is 'x', not an integer of at least 1"),
    "feed_forward_length 65": ({"feed_forward_length": 65},
                               "metadata 'qwen2.feed_forward_length' is 65, but blk.0.ffn_up.weight has 64 rows"),
    "bos_token_id 'x'": ({"tokenizer__ggml__bos_token_id": "x"},
                         "metadata 'tokenizer.ggml.bos_token_id' is 'x', not an integer of at least 0"),
    "head_count missing": ({"attention__head_count": None}, f"metadata {HC} is missing (needed for config.json)"),
}


@pytest.mark.parametrize("case", list(META))
def test_llm_metadata_is_checked(tmp_path, run_ckpt, case):
    kv, problem = META[case]
    src = tiny_llm_gguf(tmp_path / "m.gguf", **kv)
    refused(run_ckpt, tmp_path, src, problem)


def test_llama_head_size_must_be_even_for_the_rope_unpermutation(tmp_path, run_ckpt):
    src = tiny_llm_gguf(tmp_path / "m.gguf", "llama", attention__head_count=32, attention__head_count_kv=16)
    refused(run_ckpt, tmp_path, src, "metadata 'llama.attention.head_count' is 32, giving heads of 1 row (of 32); "
                                     "llama's RoPE rows come in pairs")


def test_block_count_must_match_the_blocks_present(tmp_path, run_ckpt):
    from gguf_helpers import LLM_KV

    kv = {f"qwen2.{k}": v for k, v in LLM_KV.items()} | {"qwen2.block_count": 3}
    tensors = {"token_embd.weight": RNG.standard_normal((8, 32)).astype(np.float32),
               "blk.0.attn_norm.weight": np.ones(32, np.float32), "blk.2.attn_norm.weight": np.ones(32, np.float32)}
    write_gguf(tmp_path / "m.gguf", "qwen2", tensors, kv=kv)
    refused(run_ckpt, tmp_path, tmp_path / "m.gguf",
            "metadata 'qwen2.block_count' is 3, but the file has tensors for 2 blocks (0-2), none for block 1")


@pytest.mark.parametrize("scalar,problem", [
    ("token_embd.weight", "tensor token_embd.weight is [], not the [vocabulary, embedding_length] matrix"),
    ("blk.0.attn_q.weight", "tensor blk.0.attn_q.weight is a scalar, not the rows of a projection"),
])
def test_scalar_where_llm_rows_are_read_is_refused(tmp_path, run_ckpt, scalar, problem):
    """A 0-D tensor where config.json's sizes are read (once an IndexError, or a ZeroDivisionError in
    llama's RoPE unpermutation)."""
    from gguf_helpers import LLM_KV

    tensors = {"token_embd.weight": RNG.standard_normal((8, 32)).astype(np.float32),
               "blk.0.attn_q.weight": RNG.standard_normal((32, 32)).astype(np.float32),
               "blk.0.attn_k.weight": RNG.standard_normal((16, 32)).astype(np.float32)}
    tensors[scalar] = np.float32(3.0).reshape(())
    write_gguf(tmp_path / "m.gguf", "llama", tensors, kv={f"llama.{k}": v for k, v in LLM_KV.items()})
    refused(run_ckpt, tmp_path, tmp_path / "m.gguf", problem)


def test_inspect_reports_bad_metadata_without_building_2_31_blocks(tmp_path, run_ckpt):
    src = tiny_llm_gguf(tmp_path / "m.gguf", block_count=2 ** 31)
    t0 = time.monotonic()
    code, out, err = run_ckpt("inspect", src)
    assert code == 0 and time.monotonic() - t0 < 10
    assert "cannot be decoded by ckpt" in out and "'qwen2.block_count' is 2147483648" in out


def test_good_llm_metadata_still_converts(tmp_path, run_ckpt):
    src = tiny_llm_gguf(tmp_path / "m.gguf", "llama", rope__scaling__type="linear", rope__scaling__factor=2.0,
                        tokenizer__ggml__bos_token_id=1)
    code, _, err = run_ckpt("convert", src, "--to", "fp32", "-o", tmp_path / "hf", "-q")
    assert code == 0, err
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    shape = (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"], cfg["num_hidden_layers"])
    assert shape == (2, 1, 16, 1)
    assert cfg["rope_scaling"] == {"rope_type": "linear", "factor": 2.0} and cfg["bos_token_id"] == 1


# ---- 2. header counts and lengths against the file's size ---------------------------------------------

def _header_with_first_kv(vtype: int, payload: bytes, n_tensors=0, n_kv=1) -> bytes:
    key = b"general.architecture"
    return b"GGUF" + struct.pack("<IQQ", 3, n_tensors, n_kv) + struct.pack("<Q", len(key)) + key + \
        struct.pack("<I", vtype) + payload + bytes(64)


HEADERS = {
    # the filer's file: the first key is an ARRAY of 7.9e18 values (gguf's reader loops, RSS growing)
    "array count 7.9e18": (_header_with_first_kv(V.ARRAY, struct.pack("<IQ", V.UINT8, 7_900_000_000_000_000_000)),
                           "array count of 'general.architecture' at byte 60 is 7900000000000000000, more than the "
                           "64 bytes left"),
    "string array count 2^62": (_header_with_first_kv(V.ARRAY, struct.pack("<IQ", V.STRING, 2 ** 62)),
                                "array count of 'general.architecture' at byte 60 is 4611686018427387904"),
    "string length 2^63": (_header_with_first_kv(V.STRING, struct.pack("<Q", 2 ** 63)),
                           "value of 'general.architecture' at byte 56 is 9223372036854775808 bytes long"),
    "kv count 2^60": (_header_with_first_kv(V.UINT8, b"\x01", n_kv=2 ** 60),
                      "key-value count at byte 16 is 1152921504606846976, more than the"),
    "tensor count 2^60": (_header_with_first_kv(V.UINT8, b"\x01", n_tensors=2 ** 60),
                          "tensor count at byte 8 is 1152921504606846976, more than the"),
    "value type 13": (_header_with_first_kv(13, b"\x01"),
                      "unknown metadata value type 13 (key 'general.architecture')"),
    "array of arrays": (_header_with_first_kv(V.ARRAY, struct.pack("<IQ", V.ARRAY, 1) + struct.pack("<IQ", V.UINT8, 1)),
                        "metadata 'general.architecture' is an array of arrays"),
    "big-endian": (b"GGUF" + struct.pack(">IQQ", 3, 0, 0) + bytes(8), "big-endian GGUF files are not supported"),
    "version 1": (b"GGUF" + struct.pack("<IQQ", 1, 0, 0) + bytes(8), "unsupported GGUF version 1"),
}


@pytest.mark.parametrize("command", ["inspect", "convert"])
@pytest.mark.parametrize("case", list(HEADERS))
def test_header_counts_are_checked_before_parsing(tmp_path, run_ckpt, case, command):
    data, problem = HEADERS[case]
    src = tmp_path / "m.gguf"
    src.write_bytes(data)
    refused(run_ckpt, tmp_path, src, problem, command)


def _tensor_info(data: bytes, name: str) -> int:
    """Byte offset of a tensor info's n_dims field."""
    raw = name.encode()
    return data.index(struct.pack("<Q", len(raw)) + raw) + 8 + len(raw)


def _small(tmp):
    p = tmp / "m.gguf"
    write_gguf(p, "flux", {"a.weight": (quantized(RNG.standard_normal((4, 64)).astype(np.float32), T.Q8_0)[0], T.Q8_0),
                           "b.weight": RNG.standard_normal((4, 64)).astype(np.float32)})
    return p


def _patch(p, fmt, at, value):
    data = bytearray(p.read_bytes())
    struct.pack_into(fmt, data, at, value)
    p.write_bytes(bytes(data))


TENSOR_INFOS = {
    "n_dims 2^31": (0, "<I", 2 ** 31, "tensor 'b.weight' has 2147483648 dims; ckpt reads GGUF tensors of at most 8"),
    "dim 2^40": (4, "<Q", 2 ** 40, "tensor 'b.weight' data runs past the end of the file"),
    "dim 2^64-1": (4, "<Q", 2 ** 64 - 1, "tensor 'b.weight' has a dimension of 18446744073709551615, past ggml's"),
    "dim not whole blocks": (4, "<Q", 63, "tensor 'b.weight' has rows of 63 values, not a whole number of F32"),
    "type 99": (20, "<I", 99, "unknown tensor type (tensor 'b.weight' has type 99)"),
    "offset 2^40": (24, "<Q", 2 ** 40, "tensor 'b.weight' data runs past the end of the file"),
}


@pytest.mark.parametrize("case", list(TENSOR_INFOS))
def test_tensor_infos_are_checked(tmp_path, run_ckpt, case):
    rel, fmt, value, problem = TENSOR_INFOS[case]
    src = _small(tmp_path)
    if case == "dim not whole blocks":  # a Q8_0 row of 63 values: blocks are 32
        rel, problem = 4, "tensor 'a.weight' has rows of 63 values, not a whole number of Q8_0 blocks of 32"
        _patch(src, fmt, _tensor_info(src.read_bytes(), "a.weight") + rel, value)
    else:
        _patch(src, fmt, _tensor_info(src.read_bytes(), "b.weight") + rel, value)
    refused(run_ckpt, tmp_path, src, problem)


def test_alignment_must_be_a_power_of_two(tmp_path, run_ckpt):
    src = tmp_path / "m.gguf"
    write_gguf(src, "flux", {"b.weight": RNG.standard_normal((4, 64)).astype(np.float32)},
               kv={"general.alignment": 64})
    data = src.read_bytes()
    at = data.index(b"general.alignment") + len("general.alignment") + 4
    _patch(src, "<I", at, 48)
    refused(run_ckpt, tmp_path, src, "'general.alignment' is 48, not a power of two")


# ---- 3. a zero dimension ------------------------------------------------------------------------------

def test_zero_dimension_reads_as_an_empty_tensor(tmp_path, run_ckpt):
    """ggml allows ne = 0 and gguf's reader reads such a tensor as an empty array, so it is valid GGUF: it
    converts to the empty tensor it is (a Q8_0 one of rows of 0 values once divided by zero)."""
    src = tmp_path / "m.gguf"
    x = RNG.standard_normal((4, 64)).astype(np.float32)
    write_gguf(src, "flux", {"a.weight": (quantized(x, T.Q8_0)[0], T.Q8_0),
                             "empty_rows.weight": (np.zeros((4, 0), np.uint8), T.Q8_0),  # 4 rows of 0 values
                             "no_rows.weight": (np.zeros((0, 34), np.uint8), T.Q8_0),  # 0 rows of 32 values
                             "f32.weight": np.zeros((0, 8), np.float32)})
    r = {t.name: t for t in gguf.GGUFReader(src).tensors}
    code, out, err = run_ckpt("convert", src, "--to", "fp32", "-o", tmp_path / "o.safetensors", "-q")
    assert code == 0, err
    got = load_file(tmp_path / "o.safetensors")
    assert got["empty_rows.weight"].shape == (4, 0) and got["no_rows.weight"].shape == (0, 32)
    assert got["f32.weight"].shape == (0, 8)
    assert r["empty_rows.weight"].data.size == 0 and r["no_rows.weight"].data.size == 0
    assert torch.equal(got["a.weight"], torch.from_numpy(gguf.quants.dequantize(r["a.weight"].data, T.Q8_0)))
    code, out, err = run_ckpt("inspect", src)
    assert code == 0, err


# ---- 4. NaN/Inf re-encoded into GGUF: counted, no numpy warnings --------------------------------------

def _no_runtime_warnings(run):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = run()
    assert not [w for w in caught if issubclass(w.category, RuntimeWarning)], [str(w.message) for w in caught]
    return result


def test_nan_into_q8_0_is_counted_without_numpy_warnings(tmp_path, run_ckpt):
    from helpers.flux_names import tiny_flux

    sd = tiny_flux(torch.float32)
    sd["double_blocks.0.img_attn.proj.weight"][3, 5] = float("nan")
    sd["double_blocks.0.img_attn.proj.weight"][7, :] = float("inf")
    save_file(sd, tmp_path / "m.safetensors")
    code, out, err = _no_runtime_warnings(
        lambda: run_ckpt("convert", tmp_path / "m.safetensors", "--to", "gguf-q8_0", "-o", tmp_path / "o.gguf"))
    assert code == 0, err
    assert "RuntimeWarning" not in err
    assert "65 NaN/Inf values were already in the input" in err


def test_nan_delta_into_q4_0_base_is_counted_without_numpy_warnings(tmp_path, run_ckpt):
    x = (RNG.standard_normal((64, 96)) * 0.05).astype(np.float32)
    write_gguf(tmp_path / "m.gguf", "wan", {"blocks.0.ffn.0.weight": (quantized(x, T.Q4_0)[0], T.Q4_0)})
    g = torch.Generator().manual_seed(0)
    up = torch.randn(64, 4, generator=g) * 0.1
    up[0, 0] = float("nan")  # a NaN delta in row 0: its 96 merged values are NaN
    lora = tmp_path / "l.safetensors"
    k = "lora_unet_blocks_0_ffn_0"
    save_file({f"{k}.lora_down.weight": torch.randn(4, 96, generator=g) * 0.1, f"{k}.lora_up.weight": up,
               f"{k}.alpha": torch.tensor(2.0)}, lora)
    code, out, err = _no_runtime_warnings(
        lambda: run_ckpt("merge-lora", tmp_path / "m.gguf", lora, "--keep-format", "-o", tmp_path / "o.gguf"))
    assert code == 0, err
    assert "RuntimeWarning" not in err
    assert "96 NaN/Inf values were already in the input" in err


def test_empty_metadata_array_is_kept_by_keep_format(tmp_path, run_ckpt):
    """An empty array is valid GGUF (gguf's reader reads it, though its writer will not write one): a
    --keep-format merge writes it back with its element type, not a traceback."""
    x = (RNG.standard_normal((64, 96)) * 0.05).astype(np.float32)
    src = tmp_path / "m.gguf"
    write_gguf(src, "wan", {"blocks.0.ffn.0.weight": (quantized(x, T.Q8_0)[0], T.Q8_0)},
               kv={"x.empty": ([7], V.ARRAY, V.UINT8)})
    data, start = src.read_bytes(), gguf.GGUFReader(src).data_offset
    at = data.index(b"x.empty") + len("x.empty") + 4 + 4  # the array's count, then its one element
    assert struct.unpack_from("<QB", data, at) == (1, 7)
    data = data[:at] + struct.pack("<Q", 0) + data[at + 9:start] + b"\0" + data[start:]  # one byte less, one pad more
    src.write_bytes(data)
    assert gguf.GGUFReader(src).fields["x.empty"].contents() == []
    g = torch.Generator().manual_seed(1)
    k = "lora_unet_blocks_0_ffn_0"
    save_file({f"{k}.lora_down.weight": torch.randn(4, 96, generator=g) * 0.1,
               f"{k}.lora_up.weight": torch.randn(64, 4, generator=g) * 0.1, f"{k}.alpha": torch.tensor(2.0)},
              tmp_path / "l.safetensors")
    code, out, err = run_ckpt("merge-lora", src, tmp_path / "l.safetensors", "--keep-format", "-o", tmp_path / "o.gguf")
    assert code == 0, err
    f = gguf.GGUFReader(tmp_path / "o.gguf").fields["x.empty"]
    assert f.contents() == [] and list(f.types) == [V.ARRAY] and int(f.parts[-2][0]) == V.UINT8
