"""The Flux-style MM-DiT blocks several families share, written once: what is row arithmetic rather than a
rename.

- Double blocks: an image and a text stream, each with a fused qkv whose row thirds are diffusers'
  `attn.to_q/k/v` (image) and `attn.add_q/k/v_proj` (text).
- Single blocks: one fused `linear1` whose rows [0,H), [H,2H), [2H,3H), [3H,3H+M) are diffusers'
  `attn.to_q/k/v` and `proj_mlp`.
- The final layer's `final_layer.adaLN_modulation.1`, diffusers' `norm_out.linear` with its shift and
  scale halves swapped.

Flux.1, Chroma and Flux.2 name the blocks the BFL way (`double_blocks.N.img_attn.qkv`, the `bfl_*`
helpers and tables); HunyuanVideo 1.x and 1.5 use Tencent's names (`img_attn_qkv`) and call the
name-agnostic helpers with their own. Each family module keeps its own rename tables and order.
"""

from __future__ import annotations

from ckpt.families.spec import ORIGINAL, Pair, Shapes, block_indices, renames, thirds

BOTH = ("weight", "bias")
QKV = ("to_q", "to_k", "to_v")
ADD_QKV = ("add_q_proj", "add_k_proj", "add_v_proj")
# The image and text stream's fused qkv of a BFL double block.
BFL_QKV = (("img_attn.qkv", QKV), ("txt_attn.qkv", ADD_QKV))
BFL_DOUBLE_NORMS = (
    ("img_attn.norm.query_norm", "attn.norm_q"),
    ("img_attn.norm.key_norm", "attn.norm_k"),
    ("txt_attn.norm.query_norm", "attn.norm_added_q"),
    ("txt_attn.norm.key_norm", "attn.norm_added_k"),
)
BFL_SINGLE_NORMS = (("norm.query_norm", "attn.norm_q"), ("norm.key_norm", "attn.norm_k"))


def final_adaln(ends=BOTH) -> list[Pair]:
    """`final_layer.adaLN_modulation.1` <-> `norm_out.linear`, shift and scale halves swapped."""
    return [Pair(f"final_layer.adaLN_modulation.1.{e}", f"norm_out.linear.{e}", transform="swap_halves")
            for e in ends]


def fused_qkv(b: str, d: str, h: int, fused, ends=BOTH) -> list[Pair]:
    """Row thirds of fused qkv tensors: `fused` is ((original module under `b`, its three diffusers
    names under `d.attn`), ...), each piece `h` rows."""
    return [Pair(f"{b}.{o}.{e}", f"{d}.attn.{n}.{e}", rows)
            for e in ends for o, names in fused for rows, n in zip(thirds(0, h), names)]


def single_linear1(b: str, d: str, h: int, m: int, ends=BOTH) -> list[Pair]:
    """A single block's fused `linear1` (width `h`, MLP input `m` rows) <-> `attn.to_q/k/v` and `proj_mlp`."""
    out = []
    for e in ends:
        out += fused_qkv(b, d, h, (("linear1", QKV),), ends=(e,))
        out.append(Pair(f"{b}.linear1.{e}", f"{d}.proj_mlp.{e}", (3 * h, 3 * h + m)))
    return out


def bfl_double(i: int, h: int, table, ends=BOTH) -> list[Pair]:
    """BFL double block `i` of width `h`: the fused qkv thirds, the renames of `table` and the q/k norms."""
    b, d = f"double_blocks.{i}", f"transformer_blocks.{i}"
    out = fused_qkv(b, d, h, BFL_QKV, ends)
    out += renames(table, b + ".", d + ".", ends)
    out += [Pair(f"{b}.{o}.scale", f"{d}.{n}.weight") for o, n in BFL_DOUBLE_NORMS]
    return out


def bfl_single(j: int, h: int, m: int, table, ends=BOTH) -> list[Pair]:
    """BFL single block `j` (width `h`, MLP input `m`): `linear1`'s rows, the renames of `table` and the
    q/k norms."""
    b, d = f"single_blocks.{j}", f"single_transformer_blocks.{j}"
    out = single_linear1(b, d, h, m, ends)
    out += renames(table, b + ".", d + ".", ends)
    out += [Pair(f"{b}.{o}.scale", f"{d}.{n}.weight") for o, n in BFL_SINGLE_NORMS]
    return out


def bfl_double_widths(shapes: Shapes, layout: str) -> dict[int, int]:
    """{double block: H} from either layout's shapes (a third of a fused qkv, or a q projection)."""
    out = {}
    if layout == ORIGINAL:
        for i in block_indices(shapes, "double_blocks"):
            qkv = (shapes.get(f"double_blocks.{i}.img_attn.qkv.weight")
                   or shapes.get(f"double_blocks.{i}.txt_attn.qkv.weight"))
            if qkv:
                out[i] = qkv[0] // 3
    else:
        for i in block_indices(shapes, "transformer_blocks"):
            q = shapes.get(f"transformer_blocks.{i}.attn.to_q.weight") or shapes.get(
                f"transformer_blocks.{i}.attn.add_q_proj.weight")
            if q:
                out[i] = q[0]
    return out


def bfl_single_widths(shapes: Shapes, layout: str) -> dict[int, tuple[int, int]]:
    """{single block: (H, M)} from either layout's shapes (`linear2`'s rows and the rest of `linear1`, or
    the q and `proj_mlp` projections)."""
    out = {}
    if layout == ORIGINAL:
        for j in block_indices(shapes, "single_blocks"):
            lin1 = shapes.get(f"single_blocks.{j}.linear1.weight")
            lin2 = shapes.get(f"single_blocks.{j}.linear2.weight")
            if lin1 and lin2:
                out[j] = (lin2[0], lin1[0] - 3 * lin2[0])
    else:
        for j in block_indices(shapes, "single_transformer_blocks"):
            q = shapes.get(f"single_transformer_blocks.{j}.attn.to_q.weight")
            mlp = shapes.get(f"single_transformer_blocks.{j}.proj_mlp.weight")
            if q and mlp:
                out[j] = (q[0], mlp[0])
    return out
