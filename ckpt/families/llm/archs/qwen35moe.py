"""`qwen35moe` (Qwen3_5MoeTextModel in the reference's conversion/qwen.py): Qwen3.5's mixture-of-experts text model,
Qwen3.5's layers and transforms (`ckpt.families.llm.archs.qwen35`) with Qwen3-Next's experts and gated shared
expert; a `Qwen3_5MoeForConditionalGeneration` folder's text model likewise. Read back as Qwen3-Next's are."""

from __future__ import annotations

from ckpt.families.llm.archs.qwen35 import QWEN35_LAYER, Qwen35
from ckpt.families.llm.archs.qwen3next import EXPERTS, SHAPE_RULES

ARCH = Qwen35("qwen35moe", "Qwen3_5MoeForCausalLM", "qwen3_5_moe_text",
              QWEN35_LAYER + ("mlp.gate", "mlp.shared_expert.gate_proj", "mlp.shared_expert.up_proj",
                              "mlp.shared_expert.down_proj", "mlp.shared_expert_gate"),
              hf_classes=("Qwen3_5MoeForCausalLM", "Qwen3_5MoeForConditionalGeneration"), params="qwen3next",
              vocab="gpt2", experts=EXPERTS, shape_rules=SHAPE_RULES, q_rows_per_head=2)
