"""`llama` (LlamaModel in the reference's conversion/llama.py): Llama, Mistral and Mixtral checkpoints. q/k rows
permuted for llama.cpp's RoPE, `{arch}.vocab_size` and `.rope.dimension_count` (LlamaModel.set_gguf_parameters),
Llama 3 RoPE scaling factors as `rope_freqs.weight` (generate_extra_tensors), Mixtral's experts stacked.

Read back: a dense file as `LlamaForCausalLM`; one with experts (Mixtral's: `ffn_*_exps` and the router
`ffn_gate_inp` in every block, `expert_count` / `expert_used_count` in the metadata) as `MixtralForCausalLM`, one
`block_sparse_moe.experts.X.w1|w2|w3` per expert again (`ckpt.families.llm.moe_readback`)."""

from __future__ import annotations

import math

from ckpt.lazy import torch

from ckpt.errors import file_error
from ckpt.families.llm.arch import LLAMA_LAYER, Export, LLMArch, Readback
from ckpt.families.llm.moe_readback import BLOCK_SPARSE_W, is_stacked, moe_config, unstacked
from ckpt.io.tensors import ComputedTensor, Tensor


MIXTRAL = "MixtralForCausalLM"  # what a llama GGUF with experts reads back as


class Llama(LLMArch):
    def extra_tensors(self, x: Export) -> list[tuple[str, Tensor]]:
        factors = llama3_rope_factors(x.rope, x.hparams)
        if factors is None:
            return []
        x.notes.append("rope_freqs.weight: Llama 3 RoPE scaling factors computed from config.json, as llama.cpp's "
                       "converter adds them")
        return [("rope_freqs.weight", ComputedTensor("rope_freqs.weight", lambda f=factors: f, torch.float32,
                                                     tuple(factors.shape)))]

    # ------------------------------------------------------------------ reading back (GGUF -> HF)

    def read_config(self, r: Readback) -> None:
        """Mixtral where the file has experts: MixtralConfig's expert keys from the metadata, each checked against
        the stacked experts and the router (their size is `feed_forward_length`: LlamaModel writes no expert
        size), the keys llama.cpp's llama architecture does not record set to MixtralConfig's defaults (said in a
        note). A dense file stays Llama."""
        import gguf

        from ckpt.quant.gguf_llm import Meta

        K = gguf.Keys.LLM
        m, cfg = Meta(r.header, self.arch), r.cfg
        experts = sorted(n for n in r.stored if is_stacked(n) or n.endswith(".ffn_gate_inp.weight"))
        if not experts:
            if (declared := m.integer(K.EXPERT_COUNT, 0, lo=0)):
                raise m.bad(m.key(K.EXPERT_COUNT), declared, "but the file has no experts (no blk.N.ffn_gate_inp "
                                                             "/ ffn_*_exps tensors)")
            return
        dense = next((n for n in r.stored if n.split(".")[2:3] in (["ffn_gate"], ["ffn_up"], ["ffn_down"])), None)
        if dense is not None:
            raise file_error(r.path, f"tensor {dense} is a dense feed-forward's, but the file's blocks hold experts "
                                     f"({experts[0]}); MixtralForCausalLM has no dense MLP; nothing was written")
        bias = next((k for k in ("attention_bias", "mlp_bias") if cfg.pop(k, False)), None)
        if bias is not None:
            odd = next(n for n in r.stored if n.endswith(self.bias_flags[bias]))
            raise file_error(r.path, f"tensor {odd} is a bias, which MixtralForCausalLM does not have; nothing was "
                                     "written")
        n_expert, used, _ = moe_config(m, r, K.FEED_FORWARD_LENGTH)
        cfg.update(architectures=[MIXTRAL], model_type="mixtral", num_local_experts=n_expert,
                   num_experts_per_tok=used, sliding_window=None)
        r.notes.append("config.json sliding_window: none (MixtralConfig's default; llama.cpp's llama architecture "
                       "records none and attends to the whole context)")

    def in_place(self, gname: str) -> bool:
        return not is_stacked(gname)

    def read_tensor(self, r: Readback, gname: str) -> list[tuple[str, Tensor]]:
        """Mixtral's stacked `ffn_*_exps` back to one `block_sparse_moe.experts.X.w1|w2|w3` per expert, its router
        as `block_sparse_moe.gate` (only in a file `read_config` made Mixtral: a subclass's experts are its own);
        the rest by the table."""
        parts = gname.split(".")
        if r.cfg.get("architectures") != [MIXTRAL]:
            return super().read_tensor(r, gname)
        if is_stacked(gname):
            return unstacked(r, gname, f"model.layers.{parts[1]}.block_sparse_moe.experts.{{x}}."
                                       f"{BLOCK_SPARSE_W[parts[2]]}.weight")
        if parts[2:] == ["ffn_gate_inp", "weight"]:
            hf = f"model.layers.{parts[1]}.block_sparse_moe.gate.weight"
            return [(hf, r.value(gname, hf))]
        return super().read_tensor(r, gname)


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


ARCH = Llama("llama", "LlamaForCausalLM", "llama", LLAMA_LAYER, rope_permute=True,
             bias_flags={"attention_bias": ("attn_q.bias", "attn_k.bias", "attn_v.bias", "attn_output.bias"),
                         "mlp_bias": ("ffn_gate.bias", "ffn_up.bias", "ffn_down.bias")},
             hf_classes=("LlamaForCausalLM", "LLaMAForCausalLM", "MistralForCausalLM", "MixtralForCausalLM"),
             llama_params=True, vocab="llama",
             experts=("block_sparse_moe.experts", "model.layers.{bid}.block_sparse_moe.experts.{x}.{w}.weight",
                      ("w1", "w2", "w3"), "layers.{bid}.feed_forward.experts.{w}.weight"))
