"""What llama.cpp's converter does for every text model (`TextModel` in convert_hf_to_gguf.py's `conversion/base.py`,
and `ModelBase.load_hparams`): the hyperparameters as transformers fills them in, the RoPE parameters gathered from
their several spellings, and `TextModel.set_gguf_parameters`, the keys most architectures write. An architecture
module (`ckpt.families.llm.archs`) calls these and adds its own, as the reference's model classes call `super()`."""

from __future__ import annotations

from pathlib import Path

from ckpt.errors import CkptError

# TextModel.set_gguf_parameters' expert score functions: gguf's ExpertGatingFuncType values in the reference's
# gguf-py (the installed gguf release has no SQRTSOFTPLUS yet, so the values are written as the integers they are)
GATING_FUNCS = {"softmax": 1, "sigmoid": 2, "sqrtsoftplus": 4}


def _gguf():
    import gguf

    return gguf


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
    return text_merged(load_config(folder, cfg))


def load_config(folder: Path, cfg: dict) -> dict:
    """ModelBase.load_hparams: the whole config as transformers fills it in (sub-configs as they are: a vision
    projector reads `vision_config` and the top-level `model_type`); config.json as it is without transformers."""
    try:
        from transformers import AutoConfig
    except ImportError:
        return dict(cfg)
    try:
        with quiet():
            hparams = AutoConfig.from_pretrained(folder, trust_remote_code=False).to_dict()
    except Exception as e:  # the reference falls back to config.json as it is ...
        if known_model_type(cfg.get("model_type")):  # ... but transformers knows this config and refuses its values
            from ckpt.families.llm.tokenizer_files import brief

            raise CkptError(f"{folder / 'config.json'}: transformers' config class for model_type "
                            f"{cfg['model_type']!r} refuses it ({type(e).__name__}: {brief(str(e))})") from None
        hparams = dict(cfg)
    return hparams


def known_model_type(model_type) -> bool:
    """Whether transformers has a config class for `model_type` (where it has none, as for a remote-code model,
    the reference uses config.json as it is; where it has one that refuses the file, so would its tokenizer and
    every loader of the model)."""
    try:
        from transformers import CONFIG_MAPPING
    except ImportError:
        return False
    return isinstance(model_type, str) and model_type in CONFIG_MAPPING


def find(hparams: dict, keys, optional=True):
    key = next((k for k in keys if k in hparams), None)
    if key is not None:
        return hparams[key]
    if optional:
        return None
    raise CkptError(f"config.json has none of {', '.join(keys)}")


def rope_parameters(hparams: dict) -> dict:
    """TextModel.__init__'s rope_parameters: rope_parameters or rope_scaling, the global values mirrored in."""
    rope = dict(hparams.get("rope_parameters", hparams.get("rope_scaling")) or {})
    theta = find(hparams, ["global_rope_theta", "rope_global_theta", "rope_theta_global", "rope_theta",
                            "rotary_emb_base"])
    local = find(hparams, ["local_rope_theta", "rope_local_theta", "rope_theta_local", "swa_rope_theta",
                            "rope_local_base_freq"])
    partial = find(hparams, ["partial_rotary_factor", "rope_pct", "rope_percent"])
    orig = find(hparams, ["original_max_position_embeddings"])
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


def text_parameters(w, arch, hparams: dict, rope: dict, n_block: int, ftype: int) -> list[str]:
    """TextModel.set_gguf_parameters (+ LlamaModel's): the `add_*` calls on `w`; returns notes."""
    gguf = _gguf()
    notes = []
    w.add_block_count(n_block)
    if (n := find(hparams, ["max_position_embeddings", "n_ctx", "n_positions", "max_length", "max_sequence_length",
                             "model_max_length"])) is not None:
        w.add_context_length(n)
    if (n := find(hparams, ["hidden_size", "n_embd", "dim"])) is not None:
        w.add_embedding_length(n)
    if (n := find(hparams, ["prefix_dense_intermediate_size", "dense_intermediate_size", "intermediate_size",
                             "n_inner", "hidden_dim"])) is not None:
        w.add_feed_forward_length(n)
    if (n := find(hparams, ["num_attention_heads", "n_head", "n_heads"])) is not None:
        w.add_head_count(n)
    if (n := find(hparams, ["num_key_value_heads", "n_kv_heads"])) is not None:
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
    if (v := find(hparams, ["rms_norm_eps", "norm_eps"])) is not None:
        w.add_layer_norm_rms_eps(v)
    if (v := find(hparams, ["layer_norm_eps", "layer_norm_epsilon", "norm_epsilon"])) is not None:
        w.add_layer_norm_eps(v)
    if (v := find(hparams, ["num_local_experts", "num_experts", "n_routed_experts"])) is not None:
        w.add_expert_count(v)
    if (v := find(hparams, ["num_experts_per_tok", "num_experts_per_token", "top_k_experts"])) is not None:
        w.add_expert_used_count(v)
    if (v := hparams.get("n_group")) is not None:
        w.add_expert_group_count(v)
    if (v := hparams.get("topk_group")) is not None:
        w.add_expert_group_used_count(v)
    if (v := find(hparams, ["score_function", "scoring_func", "score_func", "moe_router_activation",
                            "moe_router_activation_func", "expert_selection_fn"])) is not None:
        if v not in GATING_FUNCS:
            raise CkptError(f"config.json: the experts' score function is {str(v)[:40]!r}; llama.cpp's converter "
                            f"writes {', '.join(GATING_FUNCS)}")
        w.add_uint32(gguf.Keys.LLM.EXPERT_GATING_FUNC.format(arch=w.arch), GATING_FUNCS[v])
    if (v := hparams.get("head_dim")) is not None:
        w.add_key_length(v)
        w.add_value_length(v)
    w.add_file_type(ftype)
    if arch.llama_params:
        w.add_vocab_size(hparams["vocab_size"])
        dim = hparams.get("head_dim") or hparams["hidden_size"] // hparams["num_attention_heads"]
        w.add_rope_dimension_count(dim)
    return notes


class quiet:
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
