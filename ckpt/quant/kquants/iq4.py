"""`IQ4_NL` and `IQ4_XS` block encoders, byte for byte what llama.cpp's `quantize_iq4_nl` / `quantize_iq4_xs` write
without an importance matrix (`quantize_row_iq4_nl_impl` in `ggml/src/ggml-quants.c`, `quant_weights == NULL`,
`ntry == 7`), vectorized over all blocks with torch.

Every float32 operation of the C code is replayed in float32 tensors in the C order: the per-block sums are
accumulated in a Python loop over the 32 elements of a block (vectorized across blocks and across the 16 scale
candidates), never with `tensor.sum`, whose summation order differs and flips rounding decisions. The 15 candidate
scales of the search are compared one after the other, as the C loop does, with its strict `>`.
"""

from __future__ import annotations

from ckpt.lazy import torch

from ckpt.quant.kquants.cfloat import fp16_bytes
from ckpt.quant.kquants.rows import encode_rows

# kvalues_iq4nl (ggml-common.h)
_KVALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
_NTRY = 7
_GROUP_MAX_EPS = 1e-15  # GROUP_MAX_EPS, compared with a float32 amax below (as a float32 constant)
_CHUNK = 1 << 16  # blocks of 32 per step: bounds the [blocks, 16] temporaries


def _bins(x: torch.Tensor) -> torch.Tensor:
    """floor(2x) clamped to [-232, 203], shifted to 0..435 (int64): the row of x in the `_tables` look-ups.
    fmin/fmax (not clamp) so that NaN lands on the top row, as best_index_int8 sends NaN to 15."""
    t = torch.fmax(torch.fmin(x * 2, x.new_tensor(203.0)), x.new_tensor(-232.0)).floor_().add_(232)
    return t.long()


_TABLES: dict = {}


def _tables(device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(kvalues, index table, value table) on `device`.

    `best_index_int8(16, kvalues_iq4nl, x)` ends its binary search with kv[mu-1] <= x < kv[mu] and returns
    `x - kv[mu-1] < kv[mu] - x ? mu-1 : mu` in float32. Both float32 differences are monotone in x, so within each
    interval the answer switches at a single float32 threshold, and for these integer kvalues that threshold is
    exactly the (representable, half-integer) midpoint: x >= midpoint goes up (ties go up; checked float by float
    around every midpoint in the tests). So the index is the number of midpoints <= x, which only depends on
    floor(2x) (2x is exact, the midpoints are multiples of 1/2): a look-up in a table of 436 rows. x <= kv[0] -> 0
    and x >= kv[15] -> 15 fall out of the clamp."""
    key = str(device)
    if key not in _TABLES:
        kv = torch.tensor(_KVALUES, dtype=torch.float32)
        mids = (kv[:-1] + kv[1:]) * 0.5
        rows = torch.arange(-232, 204, dtype=torch.float32) * 0.5
        idx = torch.bucketize(rows, mids, right=True)
        _TABLES[key] = (kv.to(device), idx.to(device), kv[idx].to(device))
    return _TABLES[key]


def _best_index(x: torch.Tensor) -> torch.Tensor:
    """best_index_int8(16, kvalues_iq4nl, x) elementwise (int64)."""
    return _tables(x.device)[1][_bins(x)]


def _block_scales(xb: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
    """The scale of each block of 32 (`scales[ib]` of the C code), xb: float32 [B, 32] -> float32 [B]."""
    B = xb.shape[0]
    dev = xb.device
    f32 = torch.float32
    zero = torch.zeros((), dtype=f32, device=dev)
    ax = xb.abs()
    arg = ax.argmax(dim=1)  # first index of the largest |x| (the C loop's strict `ax > amax`)
    amax = ax.gather(1, arg[:, None])[:, 0]
    mx = xb.gather(1, arg[:, None])[:, 0]
    skip = amax < torch.tensor(_GROUP_MAX_EPS, dtype=f32, device=dev)  # amax < GROUP_MAX_EPS (1e-15f)
    # candidate inverse scales: column 0 the first pass (d = -max/values[0]; id = 1/d), columns 1..15 the tries
    # id = (itry + values[0]) / max, itry = -ntry..ntry (an int converted to float, then divided)
    d0 = (-mx) / kv[0]
    ids = torch.empty((B, 2 * _NTRY + 2), dtype=f32, device=dev)
    ids[:, 0] = 1.0 / d0
    tries = torch.arange(-_NTRY, _NTRY + 1, dtype=f32, device=dev) + kv[0]  # exact small integers
    ids[:, 1:] = tries[None, :] / mx[:, None]
    sumqx = torch.zeros_like(ids)
    sumq2 = torch.zeros_like(ids)
    qtab = _tables(dev)[2]
    for j in range(xb.shape[1]):
        x = xb[:, j:j + 1]
        w = x * x  # weight[j] = xb[j]*xb[j]
        q = qtab[_bins(ids * x)]  # values[best_index_int8(16, values, id*xb[j])]
        wq = w * q
        sumqx += wq * x  # sumqx += w*q*xb[j]
        sumq2 += wq * q  # sumq2 += w*q*q
    s0x, s02 = sumqx[:, 0], sumq2[:, 0]
    d = torch.where(s02 > 0, s0x / s02, zero)
    best = d * s0x
    for t in range(1, 2 * _NTRY + 2):
        sx, s2 = sumqx[:, t], sumq2[:, t]
        take = (s2 > 0) & (sx * sx > best * s2)
        d = torch.where(take, sx / s2, d)
        best = torch.where(take, d * sx, best)
    return torch.where(skip, zero, d)


def _pack_nibbles(L: torch.Tensor) -> torch.Tensor:
    """L: int [B, 32] indices -> uint8 [B, 16]: q4[j] = L[j] | L[16 + j] << 4."""
    L = L.to(torch.uint8)
    return L[:, :16] | (L[:, 16:] << 4)


def _encode_iq4_nl_blocks(xb: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
    zero = torch.zeros((), dtype=torch.float32, device=xb.device)
    s = _block_scales(xb, kv)
    inv = torch.where(s != 0, 1.0 / s, zero)  # id = scales[0] ? 1/scales[0] : 0
    L = _best_index(inv[:, None] * xb)
    return torch.cat([fp16_bytes(s), _pack_nibbles(L)], dim=1)


def encode_iq4_nl(rows: torch.Tensor) -> torch.Tensor:
    """fp32 [r, n] (n % 32 == 0) -> uint8 [r, n / 32 * 18]: block_iq4_nl {fp16 d; uint8 qs[16]}."""
    kv = _tables(rows.device)[0]
    return encode_rows(rows, 32, 18, _CHUNK, lambda xb: _encode_iq4_nl_blocks(xb, kv))


def _encode_iq4_xs_blocks(xs: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
    """xs: float32 [S, 256] super-blocks -> uint8 [S, 136]."""
    S = xs.shape[0]
    dev = xs.device
    f32 = torch.float32
    zero = torch.zeros((), dtype=f32, device=dev)
    xb = xs.reshape(S * 8, 32)
    scales = _block_scales(xb, kv).reshape(S, 8)
    arg = scales.abs().argmax(dim=1)  # first largest |scale| (strict `abs_d > amax_scale`, from 0)
    amax_scale = scales.abs().gather(1, arg[:, None])[:, 0]
    max_scale = torch.where(amax_scale > 0, scales.gather(1, arg[:, None])[:, 0], zero)
    d = -max_scale / 32  # float d = -max_scale/32; may be -0.0 (fp16 0x8000), as in C
    inv = torch.where(d != 0, 1.0 / d, zero)
    l = torch.round(inv[:, None] * scales).clamp_(-32, 31)  # nearest_int (round half to even), MAX/MIN
    dl = d[:, None] * l
    idl = torch.where(dl != 0, 1.0 / dl, zero)
    L = _best_index(idl.reshape(S * 8, 1) * xb)
    qs = _pack_nibbles(L).reshape(S, 128)
    li = (l.to(torch.int32) + 32)  # 0..63
    low = li & 0xF
    high = li >> 4
    scales_l = (low[:, 0::2] | (low[:, 1::2] << 4)).to(torch.uint8)  # [S, 4]
    shifts = torch.arange(0, 16, 2, dtype=torch.int32, device=dev)
    sh = (high << shifts).sum(dim=1)  # disjoint bit fields: an exact integer OR
    scales_h = torch.stack([sh & 0xFF, (sh >> 8) & 0xFF], dim=1).to(torch.uint8)
    return torch.cat([fp16_bytes(d), scales_h, scales_l, qs], dim=1)


def encode_iq4_xs(rows: torch.Tensor) -> torch.Tensor:
    """fp32 [r, n] (n % 256 == 0) -> uint8 [r, n / 256 * 136]:
    block_iq4_xs {fp16 d; uint16 scales_h; uint8 scales_l[4]; uint8 qs[128]}."""
    kv = _tables(rows.device)[0]
    return encode_rows(rows, 256, 136, _CHUNK // 8, lambda xs: _encode_iq4_xs_blocks(xs, kv))


ENCODERS = {"IQ4_NL": encode_iq4_nl, "IQ4_XS": encode_iq4_xs}
