"""The tiny gptq bases of `tests/test_gptq.py`, shared with the other tests that need one (test modules do not
import each other)."""

from __future__ import annotations

import json
import math
import torch
from helpers import gptq_ref
from safetensors.torch import save_file

LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
           "mlp.up_proj", "mlp.down_proj")


def _tiny(seed=0):
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(seed)
    return cfg, transformers.LlamaForCausalLM(cfg).half()


def _quant_params(n, k, bits, group, desc_act, sym, zero0, gen):
    gs = k if group == -1 else group
    G = math.ceil(k / gs)
    g_idx = torch.arange(k) // gs
    if desc_act:
        g_idx = g_idx[torch.randperm(k, generator=gen)]
    maxq = (1 << bits) - 1
    scales = torch.rand(n, G, generator=gen) * 0.01 + 0.002
    if sym:
        zeros = torch.full((n, G), float((maxq + 1) // 2))
    else:
        zeros = torch.randint(0 if zero0 else 1, maxq + 1, (n, G), generator=gen).float()
        if zero0:
            zeros[::5, 0] = 0  # the v1 overflow: stored -1 sets every higher field of its word
    q = torch.randint(0, maxq + 1, (n, k), generator=gen).float()
    noise = (torch.rand(n, k, generator=gen) - 0.5) * 0.5
    w = ((q - zeros[:, g_idx] + noise) * scales[:, g_idx]).half()
    return w, scales, zeros, g_idx.to(torch.int32), q


def build(folder, bits=4, group=32, desc_act=False, sym=False, fmt=None, zero0=False, seed=0, overrides=None):
    """A GPTQ folder and {weight name: expected fp16 [out, in]} from the oracle; returns (expected, oracle)."""
    cfg, model = _tiny(seed)
    gen = torch.Generator().manual_seed(seed + 1)
    sd = dict(model.state_dict())
    expected, oracle = {}, None
    ql_cls = gptq_ref.autogptq_quantlinear("cuda" if desc_act else "cuda_old")
    base = (bits, group)
    for lin_name in LINEARS:
        bits, group = (overrides or {}).get(lin_name, base)
        name = f"model.layers.0.{lin_name}"
        lin = model.get_submodule(name)
        n, k = lin.weight.shape
        w, scales, zeros, g_idx, _ = _quant_params(n, k, bits, group, desc_act, sym, zero0, gen)
        lin.weight.data = w
        if ql_cls is not None:
            oracle = f"AutoGPTQ 0.7.1 qlinear_{'cuda' if desc_act else 'cuda_old'}"
            ql = ql_cls(bits, group, k, n, bias=False)
            ql.pack(lin, scales, zeros, g_idx)
            packed = {"qweight": ql.qweight, "qzeros": ql.qzeros, "scales": ql.scales, "g_idx": ql.g_idx}
            with torch.no_grad():
                expected[f"{name}.weight"] = gptq_ref.autogptq_dequant(ql)
        else:
            oracle = "AutoGPTQ's pack restated (auto-gptq not installed)"
            packed = gptq_ref.restated_pack(w, scales, zeros, g_idx.long(), bits)
            s16 = packed["scales"].t()[:, g_idx.long()].float()  # the format's formula on the known integers
            codes = torch.round((w.float() + (zeros * scales)[:, g_idx.long()]) / s16)
            expected[f"{name}.weight"] = (s16 * (codes - zeros[:, g_idx.long()])).half()
        if fmt == "gptq_v2":
            packed["qzeros"] = gptq_ref.pack_zeros(zeros, bits, offset=0)
        del sd[f"{name}.weight"]
        for key, v in packed.items():
            sd[f"{name}.{key}"] = v.contiguous()
    folder.mkdir(parents=True, exist_ok=True)
    save_file(sd, folder / "model.safetensors", metadata={"format": "pt"})
    qc = {"quant_method": "gptq", "bits": base[0], "group_size": base[1], "desc_act": desc_act, "sym": sym}
    if fmt:
        qc["checkpoint_format"] = fmt
    config = cfg.to_dict() | {"quantization_config": qc, "torch_dtype": "float16"}
    (folder / "config.json").write_text(json.dumps(config))
    return expected, oracle
