"""Integer packs decoded: the codes unpacked from int32 words and W = (q - z) * s, one formulation that GPTQ,
AWQ and compressed-tensors share (`ckpt.quant.int_pack_encode` is the way back).

Why this formulation (issue 37: `ckpt dequant` of a 4 GB GPTQ checkpoint took 82 s where loading it whole and
dequantizing with AutoGPTQ took 62 s). The decoders computed in the stored layout: GPTQ's codes are packed along the
inputs, one stored row per 32 / bits inputs, so a band of output rows was unpacked as int32 [K, n], its zero points
and scales gathered per input row (`z[g_idx]`, `s[g_idx]`: two [K, n] copies), widened to float32, multiplied,
rounded, and transposed to [n, K] at the end: eight passes over 4-byte values and a strided transpose. On one core
that decoded 48 M values/s. Here:

- the packed words are transposed first (a quarter of the bytes of the 16-bit output) and unpacked along the last
  dim straight into uint8 codes [n, K], the output's own order (`unpack_codes`: byte shifts of the little-endian
  words, no int32 or int64 intermediate per code);
- the zero points and scales are never expanded per input: with inputs in order (every AWQ and compressed-tensors
  weight, GPTQ without act-order) the codes are viewed as [n, G, group] and the [n, G] zero points and scales
  broadcast over the last dim; act-order's permuted `g_idx` sorts the uint8 codes by group first (one gather of
  1-byte values) and puts the results back in input order at the end (`InputGroups`);
- the arithmetic runs in the scales' dtype when it is 16-bit: q - z is an integer of magnitude at most 255 (exact
  in fp16 and bf16), and its product with a 16-bit scale is exact in float32, so one correctly rounded fp16 / bf16
  multiply gives the bits the float32 product rounded once gave before (and that the libraries give). Other scale
  dtypes compute in float32 as before (compressed-tensors' decoded dtype stays float32, rounded by the cast).

Bands of about 4M values (`CACHE_BAND`, half the writer's; `ckpt merge` shrinks its bands for the same reason): on
the 2-core VM 1M to 4M decoded equally fast and 8M 20 % slower (a band's passes leave the L2 cache); below 1M the
column reads' one pread per stored row dominate (AWQ GEMM reads one per input per band). Decode rate on one core,
before -> after: GPTQ 4-bit 112 -> 399 M values/s, act-order 129 -> 168,
3-bit 85 -> 203; AWQ GEMM 55 -> 358, GEMV 77 -> 537; compressed-tensors int4 group 207 -> 716, int8 channel
255 -> 1290, int3 group 28 -> 232. The bytes are the same as before.
"""

from __future__ import annotations

from ckpt.lazy import torch

CACHE_BAND = 1 << 22  # values per band of a decoded integer pack (`Tensor.band_elems`): see the module docstring


def compute_dtype(scale_dtype):
    """The dtype W = (q - z) * s is computed in: a 16-bit scale's own (exact before its one rounding), else float32
    (a float32 or float64 scale multiplies a float32 difference, as the decoders always did)."""
    return scale_dtype if scale_dtype in (torch.float16, torch.bfloat16) else torch.float32


def unpack_codes(words: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """int32 words [R, W] -> the first n codes of each row as uint8 [R, n]: code i at bit i * bits of the row's
    little-endian bit stream. That is GPTQ's packing (3 bits: 32 codes in 3 words, codes 10 and 21 crossing a word
    boundary, exactly a dense bit stream), AWQ GEMV's and compressed-tensors' (`pack_to_int32`, codes of 3, 5, 6
    or 7 bits straddling words). Whole codes per byte are split with byte shifts; straddling ones are cut from
    `bits`-byte blocks of 8 codes read as one int64."""
    R = words.shape[0]
    b = words.contiguous().view(torch.uint8).reshape(R, -1)  # the little-endian bytes of each row
    if bits == 8:
        return b[:, :n]
    mask = (1 << bits) - 1
    if 8 % bits == 0:
        per = 8 // bits
        out = torch.empty((R, b.shape[1], per), dtype=torch.uint8, device=b.device)
        for i in range(per):
            torch.bitwise_right_shift(b, bits * i, out=out[..., i])
    else:
        pad = -b.shape[1] % bits
        if pad:
            b = torch.nn.functional.pad(b, (0, pad))
        blk = b.reshape(R, -1, bits).to(torch.int64)
        v = blk[..., 0].clone()
        for j in range(1, bits):
            v.bitwise_or_(blk[..., j] << (8 * j))
        out = torch.empty((R, v.shape[1], 8), dtype=torch.uint8, device=b.device)
        for i in range(8):
            torch.bitwise_right_shift(v, bits * i, out=out[..., i])  # the low byte: masked below
    return out.bitwise_and_(mask).reshape(R, -1)[:, :n]


class InputGroups:
    """Which group each of a weight's K inputs belongs to (G groups), prepared once per weight: `order` sorts the
    inputs by group (None when they already are: no act-order), `run` is the one group length when every group has
    it (the codes are then viewed [n, G, run]), else the zero points and scales are repeated per input."""

    def __init__(self, g: torch.Tensor, n_groups: int):
        g = g.to(torch.int64)
        self.k, self.n_groups = g.numel(), n_groups
        self.order = self.inverse = None
        if self.k > 1 and bool((g[1:] < g[:-1]).any()):
            self.order = torch.argsort(g, stable=True)
            self.inverse = torch.argsort(self.order)
        self.counts = torch.bincount(g, minlength=n_groups) if self.k else torch.zeros(n_groups, dtype=torch.int64)
        c = int(self.counts[0]) if n_groups else 0
        self.run = c if c and bool((self.counts == c).all()) else None

    @classmethod
    def in_order(cls, k: int, size: int) -> "InputGroups":
        """Inputs in order, `size` per group (the last group shorter when size does not divide k)."""
        return cls(torch.arange(k) // max(1, size), -(-k // max(1, size)) if k else 0)

    def dequantize(self, q: torch.Tensor, z, s: torch.Tensor, dtype) -> torch.Tensor:
        """W [n, K] = (q - z) * s in `dtype`: q the codes [n, K] (any integer dtype), z the zero points [n or 1, G]
        (a tensor, a number, or None), s the scales [n or 1, G] (multiplied in their own dtype; None: q - z)."""
        dev = q.device
        if self.order is not None:
            q = q.index_select(1, self.order.to(dev))
        w = q.to(dtype)
        n = w.shape[0]
        if isinstance(z, torch.Tensor):
            z = z.to(dtype)
        if self.run is not None:
            v = w.view(n, self.n_groups, self.run)
            if isinstance(z, torch.Tensor):
                v.sub_(z.unsqueeze(-1))
            elif z:
                v.sub_(z)
            if s is not None:
                v.mul_(s.unsqueeze(-1))
        else:
            counts = self.counts.to(dev)
            if isinstance(z, torch.Tensor):
                w.sub_(z.repeat_interleave(counts, dim=1))
            elif z:
                w.sub_(z)
            if s is not None:
                w.mul_(s.repeat_interleave(counts, dim=1))
        return w if self.inverse is None else w.index_select(1, self.inverse.to(dev))
