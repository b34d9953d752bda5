"""kohya's flattened module names (`double_blocks_0_img_attn_qkv`) back to the dotted tensor paths of
their model (`double_blocks.0.img_attn.qkv`), without a base, from the family registry alone.

A flattened name cannot be split on `_` by rule (`img_attn.qkv` but `img_mod.lin`, `to_out.0` but
`time_embedding.linear_1`). Instead every way of putting `.` or `_` between its tokens is a candidate
(two digit tokens in a row are always `.`-separated: `input_blocks.4.1`), all candidates of all
modules are handed, with the shapes the LoRA's factors imply, to the family's own `pairs`, and a
candidate is the module's path when the family names exactly that tensor. The family and its layout
come from `ckpt.families.identify`, whose signatures read flattened names as well.
"""

from __future__ import annotations

from ckpt import families
from ckpt.families import ORIGINAL, module_of

MAX_TOKENS = 14  # 2^13 candidates at most per name


def candidates(flat: str) -> list[str]:
    tokens = flat.split("_")
    if any(not t for t in tokens) or len(tokens) > MAX_TOKENS:
        return [flat]
    out = [tokens[0]]
    for prev, tok in zip(tokens, tokens[1:]):
        if prev.isdigit() and tok.isdigit():
            out = [o + "." + tok for o in out]
        else:
            out = [o + sep + tok for o in out for sep in (".", "_")]
    return out


def unflatten(shapes: dict[str, tuple[int, ...]]) -> tuple[dict[str, str], object]:
    """{flattened name: dotted path} for the names the family recognises, and the family Match.

    `shapes`: flattened module name (trainer prefix removed) -> the weight shape its factors imply."""
    match = families.detect(list(shapes), shapes)
    if match is None or match.family.pairs is None or match.layout is None:
        return {}, match
    owner: dict[str, list[str]] = {}
    cand_shapes: dict[str, tuple[int, ...]] = {}
    for flat, shape in shapes.items():
        for c in candidates(flat):
            owner.setdefault(c, []).append(flat)
            cand_shapes[c + ".weight"] = shape
    side = (lambda p: p.original) if match.layout == ORIGINAL else (lambda p: p.diffusers)
    known = {module_of(side(p)) for p in match.family.pairs(cand_shapes, match.layout) if side(p)}
    found: dict[str, list[str]] = {}
    for c, flats in owner.items():
        if c in known:
            for flat in flats:
                found.setdefault(flat, []).append(c)
    return {flat: cs[0] for flat, cs in found.items() if len(cs) == 1}, match
