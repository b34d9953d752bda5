"""XLabs Flux LoRAs: `double_blocks.N.processor.{qkv,proj}_lora{1,2}.{down,up}.weight`.

They name BFL (original Flux) modules directly: lora1 is the image stream, lora2 the text stream, so
`qkv_lora1` is `double_blocks.N.img_attn.qkv` and `proj_lora2` is `double_blocks.N.txt_attn.proj`.
XLabs stores no alpha: scale 1. Any key prefix in front of `double_blocks` is kept for the key map.
"""

from __future__ import annotations

import re

XLABS_KEY = re.compile(r"^(?P<prefix>.*?)double_blocks\.(?P<n>\d+)\.processor\.(?P<what>qkv|proj)_lora(?P<stream>[12])"
                       r"\.(?P<role>down|up)\.weight$")


def xlabs_part(key: str) -> tuple[str, str] | None:
    """(BFL module name, "down"|"up") for an XLabs key, else None."""
    m = XLABS_KEY.match(key)
    if m is None:
        return None
    stream = "img" if m["stream"] == "1" else "txt"
    return f"{m['prefix']}double_blocks.{m['n']}.{stream}_attn.{m['what']}", m["role"]
