"""Hugging Face causal language models with Llama-style decoder names (Llama, Mistral, Qwen, Gemma,
Phi-3...): `model.layers.N.self_attn.q_proj`. One naming, no layout conversion; LoRAs are PEFT
(`base_model.model.<key>`)."""

from __future__ import annotations

from ckpt.families.spec import Family, Signature, at

FAMILY = Family(
    family_id="hf_causal_lm",
    kind="language_model",
    label="HF causal LM (Llama-style decoder)",
    layouts={None: Signature(at(r"layers_.\d+_.(self_attn|mlp)_.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj"
                                r"|down_proj)"))},
    config_classes=(r"\w+ForCausalLM",),
    lora_namings=("PEFT", "LLaMA-Factory/axolotl (PEFT)"),
    high_precision={"": (r"(embed_tokens|lm_head)",)},
)
