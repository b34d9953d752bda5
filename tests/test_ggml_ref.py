"""The llama.cpp quantizer oracle (tests/helpers/ggml_ref.py) is what it claims to be: compiled from the vendored
ggml-quants.c, its legacy types write the bytes `gguf.quants.quantize` writes (the reference ckpt's GGUF output is
already held to), and what it writes for every type gguf's dequantizer reads back close to the input."""

from __future__ import annotations

import numpy as np
import pytest

from helpers import ggml_ref


@pytest.mark.parametrize("name", ["q8_0", "q4_0", "q4_1", "q5_0", "q5_1"])
def test_legacy_types_equal_gguf_quantize(ggml_lib, name):
    import gguf

    x = np.random.default_rng(0).standard_normal((4, 512)).astype(np.float32)
    want = gguf.quants.quantize(x, getattr(gguf.GGMLQuantizationType, name.upper())).tobytes()
    assert ggml_ref.quantize(name, x) == want


# measured on these values: q2_K 0.298, q3_K 0.150, q4_K 0.072, q5_K 0.036, q6_K 0.018, iq4_nl 0.075, iq4_xs 0.075;
# each bound is about 1.2x that (a type written in the wrong layout reads back as noise, error ~1.4)
@pytest.mark.parametrize("name, rtol", [("q2_K", 0.36), ("q3_K", 0.18), ("q4_K", 0.09), ("q5_K", 0.045),
                                        ("q6_K", 0.022), ("iq4_nl", 0.09), ("iq4_xs", 0.09)])
def test_k_and_iq4_types_round_trip_through_gguf(ggml_lib, name, rtol):
    """Relative RMS error of quantize -> gguf's dequantize, bounded by what each type's bits allow."""
    import gguf

    x = np.random.default_rng(1).standard_normal((3, 1024)).astype(np.float32)
    qtype = getattr(gguf.GGMLQuantizationType, name.upper())
    raw = np.frombuffer(ggml_ref.quantize(name, x), dtype=np.uint8).reshape(3, -1)
    y = gguf.quants.dequantize(raw, qtype)
    assert y.shape == x.shape
    assert np.sqrt(np.mean((y - x) ** 2) / np.mean(x ** 2)) < rtol
