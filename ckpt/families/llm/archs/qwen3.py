"""`qwen3` (Qwen3Model): Qwen2's, with q/k norms."""

from ckpt.families.llm.arch import LLAMA_LAYER, LLMArch

ARCH = LLMArch("qwen3", "Qwen3ForCausalLM", "qwen3", LLAMA_LAYER + ("self_attn.q_norm", "self_attn.k_norm"),
               bias_flags={"attention_bias": ("attn_q.bias", "attn_k.bias", "attn_v.bias", "attn_output.bias")},
               hf_classes=("Qwen3ForCausalLM",))
