"""bitsandbytes as the oracle of its own 4-bit files: `quantize_4bit` + `QuantState.as_dict(packed=True)`,
the tensors a `Linear4bit` state dict saves."""

from __future__ import annotations

import pytest
import torch

F = pytest.importorskip("bitsandbytes.functional")


def bnb_4bit(w: torch.Tensor, quant_type: str, blocksize: int, nested: bool, prefix: str):
    """Stored tensors of one Params4bit `prefix` and bitsandbytes' own fp32 dequantization of them."""
    q, st = F.quantize_4bit(w, blocksize=blocksize, quant_type=quant_type, compress_statistics=nested)
    sd = {prefix: q} | {f"{prefix}.{k}": v for k, v in st.as_dict(packed=True).items()}
    st.dtype = torch.float32
    if w.shape[-1] % 2 == 0:
        return sd, F.dequantize_4bit(q, st)
    # odd rows: bitsandbytes' CPU dispatch runs its PyTorch reference under torch.compile (seconds to
    # compile); run the same function uncompiled, with the absmax dequantize_4bit would give it
    from bitsandbytes.backends.default.ops import _dequantize_4bit_compute

    absmax = (F.dequantize_blockwise(st.absmax, st.state2) + st.offset) if nested else st.absmax
    return sd, _dequantize_4bit_compute.__wrapped__(q.reshape(-1), absmax, st.code, blocksize, w.shape, torch.float32)
