"""Reading a llama.cpp mixture-of-experts GGUF back as the Hugging Face checkpoint it was converted from: the
converter stacked each layer's per-expert matrices into one `blk.N.ffn_{gate,up,down}_exps.weight` [experts, rows,
cols] (`ckpt.families.llm.tensors.Stacked`); reading gives one HF tensor per expert again (`Unstacked`), and the
expert keys of the metadata become the config's, each checked against the tensors that show it. Shared by the
architectures whose HF checkpoints keep one tensor per expert (GLM-4.5, MiniMax-M2, Mixtral, Qwen3-MoE)."""

from __future__ import annotations

from ckpt.families.llm.arch import Readback
from ckpt.families.llm.tensors import Unstacked
from ckpt.io.tensors import Tensor

STACKED = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")
# the HF projection each stacked tensor holds, by the two per-expert namings: Mixtral's `block_sparse_moe.experts.X.
# w1|w2|w3` (MiniMax-M2 has it too) and the `mlp.experts.X.*_proj` of Qwen-MoE, GLM-4.5 and most others
BLOCK_SPARSE_W = {"ffn_gate_exps": "w1", "ffn_down_exps": "w2", "ffn_up_exps": "w3"}
MLP_PROJ = {"ffn_gate_exps": "gate_proj", "ffn_down_exps": "down_proj", "ffn_up_exps": "up_proj"}


def is_stacked(gname: str) -> bool:
    """`blk.N.ffn_{gate,up,down}_exps.weight`: a layer's experts stacked by llama.cpp's converter."""
    parts = gname.split(".")
    return len(parts) == 4 and parts[2] in STACKED and parts[3] == "weight"


def unstacked(r: Readback, gname: str, template: str) -> list[tuple[str, Tensor]]:
    """One HF tensor per expert (`template` with {x}) of the stacked GGUF tensor `gname`: Stacked's inverse."""
    v = r.value(gname, template.format(x="X"))
    return [(template.format(x=x), Unstacked(v, x, template.format(x=x))) for x in range(v.shape[0])]


def moe_config(m, r: Readback, ff_key: str | None = None) -> tuple[int, int, int]:
    """The expert count, experts used and shared experts of the metadata (`m`: `ckpt.quant.gguf_llm.Meta`), each
    checked against the stacked experts, the router, its score correction and the shared expert's rows; (count,
    used, shared). `ff_key`: the key that holds the experts' size, `expert_feed_forward_length` unless the
    architecture writes none (Mixtral as llama: its experts are `feed_forward_length` wide)."""
    import gguf

    K = gguf.Keys.LLM
    n_expert, used = m.integer(K.EXPERT_COUNT), m.integer(K.EXPERT_USED_COUNT)
    if used > n_expert:
        raise m.bad(m.key(K.EXPERT_USED_COUNT), used, f"more than the {n_expert} experts")
    ff_key = ff_key or K.EXPERT_FEED_FORWARD_LENGTH
    ff, hidden = m.integer(ff_key), r.cfg["hidden_size"]
    shared = m.integer(K.EXPERT_SHARED_COUNT, 0, lo=0)
    for name, t in r.stored.items():
        kind = name.split(".")[2] if name.count(".") >= 3 else ""
        shape = tuple(t.stored_shape)
        want = {"ffn_gate_exps": (n_expert, ff, hidden), "ffn_up_exps": (n_expert, ff, hidden),
                "ffn_down_exps": (n_expert, hidden, ff), "ffn_gate_inp": (n_expert, hidden),
                "exp_probs_b": (n_expert,), "ffn_gate_shexp": (ff * shared, hidden),
                "ffn_up_shexp": (ff * shared, hidden), "ffn_down_shexp": (hidden, ff * shared)}.get(kind)
        if want is not None and shape != want:  # blamed on the count a differing size comes from
            key = K.EXPERT_SHARED_COUNT if "shexp" in kind else K.EXPERT_COUNT if shape[:1] != want[:1] else ff_key
            raise m.bad(m.key(key), m.integer(key), f"but {name} is {list(shape)}, not {list(want)}")
    return n_expert, used, shared


def rope_config(m, cfg: dict, head_dim: int) -> dict:
    """rope_parameters with the partial rotary factor of rope.dimension_count (even, at most a head)."""
    import gguf

    key = gguf.Keys.Rope.DIMENSION_COUNT
    dims = m.integer(key, head_dim)
    if dims % 2 or dims > head_dim:
        raise m.bad(m.key(key), dims, f"not an even number of the head's {head_dim} values")
    rope = {"rope_type": "default", "rope_theta": cfg.pop("rope_theta"), "partial_rotary_factor": dims / head_dim}
    rope.update(cfg.pop("rope_scaling", None) or {})
    return rope
