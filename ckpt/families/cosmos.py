"""Cosmos-Predict2 (NVIDIA): the reference (MiniTrainDIT) layout (`blocks.N.adaln_modulation_cross_attn`,
`blocks.N.mlp.layer1`, `x_embedder`, `pos_embedder`), as its files and ComfyUI have it (a `net.` prefix,
when every key has it, is stripped before the names are read). Here for ComfyUI-GGUF's storage rule
(`convert --to gguf-*`) and recognition only: no diffusers correspondence is declared.

Recognition follows ComfyUI-GGUF's own (tools/convert.py: `blocks.0.mlp.layer1.weight` and
`blocks.0.adaln_modulation_cross_attn.1.weight`). Its blocks also carry Wan's `self_attn`/`cross_attn`
names: the primary pattern counts every block tensor, so a Cosmos file scores above Wan's signature.
"""

from __future__ import annotations

from ckpt.families.spec import ORIGINAL, Family, GGUFStorage, Signature, start

FAMILY = Family(
    family_id="cosmos",
    label="Cosmos-Predict2",
    layouts={ORIGINAL: Signature(start(r"blocks\.\d+\."),
                                 required=(r"^blocks\.0\.mlp\.layer1\.weight$",
                                           r"^blocks\.0\.adaln_modulation_cross_attn\.1\.weight$"))},
    # ComfyUI-GGUF's lcpp.patch: the input and output layers stay unquantized
    high_precision={ORIGINAL: (r"p_embedder\.", r"t_embedder\.", r"t_embedding_norm\.", r"x_embedder\.",
                               r"pos_embedder\.", r"final_layer\.")},
    # convert.py: the position embedder stays F32; Transformer Engine `_extra_state` and `accum_` counters
    # are no weights and are left out
    gguf=GGUFStorage("cosmos", f32=(r"pos_embedder",), ignore=(r"_extra_state", r"accum_")),
    blocks=(r"^blocks\.(\d+)\.",),
)
