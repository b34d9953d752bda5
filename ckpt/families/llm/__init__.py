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

Beside them, what an HF LLM folder must hold to be written as a GGUF llama.cpp loads, for every architecture
here: `config_keys` (each config.json key's type, range and the tensor shapes it must agree with) and
`tokenizer_files` (the structure of the tokenizer files and chat templates); `quant_mix` is llama-quantize's
per-tensor type choice.
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
    # export (HF -> GGUF, `ckpt.targets.planners.gguf_llm_out`): config.json `architectures` convert_hf_to_gguf.py writes as
    # this llama.cpp architecture (its model class's `ModelBase.register` names that ckpt supports)
    hf_classes: tuple[str, ...] = ()
    # LlamaModel.set_gguf_parameters: also `{arch}.vocab_size` and `{arch}.rope.dimension_count`
    llama_params: bool = False
    # which of the reference's model classes' set_gguf_parameters / set_vocab the architecture has
    # ("text": TextModel's; "gemma2", "gemma3", "phi3": their own) and tokenizer reader ("llama": LlamaModel's,
    # "qwen2": SentencePiece if there is a tokenizer.model else BPE, "gemma2", "gemma3", "phi3": theirs)
    params: str = "text"
    vocab: str = "qwen2"
    norm_shift: float = 0.0  # added to every `*norm.weight` (Gemma's RMSNorm scales by 1 + weight)
    drop: tuple[str, ...] = ()  # HF tensors the reference leaves out (Gemma 2's lm_head: llama.cpp ties it)
    trim_vocab: bool = False  # Gemma 3: token_embd cut to the tokenizer's size (rows beyond it are padding)
    # mixture of experts: the reference stacks each layer's per-expert matrices into one [experts, rows, cols]
    # tensor. (a substring every expert tensor's name has, its name with {bid} {x} {w}, the projections in the
    # order the stacked tensors are written, the HF name the stacked tensor is mapped from)
    experts: tuple = ()


ARCHS: dict[str, LLMArch] = {a.arch: a for a in [
    LLMArch("llama", "LlamaForCausalLM", "llama", LLAMA_LAYER, rope_permute=True,
            bias_flags={"attention_bias": ("attn_q.bias", "attn_k.bias", "attn_v.bias", "attn_output.bias"),
                        "mlp_bias": ("ffn_gate.bias", "ffn_up.bias", "ffn_down.bias")},
            hf_classes=("LlamaForCausalLM", "LLaMAForCausalLM", "MistralForCausalLM", "MixtralForCausalLM"),
            llama_params=True, vocab="llama",
            experts=("block_sparse_moe.experts", "model.layers.{bid}.block_sparse_moe.experts.{x}.{w}.weight",
                     ("w1", "w2", "w3"), "layers.{bid}.feed_forward.experts.{w}.weight")),
    LLMArch("qwen2", "Qwen2ForCausalLM", "qwen2", LLAMA_LAYER, hf_classes=("Qwen2ForCausalLM",)),
    LLMArch("qwen3", "Qwen3ForCausalLM", "qwen3", LLAMA_LAYER + ("self_attn.q_norm", "self_attn.k_norm"),
            bias_flags={"attention_bias": ("attn_q.bias", "attn_k.bias", "attn_v.bias", "attn_output.bias")},
            hf_classes=("Qwen3ForCausalLM",)),
]}

GEMMA2_LAYER = ("input_layernorm", "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                "post_attention_layernorm", "pre_feedforward_layernorm", "mlp.gate_proj", "mlp.up_proj",
                "mlp.down_proj", "post_feedforward_layernorm")
PHI3_LAYER = ("input_layernorm", "self_attn.qkv_proj", "self_attn.o_proj", "post_attention_layernorm",
              "mlp.gate_up_proj", "mlp.down_proj")

# Written (HF -> GGUF) but not read back: the reader (`ckpt.quant.gguf_llm`) would have to undo what the
# exporter does to them (Gemma's norm + 1, Phi-3's fused projections, stacked experts), which it does not.
EXPORT_ONLY: dict[str, LLMArch] = {a.arch: a for a in [
    LLMArch("gemma2", "Gemma2ForCausalLM", "gemma2", GEMMA2_LAYER, hf_classes=("Gemma2ForCausalLM",),
            params="gemma2", vocab="gemma2", norm_shift=1.0, drop=("lm_head.weight",)),
    LLMArch("gemma3", "Gemma3ForCausalLM", "gemma3_text", GEMMA2_LAYER + ("self_attn.q_norm", "self_attn.k_norm"),
            hf_classes=("Gemma3ForCausalLM",), params="gemma3", vocab="gemma3", norm_shift=1.0, trim_vocab=True),
    LLMArch("phi3", "Phi3ForCausalLM", "phi3", PHI3_LAYER, hf_classes=("Phi3ForCausalLM",), params="phi3",
            vocab="phi3"),
    LLMArch("qwen3moe", "Qwen3MoeForCausalLM", "qwen3_moe", ("input_layernorm", "self_attn.q_proj",
            "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "self_attn.q_norm", "self_attn.k_norm",
            "post_attention_layernorm", "mlp.gate"), hf_classes=("Qwen3MoeForCausalLM",), params="qwen2moe",
            experts=("experts", "model.layers.{bid}.mlp.experts.{x}.{w}.weight", ("down_proj", "gate_proj", "up_proj"),
                     "model.layers.{bid}.mlp.experts.{w}.weight")),
]}

# config.json `architectures[0]` -> the llama.cpp architecture the exporter writes it as
EXPORTS: dict[str, LLMArch] = {c: a for a in [*ARCHS.values(), *EXPORT_ONLY.values()] for c in a.hf_classes}
