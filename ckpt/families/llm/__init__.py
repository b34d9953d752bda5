"""Language-model architecture facts for llama.cpp GGUFs: per llama.cpp architecture, the transformers
class it is, the module paths of one decoder layer, the config.json fields its tensors decide, and
whether llama.cpp permutes the q/k rows for its RoPE.

These are facts about the architectures, needed in both directions: reading a GGUF back to Hugging Face
names (`ckpt.quant.gguf_llm`) and writing one from them (the HF -> GGUF exporter). They live in the
families package, where model knowledge goes, and in a subpackage because they are no `Family` (tensor
names of one model class, no layouts to tell apart): the family loader looks at the package's own
modules only.

The GGUF names themselves are not listed: gguf's tensor-name tables (`gguf.get_tensor_name_map`) map
each HF module path below to llama.cpp's name, as llama.cpp's convert_hf_to_gguf.py does.
"""

from __future__ import annotations

from dataclasses import dataclass, field

LLAMA_LAYER = ("input_layernorm", "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
               "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "post_attention_layernorm")
TOP = ("model.embed_tokens", "model.norm", "lm_head")


@dataclass(frozen=True)
class LLMArch:
    """One llama.cpp architecture that reads back into one transformers model class."""

    arch: str  # general.architecture (gguf.MODEL_ARCH_NAMES)
    hf_class: str  # config.json architectures[0]
    model_type: str
    layer_modules: tuple[str, ...]  # module paths under model.layers.N (".weight" / ".bias" added)
    rope_permute: bool = False  # llama.cpp permuted q/k rows for its RoPE
    # config.json fields set when a tensor of this GGUF name suffix exists (else False)
    bias_flags: dict[str, tuple[str, ...]] = field(default_factory=dict)
    # export (HF -> GGUF, `ckpt.convert.gguf_llm_out`): config.json `architectures` convert_hf_to_gguf.py writes as
    # this llama.cpp architecture (its model class's `ModelBase.register` names that ckpt supports)
    hf_classes: tuple[str, ...] = ()
    # LlamaModel.set_gguf_parameters: also `{arch}.vocab_size` and `{arch}.rope.dimension_count`
    llama_params: bool = False


ARCHS: dict[str, LLMArch] = {a.arch: a for a in [
    LLMArch("llama", "LlamaForCausalLM", "llama", LLAMA_LAYER, rope_permute=True,
            bias_flags={"attention_bias": ("attn_q.bias", "attn_k.bias", "attn_v.bias", "attn_output.bias"),
                        "mlp_bias": ("ffn_gate.bias", "ffn_up.bias", "ffn_down.bias")},
            hf_classes=("LlamaForCausalLM", "LLaMAForCausalLM", "MistralForCausalLM"), llama_params=True),
    LLMArch("qwen2", "Qwen2ForCausalLM", "qwen2", LLAMA_LAYER, hf_classes=("Qwen2ForCausalLM",)),
    LLMArch("qwen3", "Qwen3ForCausalLM", "qwen3", LLAMA_LAYER + ("self_attn.q_norm", "self_attn.k_norm"),
            bias_flags={"attention_bias": ("attn_q.bias", "attn_k.bias", "attn_v.bias", "attn_output.bias")},
            hf_classes=("Qwen3ForCausalLM",)),
]}

# config.json `architectures[0]` -> the llama.cpp architecture the exporter writes it as
EXPORTS: dict[str, LLMArch] = {c: a for a in ARCHS.values() for c in a.hf_classes}
