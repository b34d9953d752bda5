"""`qwen35` (Qwen3_5TextModel in the reference's conversion/qwen.py): Qwen3.5's dense text model, Qwen3-Next's
hybrid layers (`ckpt.families.llm.archs.qwen3next`) with separate DeltaNet projections (`in_proj_qkv`,
`in_proj_z`, `in_proj_a`, `in_proj_b`) and a dense MLP. Beyond Qwen3-Next's tensor transforms, the value heads are
reordered from grouped (by key head) to tiled order where there are more value heads than key heads
(`_LinearAttentionVReorderBase`: the rows of qkv's v part, z, a, b, A_log, dt_bias and the conv1d kernel's v
channels, out_proj's columns), and `rope.dimension_sections` is always written (`_Qwen35MRopeMixin`: [11, 11, 10,
0] where the config has no mrope_section). The released checkpoints are vision-language folders
(`Qwen3_5ForConditionalGeneration`): their text model is written, the vision tower left out as the reference's text
model leaves it (`--mmproj` is the projector's file). Read back as Qwen3-Next's are, as the causal LM."""

from __future__ import annotations

from ckpt.families.llm.archs.qwen3next import SHAPE_RULES, Qwen3Next

QWEN35_LAYER = ("input_layernorm", "post_attention_layernorm", "self_attn.q_proj", "self_attn.k_proj",
                "self_attn.v_proj", "self_attn.o_proj", "self_attn.q_norm", "self_attn.k_norm",
                "linear_attn.in_proj_qkv", "linear_attn.in_proj_z", "linear_attn.in_proj_a",
                "linear_attn.in_proj_b", "linear_attn.conv1d", "linear_attn.A_log", "linear_attn.dt_bias",
                "linear_attn.norm", "linear_attn.out_proj")


class Qwen35(Qwen3Next):
    v_reorder = True
    mrope_default = True


ARCH = Qwen35("qwen35", "Qwen3_5ForCausalLM", "qwen3_5_text",
              QWEN35_LAYER + ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"),
              hf_classes=("Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration"), params="qwen35", vocab="gpt2",
              shape_rules=SHAPE_RULES, q_rows_per_head=2)
