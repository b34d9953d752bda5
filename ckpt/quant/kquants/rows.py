"""What every encoder of this package does around its block math: check the rows, cut them into blocks, encode a
bounded number of blocks at a time (the vectorized math holds several float32 copies of what it works on), and
lay the encoded blocks out as rows again."""

from __future__ import annotations

from ckpt.lazy import torch


def encode_rows(rows: torch.Tensor, block: int, block_bytes: int, chunk: int, blocks_fn) -> torch.Tensor:
    """fp32 rows [r, n] (n a multiple of `block`) -> uint8 [r, n / block * block_bytes]; `blocks_fn(fp32 [c, block])
    -> uint8 [c, block_bytes]` is called on at most `chunk` blocks at a time."""
    if rows.dim() != 2 or rows.shape[1] % block:
        raise ValueError(f"expected rows [r, n] with n a multiple of {block}, got {tuple(rows.shape)}")
    r, n = rows.shape
    blocks = rows.to(torch.float32).contiguous().reshape(-1, block)
    out = torch.empty((blocks.shape[0], block_bytes), dtype=torch.uint8, device=rows.device)
    with torch.no_grad():
        for i in range(0, blocks.shape[0], chunk):
            out[i:i + chunk] = blocks_fn(blocks[i:i + chunk])
    return out.reshape(r, n // block * block_bytes)
