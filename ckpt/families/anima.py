"""Anima (CircleStone Labs / Comfy Org): Cosmos-Predict2's 2B DiT (NVIDIA's MiniTrainDIT) with an LLM adapter
inside the same file. Original layout: the MiniTrainDIT names plus `llm_adapter.*`, as the Anima single files,
ComfyUI (`comfy/ldm/anima/model.py`: `Anima(MiniTrainDIT)` + `LLMAdapter`) and kohya/ComfyUI LoRAs have them
<-> diffusers CosmosTransformer3DModel, the transformer of diffusers' Anima pipeline.

The DiT's correspondence is diffusers' Cosmos 2.0 single-file converter (`convert_cosmos_transformer_checkpoint_
to_diffusers`): the blocks' `self_attn`/`cross_attn` are `attn1`/`attn2` (`q_proj` -> `to_q`, `output_proj` ->
`to_out.0`, `q_norm` -> `norm_q`), the three adaLN-LoRA modulations `adaln_modulation_{self_attn,cross_attn,mlp}.1/.2`
are `norm1/2/3.linear_1/2`, `mlp.layer1/2` is `ff.net.0.proj`/`ff.net.2`, `x_embedder.proj.1` is `patch_embed.proj`,
`t_embedder.1` is `time_embed.t_embedder`, `t_embedding_norm` is `time_embed.norm`, the final layer is
`norm_out.linear_1/2` and `proj_out`. Nothing is fused or swapped. The converter drops the RoPE buffers
(`pos_embedder.seq/dim_spatial_range/dim_temporal_range`) and Transformer Engine's `_extra_state`/`accum_*`
bookkeeping: original-only here too.

What the weights cannot tell, and what is chosen:
- diffusers keeps the LLM adapter as a model of its own (`AnimaTextConditioner`, the pipeline's
  `text_conditioner/`, whose names are the adapter's own: `blocks.N.self_attn.q_proj`, `mlp.0`, `out_proj`...).
  `convert --layout diffusers` writes the transformer folder only: the `llm_adapter.*` tensors exist in the
  original layout only and are left out, with the note that names them (a diffusers Anima pipeline takes its
  text conditioner from its own folder). LoRAs in diffusers naming reach the adapter of an original-layout file
  all the same: `text_conditioner.<name>` is an alias of `llm_adapter.<name>` (diffusers' Anima LoRA converter,
  `_convert_non_diffusers_anima_lora_to_diffusers`, maps `diffusion_model.llm_adapter.` to `text_conditioner.`).
- a diffusers CosmosTransformer3DModel is Anima's DiT or Cosmos-Predict2's (the same class and names, nothing in
  the weights differs): this module answers for both in the diffusers layout, and for LoRA names without the
  adapter; a whole original-layout file without `llm_adapter.` is Cosmos-Predict2 (`cosmos.py`), as ComfyUI's
  detection decides (the adapter's `llm_adapter.blocks.0.cross_attn.q_proj.weight` selects Anima).
- config.json: patch size (1, 2, 2) and the padding-mask channel (in_channels = patch columns / 4 - 1), RoPE
  extrapolation (1, 4, 4) and max size (128, 240, 240) are the 2B text-to-image releases' (ComfyUI's Anima config
  asserts the same patch and channels); other models need `--config REF`.

LoRAs: kohya sd-scripts (`lora_unet_blocks_0_self_attn_q_proj`, `lora_unet_llm_adapter_...`) and ComfyUI /
diffusion-pipe (`diffusion_model.blocks.0...`) name the original modules; diffusers/PEFT the transformer's
(`transformer.transformer_blocks.0.attn1.to_q`) and the text conditioner's (`text_conditioner.blocks.0...`).
GGUF: ComfyUI-GGUF names no Anima architecture; its convert.py stores an Anima file under `cosmos` (its
CosmosPredict2 keys match, nothing bans the adapter) and ComfyUI's own detection then loads it as Anima.
"""

from __future__ import annotations

import re

from ckpt.families.spec import (DIFFUSERS, ORIGINAL, Alias, ConventionError, Family, GGUFStorage, Pair, Shapes,
                                Signature, at, block_indices, blocks_count, has, present, renames, start)

TOP = (
    ("x_embedder.proj.1", "patch_embed.proj"),
    ("t_embedder.1.linear_1", "time_embed.t_embedder.linear_1"),
    ("t_embedder.1.linear_2", "time_embed.t_embedder.linear_2"),
    ("final_layer.adaln_modulation.1", "norm_out.linear_1"),
    ("final_layer.adaln_modulation.2", "norm_out.linear_2"),
    ("final_layer.linear", "proj_out"),
)
TOP_NORMS = (("t_embedding_norm", "time_embed.norm"),)
ATTN = (("q_proj", "to_q"), ("k_proj", "to_k"), ("v_proj", "to_v"), ("output_proj", "to_out.0"))
ATTN_NORMS = (("q_norm", "norm_q"), ("k_norm", "norm_k"))
MODULATIONS = (("self_attn", "norm1"), ("cross_attn", "norm2"), ("mlp", "norm3"))
BLOCK = tuple((f"{o}.{po}", f"{d}.{pd}") for o, d in (("self_attn", "attn1"), ("cross_attn", "attn2"))
              for po, pd in ATTN) + tuple((f"adaln_modulation_{o}.{i}", f"{d}.linear_{i}")
                                          for o, d in MODULATIONS for i in (1, 2)) + (
    ("mlp.layer1", "ff.net.0.proj"), ("mlp.layer2", "ff.net.2"))
BLOCK_NORMS = tuple((f"{o}.{po}", f"{d}.{pd}") for o, d in (("self_attn", "attn1"), ("cross_attn", "attn2"))
                    for po, pd in ATTN_NORMS)
# Tensors diffusers' converter removes: RoPE buffers, Transformer Engine state, training counters.
ORIGINAL_ONLY = r"^pos_embedder\.(seq|dim_spatial_range|dim_temporal_range)$|_extra_state$|(^|\.)accum_"
ADAPTER = "llm_adapter."
TEXT_CONDITIONER = "text_conditioner."  # diffusers' name of the adapter (a model of its own there)

# Cosmos' own names (Wan's blocks have `self_attn.q`, `ffn.0`; no other family `adaln_modulation_mlp`)
COSMOS_NAMES = at(r"(adaln_modulation_.(self_attn|cross_attn|mlp)|mlp_.layer[12]|(self|cross)_attn_."
                  r"(q_proj|k_proj|v_proj|output_proj)|t_embedding_norm|llm_adapter)")
ORIGINAL_NAMES = start(r"(llm_adapter_.)?blocks_.\d+_.")
DIFFUSERS_NAMES = start(r"(transformer_blocks_.\d+_.(attn[12]|norm[123]|ff)_.|time_embed_.|patch_embed_.|norm_out_."
                        r"|proj_out)")
DIFFUSERS_ONLY = start(r"(transformer_blocks_.\d+_.norm[123]_.linear_[12]|time_embed_.t_embedder|patch_embed_.proj)")
# LTX-Video's diffusers blocks share attn1/attn2/ff names; these are its own
LTX = start(r"(transformer_blocks_.\d+_.scale_shift_table|caption_projection|adaln_single|proj_in)")
# a whole Cosmos model file (not LoRA module names): Anima only with its adapter
MODEL_FILE = r"^blocks\.0\.mlp\.layer1\.weight$"


def original_check(keys, shapes) -> bool:
    return not has(keys, MODEL_FILE) or bool(has(keys, r"^llm_adapter\."))


def pairs_for(blocks: list[int], adapter: list[str], extra: list[str]) -> list[Pair]:
    out = renames(TOP) + renames(TOP_NORMS, ends=("weight",))
    for i in blocks:
        o, d = f"blocks.{i}.", f"transformer_blocks.{i}."
        out += renames(BLOCK, o, d, ends=("weight", "bias"))
        out += renames(BLOCK_NORMS, o, d, ends=("weight",))
    out += [Pair(k, None) for k in adapter + extra]
    return out


def pairs(shapes: Shapes, layout: str) -> list[Pair]:
    head = "blocks" if layout == ORIGINAL else "transformer_blocks"
    adapter = sorted(k for k in shapes if k.startswith(ADAPTER)) if layout == ORIGINAL else []
    extra = sorted(k for k in shapes if re.search(ORIGINAL_ONLY, k)) if layout == ORIGINAL else []
    return present(pairs_for(block_indices(shapes, head), adapter, extra), shapes, layout)


def lora_aliases(shapes: Shapes, layout: str) -> list[Alias]:
    """diffusers' `text_conditioner.<module>` names for the adapter an original-layout file holds."""
    if layout != ORIGINAL:
        return []
    return [Alias(TEXT_CONDITIONER + k[len(ADAPTER):-len(".weight")], k) for k in shapes
            if k.startswith(ADAPTER) and k.endswith(".weight")]


# What the weights do not say (diffusers' CosmosTransformer3DModel config of the 2B text-to-image releases,
# which Anima keeps; ComfyUI's Anima config asserts the same patch and channels).
CONVENTIONS = {"patch_size": [1, 2, 2], "concat_padding_mask": True, "max_size": [128, 240, 240],
               "rope_scale": [1.0, 4.0, 4.0]}


def diffusers_config(s: Shapes) -> dict:
    width, cols = s["patch_embed.proj.weight"]
    patch = CONVENTIONS["patch_size"]
    per_channel = patch[0] * patch[1] * patch[2]
    if cols % per_channel or cols // per_channel < 2:
        raise ConventionError(f"a patch embedder of {cols} columns is not (channels + padding mask) x 2 x 2")
    head = s["transformer_blocks.0.attn1.norm_q.weight"][0]
    if width % head:
        raise ConventionError(f"a width of {width} is no whole number of {head}-wide heads")
    if any(k.startswith("learnable_pos_embed.") for k in s):
        raise ConventionError("a learnable position embedding (Cosmos 1.0) is not the 2B releases' layout")
    return {
        "_class_name": "CosmosTransformer3DModel",
        "in_channels": cols // per_channel - 1,
        "out_channels": s["proj_out.weight"][0] // per_channel,
        "num_attention_heads": width // head,
        "attention_head_dim": head,
        "num_layers": blocks_count(s, "transformer_blocks"),
        "mlp_ratio": s["transformer_blocks.0.ff.net.0.proj.weight"][0] / width,
        "text_embed_dim": s["transformer_blocks.0.attn2.to_k.weight"][1],
        "adaln_lora_dim": s["transformer_blocks.0.norm1.linear_1.weight"][0],
        "max_size": CONVENTIONS["max_size"],
        "patch_size": patch,
        "rope_scale": CONVENTIONS["rope_scale"],
        "concat_padding_mask": CONVENTIONS["concat_padding_mask"],
        "extra_pos_embed_type": None,
    }


def identify(keys, shapes, layout):
    if layout == DIFFUSERS:
        return "anima", "Anima / Cosmos-Predict2 transformer (diffusers CosmosTransformer3DModel)"
    if has(keys, at(r"llm_adapter_.")):
        return "anima", "Anima (Cosmos-Predict2 DiT with LLM adapter, original)"
    return "anima", "Anima / Cosmos-Predict2 DiT (original names)"


FAMILY = Family(
    family_id="anima",
    label="Anima",
    layouts={
        ORIGINAL: Signature(ORIGINAL_NAMES, required=(COSMOS_NAMES,), check=original_check),
        DIFFUSERS: Signature(DIFFUSERS_NAMES, required=(DIFFUSERS_ONLY,), forbidden=(LTX,)),
    },
    identify=identify,
    diffusers_class="CosmosTransformer3DModel",
    pairs=pairs,
    lora_aliases=lora_aliases,
    diffusers_config=diffusers_config,
    kohya_layout=ORIGINAL,
    lora_namings=("kohya sd-scripts (original names)", "ComfyUI/diffusion-pipe (original names)", "diffusers/PEFT",
                  "diffusers text_conditioner (LLM adapter)"),
    # ComfyUI-GGUF stores Anima as `cosmos`: its patched llama-quantize's COSMOS rule (the embedders, the RoPE
    # buffers and the final layer stay unquantized), the rule of cosmos.py; the diffusers names of the same layers.
    high_precision={
        ORIGINAL: (r"p_embedder\.", r"t_embedder\.", r"t_embedding_norm\.", r"x_embedder\.", r"pos_embedder\.",
                   r"final_layer\."),
        DIFFUSERS: (r"^(patch_embed|time_embed|norm_out|proj_out)\.",),
    },
    gguf=GGUFStorage("cosmos", f32=(r"pos_embedder",), ignore=(r"_extra_state", r"accum_")),
    blocks=(r"^blocks\.(\d+)\.",),
)
