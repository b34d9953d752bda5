"""Every GGML block type llama-quantize can write is read back by ckpt as llama.cpp reads it: `ckpt.quant.gguf.
dequantize` (gguf's numpy decoders, and ckpt's own for Q1_0 and Q2_0, which gguf 0.19 cannot decode) against ggml's
`dequantize_row_<type>` (tests/helpers/ggml_ref.py), bit for bit, on blocks ggml's quantizer wrote and on arbitrary
bytes (scales that are Inf/NaN, every grid index); and whole Q1_0 / Q2_0 files written by llama.cpp's own quantizer
(type 42 is unknown to gguf 0.19: `ckpt.io.ggml_types` adds it) are opened by ckpt and by gguf's reader, their
values ggml's."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from helpers import ggml_ref, llama_ref
from helpers.llm_mix_models import MODELS, write_model

from ckpt.io.ggml_types import MISSING_TYPES, block_size, gguf_package, type_name

TYPES = list(ggml_ref.BLOCKS)
NEEDS_IMATRIX = ("iq2_xxs", "iq2_xs", "iq1_s")  # ggml_quantize_requires_imatrix


def type_number(name: str) -> int:
    return int(gguf_package().GGMLQuantizationType[name.upper()])


def ckpt_values(name: str, raw: bytes, n: int) -> np.ndarray:
    from ckpt.quant.gguf import dequantize

    return dequantize(torch.frombuffer(bytearray(raw), dtype=torch.uint8), type_number(name), n).numpy().reshape(-1, n)


def same(a: np.ndarray, b: np.ndarray) -> bool:
    """Equal bit for bit, NaN beside NaN whatever its payload."""
    return a.shape == b.shape and bool(np.all((a.view(np.uint32) == b.view(np.uint32)) | (np.isnan(a) & np.isnan(b))))


@pytest.mark.parametrize("name", TYPES)
def test_ckpt_reads_every_block_type_as_llama_cpp_does(ggml_lib, name):
    blk, nbytes = ggml_ref.BLOCKS[name]
    n = max(blk, 256) * 2
    rng = np.random.default_rng(7)
    for scale in (0.02, 3.0, 4e4):  # (ggml's IQ1_S/IQ2_S search takes seconds per block at 1e-3: left out)
        x = (rng.standard_normal((6, n)) * scale).astype(np.float32)
        x[0, :blk] = 0  # an all-zero block
        x[1, 5] = scale * 40  # one large value
        qw = rng.random(n).astype(np.float32) + 0.05
        raw = ggml_ref.quantize(name, x, imatrix=qw if name in NEEDS_IMATRIX else None, release=True)
        assert same(ckpt_values(name, raw, n), ggml_ref.dequantize(name, raw, n)), (name, scale)
    # arbitrary blocks: fp16/E8M0/E4M3 scales of every kind (Inf and NaN included), every grid index and sign
    raw = rng.integers(0, 256, size=64 * nbytes, dtype=np.uint8).tobytes()
    assert same(ckpt_values(name, raw, blk), ggml_ref.dequantize(name, raw, blk)), name


def test_the_types_gguf_lacks_are_added_with_llama_cpps_numbers():
    """Q2_0 as ggml.h and ggml-common.h define it (type 42, 64 values in 18 bytes), MOSTLY_Q2_0 as llama.h does."""
    import llama_cpp  # llama-cpp-python's binding carries llama.h's and ggml.h's constants

    g = gguf_package()
    for name, (value, blk, size) in MISSING_TYPES.items():
        assert int(g.GGMLQuantizationType[name]) == value == getattr(llama_cpp, f"GGML_TYPE_{name}")
        assert g.GGML_QUANT_SIZES[g.GGMLQuantizationType(value)] == (blk, size) == ggml_ref.BLOCKS[name.lower()]
        assert type_name(value) == name and block_size(value) == (blk, size)
    assert int(g.LlamaFileType["MOSTLY_Q2_0"]) == llama_cpp.LLAMA_FTYPE_MOSTLY_Q2_0
    assert gguf_package() is g  # added once


@pytest.mark.parametrize("ftype, ggml_name", [("MOSTLY_Q2_0", "q2_0"), ("MOSTLY_Q1_0", "q1_0")])
def test_llama_cpps_q1_0_and_q2_0_files_read_back(ggml_lib, tmp_path, ftype, ggml_name):
    """llama.cpp quantizes a tiny llama to Q2_0 / Q1_0 (--pure: every matrix in the type); ckpt opens the file and
    decodes each such tensor to the values ggml decodes from the same bytes, and gguf's reader opens it too."""
    from ckpt.io.gguf import read_gguf_header
    from ckpt.io.tensors import FileHandles
    from ckpt.quant.gguf import GGUFValues

    src, out = tmp_path / "f16.gguf", tmp_path / "q.gguf"
    write_model(src, MODELS["llama8"])
    llama_ref.llama_cpp()
    llama_ref.quantize_gguf(src, out, ftype, pure=True)
    t_no = type_number(ggml_name)
    reader = gguf.GGUFReader(out)
    raw = {t.name: np.asarray(t.data).tobytes() for t in reader.tensors if int(t.tensor_type) == t_no}
    assert len(raw) > 50  # every matrix
    handles = FileHandles()
    try:
        header = read_gguf_header(out, handles, out.name)
        for name, data in raw.items():
            stored = header.tensors[name]
            assert stored.ggml_type == t_no and type_name(stored.ggml_type) == ggml_name.upper()
            v = GGUFValues(stored, None, "F32")
            got = v.read(0, v.shape[0], torch.device("cpu")).numpy().reshape(-1, v.row_len)
            assert same(got, ggml_ref.dequantize(ggml_name, data, v.row_len)), name
    finally:
        handles.close()
