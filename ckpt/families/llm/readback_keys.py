"""config.json keys that several architectures derive the same way when a llama.cpp GGUF is read back
(`LLMArch.read_config`), each checked against the tensors that show it: the head size of `attention.key_length`,
which layers attend to a sliding window (llama.cpp's `load_swa_pattern`), the padding token."""

from __future__ import annotations

from ckpt.errors import file_error
from ckpt.families.llm.arch import Readback


def check_head_dim(m, r: Readback) -> None:
    """`attention.key_length` / `value_length`, where written, against the head size the q rows give (config.json's
    head_dim, `m`: `ckpt.quant.gguf_llm.Meta`), and the q/k norms' size against it: a config with another head_dim
    does not load the weights."""
    import gguf

    A = gguf.Keys.Attention
    head = r.cfg["head_dim"]
    for key in (A.KEY_LENGTH, A.VALUE_LENGTH):
        if (v := m.integer(key, None)) is not None and v != head:
            raise m.bad(m.key(key), v, f"but the q rows give heads of {head}")
    for name, t in r.stored.items():
        if name.endswith((".attn_q_norm.weight", ".attn_k_norm.weight")) and tuple(t.stored_shape) != (head,):
            raise file_error(r.path, f"tensor {name} is {list(t.stored_shape)}, not one head's {head} values")


def swa_layers(m, n_blocks: int, step: int) -> list[bool]:
    """Which blocks attend to the sliding window, as llama.cpp's `load_swa_pattern` reads them: the
    `attention.sliding_window_pattern` array (one true/false per block), else its period (the architecture's `step`
    where the file has none): block i slides unless it is the last of each period (`llama_hparams::set_swa_pattern`;
    period 0: every block)."""
    import gguf

    key = gguf.Keys.Attention.SLIDING_WINDOW_PATTERN
    pattern = m.header.value(m.key(key))
    if isinstance(pattern, list):
        if len(pattern) != n_blocks or not all(isinstance(b, bool) for b in pattern):
            raise m.bad(m.key(key), pattern[:8], f"not one true/false per block ({n_blocks})")
        return list(pattern)
    step = m.integer(key, step, lo=0)
    return [step == 0 or i % step < step - 1 for i in range(n_blocks)]


def layer_types(swa: list[bool]) -> list[str]:
    """transformers' `layer_types` of a sliding-window pattern."""
    return ["sliding_attention" if s else "full_attention" for s in swa]


def pad_token(m, cfg: dict) -> None:
    """pad_token_id of the tokenizer's padding token, where the file has one (some configs default to an id past a
    small vocabulary, which the embedding refuses)."""
    import gguf

    if (pad := m.integer(gguf.Keys.Tokenizer.PAD_ID, None, lo=0)) is not None:
        cfg["pad_token_id"] = pad
