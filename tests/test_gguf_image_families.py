"""`convert --to gguf-*` for Chroma, Z-Image, Lumina 2, HiDream and Qwen-Image: the architecture name
ComfyUI-GGUF gives each, and its rule of what stays unquantized (the family's `high_precision`): block
matrices quantized, input/output layers (and Lumina 2's / Z-Image's refiners) kept, pad tokens F32."""

from __future__ import annotations

import gguf
import pytest
import torch
from gguf import GGMLQuantizationType as T
from safetensors.torch import save_file

from families_util import original_from_pairs, state_dict
from ckpt import families

diffusers = pytest.importorskip("diffusers")


def _models():
    d = diffusers
    return {
        "chroma": lambda: d.ChromaTransformer2DModel(
            in_channels=4, num_layers=1, num_single_layers=1, attention_head_dim=32, num_attention_heads=2,
            joint_attention_dim=32, axes_dims_rope=(8, 12, 12), approximator_num_channels=64,
            approximator_hidden_dim=64, approximator_layers=1),
        "z_image": lambda: d.ZImageTransformer2DModel(
            in_channels=16, dim=64, n_layers=1, n_refiner_layers=1, n_heads=2, n_kv_heads=2, cap_feat_dim=64,
            axes_dims=[8, 12, 12], axes_lens=[64, 64, 64]),
        "lumina2": lambda: d.Lumina2Transformer2DModel(
            patch_size=2, in_channels=16, hidden_size=64, num_layers=1, num_refiner_layers=1, num_attention_heads=2,
            num_kv_heads=1, multiple_of=32, cap_feat_dim=64, axes_dim_rope=(8, 12, 12), axes_lens=(64, 64, 64)),
        "hidream": lambda: d.HiDreamImageTransformer2DModel(
            patch_size=2, in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=32,
            num_attention_heads=2, caption_channels=[64, 64], text_emb_dim=64, num_routed_experts=2,
            num_activated_experts=1, axes_dims_rope=(16, 16), max_resolution=(16, 16), llama_layers=[0, 1]),
        "qwen_image": lambda: d.QwenImageTransformer2DModel(
            patch_size=2, in_channels=64, out_channels=16, num_layers=1, attention_head_dim=32, num_attention_heads=2,
            joint_attention_dim=64, axes_dims_rope=(8, 12, 12)),
    }


# family id: (architecture, a block matrix quantized, matrices kept unquantized)
CASES = {
    "chroma": ("flux", "double_blocks.0.img_attn.qkv.weight",
               ["distilled_guidance_layer.layers.0.in_layer.weight", "txt_in.weight"]),
    "z_image": ("lumina2", "layers.0.attention.qkv.weight",
                ["noise_refiner.0.attention.qkv.weight", "context_refiner.0.feed_forward.w1.weight",
                 "cap_embedder.1.weight"]),
    "lumina2": ("lumina2", "layers.0.attention.qkv.weight",
                ["noise_refiner.0.attention.qkv.weight", "cap_embedder.1.weight"]),
    "hidream": ("hidream", "double_stream_blocks.0.block.attn1.to_q.weight",
                ["caption_projection.0.linear.weight", "final_layer.linear.weight"]),
    "qwen_image": ("qwen_image", "transformer_blocks.0.attn.to_q.weight", ["txt_in.weight", "norm_out.linear.weight"]),
}


@pytest.mark.parametrize("family_id", list(CASES))
def test_comfyui_gguf_rules_of_the_image_families(tmp_path, run_ckpt, family_id):
    arch, quantized, kept = CASES[family_id]
    torch.manual_seed(0)
    sd = {k: v.to(torch.bfloat16) for k, v in state_dict(_models()[family_id]()).items()}
    fam = families.get(family_id)
    sd = original_from_pairs(fam, sd) if fam.pairs else sd
    save_file({"model.diffusion_model." + k: v for k, v in sd.items()}, tmp_path / "m.safetensors")
    code, _, err = run_ckpt("convert", tmp_path / "m.safetensors", "--to", "gguf-q8_0", "-o", tmp_path / "m.gguf",
                            "-q")
    assert code == 0, err
    r = gguf.GGUFReader(tmp_path / "m.gguf")
    types = {t.name: t.tensor_type for t in r.tensors}
    assert r.fields["general.architecture"].contents() == arch
    assert set(types) == set(sd)
    assert types[quantized] == T.Q8_0
    for k in kept:
        assert sd[k].numel() > 1024 and sd[k].shape[1] % 32 == 0, k  # would be quantized were it not kept
        assert types[k] == T.BF16, k
    for k in ("x_pad_token", "cap_pad_token"):
        if k in types:
            assert types[k] == T.F32
    if family_id == "hidream":  # a diffusers-named file is this family's only layout: not refused
        assert any(t == T.Q8_0 for n, t in types.items() if n.startswith("single_stream_blocks."))
