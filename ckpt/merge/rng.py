"""Counter-based random numbers for the randomized methods (DARE, DELLA): the uniform value of element i of a
tensor is a hash of (seed, model, tensor name, i), so a drop mask is the same whatever the band size, the order
bands are read in, the device, or the other models in the config, and one band is made without the ones before it.

The hash: the seed, the model (its text in the config) and the tensor name give two 32-bit keys (BLAKE2b); the
element's 64-bit index is mixed with them by three rounds of a 32-bit integer finalizer ("lowbias32", Chris
Wellons' hash-prospector), computed in int64 torch ops that every device runs the same way; the top 24 bits are the
uniform value in [0, 1), exact in fp32. It is not mergekit's RNG (torch.bernoulli on the global generator, whose
draws depend on every tensor merged before), so masks differ from mergekit's while their statistics agree.
"""

from __future__ import annotations

import hashlib

from ckpt.lazy import torch

M32 = 0xFFFFFFFF


def keys(seed: int, model: str, tensor: str) -> tuple[int, int]:
    h = hashlib.blake2b(f"{seed}\0{model}\0{tensor}".encode(), digest_size=8).digest()
    return int.from_bytes(h[:4], "little"), int.from_bytes(h[4:], "little")


def _mix(x):
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & M32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & M32
    return x ^ (x >> 16)


def uniform(seed: int, model: str, tensor: str, offset: int, n: int, device) -> "torch.Tensor":
    """n uniform fp32 values in [0, 1) for elements offset .. offset + n - 1 of the tensor (flat index)."""
    k0, k1 = keys(seed, model, tensor)
    idx = torch.arange(offset, offset + n, dtype=torch.int64, device=device)
    x = _mix((idx & M32) ^ k0)
    x = _mix(x ^ (idx >> 32) ^ k1)
    x = _mix(x ^ k0)
    return (x >> 8).to(torch.float32) * (1.0 / (1 << 24))
