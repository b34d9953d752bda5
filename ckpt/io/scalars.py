"""A stored scalar (a LoRA's `alpha`) as a Python float, from its bytes, without torch.

merge-lora reads every module's alpha while planning, before any output byte; through `Tensor.read_all` each
read imported torch (1.1-1.35 s on a 2-core machine), which kept the kernel copies of untouched tensors
(`ckpt.io.early_copies`) from starting while torch imports. The common stored dtypes decode from their
bytes here with the same value torch gives (`float(t.float().reshape(-1)[0])`: F32, F16 and BF16 widen
exactly to fp32, and fp32 exactly to a Python float); any other dtype, or a tensor that is not stored bytes
(decoded, pickled), is read through torch as before (`None` here tells the caller to).
"""

from __future__ import annotations

import struct

from ckpt.io.header import read_into

# safetensors dtype name -> how its first element is decoded to a float exactly (little-endian, as stored)
_WIDTH = {"F32": 4, "F16": 2, "BF16": 2}


def first_float(t) -> float | None:
    """The first element of `t` (a `ckpt.io.tensors.Tensor`) as its fp32 value in a Python float, read from
    its stored bytes; None where that needs torch (another dtype, no stored bytes, no element)."""
    width = _WIDTH.get(t.dtype_name)
    ranges = t.byte_ranges() if width is not None and t.numel else None
    if not ranges or ranges[0].length < width:
        return None
    buf = bytearray(width)
    read_into(ranges[0].fd(), memoryview(buf), ranges[0].start, ranges[0].path)
    if t.dtype_name == "F32":
        return struct.unpack("<f", buf)[0]
    if t.dtype_name == "F16":
        return struct.unpack("<e", buf)[0]
    return struct.unpack("<f", b"\0\0" + bytes(buf))[0]  # BF16: the top half of an fp32
