"""SD1/SD2/SDXL UNets: LDM names (`input_blocks.4.1.proj_in`) <-> diffusers UNet2DConditionModel
(`down_blocks.1.attentions.0.proj_in`). One module for the ids `sd1`, `sd2`, `sdxl` (the correspondence
is the same); the cross-attention width tells which (768 / 1024 / 2048, SDXL refiner 1280).

The block correspondence is derived from the file's own keys (which input blocks hold a downsampler,
which output blocks an upsampler), so it holds for any number of levels and resnets per level without
a config. Reference: diffusers `convert_ldm_unet_checkpoint`.

LoRAs: kohya's SD1/SD2 LoRAs and every diffusers/PEFT LoRA name UNet modules the diffusers way, kohya's
SDXL LoRAs the LDM way; old diffusers LoRAs name attention processors (`attn1.processor.to_q`).
"""

from __future__ import annotations

import re

from ckpt.families.spec import (DIFFUSERS, ORIGINAL, SEP, Alias, ConventionError, Family, GGUFStorage, Pair, Shapes,
                                Signature, at, block_indices, blocks_count, dim, has, module_of, prefixes_of)

# LDM resnet submodules -> diffusers ResnetBlock2D submodules.
RESNET = (
    ("in_layers.0", "norm1"),
    ("in_layers.2", "conv1"),
    ("emb_layers.1", "time_emb_proj"),
    ("out_layers.0", "norm2"),
    ("out_layers.3", "conv2"),
    ("skip_connection", "conv_shortcut"),
)
# Top-level modules. `label_emb` is SDXL's `add_embedding` (SD2-unCLIP's `class_embedding`: LoRA alias).
BASIC = (
    ("input_blocks.0.0", "conv_in"),
    ("time_embed.0", "time_embedding.linear_1"),
    ("time_embed.2", "time_embedding.linear_2"),
    ("label_emb.0.0", "add_embedding.linear_1"),
    ("label_emb.0.2", "add_embedding.linear_2"),
    ("out.0", "conv_norm_out"),
    ("out.2", "conv_out"),
)
UNCLIP = (("label_emb.0.0", "class_embedding.linear_1"), ("label_emb.0.2", "class_embedding.linear_2"))

_ATTN_PROC = re.compile(r"\.(attn[12])\.(to_q|to_k|to_v|to_out\.0)$")


def _blocks_from_ldm(keys) -> list[tuple[str, str, bool]]:
    """(LDM prefix, diffusers prefix, is_resnet) for every block, walking the LDM layout."""
    has_ = prefixes_of(keys)
    out: list[tuple[str, str, bool]] = []
    level, i = 0, 0
    for n in block_indices(keys, "input_blocks"):
        if n == 0:
            continue
        if f"input_blocks.{n}.0.op" in has_:
            out.append((f"input_blocks.{n}.0.op", f"down_blocks.{level}.downsamplers.0.conv", False))
            level, i = level + 1, 0
            continue
        out.append((f"input_blocks.{n}.0", f"down_blocks.{level}.resnets.{i}", True))
        if f"input_blocks.{n}.1" in has_:
            out.append((f"input_blocks.{n}.1", f"down_blocks.{level}.attentions.{i}", False))
        i += 1
    r = a = 0
    for n in block_indices(keys, "middle_block"):
        if f"middle_block.{n}.in_layers" in has_:
            out.append((f"middle_block.{n}", f"mid_block.resnets.{r}", True))
            r += 1
        else:
            out.append((f"middle_block.{n}", f"mid_block.attentions.{a}", False))
            a += 1
    level, i = 0, 0
    for n in block_indices(keys, "output_blocks"):
        out.append((f"output_blocks.{n}.0", f"up_blocks.{level}.resnets.{i}", True))
        if f"output_blocks.{n}.1" in has_ and f"output_blocks.{n}.1.conv" not in has_:
            out.append((f"output_blocks.{n}.1", f"up_blocks.{level}.attentions.{i}", False))
        up = next((c for c in (1, 2) if f"output_blocks.{n}.{c}.conv" in has_), None)
        if up is not None:
            out.append((f"output_blocks.{n}.{up}.conv", f"up_blocks.{level}.upsamplers.0.conv", False))
            level, i = level + 1, 0
        else:
            i += 1
    return out


def _blocks_from_diffusers(keys) -> list[tuple[str, str, bool]]:
    """The same correspondence, walking a diffusers UNet2DConditionModel layout."""
    has_ = prefixes_of(keys)
    out: list[tuple[str, str, bool]] = []
    n = 1
    for x in block_indices(keys, "down_blocks"):
        for i in block_indices(keys, f"down_blocks.{x}.resnets"):
            out.append((f"input_blocks.{n}.0", f"down_blocks.{x}.resnets.{i}", True))
            if f"down_blocks.{x}.attentions.{i}" in has_:
                out.append((f"input_blocks.{n}.1", f"down_blocks.{x}.attentions.{i}", False))
            n += 1
        if f"down_blocks.{x}.downsamplers.0.conv" in has_:
            out.append((f"input_blocks.{n}.0.op", f"down_blocks.{x}.downsamplers.0.conv", False))
            n += 1
    m = 0
    for i in block_indices(keys, "mid_block.resnets"):
        out.append((f"middle_block.{m}", f"mid_block.resnets.{i}", True))
        m += 1
        if f"mid_block.attentions.{i}" in has_:
            out.append((f"middle_block.{m}", f"mid_block.attentions.{i}", False))
            m += 1
    n = 0
    for x in block_indices(keys, "up_blocks"):
        resnets = block_indices(keys, f"up_blocks.{x}.resnets")
        for i in resnets:
            out.append((f"output_blocks.{n}.0", f"up_blocks.{x}.resnets.{i}", True))
            c = 1
            if f"up_blocks.{x}.attentions.{i}" in has_:
                out.append((f"output_blocks.{n}.1", f"up_blocks.{x}.attentions.{i}", False))
                c = 2
            if i == resnets[-1] and f"up_blocks.{x}.upsamplers.0.conv" in has_:
                out.append((f"output_blocks.{n}.{c}.conv", f"up_blocks.{x}.upsamplers.0.conv", False))
            n += 1
    return out


def _translate(module: str, table: dict[str, list[tuple[str, bool]]], resnet_renames) -> list[str]:
    """Names of `module` in the other layout, by its longest block prefix in `table`."""
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
                for a, b in resnet_renames:
                    if r == a or r.startswith(a + "."):
                        r = b + r[len(a):]
                        break
            outs.append(other + ("." + r if r else ""))
        return outs
    return []


def _table(keys, layout: str):
    """{block prefix in `layout`: [(prefix in the other layout, is_resnet)]} and the resnet renames."""
    table: dict[str, list[tuple[str, bool]]] = {}
    if layout == ORIGINAL:
        for ldm, dif, res in _blocks_from_ldm(keys):
            table.setdefault(ldm, []).append((dif, res))
        for ldm, dif in BASIC:
            table.setdefault(ldm, []).append((dif, False))
        return table, RESNET
    for ldm, dif, res in _blocks_from_diffusers(keys):
        table.setdefault(dif, []).append((ldm, res))
    for ldm, dif in BASIC + UNCLIP:
        table.setdefault(dif, []).append((ldm, False))
    return table, tuple((b, a) for a, b in RESNET)


def pairs(shapes: Shapes, layout: str) -> list[Pair]:
    """One Pair per tensor of the UNet (weights, biases, norms): renames only."""
    table, rn = _table(shapes, layout)
    out = []
    for key in shapes:
        module, _, param = key.rpartition(".")
        for other in _translate(module, table, rn):
            other_key = f"{other}.{param}"
            out.append(Pair(key, other_key) if layout == ORIGINAL else Pair(other_key, key))
    return out


def _processor_names(diffusers_module: str) -> list[str]:
    """Old diffusers attention-processor LoRA names (`attn1.processor.to_q`, `processor.to_out`)."""
    m = _ATTN_PROC.search(diffusers_module)
    if not m:
        return []
    proj = "to_out" if m.group(2) == "to_out.0" else m.group(2)
    return [diffusers_module[: m.start()] + f".{m.group(1)}.processor.{proj}"]


def lora_aliases(shapes: Shapes, layout: str) -> list[Alias]:
    out = []
    if layout == ORIGINAL:
        for p in pairs(shapes, layout):
            if p.original.endswith(".weight"):
                out += [Alias(n, p.original) for n in _processor_names(module_of(p.diffusers))]
        for ldm, name in UNCLIP:
            if f"{ldm}.weight" in shapes:
                out.append(Alias(name, f"{ldm}.weight"))
        return out
    for key in shapes:
        if key.endswith(".weight"):
            out += [Alias(n, key) for n in _processor_names(module_of(key))]
    return out


def _ldm_unet(keys, shapes) -> tuple[str | None, str]:
    ctx = dim(shapes, keys, rf"attn2{SEP}to_k(\.weight)?$", 1)
    if has(keys, at(r"label_emb_.")) or has(keys, at(r"add_embedding_.")):
        return "sdxl", "SDXL refiner UNet" if ctx == 1280 else "SDXL UNet"
    return {2048: ("sdxl", "SDXL UNet"), 768: ("sd1", "SD1 UNet"), 1024: ("sd2", "SD2 UNet")}.get(
        ctx, (None, "SD1/SD2/SDXL UNet"))


def identify(keys, shapes, layout):
    fid, label = _ldm_unet(keys, shapes)
    if layout == ORIGINAL:
        return fid, label + " (LDM)"
    if fid is None and not has(keys, at(r"add_embedding_.")) and has(keys, rf"down_blocks{SEP}[12]{SEP}attentions") \
            and not has(keys, rf"down_blocks{SEP}0{SEP}attentions"):
        fid, label = "sdxl", "SDXL UNet"  # SDXL has no attention in its first level
    return fid, label + " (diffusers UNet2DConditionModel)"


# What the weights do not say (the UNet configs of the SD1.5, SD2.1 and SDXL releases): SD1 has 8 heads
# at every level, SD2 and SDXL heads of 64 channels; the sample size (latent pixels) of each release;
# SDXL's time ids are embedded in 256 channels each.
CONVENTIONS = {"sd1": {"heads": 8, "sample_size": 64}, "sd2": {"head_dim": 64, "sample_size": 96},
               "sdxl": {"head_dim": 64, "sample_size": 128}, "addition_time_embed_dim": 256}


def diffusers_config(s: Shapes) -> dict:
    keys = list(s)
    fid, _ = identify(keys, s, DIFFUSERS)
    if fid is None:
        raise ConventionError("the cross-attention width is none of SD1's 768, SD2's 1024, SDXL's 2048 or 1280")
    conv = CONVENTIONS[fid]
    levels = block_indices(s, "down_blocks")
    channels = [s[f"down_blocks.{x}.resnets.0.conv1.weight"][0] for x in levels]
    attn = [f"down_blocks.{x}.attentions.0.proj_in.weight" in s for x in levels]
    ups = block_indices(s, "up_blocks")
    up_attn = [f"up_blocks.{x}.attentions.0.proj_in.weight" in s for x in ups]
    layers = [blocks_count(s, f"down_blocks.{x}.attentions.0.transformer_blocks") or 1 for x in levels]
    proj = next(v for k, v in s.items() if k.endswith("proj_in.weight"))
    heads = [conv["heads"]] * len(levels) if "heads" in conv else [c // conv["head_dim"] for c in channels]
    cfg = {
        "_class_name": "UNet2DConditionModel",
        "sample_size": conv["sample_size"],
        "in_channels": s["conv_in.weight"][1],
        "out_channels": s["conv_out.weight"][0],
        "down_block_types": ["CrossAttnDownBlock2D" if a else "DownBlock2D" for a in attn],
        "up_block_types": ["CrossAttnUpBlock2D" if a else "UpBlock2D" for a in up_attn],
        "block_out_channels": channels,
        "layers_per_block": blocks_count(s, "down_blocks.0.resnets"),
        "cross_attention_dim": dim(s, keys, r"attn2\.to_k\.weight$", 1),
        "attention_head_dim": heads[0] if len(set(heads)) == 1 else heads,
        "use_linear_projection": len(proj) == 2,
        "transformer_layers_per_block": layers[0] if len(set(layers)) == 1 else layers,
    }
    if "add_embedding.linear_1.weight" in s:
        cfg.update(addition_embed_type="text_time", addition_time_embed_dim=CONVENTIONS["addition_time_embed_dim"],
                   projection_class_embeddings_input_dim=s["add_embedding.linear_1.weight"][1])
    return cfg


FAMILY = Family(
    family_id="sd1",
    ids=("sd2", "sdxl"),
    label="SD1/SD2/SDXL UNet",
    layouts={
        ORIGINAL: Signature(at(r"(input_blocks|output_blocks)_.\d+_.\d+_.")),
        DIFFUSERS: Signature(at(r"(down_blocks|up_blocks)_.\d+_.(resnets|attentions)_."),
                             forbidden=(at(r"(encoder_.down_blocks|decoder_.up_blocks)_."),)),
    },
    identify=identify,
    diffusers_class="UNet2DConditionModel",
    pairs=pairs,
    lora_aliases=lora_aliases,
    diffusers_config=diffusers_config,
    kohya_layout=None,  # SD1/SD2: diffusers names; SDXL: LDM names (both answer on either base)
    kohya_layouts={"sd1": DIFFUSERS, "sd2": DIFFUSERS, "sdxl": ORIGINAL},  # what kohya's trainers write
    lora_namings=("kohya (SD1/SD2 diffusers names, SDXL LDM names)", "diffusers/PEFT", "old diffusers processors",
                  "OneTrainer", "SimpleTuner LyCORIS"),
    high_precision={
        ORIGINAL: (r"^(input_blocks\.0\.|out\.|time_embed\.|label_emb\.)",),
        DIFFUSERS: (r"^(conv_in|conv_out|conv_norm_out|time_embedding|add_embedding|class_embedding)\.",),
    },
    gguf=GGUFStorage({"sd1": "sd1", "sd2": "sd1", "sdxl": "sdxl", "": "sd1"}, reshape=True),  # "": keys cannot tell
    blocks=(r"^input_blocks\.(\d+)\.", r"^middle_block\.", r"^output_blocks\.(\d+)\."),
)
