"""AuraFlow (fal): the reference layout (`double_layers.N.modX`, `single_layers.N`, `init_x_linear`), as
its single files and ComfyUI have it. Here for ComfyUI-GGUF's storage rule (`convert --to gguf-*`) and
recognition only: no correspondence to diffusers' AuraFlowTransformer2DModel is declared, so neither
`convert --layout` nor a layout-crossing LoRA merge is offered.

Recognition follows ComfyUI-GGUF's own (tools/convert.py): a file with `double_layers.3.modX.1.weight`.
The diffusers layout (`joint_transformer_blocks`), which ComfyUI-GGUF refuses, is not declared.
"""

from __future__ import annotations

from ckpt.families.spec import ORIGINAL, Family, GGUFStorage, Signature, start

FAMILY = Family(
    family_id="auraflow",
    label="AuraFlow",
    layouts={ORIGINAL: Signature(start(r"(double|single)_layers\.\d+\."),
                                 required=(r"^double_layers\.3\.modX\.1\.weight$",))},
    # ComfyUI-GGUF's lcpp.patch: the input and output layers stay unquantized (substrings, or whole names)
    high_precision={ORIGINAL: (r"t_embedder\.", r"init_x_linear\.", r"^modF\.1\.weight$", r"^cond_seq_linear\.weight$",
                               r"^final_linear\.weight$", r"^positional_encoding$", r"^register_tokens$")},
    gguf=GGUFStorage("aura"),
    blocks=(r"^double_layers\.(\d+)\.", r"^single_layers\.(\d+)\."),
)
