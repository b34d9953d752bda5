"""Microscaling arithmetic shared by the NVFP4 and MXFP8 codecs (ckpt.quant.comfy_quant).

- fp4 e2m1 codes (sign bit 3, then 2 exponent bits and 1 mantissa bit: 0, 0.5, 1, 1.5, 2, 3, 4, 6),
  packed two per byte with the even element in the high nibble (comfy-kitchen's `hi_first=True`);
- e8m0 block scales (a bare biased exponent: 2**(e - 127)), decoded as comfy-kitchen decodes them:
  code 0 is 0.0, not 2**-127;
- the cuBLAS "blocked" scale layout: scales of a (rows, cols) grid padded to (128k, 4m) and stored in
  tiles of 128 x 4, each tile ordered [row % 32][row // 32 % 4][col % 4]. Tile row-block i is stored rows
  [128 i, 128 i + 128) of the (padded_rows, padded_cols) tensor, so any whole 128-row band of scales can
  be read, swizzled or unswizzled on its own.

The values follow comfy-kitchen 0.2.40's eager backend (`float_utils.py`, `backends/eager/
quantization.py`) operation for operation, so codes and decoded fp32 values are bit-identical to it;
tests compare both ways. Everything is computed in float32.
"""

from __future__ import annotations

from ckpt.lazy import torch

E2M1_MAX = 6.0
E4M3_MAX = 448.0
TILE_ROWS, TILE_COLS = 128, 4

# e2m1 code -> value (codes 8..15 are the negatives, 8 is -0.0)
_E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
_LUTS: dict[tuple, torch.Tensor] = {}


def _encode_lut() -> list[int]:
    """Code of a magnitude m in [0, 6] by q = 4m (exact): entry 2 * floor(q) + (q not an integer), plus 50
    for a set sign bit. Round to nearest, ties to the even code: above a boundary a magnitude takes the
    upper code; at one it does only where the upper code is even (0.75 -> 1.0, 1.75 -> 2.0, 3.5 -> 4.0;
    0.25 -> 0, 1.25 -> 1.0, 2.5 -> 2.0, 5.0 -> 4.0). Boundaries are multiples of 0.25, so floor(q) and
    whether q is an integer decide."""
    up_above, up_at = (1, 5, 10, 20), (3, 7, 14)  # boundaries in units of q
    lut = []
    for k in range(25):
        for frac in (0, 1):
            lut.append(sum(k > b or (frac and k >= b) for b in up_above) + sum(k >= b for b in up_at))
    return lut + [c | 8 for c in lut]


_ENCODE = _encode_lut()


def _lut(name: str, values, dtype, device) -> torch.Tensor:
    key = (name, str(device))
    if key not in _LUTS:
        _LUTS[key] = torch.tensor(values, dtype=dtype).to(device)
    return _LUTS[key]


def _pair_lut(device) -> torch.Tensor:
    """256 entries: byte b -> its two float32 values (E2M1[b >> 4], E2M1[b & 15]) viewed as one int64."""
    key = ("pairs", str(device))
    if key not in _LUTS:
        e = torch.tensor(_E2M1, dtype=torch.float32)
        pairs = torch.stack((e.repeat_interleave(16), e.repeat(16)), dim=-1).contiguous()
        _LUTS[key] = pairs.view(torch.int64).reshape(256).to(device)
    return _LUTS[key]


def roundup(x: int, m: int) -> int:
    return -(-x // m) * m


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """(..., n) uint8 -> (..., 2n) float32 values; the high nibble holds the even element (one lookup of
    a value pair per byte)."""
    idx = packed.reshape(-1).to(torch.int32)
    pairs = torch.index_select(_pair_lut(packed.device), 0, idx)
    return pairs.view(torch.float32).reshape(*packed.shape[:-1], -1)


def encode_e2m1(x: torch.Tensor) -> torch.Tensor:
    """float32 values already clamped to [-6, 6] -> uint8 codes (round to nearest, ties to even; the
    sign of -0.0 and of values rounding to zero is kept, as comfy-kitchen keeps it)."""
    q = x.abs().mul_(4)  # exact: a power of two
    idx = q.to(torch.int32)  # floor, q >= 0
    idx.mul_(2).add_(q.frac_() != 0).add_(torch.signbit(x), alpha=50)
    return torch.index_select(_lut("encode", _ENCODE, torch.uint8, x.device), 0, idx.reshape(-1)).reshape(x.shape)


def pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """(..., 2n) uint8 codes -> (..., n) bytes, even element in the high nibble."""
    return (codes[..., 0::2] << 4) | codes[..., 1::2]


def e8m0_to_float(codes: torch.Tensor) -> torch.Tensor:
    """uint8 biased exponents -> float32 2**(e - 127) by placing e in the exponent field; e == 0 -> 0.0
    (comfy-kitchen's `e8m0_to_f32`, which ComfyUI decodes with)."""
    bits = codes.to(torch.int32) << 23
    return torch.where(codes == 0, torch.zeros_like(bits), bits).view(torch.float32)


def scale_grid(rows: int, blocks: int) -> tuple[int, int]:
    """Stored (padded) shape of the blocked scales of `rows` x `blocks` block scales."""
    return roundup(rows, TILE_ROWS), roundup(blocks, TILE_COLS)


def swizzle(natural: torch.Tensor) -> torch.Tensor:
    """(128k, 4m) natural scales -> the same shape in the cuBLAS blocked order."""
    r, c = natural.shape
    k, m = r // TILE_ROWS, c // TILE_COLS
    tiles = natural.reshape(k, 4, 32, m, 4).permute(0, 3, 2, 1, 4)  # [i, j, row%32, row//32, col%4]
    return tiles.reshape(r, c)


def unswizzle(blocked: torch.Tensor) -> torch.Tensor:
    """(128k, 4m) blocked scales (whole tile row-blocks) -> natural (128k, 4m)."""
    r, c = blocked.shape
    k, m = r // TILE_ROWS, c // TILE_COLS
    tiles = blocked.reshape(k, m, 32, 4, 4).permute(0, 3, 2, 1, 4)  # [i, row//32, row%32, j, col%4]
    return tiles.reshape(r, c)


def pad_grid(natural: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Zero-pad a (r, c) grid of scales to (rows, cols) (the blocked layout's padding is zeros)."""
    r, c = natural.shape
    if (r, c) == (rows, cols):
        return natural
    out = torch.zeros((rows, cols), dtype=natural.dtype, device=natural.device)
    out[:r, :c] = natural
    return out


# ---------------------------------------------------------------------------------------------------
# per-band block math, exactly as comfy-kitchen's eager quantize_nvfp4 / quantize_mxfp8


def block_amax(x: torch.Tensor, block: int) -> torch.Tensor:
    """(rows, cols) -> (rows, cols/block) max |x| per block: one min/max pass, no |x| copy (NaN
    propagates, and the result is never -0.0, as with abs().amax())."""
    lo, hi = torch.aminmax(x.reshape(x.shape[0], -1, block), dim=-1)
    return torch.maximum(hi, lo.neg_()).abs_()


def nvfp4_block_scales(x: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    """(rows, cols) float32 -> (rows, cols/16) float8_e4m3fn block scales relative to `global_scale`."""
    scaled = (block_amax(x, 16) / E2M1_MAX) / global_scale
    return torch.clamp(scaled, max=E4M3_MAX).to(torch.float8_e4m3fn)


def nvfp4_codes(x: torch.Tensor, global_scale: torch.Tensor, block_scales: torch.Tensor) -> torch.Tensor:
    """(rows, cols) float32 -> (rows, cols/2) packed e2m1 bytes, given this band's block scales."""
    rows, cols = x.shape
    total = global_scale * block_scales.to(torch.float32)
    zero = total == 0
    has_zero = bool(zero.any())
    if has_zero:
        total = torch.where(zero, torch.ones_like(total), total)
    y = x.reshape(rows, -1, 16) / total.unsqueeze(-1)
    if has_zero:  # comfy-kitchen's zero-scale blocks (all-zero or underflowed): codes 0
        y.masked_fill_(zero.unsqueeze(-1), 0.0)
    y = y.nan_to_num_(0.0).clamp_(-E2M1_MAX, E2M1_MAX).reshape(rows, cols)  # NaN has no e2m1 code: 0
    return pack_e2m1(encode_e2m1(y))


def nvfp4_decode(packed: torch.Tensor, global_scale: torch.Tensor, block_scales: torch.Tensor) -> torch.Tensor:
    """(rows, n) bytes + (rows, 2n/16) float8 block scales -> (rows, 2n) float32:
    value * (global_scale * block_scale), comfy-kitchen's dequantize_nvfp4 with output_type float32."""
    vals = unpack_e2m1(packed)
    rows = vals.shape[0]
    total = global_scale.to(torch.float32) * block_scales.to(torch.float32)
    return (vals.reshape(rows, -1, 16) * total.unsqueeze(-1)).reshape(rows, -1)


def mxfp8_block_scales(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, cols) float32 -> ((rows, cols/32) uint8 e8m0 exponents, all-zero-block mask); an
    all-zero block gets exponent 0."""
    amax = block_amax(x, 32)
    need = torch.clamp(amax / E4M3_MAX, min=2.0 ** -127)
    e = torch.clamp(torch.ceil(torch.log2(need)).to(torch.int32) + 127, 0, 254).to(torch.uint8)
    zero = amax == 0
    return torch.where(zero, torch.zeros_like(e), e), zero


def mxfp8_codes(x: torch.Tensor) -> torch.Tensor:
    """(rows, cols) float32 -> float8_e4m3fn codes scaled by their blocks' e8m0 scales."""
    rows, cols = x.shape
    exps, zero = mxfp8_block_scales(x)
    s = e8m0_to_float(exps)
    s = torch.where(zero, torch.ones_like(s), s)
    y = x.reshape(rows, -1, 32) / s.unsqueeze(-1)
    y = torch.where(zero.unsqueeze(-1), torch.zeros_like(y), y)
    return torch.clamp(y, -E4M3_MAX, E4M3_MAX).reshape(rows, cols).to(torch.float8_e4m3fn)


def mxfp8_decode(codes: torch.Tensor, exps: torch.Tensor) -> torch.Tensor:
    """(rows, cols) float8 codes + (rows, cols/32) e8m0 exponents -> float32 codes * 2**(e-127)."""
    rows = codes.shape[0]
    vals = codes.to(torch.float32).reshape(rows, -1, 32)
    return (vals * e8m0_to_float(exps).unsqueeze(-1)).reshape(rows, -1)
