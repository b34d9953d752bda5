"""Krea 2 (Raw, Turbo; Krea AI): the reference layout (`krea-ai/krea-2`'s SingleStreamDiT, as in ComfyUI single
files and Comfy-Org's int8 ConvRot releases: `blocks.N.attn.wq`, `txtfusion.`, `first`, `last`) <-> diffusers
Krea2Transformer2DModel.

A single-stream DiT: `blocks.N` (diffusers `transformer_blocks.N`) with grouped-query attention `attn.wq/wk/wv`,
a sigmoid output gate `attn.gate` (`attn.to_gate`), `attn.wo` (`attn.to_out.0`), per-head q/k norms
`attn.qknorm.qnorm/knorm.scale` (`attn.norm_q/norm_k.weight`), a SwiGLU `mlp.gate/up/down` (`ff.gate/up/down`),
`prenorm/postnorm.scale` (`norm1/norm2.weight`), and one per-block modulation table `mod.lin`. Beside them: the
text-fusion transformer `txtfusion.layerwise_blocks/refiner_blocks/projector` (`text_fusion.`, blocks named
as above), the patch embedder `first` (`img_in`), the timestep MLP `tmlp.0/2` (`time_embed.linear_1/2`), the
shared modulation projection `tproj.1` (`time_mod_proj`), the text projection `txtmlp.0/1/3`
(`txt_in.norm/linear_1/linear_2`) and the final layer `last.norm/linear/modulation.lin` (`final_layer.norm/
linear/scale_shift_table`). Every tensor pairs with one tensor: nothing is fused. The one change of shape:
a block's `mod.lin` is its six modulation vectors flattened, [6 * width], and diffusers' `scale_shift_table`
the [6, width] table (`Transform.SIX_ROWS`); the final layer's table is [2, width] in both. Reference:
diffusers `convert_krea2_transformer_checkpoint_to_diffusers` (there is no reverse converter).

LoRAs: the Krea 2 reference trainer and ComfyUI (`diffusion_model.`) and ai-toolkit (`base_model.model.`) name
the reference modules (`blocks.0.attn.wq`), diffusers/PEFT the diffusers ones; both land on either layout.
A kohya-style `lora_unet_blocks_0_attn_wq` is read with the reference names (`kohya_layout` original).

High precision (what `convert --to int8|int8_convrot|...` keeps): Comfy-Org's `krea2_turbo_int8_convrot`
release quantizes the seven linears of the 28 `blocks` and nothing else (its 13,492,686,496 bytes are exactly
those at one byte per weight with per-channel fp32 scales, and every other tensor, the text-fusion transformer
included, in bf16), so every tensor outside `blocks.N` stays as it is.
"""

from __future__ import annotations

import re

from ckpt.families.spec import (DIFFUSERS, ORIGINAL, ConventionError, Family, Pair, Shapes, Signature,
                                block_indices, blocks_count, present, renames, start)

TOP = (("first", "img_in"), ("tmlp.0", "time_embed.linear_1"), ("tmlp.2", "time_embed.linear_2"),
       ("tproj.1", "time_mod_proj"), ("txtmlp.1", "txt_in.linear_1"), ("txtmlp.3", "txt_in.linear_2"),
       ("last.linear", "final_layer.linear"))
TOP_PARAMS = (("txtmlp.0.scale", "txt_in.norm.weight"), ("last.norm.scale", "final_layer.norm.weight"),
              ("last.modulation.lin", "final_layer.scale_shift_table"),
              ("txtfusion.projector.weight", "text_fusion.projector.weight"))
# one block's tensors (no biases: Krea 2's attention and MLP linears have none)
BLOCK = (("attn.wq.weight", "attn.to_q.weight"), ("attn.wk.weight", "attn.to_k.weight"),
         ("attn.wv.weight", "attn.to_v.weight"), ("attn.wo.weight", "attn.to_out.0.weight"),
         ("attn.gate.weight", "attn.to_gate.weight"), ("attn.qknorm.qnorm.scale", "attn.norm_q.weight"),
         ("attn.qknorm.knorm.scale", "attn.norm_k.weight"), ("mlp.gate.weight", "ff.gate.weight"),
         ("mlp.up.weight", "ff.up.weight"), ("mlp.down.weight", "ff.down.weight"),
         ("prenorm.scale", "norm1.weight"), ("postnorm.scale", "norm2.weight"))
FUSION_HEADS = ("layerwise_blocks", "refiner_blocks")

ORIGINAL_NAMES = start(r"(blocks_.\d+_.(attn_.(wq|wk|wv|wo|gate|qknorm)|mlp_.(gate|up|down)|mod_.lin|prenorm|postnorm)"
                       r"|txtfusion_.|txtmlp_.|tmlp_.|tproj_.|first(\.|$)|last_.(linear|norm|modulation))")
# names no other family has: the gated attention's `wq`/`gate`, the text fusion, the shared modulation
ORIGINAL_ONLY = start(r"(blocks_.\d+_.attn_.(wq|wk|wv|wo|gate|qknorm)|txtfusion_.|tproj_.1)")
DIFFUSERS_NAMES = start(r"(transformer_blocks_.\d+_.(attn_.(to_[qkv]|to_out|to_gate|norm_[qk])|ff_.(gate|up|down)"
                        r"|norm[12]|scale_shift_table)|text_fusion_.|time_mod_proj|time_embed_.linear_[12]"
                        r"|txt_in_.(norm|linear_[12])|img_in|final_layer_.(linear|norm|scale_shift_table))")
DIFFUSERS_ONLY = start(r"(transformer_blocks_.\d+_.(attn_.to_gate|ff_.(gate|up|down))|text_fusion_.|time_mod_proj)")


def _block_pairs(o: str, d: str) -> list[Pair]:
    return [Pair(o + a, d + b) for a, b in BLOCK]


def pairs_for(blocks: list[int], fusion: dict[str, list[int]]) -> list[Pair]:
    out = renames(TOP) + [Pair(o, d) for o, d in TOP_PARAMS]
    for i in blocks:
        o, d = f"blocks.{i}.", f"transformer_blocks.{i}."
        out += _block_pairs(o, d)
        out.append(Pair(o + "mod.lin", d + "scale_shift_table", transform="six_rows"))
    for head, indices in fusion.items():
        out += [p for i in indices for p in _block_pairs(f"txtfusion.{head}.{i}.", f"text_fusion.{head}.{i}.")]
    return out


def pairs(shapes: Shapes, layout: str) -> list[Pair]:
    trunk, fusion = ("blocks", "txtfusion") if layout == ORIGINAL else ("transformer_blocks", "text_fusion")
    return present(pairs_for(block_indices(shapes, trunk),
                             {h: block_indices(shapes, f"{fusion}.{h}") for h in FUSION_HEADS}), shapes, layout)


# What the weights do not say (diffusers' Krea2Transformer2DModel defaults, those of krea/Krea-2-Raw): rope
# theta and norm eps. The rope axes follow from the head size by ComfyUI's rule (comfy/ldm/krea2/model.py:
# h - 12 * (h // 16), 6 * (h // 16), 6 * (h // 16); 128 -> 32, 48, 48, diffusers' default).
CONVENTIONS = {"rope_theta": 1000.0, "norm_eps": 1e-05}


def _rope_axes(head: int) -> list[int]:
    part = head // 16
    if part == 0:
        raise ConventionError(f"Krea 2's rope axes are known for attention heads of 16 or more, not {head}")
    return [head - 12 * part, 6 * part, 6 * part]


def diffusers_config(s: Shapes) -> dict:
    head = s["transformer_blocks.0.attn.norm_q.weight"][0]
    width = s["img_in.weight"][0]
    text_head = s["text_fusion.layerwise_blocks.0.attn.norm_q.weight"][0]
    return {
        "_class_name": "Krea2Transformer2DModel",
        "in_channels": s["img_in.weight"][1],
        "num_layers": blocks_count(s, "transformer_blocks"),
        "attention_head_dim": head,
        "num_attention_heads": width // head,
        "num_key_value_heads": s["transformer_blocks.0.attn.to_k.weight"][0] // head,
        "intermediate_size": s["transformer_blocks.0.ff.gate.weight"][0],
        "timestep_embed_dim": s["time_embed.linear_1.weight"][1],
        "text_hidden_dim": s["txt_in.norm.weight"][0],
        "num_text_layers": s["text_fusion.projector.weight"][1],
        "text_num_attention_heads": s["text_fusion.layerwise_blocks.0.attn.to_q.weight"][0] // text_head,
        "text_num_key_value_heads": s["text_fusion.layerwise_blocks.0.attn.to_k.weight"][0] // text_head,
        "text_intermediate_size": s["text_fusion.layerwise_blocks.0.ff.gate.weight"][0],
        "num_layerwise_text_blocks": blocks_count(s, "text_fusion.layerwise_blocks"),
        "num_refiner_text_blocks": blocks_count(s, "text_fusion.refiner_blocks"),
        "axes_dims_rope": _rope_axes(head),
        "rope_theta": CONVENTIONS["rope_theta"],
        "norm_eps": CONVENTIONS["norm_eps"],
    }


def identify(keys, shapes, layout):
    where = "(original)" if layout == ORIGINAL else "(diffusers Krea2Transformer2DModel)"
    return "krea2", f"Krea 2 transformer {where}"


def _outside(trunk: str) -> str:
    """Every name not inside a `trunk.N.` block (the int8 ConvRot release keeps them all in bf16)."""
    return rf"^(?!{re.escape(trunk)}\.\d+\.)"


FAMILY = Family(
    family_id="krea2",
    label="Krea 2",
    layouts={
        ORIGINAL: Signature(ORIGINAL_NAMES, required=(ORIGINAL_ONLY,)),
        DIFFUSERS: Signature(DIFFUSERS_NAMES, required=(DIFFUSERS_ONLY,)),
    },
    identify=identify,
    diffusers_class="Krea2Transformer2DModel",
    pairs=pairs,
    diffusers_config=diffusers_config,
    kohya_layout=ORIGINAL,
    lora_namings=("Krea 2 trainer/ComfyUI (`diffusion_model.`, reference names)",
                  "ai-toolkit (`base_model.model.`, reference names)", "diffusers/PEFT", "OneTrainer",
                  "SimpleTuner LyCORIS"),
    # Comfy-Org's int8 ConvRot release (see the docstring): only the blocks' linears are quantized; the
    # blocks' modulation table (1-D in the original, [6, w] in diffusers) stays too.
    high_precision={
        ORIGINAL: (_outside("blocks"),),
        DIFFUSERS: (_outside("transformer_blocks"), r"\.scale_shift_table$"),
    },
    blocks=(r"^blocks\.(\d+)\.",),
)
