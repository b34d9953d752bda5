"""`convert ./my-llm --to gguf-<type>`: a Hugging Face causal LM folder as the GGUF llama.cpp runs, as llama.cpp's
`convert_hf_to_gguf.py` writes it (then, for K-quant and IQ mixes, as `llama-quantize` would type it), streamed.

The reference is llama.cpp 0c1e57098 as vendored in llama-cpp-python 0.3.36 (`convert_hf_to_gguf.py` and its
`conversion/` package: `TextModel`, `LlamaModel`, `Qwen2Model`, `Qwen3Model`, `Gemma2Model`, `Gemma3Model`,
`Phi3MiniModel`; which one an architecture is, is data in `ckpt.families.llm`). What it does, and so ckpt:

- tensors: each safetensors part in sorted order, names sorted within a part (gguf's `SafetensorsLocal`), each named
  by gguf's tensor-name table (`TensorNameMap.get_name`); a name the table does not know is an error (the reference
  raises "Can not map tensor"), never a dropped key. `*.rotary_emb.inv_freq` (old checkpoints) is left out, as there.
  Llama's rope type `llama3` adds `rope_freqs.weight` (its factors, F32) first (`generate_extra_tensors`).
- llama: q_proj / k_proj rows (weights and biases) permuted per head for llama.cpp's RoPE (`LlamaModel.permute`,
  k with the kv head count), band by band in whole heads (`HeadRowsPermuted`, the mirror of the reader's).
- tied embeddings: no `lm_head.weight` in the files, no `output.weight` in the GGUF (llama.cpp ties them itself).
- Gemma 2 / 3: every `*norm.weight` + 1 (`Shifted`: in float32 for a BF16 model, in F16 for an F16 one, as
  there), Gemma 2's lm_head left out, Gemma 3's token_embd cut to the tokenizer's size; their own
  `set_gguf_parameters` (softcapping, sliding window). Phi-3: its own parameters, fused qkv / gate_up kept fused
  (llama.cpp splits them), a long-context model's `rope_factors_long/short.weight` and attention factor.
- mixture of experts (Mixtral as `llama`, Qwen3-MoE): each layer's per-expert matrices stacked into one
  `blk.N.ffn_{gate,up,down}_exps.weight` [experts, rows, cols] (`Stacked`, read a few experts per band), written
  where the reference writes them (when the layer's last expert tensor is reached, in its projection order).
  Checkpoints with fused expert tensors (`mlp.experts.gate_up_proj`) are refused by name.
- types (`prepare_tensors`): F32 for 1-D tensors, `*_norm.weight`, names not ending in `.weight` and the
  reference's always-F32 list (MoE routers, position embeddings); the others in the mix's type. `--to gguf-f16`,
  `-bf16`, `-f32` and `-q8_0` are `--outtype f16|bf16|f32|q8_0`. A quantizing mix starts from what
  `--outtype auto` gives (BF16 for a BF16 model, else F16: what one would feed `llama-quantize`) and
  `ckpt.families.llm.quant_mix.llm_types` (llama.cpp's `llama_tensor_get_type`) gives each tensor its final type.
  Values go through float32 as there (BF16 sources are upcast before rounding to F16: one rounding either way).
  A mix `convert_hf_to_gguf.py` has no outtype for (K-quants, IQ4, q4_0...) is the file `llama-quantize` makes of
  the `--outtype auto` file: tensors in its order (block number, then name) and `general.quantization_version`,
  `general.file_type` moved last as it sets them; from a BF16 or F16 model the bytes are its bytes, from an F32
  one ckpt quantizes the F32 values where that route would round them to F16 first.
- metadata (`TextModel.set_gguf_parameters`, `LlamaModel.set_gguf_parameters`): the hyperparameters as
  `AutoConfig.from_pretrained(folder).to_dict()` gives them (defaults filled in by transformers, as the reference
  reads them; config.json as it is where transformers is not installed), rope scaling, `general.file_type` (the
  mix's `gguf.LlamaFileType`), `general.quantization_version`; the `general.*` model-card keys from gguf's own
  `Metadata.load` (name, size label, ...); the tokenizer from `ckpt.targets.planners.gguf_vocab`. The `add_*` calls go to
  an in-memory `gguf.GGUFWriter` in the reference's order, so keys and value types are gguf's own; ckpt adds
  `ckpt.version` and `ckpt.operation`.

Refused in one line before anything is written: an architecture outside `ckpt.families.llm.EXPORTS`, a folder
without config.json or a tokenizer, a BPE pre-tokenizer llama.cpp does not know, a tensor with no GGUF name. The
inputs are checked first, where the reference takes them on trust: config.json's values for type, range and
agreement with the tensors (`ckpt.families.llm.config_keys`, on the file as written and again on the values
transformers fills in), every tokenizer file (`gguf_vocab.check_tokenizer`), and the token list written against
the embedding rows, so that what is written is a GGUF llama.cpp loads.
"""

from __future__ import annotations

import math
import re
from contextlib import nullcontext
from pathlib import Path

import torch

from ckpt import __version__
from ckpt.errors import CkptError
from ckpt.families.llm import EXPORTS, LLMArch, config_keys
from ckpt.io.plan import OutFile, Plan
from ckpt.io.tensors import ComputedTensor, RowSlice, Tensor
from ckpt.report import Report, plural

SKIPPED = (".attention.masked_bias", ".attention.bias", ".rotary_emb.inv_freq")  # prepare_tensors: "we don't need these"
# prepare_tensors' always-F32 tensors that these architectures can have (gguf.MODEL_TENSOR names)
F32_TENSORS = ("FFN_GATE_INP", "FFN_GATE_INP_SHEXP", "POS_EMBD", "TOKEN_TYPES")
PLAIN = ("F32", "F16", "BF16")
CONVERT_OUTTYPES = ("f32", "f16", "bf16", "q8_0")  # convert_hf_to_gguf.py --outtype; other mixes are llama-quantize's


def block_number(name: str) -> int:
    """llama.cpp's weight order key (llama_model_loader's weight_name_comparer): sscanf "blk.%d.", -1 outside."""
    m = re.match(r"blk\.(\d+)\.", name)
    return int(m.group(1)) if m else -1


def _gguf():
    import gguf

    return gguf


class Shifted(Tensor):
    """`base + shift` as the reference computes it (Gemma's norms + 1): in float32 for a BF16 source (upcast
    first, as prepare_tensors does), else in the source's own dtype."""

    def __init__(self, base: Tensor, shift: float):
        self.base, self.shift, self.name, self.home = base, shift, base.name, base.home
        self.shape, self.row_align = tuple(base.shape), base.row_align
        self.dtype = base.dtype if base.dtype in (torch.float16, torch.float32) else torch.float32

    def read(self, start, stop, device, scratch=None):
        return self.base.read(start, stop, device, scratch).to(self.dtype) + self.shift


def _first_class(value) -> str | None:
    return value[0] if isinstance(value, list) and value and isinstance(value[0], str) else None


def _architecture(cfg: dict | None) -> str | None:
    """get_model_architecture: `architectures[0]`, a text_config's own where it has one (None where there is no
    list of class names)."""
    if not isinstance(cfg, dict):
        return None
    arch = _first_class(cfg.get("architectures"))
    text = cfg.get("text_config")
    if isinstance(text, dict) and _first_class(text.get("architectures")) is not None:
        arch = _first_class(text["architectures"])
    return arch


def applies(ckpt, views) -> bool:
    """An HF causal LM folder (its config.json names a `*ForCausalLM` / `*LMHeadModel` /
    `*ForConditionalGeneration` class, or its tensors are a Llama-style decoder's) or a llama.cpp LLM GGUF: the LLM
    exporter plans it, supported or not (an unsupported one is refused by name there, not taken for a diffusion
    model)."""
    if len(ckpt.components) != 1:
        return False
    comp = ckpt.components[0]
    if _gguf_llm_source(comp) is not None:
        return True
    arch = _architecture(comp.config)
    if arch is not None:
        return arch in EXPORTS or arch.endswith(("ForCausalLM", "LMHeadModel", "ForConditionalGeneration"))
    return any(re.match(r"(model\.)?layers\.\d+\.self_attn\.q_proj\.", n) for n in views[0].tensors)


def _gguf_llm_source(comp):
    """The GGUFHeader of a component that is one llama.cpp LLM GGUF (`blk.N.*` names), else None."""
    from ckpt.quant.gguf_llm import is_llm

    if len(comp.files) == 1 and comp.files[0].kind == "gguf" and is_llm(comp.files[0].gguf, comp.tensors):
        return comp.files[0].gguf
    return None


def _folder(ckpt) -> Path:
    comp = ckpt.components[0]
    root = ckpt.path if ckpt.kind != "file" else ckpt.path.parent
    return root / comp.subdir


def text_merged(cfg: dict) -> dict:
    """TextModel.__init__: a multimodal config's language model config (`text_config` or an alias) merged over it."""
    hparams = dict(cfg)
    for key in ("llm_config", "lm_config", "language_config"):
        if key in hparams:
            hparams["text_config"] = hparams[key]
    if isinstance(hparams.get("text_config"), dict):
        hparams = {**hparams, **hparams["text_config"]}
    return hparams


def load_hparams(folder: Path, cfg: dict) -> dict:
    """ModelBase.load_hparams + TextModel.__init__: the config as transformers fills it in, text_config merged.
    (Called once config.json's own values are checked: transformers' config classes build per-layer lists.)"""
    try:
        from transformers import AutoConfig
    except ImportError:
        return text_merged(cfg)
    try:
        with _quiet():
            hparams = AutoConfig.from_pretrained(folder, trust_remote_code=False).to_dict()
    except Exception as e:  # the reference falls back to config.json as it is ...
        if _known_model_type(cfg.get("model_type")):  # ... but transformers knows this config and refuses its values
            from ckpt.families.llm.tokenizer_files import brief

            raise CkptError(f"{folder / 'config.json'}: transformers' config class for model_type "
                            f"{cfg['model_type']!r} refuses it ({type(e).__name__}: {brief(str(e))})") from None
        hparams = dict(cfg)
    return text_merged(hparams)


def _known_model_type(model_type) -> bool:
    """Whether transformers has a config class for `model_type` (where it has none, as for a remote-code model,
    the reference uses config.json as it is; where it has one that refuses the file, so would its tokenizer and
    every loader of the model)."""
    try:
        from transformers import CONFIG_MAPPING
    except ImportError:
        return False
    return isinstance(model_type, str) and model_type in CONFIG_MAPPING


def _find(hparams: dict, keys, optional=True):
    key = next((k for k in keys if k in hparams), None)
    if key is not None:
        return hparams[key]
    if optional:
        return None
    raise CkptError(f"config.json has none of {', '.join(keys)}")


def rope_parameters(hparams: dict) -> dict:
    """TextModel.__init__'s rope_parameters: rope_parameters or rope_scaling, the global values mirrored in."""
    rope = dict(hparams.get("rope_parameters", hparams.get("rope_scaling")) or {})
    theta = _find(hparams, ["global_rope_theta", "rope_global_theta", "rope_theta_global", "rope_theta",
                            "rotary_emb_base"])
    local = _find(hparams, ["local_rope_theta", "rope_local_theta", "rope_theta_local", "swa_rope_theta",
                            "rope_local_base_freq"])
    partial = _find(hparams, ["partial_rotary_factor", "rope_pct", "rope_percent"])
    orig = _find(hparams, ["original_max_position_embeddings"])
    if "full_attention" not in rope and "sliding_attention" not in rope:
        if local is not None:
            rope["sliding_attention"] = {"rope_theta": local}
        if "rope_theta" not in rope and theta is not None:
            rope["rope_theta"] = theta
        if "rope_type" not in rope and (t := rope.get("type")) is not None:
            rope["rope_type"] = t
        if "partial_rotary_factor" not in rope and partial is not None:
            rope["partial_rotary_factor"] = partial
        if "original_max_position_embeddings" not in rope and orig is not None:
            rope["original_max_position_embeddings"] = orig
    return rope


def set_parameters(w, arch: LLMArch, hparams: dict, rope: dict, n_block: int, ftype: int) -> list[str]:
    """The `set_gguf_parameters` of the architecture's model class (`LLMArch.params`): the `add_*` calls on `w`;
    returns notes."""
    if arch.params == "gemma2":
        _gemma2_parameters(w, hparams, n_block, ftype)
        return []
    if arch.params == "phi3":
        _phi3_parameters(w, hparams, rope, n_block, ftype)
        return []
    notes = text_parameters(w, arch, hparams, rope, n_block, ftype)
    if arch.params == "gemma3":
        _gemma3_parameters(w, hparams, rope)
    if arch.params == "qwen2moe":  # Qwen2MoeModel.set_gguf_parameters
        if (n := hparams.get("moe_intermediate_size")) is not None:
            w.add_expert_feed_forward_length(n)
        if (n := hparams.get("shared_expert_intermediate_size")) is not None:
            w.add_expert_shared_feed_forward_length(n)
    return notes


def _gemma2_parameters(w, hparams: dict, n_block: int, ftype: int) -> None:
    """Gemma2Model.set_gguf_parameters (its own, not TextModel's)."""
    w.add_context_length(hparams["max_position_embeddings"])
    w.add_embedding_length(hparams["hidden_size"])
    w.add_block_count(n_block)
    w.add_feed_forward_length(hparams["intermediate_size"])
    w.add_head_count(hparams["num_attention_heads"])
    w.add_head_count_kv(hparams.get("num_key_value_heads", hparams["num_attention_heads"]))
    w.add_layer_norm_rms_eps(hparams["rms_norm_eps"])
    w.add_key_length(hparams["head_dim"])
    w.add_value_length(hparams["head_dim"])
    w.add_file_type(ftype)
    w.add_attn_logit_softcapping(hparams["attn_logit_softcapping"])
    w.add_final_logit_softcapping(hparams["final_logit_softcapping"])
    w.add_sliding_window(hparams["sliding_window"])


def _gemma3_parameters(w, hparams: dict, rope: dict) -> None:
    """Gemma3Model.set_gguf_parameters after TextModel's (a key set again keeps its place)."""
    w.add_context_length(hparams.get("max_position_embeddings", 131072))
    w.add_head_count(hparams.get("num_attention_heads", 8))
    w.add_layer_norm_rms_eps(hparams.get("rms_norm_eps", 1e-6))
    w.add_key_length(hparams.get("head_dim", 256))
    w.add_value_length(hparams.get("head_dim", 256))
    w.add_rope_freq_base(rope.get("full_attention", rope).get("rope_theta", 1_000_000.0))
    if hparams.get("attn_logit_softcapping") is not None:
        raise CkptError("config.json sets attn_logit_softcapping, which Gemma 3 does not have (llama.cpp's converter "
                        "refuses it)")
    if final := hparams.get("final_logit_softcapping"):
        w.add_final_logit_softcapping(final)
    if hparams.get("sliding_window_pattern") != 1:
        w.add_sliding_window(hparams["sliding_window"])
    w.add_head_count_kv(hparams.get("num_key_value_heads", 4))


def _phi3_rope(hparams: dict, rope: dict, where="config.json") -> tuple[int, int, int]:
    n_embd = _find(hparams, ["hidden_size", "n_embd"], optional=False)
    n_head = _find(hparams, ["num_attention_heads", "n_head"], optional=False)
    if rope.get("original_max_position_embeddings") is None:
        raise CkptError(f"{where}: has no original_max_position_embeddings, which llama.cpp's Phi-3 converter needs")
    return n_embd, n_head, int(rope.get("partial_rotary_factor", 1.0) * n_embd) // n_head


def _phi3_parameters(w, hparams: dict, rope: dict, n_block: int, ftype: int) -> None:
    """Phi3MiniModel.set_gguf_parameters (its own)."""
    n_embd, n_head, rope_dims = _phi3_rope(hparams, rope)
    w.add_context_length(_find(hparams, ["n_positions", "max_position_embeddings"], optional=False))
    w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    w.add_embedding_length(n_embd)
    w.add_feed_forward_length(_find(hparams, ["intermediate_size"], optional=False))
    w.add_block_count(n_block)
    w.add_head_count(n_head)
    w.add_head_count_kv(_find(hparams, ["num_key_value_heads", "n_head_kv"], optional=False))
    w.add_layer_norm_rms_eps(_find(hparams, ["rms_norm_eps"], optional=False))
    w.add_rope_dimension_count(rope_dims)
    w.add_rope_freq_base(rope.get("full_attention", rope)["rope_theta"])
    w.add_file_type(ftype)
    w.add_sliding_window(hparams.get("sliding_window") or 0)


def phi3_rope_factors(hparams: dict, rope: dict, where="config.json"):
    """Phi3MiniModel.generate_extra_tensors: (attention factor, long factors, short factors) of a long-context
    model, None without long factors."""
    n_embd, n_head, rope_dims = _phi3_rope(hparams, rope, where)
    long, short = rope.get("long_factor"), rope.get("short_factor")
    if not long:
        return None
    orig = rope["original_max_position_embeddings"]
    scale = _find(hparams, ["n_positions", "max_position_embeddings"], optional=False) / orig
    kind = str(rope.get("rope_type", "")).lower()
    if scale > 1.0 and orig < 2 and kind in ("su", "longrope"):
        raise CkptError(f"{where}: original_max_position_embeddings is {orig}; Phi-3's long-context attention factor "
                        "divides by its logarithm")
    if kind in ("su", "longrope"):
        attn = math.sqrt(1 + math.log(scale) / math.log(orig)) if scale > 1.0 else 1.0
    elif kind == "yarn":
        attn = 0.1 * math.log(scale) + 1.0 if scale > 1.0 else 1.0
    else:
        raise CkptError(f"{where}: rope type {config_keys.show(kind)} with long_factor: llama.cpp's Phi-3 converter "
                        "supports longrope, su and yarn")
    if short is None or len(long) != len(short) or len(long) != rope_dims / 2:
        raise CkptError(f"{where}: long_factor has {len(long)} values and short_factor "
                        f"{len(short) if short is not None else 'none'}; each must have {rope_dims // 2} (half of "
                        "the rotary dimensions)")
    return attn, torch.tensor(long, dtype=torch.float32), torch.tensor(short, dtype=torch.float32)


def text_parameters(w, arch: LLMArch, hparams: dict, rope: dict, n_block: int, ftype: int) -> list[str]:
    """TextModel.set_gguf_parameters (+ LlamaModel's): the `add_*` calls on `w`; returns notes."""
    gguf = _gguf()
    notes = []
    w.add_block_count(n_block)
    if (n := _find(hparams, ["max_position_embeddings", "n_ctx", "n_positions", "max_length", "max_sequence_length",
                             "model_max_length"])) is not None:
        w.add_context_length(n)
    if (n := _find(hparams, ["hidden_size", "n_embd", "dim"])) is not None:
        w.add_embedding_length(n)
    if (n := _find(hparams, ["prefix_dense_intermediate_size", "dense_intermediate_size", "intermediate_size",
                             "n_inner", "hidden_dim"])) is not None:
        w.add_feed_forward_length(n)
    if (n := _find(hparams, ["num_attention_heads", "n_head", "n_heads"])) is not None:
        w.add_head_count(n)
    if (n := _find(hparams, ["num_key_value_heads", "n_kv_heads"])) is not None:
        w.add_head_count_kv(n)
    if hparams.get("is_causal") is False:
        w.add_causal_attention(False)
    params = rope.get("full_attention", rope)
    if (rope_type := params.get("rope_type")) is not None:
        factor = params.get("factor")
        R = gguf.RopeScalingType
        if rope_type == "linear" and factor is not None:
            w.add_rope_scaling_type(R.LINEAR)
            w.add_rope_scaling_factor(factor)
        elif rope_type == "yarn" and factor is not None:
            w.add_rope_scaling_type(R.YARN)
            w.add_rope_scaling_factor(factor)
            w.add_rope_scaling_orig_ctx_len(params["original_max_position_embeddings"])
            if (v := params.get("extrapolation_factor")) is not None:
                w.add_rope_scaling_yarn_ext_factor(v)
            if (v := params.get("attention_factor", params.get("attn_factor"))) is not None:
                w.add_rope_scaling_yarn_attn_factor(v)
            if (v := params.get("beta_fast")) is not None:
                w.add_rope_scaling_yarn_beta_fast(v)
            if (v := params.get("beta_slow")) is not None:
                w.add_rope_scaling_yarn_beta_slow(v)
        elif rope_type in ("su", "longrope"):
            w.add_rope_scaling_type(R.LONGROPE)
        elif rope_type not in ("dynamic", "default") and rope_type.lower() != "llama3":
            notes.append(f"RoPE type {rope_type!r} is unknown to llama.cpp's converter: written without scaling, as "
                         "it does")
    if "mrope_section" in rope:
        sections = list(rope["mrope_section"]) + [0] * 4
        w.add_rope_dimension_sections(sections[:4])
    if (v := params.get("rope_theta")) is not None:
        w.add_rope_freq_base(v)
    if (v := rope.get("sliding_attention", {}).get("rope_theta")) is not None:
        w.add_rope_freq_base_swa(v)
    if (v := _find(hparams, ["rms_norm_eps", "norm_eps"])) is not None:
        w.add_layer_norm_rms_eps(v)
    if (v := _find(hparams, ["layer_norm_eps", "layer_norm_epsilon", "norm_epsilon"])) is not None:
        w.add_layer_norm_eps(v)
    if (v := _find(hparams, ["num_local_experts", "num_experts", "n_routed_experts"])) is not None:
        w.add_expert_count(v)
    if (v := _find(hparams, ["num_experts_per_tok", "num_experts_per_token", "top_k_experts"])) is not None:
        w.add_expert_used_count(v)
    if (v := hparams.get("head_dim")) is not None:
        w.add_key_length(v)
        w.add_value_length(v)
    w.add_file_type(ftype)
    if arch.llama_params:
        w.add_vocab_size(hparams["vocab_size"])
        dim = hparams.get("head_dim") or hparams["hidden_size"] // hparams["num_attention_heads"]
        w.add_rope_dimension_count(dim)
    return notes


def llama3_rope_factors(rope: dict, hparams: dict) -> torch.Tensor | None:
    """LlamaModel.generate_extra_tensors: `rope_freqs.weight` for rope type llama3, computed as the reference does."""
    params = rope.get("full_attention", rope)
    if not params or str(params.get("rope_type", "")).lower() != "llama3":
        return None
    # (floats: config_keys lets an integer 1e30 through as a number, and torch.pow takes no int past int64)
    base = float(params.get("rope_theta", 10000.0))
    dim = hparams.get("head_dim") or hparams["hidden_size"] // hparams["num_attention_heads"]
    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factor = float(params.get("factor", 8.0))
    low, high = float(params.get("low_freq_factor", 1.0)), float(params.get("high_freq_factor", 4.0))
    old = params.get("original_max_position_embeddings", 8192)
    low_wavelen, high_wavelen = old / low, old / high
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            out.append(1)
        elif wavelen > low_wavelen:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(out, dtype=torch.float32)


class Stacked(Tensor):
    """Matrices of one shape stacked on a new first dim (`torch.stack(parts)`): a layer's experts as the one
    [experts, rows, cols] tensor llama.cpp has. A band is whole experts, each read and copied in turn."""

    row_align = 1

    def __init__(self, name: str, parts: list[Tensor]):
        first = parts[0]
        for p in parts:
            if tuple(p.shape) != tuple(first.shape) or p.dtype != first.dtype:
                raise CkptError(f"{name}: experts {first.name} {list(first.shape)} and {p.name} {list(p.shape)} "
                                "cannot be stacked")
        self.name, self.parts, self.home, self.dtype = name, list(parts), first.home, first.dtype
        self.shape = (len(parts), *first.shape)

    @property
    def natural_dtype(self) -> torch.dtype:
        return self.parts[0].natural_dtype

    def read(self, start, stop, device, scratch=None):
        out = torch.empty((stop - start, *self.shape[1:]), dtype=self.dtype, device=device)
        for i in range(start, stop):
            p = self.parts[i]
            out[i - start].copy_(p.read(0, p.rows, device, scratch).reshape(self.shape[1:]))
        return out


def _expert_group(comp, arch: LLMArch, table, name: str, t: Tensor, n_expert: int, pending: dict) -> list:
    """One expert matrix into its layer's pending set; the stacked tensors (GGUF name, Stacked) when the set is
    complete, in the reference's order (LlamaModel / Qwen2MoeModel.modify_tensors), else nothing."""
    _, template, projections, merged = arch.experts
    bid = next((int(part) for part in name.split(".") if part.isdecimal()), None)
    if bid is None:
        raise CkptError(f"{comp.where}: expert tensor {name!r} has no layer number")
    pattern = re.escape(template).replace(r"\{bid\}", str(bid)).replace(r"\{x\}", r"\d+").replace(
        r"\{w\}", "(" + "|".join(projections) + ")")
    if not re.fullmatch(pattern, name):
        raise CkptError(f"{comp.where}: expert tensor {name!r} is not one expert's matrix as llama.cpp's converter "
                        f"stacks them ({template.format(bid=bid, x='X', w='/'.join(projections))}); fused expert "
                        "tensors are not written by ckpt (use llama.cpp's convert_hf_to_gguf.py)")
    group = pending.setdefault(bid, {})
    group[name] = t
    if len(group) < n_expert * len(projections):
        return []
    out = []
    for w in projections:
        names = [template.format(bid=bid, x=x, w=w) for x in range(n_expert)]
        missing = next((n for n in names if n not in group), None)
        if missing is not None:
            odd = next(n for n in group if n not in {template.format(bid=bid, x=x, w=p) for x in range(n_expert)
                                                     for p in projections})
            raise CkptError(f"{comp.where}: expert tensor {odd!r} is not one of the {n_expert} experts x "
                            f"{'/'.join(projections)} llama.cpp's converter stacks (no {missing!r})")
        hf = merged.format(bid=bid, w=w)
        gname = table.get_name(hf, try_suffixes=(".weight", ".bias"))
        if gname is None:
            raise CkptError(f"{comp.where}: stacked experts {hf!r} have no llama.cpp name in gguf's {arch.arch} table")
        out.append((gname, Stacked(gname, [group.pop(n) for n in names])))
    del pending[bid]
    return out


def _f32_names(arch_enum, n_block: int) -> set[str]:
    gguf = _gguf()
    out = set()
    for key in F32_TENSORS:
        k = getattr(gguf.MODEL_TENSOR, key, None)
        if k is None or k not in gguf.MODEL_TENSORS[arch_enum]:
            continue
        name = gguf.TENSOR_NAMES[k]
        out.update(name.format(bid=b) + ".weight" for b in range(n_block)) if "{bid}" in name else \
            out.add(name + ".weight")
    return out


def _source_order(view, comp) -> list[str]:
    """The reference's tensor order: parts in sorted order, names sorted within each."""
    return sorted(view.tensors, key=lambda n: (view.tensors[n].home or "", n))


def _llm_types(mix, tensors, *, arch: str, n_layer: int, n_head: int, n_head_kv: int, n_expert: int, pure: bool):
    from ckpt.families.llm.quant_mix import llm_types

    return llm_types(mix.ftype, tensors, arch=arch, n_layer=n_layer, n_head=n_head, n_head_kv=n_head_kv,
                     n_expert=n_expert, pure=pure)


def plan_gguf_llm(ckpt, views, mix, pure: bool, report: Report, operation: str) -> Plan:
    """The whole single-file llama.cpp GGUF of an HF causal LM folder (module docstring)."""
    from ckpt.targets.planners import gguf_vocab
    from ckpt.targets.planners.gguf_out import out_tensor
    from ckpt.io.gguf_writer import from_gguf_writer, string
    from ckpt.quant.gguf_llm import HeadRowsPermuted

    gguf = _gguf()
    T = gguf.GGMLQuantizationType
    comp, view = ckpt.components[0], views[0]
    if (header := _gguf_llm_source(comp)) is not None:
        return plan_from_gguf(comp, header, view, mix, pure, report, operation)
    folder = _folder(ckpt)
    where = folder / "config.json"
    hf_arch = _architecture(comp.config)
    if comp.config is None:
        raise CkptError(f"{folder}: no config.json beside the weights; a llama.cpp GGUF is made from the model's "
                        "config (architecture, heads, RoPE): copy the model's config.json into the folder")
    for cfg in (comp.config, comp.config.get("text_config")):
        if isinstance(cfg, dict) and "architectures" in cfg and _first_class(cfg["architectures"]) is None:
            raise CkptError(f"{where}: architectures is {config_keys.show(cfg['architectures'])}, not a list of "
                            "model class names")
    if hf_arch is None:
        raise CkptError(f"{where}: has no architectures (the model class, which decides the GGUF architecture "
                        f"llama.cpp's converter writes)")
    arch = EXPORTS.get(hf_arch)
    if arch is None:
        raise CkptError(f"{folder}: architecture {hf_arch!r} cannot be written as a llama.cpp GGUF by ckpt (supported: "
                        f"{', '.join(EXPORTS)}); use llama.cpp's convert_hf_to_gguf.py")
    gguf_vocab.check_tokenizer(folder)
    shapes = {n: tuple(t.shape) for n, t in view.tensors.items()}
    stated = text_merged(comp.config)
    config_keys.check(stated, shapes, arch, str(where))  # before transformers' config class builds anything
    hparams = load_hparams(folder, comp.config)
    sizes = config_keys.check(hparams, shapes, arch, str(where), stated=stated)
    n_block, n_head, n_head_kv, n_expert = sizes.blocks, sizes.heads, sizes.kv_heads, sizes.experts
    if n_expert and not arch.experts:
        raise CkptError(f"{folder}: {hf_arch} with experts (num_experts {n_expert}) is not a variant ckpt writes; use "
                        "llama.cpp's convert_hf_to_gguf.py")
    arch_enum = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch.arch)
    table = gguf.get_tensor_name_map(arch_enum, n_block)
    rope = rope_parameters(hparams)
    f32_names = _f32_names(arch_enum, n_block)

    # the tensors, in the reference's order, with their GGUF names and (permuted) sources
    sources: list[tuple[str, Tensor]] = []
    factors = llama3_rope_factors(rope, hparams) if arch.arch == "llama" else None
    if factors is not None:
        sources.append(("rope_freqs.weight", ComputedTensor("rope_freqs.weight", lambda f=factors: f, torch.float32,
                                                            tuple(factors.shape))))
    phi3 = phi3_rope_factors(hparams, rope, where) if arch.params == "phi3" else None
    if phi3 is not None:
        for gname, f in (("rope_factors_long.weight", phi3[1]), ("rope_factors_short.weight", phi3[2])):
            sources.append((gname, ComputedTensor(gname, lambda f=f: f, torch.float32, tuple(f.shape))))
    skipped = []
    pending: dict[int, dict[str, Tensor]] = {}  # a layer's expert matrices until all have been seen
    for name in _source_order(view, comp):
        t = view.tensors[name]
        if name.endswith(SKIPPED) or name in arch.drop:
            skipped.append(name)
            continue
        if arch.experts and arch.experts[0] in name:
            sources += _expert_group(comp, arch, table, name, t, n_expert, pending)
            continue
        if arch.norm_shift and name.endswith("norm.weight"):
            t = Shifted(t, arch.norm_shift)
        if arch.trim_vocab and "embed_tokens.weight" in name and t.shape:
            rows = gguf_vocab.vocab_rows(folder, hparams)
            if rows < t.shape[0]:
                t = RowSlice(t, 0, rows, name)
        gname = table.get_name(name, try_suffixes=(".weight", ".bias"))
        if gname is None:
            raise CkptError(f"{comp.where}: tensor {name!r} has no llama.cpp name in gguf's {arch.arch} table (a "
                            "variant llama.cpp's converter does not know either); nothing was written")
        if arch.rope_permute and name.endswith(("q_proj.weight", "q_proj.bias", "k_proj.weight", "k_proj.bias")):
            heads = n_head if ".q_proj." in name else n_head_kv
            if not t.shape or t.shape[0] % heads or (t.shape[0] // heads) % 2:
                raise CkptError(f"{comp.where}: tensor {name!r} has {t.shape[0] if t.shape else 0} rows, not {heads} "
                                "heads of an even size (llama.cpp's RoPE permutes rows in pairs)")
            t = HeadRowsPermuted(t, t.shape[0] // heads)
        sources.append((gname, t))
    left = sorted(n for group in pending.values() for n in group)
    if left:
        raise CkptError(f"{comp.where}: expert tensors of an incomplete set ({plural(len(left), 'tensor')}, e.g. "
                        f"{left[0]!r}; each layer needs {n_expert} experts x {len(arch.experts[2])} projections)")
    seen: set[str] = set()
    for g, _ in sources:
        if g in seen:
            raise CkptError(f"{comp.where}: two tensors map to GGUF name {g!r}")
        seen.add(g)

    # types: --outtype's (or auto's) first, then the mix's per-tensor rule
    big = next((t for _, t in sources if len(t.shape) >= 2), None)
    base = mix.default if mix.default in PLAIN else \
        ("BF16" if big is not None and big.natural_dtype == torch.bfloat16 else "F16")
    before = []
    for gname, t in sources:
        if not t.dtype.is_floating_point:
            raise CkptError(f"{comp.where}: tensor {t.name!r} is {t.dtype}, not floating point; llama.cpp's converter "
                            "writes float weights only")
        f32 = len(t.shape) <= 1 or gname.endswith("_norm.weight") or gname in f32_names or \
            gname[-7:] not in (".weight", ".lora_a", ".lora_b")
        before.append((gname, tuple(t.shape), "F32" if f32 else base))
    types = _llm_types(mix, before, arch=arch.arch, n_layer=n_block, n_head=n_head, n_head_kv=n_head_kv,
                       n_expert=n_expert, pure=pure)

    casters: dict = {}
    outs, summary, fallbacks = [], {}, {}
    order = list(range(len(sources)))
    if mix.name not in CONVERT_OUTTYPES:  # llama-quantize's file: its weights_map order
        order.sort(key=lambda i: (block_number(sources[i][0]), sources[i][0]))
    sources, before, types = ([x[i] for i in order] for x in (sources, before, types))
    for (gname, t), (_, shape, was), (tname, why, fell) in zip(sources, before, types):
        outs.append(out_tensor(gname, t, int(T[tname]), shape, report, casters))
        summary[(tname, why)] = summary.get((tname, why), 0) + 1
        if fell:
            fallbacks[(mix.default, tname)] = fallbacks.get((mix.default, tname), 0) + 1

    # metadata, in the reference's order (ModelBase.prepare_metadata, TextModel.prepare_metadata)
    with _quiet():
        w = gguf.GGUFWriter(path=None, arch=arch.arch)
        if phi3 is not None:  # set while the reference prepares its tensors, before its metadata
            w.add_rope_scaling_attn_factors(phi3[0])
        notes, n_tokens, vocab_file = _metadata(w, gguf, arch, folder, hparams, rope, n_block, mix, sources)
    embd = next((t for g, t in sources if g == "token_embd.weight"), None)
    if embd is not None and embd.shape and n_tokens != embd.shape[0]:
        raise CkptError(f"{vocab_file}: the tokenizer has {n_tokens} tokens but {embd.name} has {embd.shape[0]} rows; "
                        "llama.cpp needs one embedding row per token")
    for warning in config_keys.token_id_warnings(stated, n_tokens, str(where)):
        report.warn(warning)

    fields = from_gguf_writer(w)
    if mix.name not in CONVERT_OUTTYPES:  # llama-quantize sets these two last (gguf_set_val_u32 re-adds a key)
        last = ("general.quantization_version", "general.file_type")
        fields = [f for f in fields if f.key not in last] + [f for k in last for f in fields if f.key == k]
    fields += [string("ckpt.version", __version__),
               string("ckpt.operation", operation)]

    if skipped:
        notes.append(f"{plural(len(skipped), 'tensor')} llama.cpp does not use left out (e.g. {skipped[0]!r})")
    if factors is not None:
        notes.append("rope_freqs.weight: Llama 3 RoPE scaling factors computed from config.json, as llama.cpp's "
                     "converter adds them")
    if "output.weight" not in {g for g, _ in sources}:
        notes.append("no lm_head.weight: tied embeddings (llama.cpp uses token_embd.weight as the output layer)")
    counts = ", ".join(f"{n} {label} ({why})" for (label, why), n in sorted(summary.items(), key=lambda kv: -kv[1]))
    notes.append(f"GGUF {arch.arch} LLM, {mix.label} (llama.cpp's convert_hf_to_gguf.py rules): {counts}")
    from ckpt.targets.planners.gguf_out import fallback_note

    if (fb := fallback_note(fallbacks)) is not None:
        notes.append(fb)
    return Plan(single_file=True, files=[OutFile("", {}, outs, "gguf", fields=fields)], notes=notes,
                busy_stage="compute" if mix.quantized else None)  # the encoders hold the work (ckpt.quant.gguf)


def _metadata(w, gguf, arch: LLMArch, folder: Path, hparams: dict, rope: dict, n_block: int, mix, sources):
    """ModelBase.prepare_metadata + TextModel.prepare_metadata: the key-values after general.architecture; returns
    (notes, the number of tokens written, the tokenizer file they came from)."""
    from ckpt.targets.planners import gguf_vocab
    from ckpt.families.llm.tokenizer_files import read_json
    from ckpt.io.small_inputs import read_text

    w.add_type(gguf.GGUFType.MODEL)
    total, shared, expert, n_expert = _param_counts(sources)
    # gguf's Metadata reads generation_config.json and README.md itself: each read here first (a regular file of
    # a bounded size), the sampling defaults checked, and what its YAML model card reader raises said in one line
    if (gen := read_json(folder, "generation_config.json")) is not None:
        config_keys.check_generation(gen, str(folder / "generation_config.json"))
    card = folder / "README.md"
    if card.exists() or card.is_symlink():
        read_text(card)
    with gguf_vocab.read_by(card, "gguf's model card reader") if card.exists() else nullcontext():
        meta = gguf.Metadata.load(None, folder, None, total)
        if meta.name is None:
            meta.name = folder.name
        if meta.size_label is None and total > 0:
            meta.size_label = gguf.size_label(total, shared, expert, n_expert)
        meta.set_gguf_meta_model(w)
    notes = set_parameters(w, arch, hparams, rope, n_block, int(gguf.LlamaFileType[mix.ftype]))
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    n_tokens, vocab_file = gguf_vocab.set_vocab(w, arch.vocab, folder, hparams)
    return notes, n_tokens, vocab_file


class _quiet:
    """gguf's writer and vocabulary readers log (a key set twice, merges not found) through the `gguf` logger, and
    transformers its config advice: both print to stderr where nothing configured logging; ckpt says what matters
    in its own notes."""

    def __init__(self, *names: str):
        self.names = names or ("gguf", "transformers")

    def __enter__(self):
        import logging

        self.loggers = [logging.getLogger(n) for n in self.names]
        self.levels = [lg.level for lg in self.loggers]
        for lg in self.loggers:
            lg.setLevel(logging.ERROR)

    def __exit__(self, *exc):
        for lg, level in zip(self.loggers, self.levels):
            lg.setLevel(level)


def _param_counts(sources) -> tuple[int, int, int, int]:
    """GGUFWriter.get_total_parameter_count over the planned tensors: (total, shared, expert, expert count)."""
    total = shared = expert = expert_sum = n_expert_tensors = 0
    for gname, t in sources:
        size = math.prod(t.shape)
        if "_exps." in gname and len(t.shape) >= 3:
            count = t.shape[-2 if ".bias" in gname else -3]
            expert += size // count
            expert_sum += count
            n_expert_tensors += 1
        else:
            shared += size
        total += size
    return total, shared, expert, (expert_sum // n_expert_tensors) if n_expert_tensors else 0


def _stored_of(v, stored) -> bool:
    """Whether the view's tensor `v` is the stored GGUF tensor unchanged: only the reader's own wrappers (its HF
    name, dequantized values, q/k rows unpermuted) between them; a merged or otherwise computed tensor is not."""
    from ckpt.quant.gguf import GGUFValues
    from ckpt.quant.gguf_llm import HeadRowsUnpermuted, HFNamed

    while True:
        if v is stored:
            return True
        if type(v) is GGUFValues:
            return v.stored is stored
        if type(v) not in (HFNamed, HeadRowsUnpermuted):
            return False
        v = v.base


def _header_int(header, key: str, default=None) -> int:
    v = header.value(key, default)
    if isinstance(v, list):  # per-layer values: llama.cpp's quantizer counts with the first layer's
        v = v[0] if v else default
    if v is None or isinstance(v, bool) or not isinstance(v, int):
        raise CkptError(f"{header.path}: metadata {key!r} is {v!r}, not the integer llama.cpp's quantizer needs")
    return v


def plan_from_gguf(comp, header, view, mix, pure: bool, report: Report, operation: str) -> Plan:
    """`convert model-F16.gguf --to gguf-<mix>`, and merge-lora into a GGUF base: `llama-quantize` of a llama.cpp
    GGUF. Its metadata copied (tokenizer included) with `general.quantization_version` and `general.file_type`
    set last, as llama-quantize sets them; the tensors in its order (block, then name) and per-tensor types
    (`llm_types` from each stored type). A tensor the view leaves as stored and whose type stays is copied byte for
    byte; one the view changed (a merged LoRA) is taken from the view under its GGUF name (llama's q/k rows
    permuted back). Requantizing an already quantized tensor into another type is refused, as llama-quantize
    refuses it without --allow-requantize."""
    from ckpt.targets.planners.gguf_out import fallback_note, out_tensor
    from ckpt.io.gguf_writer import fields_from, string, uint32
    from ckpt.quant.gguf import GGUFValues, stored_output
    from ckpt.quant.gguf_llm import ARCHS, HeadRowsPermuted

    gguf = _gguf()
    T = gguf.GGMLQuantizationType
    f = comp.files[0]
    arch = header.architecture
    K = gguf.Keys
    n_layer = _header_int(header, K.LLM.BLOCK_COUNT.format(arch=arch))
    n_head = _header_int(header, K.Attention.HEAD_COUNT.format(arch=arch))
    n_head_kv = _header_int(header, K.Attention.HEAD_COUNT_KV.format(arch=arch), n_head)
    n_expert = _header_int(header, K.LLM.EXPERT_COUNT.format(arch=arch), 0)
    permute = ARCHS[arch].rope_permute if arch in ARCHS else False
    placed = set(view.anchors.values())
    extra = sorted(n for n in view.tensors if n not in placed)
    if extra:
        raise CkptError(f"{f.path}: tensor {extra[0]!r} is not one of the GGUF's own ({plural(len(extra), 'tensor')} "
                        "without a place in it); nothing was written")
    names = sorted(f.names, key=lambda n: (block_number(n), n))  # llama-quantize's weights_map order
    sources, before = [], []
    for gname in names:
        stored = comp.tensors[gname]
        hf = view.anchors.get(gname)
        v = view.tensors.get(hf) if hf is not None else None
        if v is None or _stored_of(v, stored):
            src, changed = GGUFValues(stored, name=gname), False
        else:
            src, changed = v, True
            if permute and gname.endswith((".attn_q.weight", ".attn_q.bias", ".attn_k.weight", ".attn_k.bias")):
                src = HeadRowsPermuted(v, v.shape[0] // (n_head if ".attn_q." in gname else n_head_kv))
        sources.append((gname, stored, src, changed))
        before.append((gname, tuple(stored.stored_shape), stored.type_name))
    types = _llm_types(mix, before, arch=arch, n_layer=n_layer, n_head=n_head, n_head_kv=n_head_kv,
                       n_expert=n_expert, pure=pure)
    casters: dict = {}
    outs, summary, fallbacks, copied = [], {}, {}, 0
    for (gname, stored, src, changed), (tname, why, fell) in zip(sources, types):
        if tname == stored.type_name and not changed:
            outs.append(stored_output(stored))
            copied += 1
        elif stored.quantized and tname != stored.type_name:
            raise CkptError(f"{f.path}: tensor {gname} is {stored.type_name}; requantizing it as {tname} loses "
                            f"precision twice (llama-quantize refuses it without --allow-requantize): write "
                            f"--to gguf-{mix.name} from the F16/BF16/F32 GGUF or the Hugging Face folder")
        else:
            outs.append(out_tensor(gname, src, int(T[tname]), tuple(stored.stored_shape), report, casters))
        summary[(tname, why)] = summary.get((tname, why), 0) + 1
        if fell:
            fallbacks[(mix.default, tname)] = fallbacks.get((mix.default, tname), 0) + 1
    last = ("general.quantization_version", "general.file_type")
    fields = [x for x in fields_from(header) if x.key not in last and not x.key.startswith("ckpt.")]
    fields += [uint32("general.quantization_version", gguf.GGML_QUANT_VERSION),
               uint32("general.file_type", gguf.LlamaFileType[mix.ftype]),
               string("ckpt.version", __version__),
               string("ckpt.operation", operation)]
    counts = ", ".join(f"{n} {label} ({why})" for (label, why), n in sorted(summary.items(), key=lambda kv: -kv[1]))
    notes = [f"GGUF {arch} LLM -> {mix.label} as llama-quantize types it: {counts}; {copied} copied as stored"]
    if (fb := fallback_note(fallbacks)) is not None:
        notes.append(fb)
    return Plan(single_file=True, files=[OutFile("", {}, outs, "gguf", fields=fields)], notes=notes,
                busy_stage="compute" if mix.quantized else None)  # the encoders hold the work (ckpt.quant.gguf)
