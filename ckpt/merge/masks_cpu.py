"""DARE's and DELLA's drop masks on the CPU as compiled kernels (`ckpt.jit`): the same bits as the torch
formulation (`ckpt.merge.rng.uniform` < keep probability), in one pass over the band instead of ~35.

Why: the counter-based hash is three rounds of a 32-bit finalizer, ~35 int64 torch ops over the band, each a full
pass through memory; DELLA's per-row stable argsort plus the scatter of ranks costs as much again. Both run twice
per band with the L1 rescale (its pass and the merge). That put DARE at ~2x and DELLA at ~6x the time of TIES
(issue 37). Here the hash is a handful of register ops per element, and the ranks come from sorting each row's
(magnitude key, index) pairs packed in one uint64 with numpy's vectorized sort (x86-simd-sort where the CPU has
AVX2/AVX-512): about 4 ns an element against 7-9 for the stable LSD radix sort of (key, index) pairs this module
had before, the same order.

Exactly the torch results, by construction:
- the hash: the same int arithmetic in uint64, masked to 32 bits after each product (the low 32 bits of a product
  do not depend on the width it is computed in);
- `u < p` with u = (hash >> 8) * 2^-24 (exact in fp32) and p a fp32 value is `(hash >> 8) < ceil(p * 2^24)`
  (exact in float64), so each keep probability becomes an integer threshold; torch compares a fp32 tensor with a
  Python float in fp32, so DARE's density is rounded to fp32 first (`threshold`);
- DELLA's probabilities depend on the rank alone: the table over ranks 0 .. n - 1 is made by the same torch ops on
  the same fp32 values as the per-element formulation (`ckpt.merge.methods.task_arithmetic`), then turned into
  thresholds; the pairs are unique, so any sort orders them alike: equal magnitudes in index order, as
  `argsort(stable=True)`, every NaN as one key above +inf (torch's order: NaNs last, stable among themselves).

Imports neither numba nor numpy (tests/test_layering.py): `compiled(__name__)` builds the kernels on first use.
"""

from __future__ import annotations

from ckpt.lazy import numpy as np

from ckpt.jit import kernel


@kernel
def mix32(x):
    """`ckpt.merge.rng`'s finalizer ("lowbias32") of a uint64 holding a 32-bit value."""
    m = np.uint64(0xFFFFFFFF)
    x = x ^ (x >> np.uint64(16))
    x = (x * np.uint64(0x7FEB352D)) & m
    x = x ^ (x >> np.uint64(15))
    x = (x * np.uint64(0x846CA68B)) & m
    return x ^ (x >> np.uint64(16))


@kernel
def hash24(i, k0, k1):
    """The 24-bit uniform integer of flat element `i` (uint64) under the keys (k0, k1): `rng.uniform` * 2^24."""
    x = mix32((i & np.uint64(0xFFFFFFFF)) ^ k0)
    x = mix32(x ^ (i >> np.uint64(32)) ^ k1)
    x = mix32(x ^ k0)
    return x >> np.uint64(8)


@kernel
def dare_mask(offset, k0, k1, limit, out):
    """out[j] = hash24(offset + j) < limit: the kept elements of a flat band starting at element `offset`."""
    o = np.uint64(offset)
    a = np.uint64(k0)
    b = np.uint64(k1)
    t = np.uint64(limit)
    for j in range(out.shape[0]):
        out[j] = hash24(o + np.uint64(j), a, b) < t


@kernel
def hash_fill(offset, k0, k1, out):
    """out[j] = hash24(offset + j) (int32): the uniform integers of a flat band, for masks made in another layout."""
    o = np.uint64(offset)
    a = np.uint64(k0)
    b = np.uint64(k1)
    for j in range(out.shape[0]):
        out[j] = np.int32(hash24(o + np.uint64(j), a, b))


@kernel
def pack_keys(mag, packed):
    """packed[r, e] = the rank key of mag[r, e] in the high 32 bits, e in the low ones: sorted along the row, these
    order by magnitude with equal ones in index order, as `torch.argsort(stable=True)` does (the key: the fp32
    bits without the sign, every NaN one key above +inf). Rows of up to `MAX_ROW` elements."""
    rows, n = mag.shape
    bits = mag.view(np.uint32)
    for r in range(rows):
        for e in range(n):
            k = bits[r, e] & np.uint32(0x7FFFFFFF)
            k = np.uint32(0x7FC00000) if k > np.uint32(0x7F800000) else k
            packed[r, e] = (np.uint64(k) << np.uint64(32)) | np.uint64(e)


@kernel
def rank_mask_packed(packed, h, limits, out):
    """out[r, e] = h[r, e] < limits[rank of e], from `pack_keys`' pairs sorted along each row: the j-th pair's
    index is the element of rank j."""
    rows, n = packed.shape
    for r in range(rows):
        for j in range(n):
            e = np.int64(packed[r, j] & np.uint64(0xFFFFFFFF))
            out[r, e] = np.int64(h[r, e]) < limits[j]


# ------------------------------------------------------------------------------------------- running the kernels

PIECE_ELEMS = 1 << 16  # elements per piece a thread takes (`ckpt.quant.gguf.run_pieces`)
MAX_ROW = (1 << 32) - 1  # DELLA's rows: the pairs' index has 32 bits (longer rows: the torch formulation)


def available() -> bool:
    """The kernels can run here (numba imports; without it the torch formulation runs)."""
    from ckpt.jit import available as jit_available

    return jit_available()


def _kernels():
    from ckpt.jit import compiled

    return compiled(__name__)


def threshold(p: float) -> int:
    """The integer t with (h * 2^-24 < fp32(p)) == (h < t) for every 24-bit h: torch's `u < p` (a fp32 tensor
    against a Python float compares in fp32)."""
    import math

    import struct

    p32 = struct.unpack("<f", struct.pack("<f", p))[0]  # round to nearest fp32, as torch does
    return math.ceil(p32 * (1 << 24))


def dare_keep(k0: int, k1: int, offset: int, shape, density: float):
    """Bool mask of the kept elements of a band of `shape` starting at flat element `offset`: `rng.uniform(...) <
    density`, keys (k0, k1) from `rng.keys`."""
    import math

    from ckpt.lazy import torch
    from ckpt.quant.gguf import run_pieces

    fn = _kernels().dare_mask
    n = math.prod(shape)
    out = torch.empty(n, dtype=torch.bool)
    dst = out.numpy()
    limit = threshold(density)
    run_pieces(n, PIECE_ELEMS, lambda a, b: fn(offset + a, k0, k1, limit, dst[a:b]))
    return out.reshape(shape)


def della_keep(k0: int, k1: int, offset: int, mag, probs):
    """Bool mask of the kept elements of a band starting at flat element `offset`, whose magnitudes `mag` (fp32, rows
    along dim 1: [rows, n] for a 2-D band, fibres along dim 1 otherwise) rank within their rows: element e is kept
    when `rng.uniform` of it < probs[rank of e] (`probs`: fp32 [n], the keep probability of each rank)."""
    from ckpt.lazy import torch
    from ckpt.quant.gguf import run_pieces

    ks = _kernels()
    n = mag.shape[1]
    h = torch.empty(mag.shape, dtype=torch.int32)
    hv = h.numpy().reshape(-1)
    run_pieces(hv.shape[0], PIECE_ELEMS, lambda a, b: ks.hash_fill(offset + a, k0, k1, hv[a:b]))
    if mag.dim() > 2:  # rows along dim 1: every other dim becomes a row index
        m2, h2 = mag.movedim(1, -1).reshape(-1, n), h.movedim(1, -1).reshape(-1, n)
    else:
        m2, h2 = mag, h
    m2 = m2.to(torch.float32).contiguous()
    h2 = h2.contiguous()
    limits = torch.ceil(probs.to(torch.float64) * (1 << 24)).to(torch.int64).numpy()
    keep = torch.empty(m2.shape, dtype=torch.bool)
    mv, hv2, kv = m2.numpy(), h2.numpy(), keep.numpy()
    step = max(1, PIECE_ELEMS // max(1, n))

    def piece(a, b):  # numpy's vectorized sort of the (key, index) pairs, which releases the GIL
        packed = np.empty((b - a, n), dtype=np.uint64)
        ks.pack_keys(mv[a:b], packed)
        packed.sort(axis=1)
        ks.rank_mask_packed(packed, hv2[a:b], limits, kv[a:b])

    run_pieces(m2.shape[0], step, piece)
    if mag.dim() > 2:
        moved = list(mag.movedim(1, -1).shape)
        keep = keep.reshape(moved).movedim(-1, 1)
    return keep
