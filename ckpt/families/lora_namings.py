"""How LoRA files name the model they were trained on: the prefixes trainers put before module names,
and what a LoRA's module names say about its target family and layout.

A helper of the registry (no FAMILY here): inspect names the parts of a LoRA with it, merge-lora says
which family and layout a LoRA that matched nothing looks like, LoRA conversion picks a naming.
"""

from __future__ import annotations

import re

from ckpt.families.spec import Match

# (prefix, what it means, naming in one word); longest match wins.
LORA_NAMINGS: list[tuple[re.Pattern, str, str]] = [
    (re.compile(r"^lora_unet_"), "kohya UNet/transformer", "kohya"),
    (re.compile(r"^lora_te\d?_"), "kohya text encoder", "kohya"),
    (re.compile(r"^lora_transformer_"), "OneTrainer transformer", "OneTrainer"),
    (re.compile(r"^lycoris_"), "LyCORIS, SimpleTuner", "LyCORIS"),
    (re.compile(r"^base_model\.model\."), "PEFT", "PEFT"),
    (re.compile(r"^(unet|transformer|prior)\."), "diffusers", "diffusers"),
    (re.compile(r"^text_encoder(_\d)?\."), "diffusers text encoder", "diffusers"),
    (re.compile(r"^(diffusion_model|model\.diffusion_model)\."), "ComfyUI", "ComfyUI"),
]
LORA_PREFIXES = [(p, what) for p, what, _ in LORA_NAMINGS]


def naming_of(name: str) -> tuple[str, str]:
    """(prefix, naming) of one LoRA module name; ("", "") when it has no known prefix."""
    best = ("", "")
    for pat, _what, naming in LORA_NAMINGS:
        m = pat.match(name)
        if m and len(m.group(0)) > len(best[0]):
            best = (m.group(0), naming)
    return best


def lora_target(names, shapes: dict | None = None) -> tuple[str, Match | None]:
    """(naming of most module names, family Match of the module names under that naming's prefixes).
    `shapes`: module name -> base weight shape where the LoRA's factors tell it."""
    from ckpt.families import detect

    shapes = shapes or {}
    counts: dict[str, int] = {}
    stripped, stripped_shapes = [], {}
    for n in names:
        prefix, naming = naming_of(n)
        counts[naming] = counts.get(naming, 0) + 1
        if prefix.startswith("lora_te") or prefix.startswith("text_encoder"):
            continue  # the text encoders are not what the LoRA is named for
        stripped.append(n[len(prefix):])
        if n in shapes:
            stripped_shapes[n[len(prefix):]] = shapes[n]
    naming = max(counts, key=counts.get) if counts else ""
    return naming or "unprefixed", detect(stripped, stripped_shapes) if stripped else None
