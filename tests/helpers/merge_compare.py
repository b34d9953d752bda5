"""merge-lora against diffusers' own LoRA loading: a diffusers-format LoRA file as a pipeline's
`save_lora_weights` writes it, diffusers' fused answer, and the comparison (fp32: rtol 1e-5, atol 1e-6, only
the summation order differs) that also counts the tensors the LoRA changed."""

from __future__ import annotations

import pytest
import torch

peft = pytest.importorskip("peft")
TOL = dict(rtol=1e-5, atol=1e-6)


def diffusers_fused(make_model, base_sd, lora_file, pipeline_cls, ratio):
    """diffusers' answer: the LoRA file read by the pipeline's loader, fused into a fresh model."""
    model = make_model()
    model.load_state_dict(base_sd)
    lora_sd, metadata = pipeline_cls.lora_state_dict(str(lora_file), return_lora_metadata=True)
    model.load_lora_adapter(lora_sd, prefix="transformer", adapter_name="x", metadata=metadata)
    model.fuse_lora(lora_scale=ratio)
    return {k.replace(".base_layer.", "."): v.detach().clone() for k, v in model.state_dict().items()
            if "lora_" not in k}


def peft_lora_file(model, targets, path, pipeline_cls, r=4, alpha=8, seed=3):
    """A diffusers-format LoRA file (random A and B) as the pipeline's save_lora_weights writes it."""
    from peft.utils import get_peft_model_state_dict

    torch.manual_seed(seed)
    model.add_adapter(peft.LoraConfig(r=r, lora_alpha=alpha, init_lora_weights=False, target_modules=targets))
    layers = get_peft_model_state_dict(model)
    meta = model.peft_config["default"].to_dict()
    pipeline_cls.save_lora_weights(path, transformer_lora_layers=layers, transformer_lora_adapter_metadata=meta)
    return path / "pytorch_lora_weights.safetensors"


def compare(got: dict, want: dict, base: dict):
    assert set(got) == set(want)
    for k in want:
        torch.testing.assert_close(got[k], want[k], **TOL, msg=k)
    return sum(not torch.equal(want[k], base[k]) for k in want)
