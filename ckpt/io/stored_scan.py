"""Whether a small stored tensor is all zero, answered from its bytes without torch.

merge-lora asks it of every LoRA factor while planning (an untrained factor changes nothing), before any
output byte. Read through torch, it imported torch (1.1-1.35 s on a 2-core machine) and kept the kernel
copies of untouched tensors (`ckpt.io.early_copies`) from starting during that import. For F32, F16 and BF16
it is a bit test: zero is every bit but the sign clear (-0.0 is zero, as `Tensor.any()` says). Any other
dtype, or a tensor that is not stored bytes, returns None: the caller asks torch as before.
"""

from __future__ import annotations

from ckpt.io.tensors import read_ranges
from ckpt.lazy import numpy as np

# safetensors name -> (numpy type of its bits, little-endian as stored; every bit but the sign)
_BITS = {"F32": ("<u4", 0x7FFFFFFF), "F16": ("<u2", 0x7FFF), "BF16": ("<u2", 0x7FFF)}


def _bits(t):
    """`t`'s elements as unsigned integers of their width (numpy), or None where this module does not answer."""
    spec = _BITS.get(t.dtype_name)
    ranges = t.byte_ranges() if spec is not None else None
    if ranges is None:
        return None, None
    buf = bytearray(sum(r.length for r in ranges))
    read_ranges(ranges, buf)
    return np.frombuffer(buf, dtype=spec[0]), spec


def all_zero(t) -> bool | None:
    """Whether stored `t` holds no nonzero value (-0.0 is zero); None: ask torch."""
    x, spec = _bits(t)
    if x is None:
        return None
    return not bool((x & spec[1]).any())

