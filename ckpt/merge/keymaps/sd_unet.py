"""SD1/SD2/SDXL UNets: LDM module names (`input_blocks.4.1.proj_in`) <-> diffusers names
(`down_blocks.1.attentions.0.proj_in`).

kohya's SD1/SD2 LoRAs and every diffusers/PEFT LoRA name UNet modules the diffusers way, while kohya's
SDXL LoRAs use the LDM names; bases come in either layout. The block correspondence is derived from the
base's own keys (which input blocks hold a downsampler, which output blocks an upsampler), so it holds
for any number of levels and resnets per level without a config.
"""

from __future__ import annotations

import re

from ckpt.merge.keymaps import Alias, Shapes, block_indices, module_of, prefixes_of
from ckpt.merge.targets import Target

# LDM resnet submodules -> diffusers ResnetBlock2D submodules.
RESNET = (
    ("in_layers.0", "norm1"),
    ("in_layers.2", "conv1"),
    ("emb_layers.1", "time_emb_proj"),
    ("out_layers.0", "norm2"),
    ("out_layers.3", "conv2"),
    ("skip_connection", "conv_shortcut"),
)

# Top-level modules. `label_emb` is SDXL's `add_embedding` or SD2-unCLIP's `class_embedding`.
BASIC = (
    ("input_blocks.0.0", "conv_in"),
    ("time_embed.0", "time_embedding.linear_1"),
    ("time_embed.2", "time_embedding.linear_2"),
    ("label_emb.0.0", "add_embedding.linear_1"),
    ("label_emb.0.2", "add_embedding.linear_2"),
    ("label_emb.0.0", "class_embedding.linear_1"),
    ("label_emb.0.2", "class_embedding.linear_2"),
    ("out.0", "conv_norm_out"),
    ("out.2", "conv_out"),
)

_ATTN_PROC = re.compile(r"\.(attn[12])\.(to_q|to_k|to_v|to_out\.0)$")


def is_ldm(base: Shapes) -> bool:
    return any(k.startswith("input_blocks.") for k in base) and any(k.startswith("middle_block.") for k in base)


def is_diffusers(base: Shapes) -> bool:
    return any(k.startswith("down_blocks.") for k in base) and any(k.startswith("mid_block.") for k in base)


def _blocks_from_ldm(base: Shapes) -> list[tuple[str, str, bool]]:
    """(LDM prefix, diffusers prefix, is_resnet) for every block, walking the LDM layout."""
    has = prefixes_of(base)
    out: list[tuple[str, str, bool]] = []
    level, i = 0, 0
    for n in block_indices(base, "input_blocks"):
        if n == 0:
            continue
        if f"input_blocks.{n}.0.op" in has:
            out.append((f"input_blocks.{n}.0.op", f"down_blocks.{level}.downsamplers.0.conv", False))
            level, i = level + 1, 0
            continue
        out.append((f"input_blocks.{n}.0", f"down_blocks.{level}.resnets.{i}", True))
        if f"input_blocks.{n}.1" in has:
            out.append((f"input_blocks.{n}.1", f"down_blocks.{level}.attentions.{i}", False))
        i += 1
    r = a = 0
    for n in block_indices(base, "middle_block"):
        if f"middle_block.{n}.in_layers" in has:
            out.append((f"middle_block.{n}", f"mid_block.resnets.{r}", True))
            r += 1
        else:
            out.append((f"middle_block.{n}", f"mid_block.attentions.{a}", False))
            a += 1
    level, i = 0, 0
    for n in block_indices(base, "output_blocks"):
        out.append((f"output_blocks.{n}.0", f"up_blocks.{level}.resnets.{i}", True))
        if f"output_blocks.{n}.1" in has and f"output_blocks.{n}.1.conv" not in has:
            out.append((f"output_blocks.{n}.1", f"up_blocks.{level}.attentions.{i}", False))
        up = next((c for c in (1, 2) if f"output_blocks.{n}.{c}.conv" in has), None)
        if up is not None:
            out.append((f"output_blocks.{n}.{up}.conv", f"up_blocks.{level}.upsamplers.0.conv", False))
            level, i = level + 1, 0
        else:
            i += 1
    return out


def _blocks_from_diffusers(base: Shapes) -> list[tuple[str, str, bool]]:
    """The same correspondence, walking a diffusers UNet2DConditionModel layout."""
    has = prefixes_of(base)
    out: list[tuple[str, str, bool]] = []
    n = 1
    for x in block_indices(base, "down_blocks"):
        for i in block_indices(base, f"down_blocks.{x}.resnets"):
            out.append((f"input_blocks.{n}.0", f"down_blocks.{x}.resnets.{i}", True))
            if f"down_blocks.{x}.attentions.{i}" in has:
                out.append((f"input_blocks.{n}.1", f"down_blocks.{x}.attentions.{i}", False))
            n += 1
        if f"down_blocks.{x}.downsamplers.0.conv" in has:
            out.append((f"input_blocks.{n}.0.op", f"down_blocks.{x}.downsamplers.0.conv", False))
            n += 1
    m = 0
    for i in block_indices(base, "mid_block.resnets"):
        out.append((f"middle_block.{m}", f"mid_block.resnets.{i}", True))
        m += 1
        if f"mid_block.attentions.{i}" in has:
            out.append((f"middle_block.{m}", f"mid_block.attentions.{i}", False))
            m += 1
    n = 0
    for x in block_indices(base, "up_blocks"):
        resnets = block_indices(base, f"up_blocks.{x}.resnets")
        for i in resnets:
            out.append((f"output_blocks.{n}.0", f"up_blocks.{x}.resnets.{i}", True))
            c = 1
            if f"up_blocks.{x}.attentions.{i}" in has:
                out.append((f"output_blocks.{n}.1", f"up_blocks.{x}.attentions.{i}", False))
                c = 2
            if i == resnets[-1] and f"up_blocks.{x}.upsamplers.0.conv" in has:
                out.append((f"output_blocks.{n}.{c}.conv", f"up_blocks.{x}.upsamplers.0.conv", False))
            n += 1
    return out


def _translate(module: str, table: dict[str, tuple[str, bool]], renames) -> list[str]:
    """Names of `module` in the other scheme, by its longest block prefix in `table`."""
    parts = module.split(".")
    for cut in range(len(parts), 0, -1):
        head = ".".join(parts[:cut])
        if head not in table:
            continue
        rest = ".".join(parts[cut:])
        outs = []
        for other, is_resnet in table[head]:
            r = rest
            if is_resnet:
                for a, b in renames:
                    if r == a or r.startswith(a + "."):
                        r = b + r[len(a):]
                        break
            outs.append(other + ("." + r if r else ""))
        return outs
    return []


def _processor_names(diffusers_module: str) -> list[str]:
    """Old diffusers attention-processor LoRA names (`attn1.processor.to_q`, `processor.to_out`)."""
    m = _ATTN_PROC.search(diffusers_module)
    if not m:
        return []
    proj = "to_out" if m.group(2) == "to_out.0" else m.group(2)
    return [diffusers_module[: m.start()] + f".{m.group(1)}.processor.{proj}"]


def aliases(base: Shapes) -> list[Alias] | None:
    """Diffusers names for an LDM UNet, or LDM names for a diffusers UNet; None if not an SD UNet."""
    if is_ldm(base):
        blocks = _blocks_from_ldm(base)
        table: dict[str, list[tuple[str, bool]]] = {}
        for ldm, dif, res in blocks:
            table.setdefault(ldm, []).append((dif, res))
        for ldm, dif in BASIC:
            table.setdefault(ldm, []).append((dif, False))
        renames = RESNET
        to_diffusers = True
    elif is_diffusers(base):
        blocks = _blocks_from_diffusers(base)
        table = {}
        for ldm, dif, res in blocks:
            table.setdefault(dif, []).append((ldm, res))
        for ldm, dif in BASIC:
            table.setdefault(dif, []).append((ldm, False))
        renames = tuple((b, a) for a, b in RESNET)
        to_diffusers = False
    else:
        return None
    out: list[Alias] = []
    for key in base:
        if not key.endswith(".weight"):
            continue
        target = (Target(key),)
        for name in _translate(module_of(key), table, renames):
            out.append(Alias(name, target))
            if to_diffusers:
                out += [Alias(p, target) for p in _processor_names(name)]
        if not to_diffusers:
            out += [Alias(p, target) for p in _processor_names(module_of(key))]
    return out
