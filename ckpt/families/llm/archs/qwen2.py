"""`qwen2` (Qwen2Model): TextModel's tensors and parameters, its own vocabulary reader."""

from ckpt.families.llm.arch import LLAMA_LAYER, LLMArch

ARCH = LLMArch("qwen2", "Qwen2ForCausalLM", "qwen2", LLAMA_LAYER, hf_classes=("Qwen2ForCausalLM",))
