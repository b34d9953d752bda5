"""`ckpt merge-lora` against diffusers' own `fuse_lora()` on a tiny FluxTransformer2DModel.

The base is saved with `save_pretrained` (diffusers layout), the LoRA is a real PEFT adapter added
with `add_adapter` (random A and B) and saved with `save_lora_adapter` (alpha only in the
`lora_adapter_metadata` JSON). Oracle: the model's weights after `fuse_lora(lora_scale=0.7)`, fp32
both sides; tolerance a few fp32 ulps (rtol 1e-5, atol 1e-6): only the summation order differs.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

diffusers = pytest.importorskip("diffusers")
peft = pytest.importorskip("peft")


def test_flux_lora_matches_fuse_lora(tmp_path, run_ckpt):
    torch.manual_seed(0)
    model = diffusers.FluxTransformer2DModel(patch_size=1, in_channels=4, num_layers=1, num_single_layers=1,
                                             attention_head_dim=8, num_attention_heads=2, joint_attention_dim=16,
                                             pooled_projection_dim=16, axes_dims_rope=(2, 2, 4))
    model.save_pretrained(tmp_path / "flux")
    cfg = peft.LoraConfig(r=4, lora_alpha=2, init_lora_weights=False,
                          target_modules=["to_q", "to_k", "add_v_proj", "proj_mlp", "norm_out.linear", "ff.net.2"])
    model.add_adapter(cfg)
    model.save_lora_adapter(tmp_path / "lora")
    model.fuse_lora(lora_scale=0.7)
    want = {k.replace(".base_layer.", "."): v.detach().clone() for k, v in model.state_dict().items() if "lora_" not in k}
    out = tmp_path / "merged"
    code, stdout, err = run_ckpt("merge-lora", tmp_path / "flux", tmp_path / "lora", "--ratio", "0.7", "-o", out, "-q")
    assert code == 0, err
    got = load_file(out / "diffusion_pytorch_model.safetensors")
    base = load_file(tmp_path / "flux" / "diffusion_pytorch_model.safetensors")
    assert set(got) == set(want) == set(base)
    changed = [k for k in got if not torch.equal(got[k], base[k])]
    for k in got:
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6, msg=k)
    assert len(changed) >= 6 and f"base tensors changed: {len(changed)}" in stdout
