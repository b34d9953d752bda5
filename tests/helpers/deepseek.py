"""Tiny DeepSeek-V3 style folders (`DeepseekV3ForCausalLM`, llama.cpp's `deepseek2`) built in the test: a random
model from transformers' own `DeepseekV3Config` with a BPE tokenizer trained here (`helpers.hf_llm`), in three
shapes, and an FP8 copy of one as DeepSeek releases its weights.

- `v3`: DeepSeek-V3 itself scaled down: low-rank queries (`q_lora_rank`), one dense layer first, routed experts with
  a sigmoid router and its score correction, a shared expert, expert groups, yarn RoPE with `mscale_all_dim`.
- `kimi`: Kimi K2's config.json (`rope_scaling` with `type` and yarn's beta 1 / 1, `rope_theta` 50000, one expert
  group, 8 experts, `routed_scaling_factor` 2.827, no MTP layers), BF16 weights.
- `lite`: DeepSeek-V2-Lite's attention (one `q_proj`, no `q_lora_rank`), no dense layer, tied embeddings with an
  `lm_head.weight` in the file all the same (the reference skips it).
- `fp8_copy`: the weights DeepSeek quantizes (every linear layer but the router) as float8_e4m3fn with
  `weight_scale_inv` per 128x128 block (fp32, partial blocks at the edges), everything else BF16, config.json's
  `quantization_config` (`quant_method: fp8`, `weight_block_size: [128, 128]`); with `mtp`, DeepSeek-V3's
  multi-token-prediction layer after the model's (`model.layers.{num_hidden_layers}.*`, `num_nextn_predict_layers`
  1), quantized the same way.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from helpers.hf_llm import bpe_tokenizer

YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 128,
        "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}
COMMON = dict(hidden_size=256, intermediate_size=384, moe_intermediate_size=192, num_attention_heads=4,
              num_key_value_heads=4, n_shared_experts=1, num_experts_per_tok=2, kv_lora_rank=64, qk_rope_head_dim=32,
              qk_nope_head_dim=32, v_head_dim=32, max_position_embeddings=512, rms_norm_eps=1e-6)
VARIANTS = {
    "v3": dict(num_hidden_layers=3, n_routed_experts=4, n_group=2, topk_group=1, first_k_dense_replace=1,
               q_lora_rank=96, rope_parameters=YARN, scoring_func="sigmoid", routed_scaling_factor=2.5),
    "kimi": dict(num_hidden_layers=2, n_routed_experts=8, n_group=1, topk_group=1, first_k_dense_replace=1,
                 q_lora_rank=64, routed_scaling_factor=2.827, num_nextn_predict_layers=0,
                 rope_parameters={"rope_type": "yarn", "rope_theta": 50000.0, "factor": 8.0,
                                  "original_max_position_embeddings": 64, "beta_fast": 1.0, "beta_slow": 1.0,
                                  "mscale": 1.0, "mscale_all_dim": 1.0}),
    "lite": dict(num_hidden_layers=2, n_routed_experts=4, n_group=1, topk_group=1, first_k_dense_replace=0,
                 q_lora_rank=None, tie_word_embeddings=True, norm_topk_prob=False, routed_scaling_factor=1.0),
}
FP8_LINEAR = ("q_a_proj", "q_b_proj", "q_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "gate_proj", "up_proj",
              "down_proj", "eh_proj")


def kimi_config(cfg: dict) -> dict:
    """Kimi K2's config.json keys and spellings (rope_scaling with `type`, rope_theta beside it, scoring_func and
    topk_method, no head_dim / qk_head_dim / rope_interleave, which transformers' DeepSeek-V3 config adds) over the
    sizes of `cfg`. Its model_type stays `deepseek_v3`: with Kimi's own `kimi_k2` (and its remote code absent)
    transformers' generic config class cannot read the file (its rope_scaling needs max_position_embeddings before
    it is set), and the reference's tokenizer loading stops there."""
    rope = dict(cfg["rope_parameters"])
    theta = rope.pop("rope_theta")
    rope["type"] = rope.pop("rope_type")
    keep = ("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
            "num_attention_heads", "num_key_value_heads", "n_shared_experts", "n_routed_experts",
            "routed_scaling_factor", "kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "v_head_dim",
            "qk_nope_head_dim", "n_group", "topk_group", "num_experts_per_tok", "first_k_dense_replace",
            "norm_topk_prob", "hidden_act", "max_position_embeddings", "initializer_range", "rms_norm_eps",
            "tie_word_embeddings", "attention_bias", "attention_dropout", "bos_token_id", "eos_token_id",
            "num_nextn_predict_layers")
    out = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
           **{k: cfg[k] for k in keep if k in cfg}, "rope_scaling": rope, "rope_theta": theta,
           "scoring_func": "sigmoid", "topk_method": "noaux_tc", "moe_layer_freq": 1, "torch_dtype": "bfloat16"}
    return out


def deepseek_folder(folder: Path, variant: str, dtype=torch.float32):
    """A tiny random `variant` (VARIANTS) saved with its tokenizer; returns (folder, the model in float32)."""
    import transformers

    folder.mkdir(parents=True, exist_ok=True)
    vocab = bpe_tokenizer(folder)
    cfg = dict(COMMON, vocab_size=vocab, bos_token_id=None, eos_token_id=vocab - 1, **VARIANTS[variant])
    torch.manual_seed({"v3": 0, "kimi": 1, "lite": 2}[variant])
    model = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**cfg)).eval()
    with torch.no_grad():  # norms, router biases away from 1 / 0, so a dropped or swapped one shows
        for n, p in model.named_parameters():
            if "norm" in n or "e_score_correction_bias" in n:
                p.add_(torch.randn(p.shape) * 0.1)
    model.to(dtype).save_pretrained(folder)
    model.float()
    if variant == "kimi":
        (folder / "config.json").write_text(json.dumps(kimi_config(cfg), indent=2))
    if variant == "lite":  # tied, yet an lm_head.weight in the file (the reference skips it)
        from safetensors.torch import load_file, save_file

        sd = load_file(folder / "model.safetensors")
        sd["lm_head.weight"] = sd["model.embed_tokens.weight"].clone()
        save_file(sd, folder / "model.safetensors", metadata={"format": "pt"})
    return folder, model


def _fp8_blocks(w: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """`w` as DeepSeek's FP8 release stores a weight: float8_e4m3fn codes and a float32 scale per block (the codes
    times the scale are the weight; edges in partial blocks)."""
    rows, cols = w.shape
    br, bc = -(-rows // block), -(-cols // block)
    pad = torch.zeros(br * block, bc * block)
    pad[:rows, :cols] = w.float()
    blocks = pad.view(br, block, bc, block)
    scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / 448.0
    codes = (blocks / scale[:, None, :, None]).view(br * block, bc * block)[:rows, :cols]
    return codes.to(torch.float8_e4m3fn).contiguous(), scale.float().contiguous()


def fp8_copy(src: Path, dst: Path, mtp: bool = False) -> Path:
    """DeepSeek's FP8 release format of the model in `src` (module docstring)."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    sd = load_file(src / "model.safetensors")
    cfg = json.loads((src / "config.json").read_text())
    n = cfg["num_hidden_layers"]
    if mtp:  # DeepSeek-V3's MTP layer: a decoder layer (the last one's weights here) and its own head
        torch.manual_seed(5)
        hidden = cfg["hidden_size"]
        for k in [k for k in sd if k.startswith(f"model.layers.{n - 1}.")]:
            sd[k.replace(f"model.layers.{n - 1}.", f"model.layers.{n}.")] = sd[k].clone()
        sd[f"model.layers.{n}.embed_tokens.weight"] = sd["model.embed_tokens.weight"].clone()
        sd[f"model.layers.{n}.enorm.weight"] = torch.ones(hidden)
        sd[f"model.layers.{n}.hnorm.weight"] = torch.ones(hidden)
        sd[f"model.layers.{n}.eh_proj.weight"] = torch.randn(hidden, 2 * hidden) * 0.02
        sd[f"model.layers.{n}.shared_head.norm.weight"] = torch.ones(hidden)
        sd[f"model.layers.{n}.shared_head.head.weight"] = sd["lm_head.weight"].clone()
        cfg["num_nextn_predict_layers"] = 1
    out = {}
    for k, v in sd.items():
        if v.dim() == 2 and k.endswith(".weight") and k.split(".")[-2] in FP8_LINEAR:
            out[k], out[k + "_scale_inv"] = _fp8_blocks(v)
        else:
            out[k] = v.to(torch.bfloat16)
    save_file(out, dst / "model.safetensors", metadata={"format": "pt"})
    cfg.pop("dtype", None)
    cfg["torch_dtype"] = "bfloat16"
    cfg["quantization_config"] = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                  "weight_block_size": [128, 128]}
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    return dst
