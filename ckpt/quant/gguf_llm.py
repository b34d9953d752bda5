"""llama.cpp LLM GGUFs back to Hugging Face transformers names, weights and config.json.

llama.cpp's converter (convert_hf_to_gguf.py) names each HF tensor with gguf's tensor-name tables
(`gguf.get_tensor_name_map(arch, n_blocks).get_name(hf_name)`); reading goes the other way by asking the
same table for the GGUF name of every key the HF model class has, and inverting (what transformers'
own GGUF loader does from an instantiated model; here the keys are listed per architecture below, so
no model is built). Each GGUF tensor must find its HF name: one that does not is an error, never a
dropped key.

What llama.cpp changed on the way, undone here:
- `llama` (Llama, Mistral and other LlamaForCausalLM checkpoints): the rows of q_proj and k_proj were
  permuted per head for llama.cpp's RoPE (`LlamaModel.permute`: rows (2, hd/2) -> (hd/2, 2) in each
  head; k with the key/value head count). The inverse permutation is applied per head, in bands of
  whole heads.
- tied embeddings: a file without `output.weight` ties lm_head to the embeddings (config
  `tie_word_embeddings`), as the HF model had.
- `rope_freqs.weight` (Llama 3 RoPE scaling factors computed by the converter) has no HF tensor; it is
  left out with a note: the factors belong in config.json `rope_scaling`, which GGUF does not record.

config.json comes from the GGUF metadata (`{arch}.embedding_length`, `.block_count`, `.attention.*`,
`.rope.*`, `tokenizer.ggml.*_token_id`) and the tensor shapes (vocabulary, head size). The tokenizer
is not exported (transformers reads it from the .gguf itself).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ckpt.errors import file_error
from ckpt.io.gguf import GGUFStored
from ckpt.io.tensors import Tensor
from ckpt.io.wrapper import Wrapper
from ckpt.quant.encoding import Encoding, encoding_of
from ckpt.quant.view import Decoded

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


ARCHS: dict[str, LLMArch] = {a.arch: a for a in [
    LLMArch("llama", "LlamaForCausalLM", "llama", LLAMA_LAYER, rope_permute=True,
            bias_flags={"attention_bias": ("attn_q.bias", "attn_k.bias", "attn_v.bias", "attn_output.bias"),
                        "mlp_bias": ("ffn_gate.bias", "ffn_up.bias", "ffn_down.bias")}),
    LLMArch("qwen2", "Qwen2ForCausalLM", "qwen2", LLAMA_LAYER),
    LLMArch("qwen3", "Qwen3ForCausalLM", "qwen3", LLAMA_LAYER + ("self_attn.q_norm", "self_attn.k_norm"),
            bias_flags={"attention_bias": ("attn_q.bias", "attn_k.bias", "attn_v.bias", "attn_output.bias")}),
]}
SUPPORTED = ", ".join(ARCHS)
DROPPED = {"rope_freqs.weight": "Llama 3 RoPE scaling factors computed by llama.cpp's converter (no HF tensor)"}


def _gguf():
    import gguf

    return gguf


def is_llm(header, stored: dict) -> bool:
    """llama.cpp's tensor names (`blk.N.*`, `token_embd.weight`), as opposed to a diffusion model's own."""
    return any(n.startswith("blk.") or n == "token_embd.weight" for n in stored)


def name_map(arch: LLMArch, n_blocks: int) -> dict[str, str]:
    """GGUF tensor name -> HF name, from gguf's own table for `arch`."""
    gguf = _gguf()
    enum = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch.arch)
    table = gguf.get_tensor_name_map(enum, n_blocks)
    hf = list(TOP) + [f"model.layers.{i}.{m}" for i in range(n_blocks) for m in arch.layer_modules]
    out = {}
    for name in hf:
        g = table.get_name(name)
        if g is None:
            continue
        for suffix in (".weight", ".bias"):
            out[g + suffix] = name + suffix
    return out


class HeadRowsUnpermuted(Wrapper):
    """Rows of a q/k projection put back in HF order: llama.cpp stored each head's rows as (hd/2, 2), HF
    has (2, hd/2). Bands hold whole heads, so each band is permuted on its own."""

    def __init__(self, base: Tensor, n_heads: int, name: str):
        self.base, self.name, self.home = base, name, base.home
        self.shape = tuple(base.shape)
        self.head = base.rows // n_heads
        self.row_align = None if base.row_align is None else math.lcm(self.head, base.row_align)

    dtype = property(lambda self: self.base.dtype)  # the base's, asked when needed (planning needs no torch)
    dtype_name = property(lambda self: self.base.dtype_name)

    def read(self, start, stop, device, scratch=None):
        x = self.base.read(start, stop, device, scratch)
        rest = x.shape[1:]
        h = (stop - start) // self.head
        return x.reshape(h, self.head // 2, 2, *rest).transpose(1, 2).reshape(stop - start, *rest).contiguous()

    @property
    def encoding(self):
        """A new value in HF order goes back through llama.cpp's permute, then the stored encoding."""
        inner = encoding_of(self.base)
        return None if inner is None else HeadRowsPermutedEncoding(inner, self.head)


class HeadRowsPermuted(Tensor):
    """The inverse of `HeadRowsUnpermuted`: HF rows (2, hd/2) per head -> llama.cpp's (hd/2, 2)."""

    def __init__(self, base: Tensor, head: int):
        self.base, self.head, self.name, self.home = base, head, base.name, base.home
        self.dtype, self.shape = base.dtype, tuple(base.shape)
        self.row_align = None if base.row_align is None else math.lcm(head, base.row_align)

    def read(self, start, stop, device, scratch=None):
        x = self.base.read(start, stop, device, scratch)
        rest = x.shape[1:]
        h = (stop - start) // self.head
        return x.reshape(h, 2, self.head // 2, *rest).transpose(1, 2).reshape(stop - start, *rest).contiguous()


class HeadRowsPermutedEncoding(Encoding):
    """Storing a new q/k value of a llama GGUF: permuted back to llama.cpp's row order, then encoded as the
    stored tensor is."""

    def __init__(self, inner, head: int):
        self.inner, self.head = inner, head
        self.label, self.keys, self.note = inner.label, inner.keys, inner.note

    def why_not(self):
        return self.inner.why_not()

    def encode(self, value, report, meter):
        return self.inner.encode(HeadRowsPermuted(value, self.head), report, meter)


class Renamed(Wrapper):
    """A stored tensor under its HF name (plain GGUF types need no decoding, only the name)."""

    def __init__(self, base: Tensor, name: str):
        self.base, self.name, self.home = base, name, base.home
        self.shape, self.row_align = tuple(base.shape), base.row_align

    dtype = property(lambda self: self.base.dtype)  # the base's, asked when needed (planning needs no torch)
    dtype_name = property(lambda self: self.base.dtype_name)

    @property
    def encoding(self):
        return encoding_of(self.base)


def _f32(v) -> float:
    """A float32 metadata value as the decimal it was written from (1e-06, not 9.99999997e-07)."""
    import numpy as np

    return float(str(np.float32(v)))


def _uniform(header, key: str, default=None):
    """A per-model hyperparameter; llama.cpp writes some as per-layer arrays, which must then agree."""
    v = header.value(key, default)
    if isinstance(v, list):
        if not v or any(x != v[0] for x in v):
            raise file_error(header.path, f"metadata {key!r} differs between layers ({v[:8]}...), which "
                                          "one transformers config cannot express")
        v = v[0]
    return v


def derive_config(header, arch: LLMArch, stored: dict[str, GGUFStored]) -> tuple[dict, list[str]]:
    """config.json for the HF model class, from the GGUF metadata and the tensor shapes; and notes."""
    K = _gguf().Keys
    a = arch.arch

    def key(template: str) -> str:
        return template.format(arch=a)

    def need(template: str):
        v = _uniform(header, key(template))
        if v is None:
            raise file_error(header.path, f"metadata {key(template)!r} is missing (needed for config.json)")
        return v

    heads = int(need(K.Attention.HEAD_COUNT))
    kv_heads = int(_uniform(header, key(K.Attention.HEAD_COUNT_KV), heads))
    emb = stored.get("token_embd.weight")
    q = stored.get("blk.0.attn_q.weight")
    hidden = int(need(K.LLM.EMBEDDING_LENGTH))
    cfg = {
        "architectures": [arch.hf_class],
        "model_type": arch.model_type,
        "hidden_size": hidden,
        "intermediate_size": int(need(K.LLM.FEED_FORWARD_LENGTH)),
        "num_hidden_layers": int(need(K.LLM.BLOCK_COUNT)),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": q.stored_shape[0] // heads if q is not None else hidden // heads,
        "rms_norm_eps": _f32(need(K.Attention.LAYERNORM_RMS_EPS)),
        "max_position_embeddings": int(need(K.LLM.CONTEXT_LENGTH)),
        "rope_theta": _f32(_uniform(header, key(K.Rope.FREQ_BASE), 10000.0)),
        "tie_word_embeddings": "output.weight" not in stored,
        "hidden_act": "silu",
    }
    if emb is not None:
        cfg["vocab_size"] = emb.stored_shape[0]
    elif header.value(key(K.LLM.VOCAB_SIZE)) is not None:
        cfg["vocab_size"] = int(header.value(key(K.LLM.VOCAB_SIZE)))
    for field_name, suffixes in arch.bias_flags.items():
        cfg[field_name] = any(n.endswith(suffixes) for n in stored)
    for hf_key, gguf_key in (("bos_token_id", K.Tokenizer.BOS_ID), ("eos_token_id", K.Tokenizer.EOS_ID)):
        v = header.value(gguf_key)
        if isinstance(v, int):
            cfg[hf_key] = v
    notes = []
    scaling = header.value(key(K.Rope.SCALING_TYPE))
    if isinstance(scaling, str) and scaling not in ("none", ""):
        rope = {"rope_type": scaling, "factor": _f32(_uniform(header, key(K.Rope.SCALING_FACTOR), 1.0))}
        orig = header.value(key(K.Rope.SCALING_ORIG_CTX_LEN))
        if orig is not None:
            rope["original_max_position_embeddings"] = int(orig)
        cfg["rope_scaling"] = rope
        notes.append(f"config.json rope_scaling {rope} from the GGUF metadata; check it against the original model")
    return cfg, notes


def decode(header, stored: dict[str, GGUFStored], natural: str) -> Decoded:
    from ckpt.quant.gguf import GGUFValues, type_summary

    arch_name = header.architecture
    arch = ARCHS.get(arch_name or "")
    if arch is None:
        known = arch_name in _gguf().MODEL_ARCH_NAMES.values()
        what = "an LLM architecture ckpt has no HF name table for" if known else "not an architecture gguf knows"
        raise file_error(header.path, f"GGUF architecture {arch_name!r} is {what} (supported LLMs: {SUPPORTED}); "
                                      "nothing was written")
    cfg, notes = derive_config(header, arch, stored)
    names = name_map(arch, cfg["num_hidden_layers"])
    tensors, consumed, anchors = {}, {}, {}
    for gname, t in stored.items():
        if gname in DROPPED:
            consumed[gname] = DROPPED[gname]
            notes.append(f"{gname}: left out ({DROPPED[gname]}); config.json has no rope_scaling for it: copy "
                         "rope_scaling from the original model's config.json")
            continue
        hf = names.get(gname)
        if hf is None:
            raise file_error(header.path, f"tensor {gname!r} has no Hugging Face name in ckpt's {arch.arch} table "
                                          "(a variant ckpt does not know); nothing was written")
        value = GGUFValues(t, None, natural, name=hf) if t.quantized else Renamed(t, hf)
        if arch.rope_permute and gname.endswith((".attn_q.weight", ".attn_q.bias", ".attn_k.weight", ".attn_k.bias")):
            n = cfg["num_attention_heads"] if ".attn_q." in gname else cfg["num_key_value_heads"]
            value = HeadRowsUnpermuted(value, n, hf)
        tensors[hf] = value
        consumed[gname] = f"GGUF name of {hf}"
        anchors[gname] = hf
    quantized = any(t.quantized for t in stored.values())
    return Decoded(f"GGUF {arch.arch} LLM ({type_summary(stored.values())})", tensors, consumed,
                   dequantized=quantized, notes=notes, anchors=anchors, config=cfg)
