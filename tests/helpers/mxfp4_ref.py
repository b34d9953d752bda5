"""gpt-oss MXFP4 test checkpoints: a tiny `GptOssForCausalLM` built here (no downloads) whose expert banks are
quantized to MXFP4 blocks / scales and saved as gpt-oss checkpoints are.

The packer is triton_kernels' `numerics_details/mxfp.py` `downcast_to_mxfp_torch` (the pure-torch reference
of its Triton kernel; transformers' `quantize_to_mxfp4` calls it through the `triton_kernels` hub package,
which does not install on the CPU machine), restated here for fp4 with its default ROUND_UP scale rule:
the block scale is amax / 6 rounded up to a power of two (its float32 exponent field is the e8m0 code),
each value times the inverse scale is converted to e2m1 by its bit manipulation (round half to even on the
mantissa, saturating at 6), two codes per byte, the even element in the low nibble. The MXFP4 axis is the
input dim K of each expert matrix: the HF parameter [E, K, N] is transposed to [E, N, K] first, as the
gpt-oss conversion stores it, giving `_blocks` [E, N, K / 32, 16] and `_scales` [E, N, K / 32].
"""

from __future__ import annotations

import json

import torch

BLOCK = 32


def _shr(x: torch.Tensor, s: int) -> torch.Tensor:
    """triton_kernels' `right_shift_unsigned` (int32 logical shift)."""
    return (x >> s) & ((1 << (32 - s)) - 1)


def downcast_to_mxfp4(src: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., K] float -> (uint8 [..., K / 2] packed e2m1, uint8 [..., K / 32] e8m0), `downcast_to_mxfp_torch`
    (out_quant_type uint8, axis -1, ROUND_UP) for K a multiple of 32."""
    src = src.to(torch.float32)
    k = src.shape[-1]
    assert k % BLOCK == 0
    groups = src.reshape(*src.shape[:-1], k // BLOCK, BLOCK)
    max_val = groups.abs().amax(dim=-1, keepdim=True)
    dequant_scale = max_val / 6.0
    ds_int = dequant_scale.view(torch.int32)
    ds_rounded = ((ds_int + 0x007FFFFF) & 0x7F800000).view(torch.float32)
    quant_scale = torch.where(ds_rounded == 0, torch.tensor(0.0), 1.0 / ds_rounded)
    q = (groups * quant_scale).reshape(src.shape)
    q_int = q.contiguous().view(torch.int32)
    signs = q_int & 0x80000000
    exponents = _shr(q_int, 23) & 0xFF
    mantissas = q_int & 0x7FFFFF
    mantissas = torch.where(exponents < 127, (0x400000 | _shr(mantissas, 1)) >> (127 - exponents - 1), mantissas)
    exponents = torch.maximum(exponents, torch.tensor(126)) - 126
    e2m1 = _shr(((exponents << 2) | _shr(mantissas, 21)) + 1, 1)
    e2m1 = torch.minimum(e2m1, torch.tensor(0x7))
    codes = (_shr(signs, 28) | e2m1).to(torch.uint8)
    codes = codes.reshape(*codes.shape[:-1], k // 2, 2)
    packed = codes[..., 0] | (codes[..., 1] << 4)
    scales = (ds_rounded.view(torch.int32) >> 23).to(torch.uint8).squeeze(-1)
    return packed, scales


def quantize_bank(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """HF expert parameter [E, K, N] -> gpt-oss (`_blocks` [E, N, K / 32, 16], `_scales` [E, N, K / 32])."""
    e, k, n = w.shape
    packed, scales = downcast_to_mxfp4(w.transpose(1, 2))
    return packed.reshape(e, n, k // BLOCK, BLOCK // 2).contiguous(), scales.contiguous()


def tiny_config(hidden=64, inter=64, experts=4, layers=2):
    import transformers

    return transformers.GptOssConfig(vocab_size=64, hidden_size=hidden, intermediate_size=inter,
                                     num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=1,
                                     head_dim=32, num_local_experts=experts, num_experts_per_tok=2,
                                     max_position_embeddings=131072, sliding_window=16)


def build(folder, hidden=64, inter=64, experts=4, layers=2, seed=0, torch_dtype="bfloat16"):
    """A gpt-oss MXFP4 folder; returns ({stem: (blocks, scales)}, config). Expert weights get block-to-block
    magnitudes spread over many exponents so that the scales vary."""
    import transformers
    from safetensors.torch import save_file

    cfg = tiny_config(hidden, inter, experts, layers)
    torch.manual_seed(seed)
    model = transformers.GptOssForCausalLM(cfg).to(torch.bfloat16)
    gen = torch.Generator().manual_seed(seed + 1)
    sd, packs = {}, {}
    for k, v in model.state_dict().items():
        if k.endswith(("experts.gate_up_proj", "experts.down_proj")):
            mag = torch.exp2(torch.randint(-12, 4, (*v.shape[:-1], 1), generator=gen).float())
            w = torch.randn(v.shape, generator=gen) * mag
            blocks, scales = quantize_bank(w)
            sd[f"{k}_blocks"], sd[f"{k}_scales"] = blocks, scales
            packs[k] = (blocks, scales)
        else:
            sd[k] = v.contiguous()
    folder.mkdir(parents=True, exist_ok=True)
    save_file(sd, folder / "model.safetensors", metadata={"format": "pt"})
    qc = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                              "model.embed_tokens", "lm_head"]}
    (folder / "config.json").write_text(json.dumps(cfg.to_dict() | {"quantization_config": qc,
                                                                    "torch_dtype": torch_dtype}))
    return packs, cfg
