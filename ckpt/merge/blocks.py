"""Where a tensor sits in the model's depth: the `t` of a parameter gradient (`ckpt.merge.params`).

For a language model a layer is `layers.N.` (or `h.N.`, `blocks.N.`), as mergekit counts layers; for a diffusion
model a layer is a block of its family (`Family.blocks`: Flux double then single blocks, SDXL input, middle and
output blocks, ...), matched on the original-layout name whatever the layout of the file. The blocks present are
numbered in depth order and block i of n has t = i / (n - 1) (t = 1 when there is one block, as mergekit's single
layer slice); tensors outside the blocks get t = 0, as mergekit gives its pre- and post-layer weights.
"""

from __future__ import annotations

import re

LAYERS = (r"(?:^|\.)(?:layers|h|blocks)\.(\d+)\.",)


def patterns(family) -> tuple[str, ...]:
    return family.blocks if family is not None and family.blocks else LAYERS


def block_of(name: str, rx: list[re.Pattern]) -> tuple[int, int] | None:
    """(pattern index, block index) of `name`, None outside the blocks."""
    for i, r in enumerate(rx):
        m = r.search(name)
        if m:
            return i, int(m.group(1)) if m.groups() else 0
    return None


def positions(names: dict[str, str], family) -> dict[str, float]:
    """t per output name; `names` maps each output name to the name blocks are matched on (original layout,
    prefix stripped)."""
    rx = [re.compile(p) for p in patterns(family)]
    where = {k: block_of(v, rx) for k, v in names.items()}
    order = sorted({b for b in where.values() if b is not None})
    n = len(order)
    index = {b: i for i, b in enumerate(order)}
    return {k: (0.0 if b is None else (index[b] / (n - 1) if n > 1 else 1.0)) for k, b in where.items()}


def layer_split(name: str) -> tuple[str, int, str] | None:
    """`model.layers.7.mlp.up_proj.weight` -> ("model.layers.", 7, ".mlp.up_proj.weight"): what slices index."""
    m = re.search(LAYERS[0], name)
    if not m:
        return None
    return name[: m.start(1)], int(m.group(1)), name[m.end(1):]
