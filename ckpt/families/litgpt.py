"""LitGPT checkpoints (`lit_model.pth`: `transformer.h.N.attn.qkv`, older `attn.attn`): one naming.
The merge of LitGPT LoRAs is `ckpt.adapters.litgpt`; this module only recognises the layout."""

from __future__ import annotations

from ckpt.families.spec import Family, Signature, at, has


def identify(keys, shapes, layout):
    older = " (older attn.attn names)" if has(keys, at(r"attn_.attn")) else ""
    return "litgpt", "LitGPT GPT" + older


FAMILY = Family(
    family_id="litgpt",
    kind="language_model",
    label="LitGPT GPT",
    # "transformer." may be stripped
    layouts={None: Signature(at(r"h_.\d+_.(attn_.(qkv|attn)|mlp_.(fc|fc_1|fc_2|proj))"))},
    identify=identify,
    lora_namings=("LitGPT lit_model.pth.lora",),
    high_precision={"": (r"(wte|lm_head)",)},
)
