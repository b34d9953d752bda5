"""optimum-quanto references: an int4 weight with a uint8 zero-point shift (quanto's own optimizer and
`quantize_weight`), and the packing of int4/int2 rows by docs/format-facts.md's definition."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("optimum.quanto")
from optimum.quanto import qint4, quantize_weight  # noqa: E402
from optimum.quanto.tensor.optimizers import MaxOptimizer  # noqa: E402


def int_shift_weight(dtype):
    torch.manual_seed(3)
    w = torch.randn(32, 256, dtype=dtype)
    scale, shift = MaxOptimizer()(w, qtype=qint4, axis=0, group_size=128, zeropoint=True)
    assert shift.dtype == torch.uint8
    return quantize_weight(w, qtype=qint4, axis=0, scale=scale, shift=shift, group_size=128, optimized=False)


def unpack_by_definition(packed: torch.Tensor, bits: int, rows: int) -> torch.Tensor:
    """docs/format-facts.md: bit field i of packed row r is unpacked row i*rows_p + r."""
    rp = packed.shape[0]
    out = torch.empty((rp * (8 // bits), *packed.shape[1:]), dtype=torch.uint8)
    for i in range(8 // bits):
        for r in range(rp):
            out[i * rp + r] = (packed[r] >> (bits * i)) & ((1 << bits) - 1)
    return out[:rows]
