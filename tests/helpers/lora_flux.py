"""A tiny Flux.1 with a diffusers/PEFT LoRA fused by diffusers (the oracle of `ckpt lora convert` and
`lora resize/merge --format`), and ckpt's own merge of a LoRA file."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from families_util import original_from_pairs, state_dict, tiny_flux1
from ckpt.families import get

peft = pytest.importorskip("peft")

TOL = dict(rtol=0, atol=2e-5)


def flux_with_lora(tmp_path, targets=("to_q", "to_k", "to_v", "add_k_proj", "proj_mlp", "proj_out",
                                       "norm_out.linear", "ff.net.2")):
    torch.manual_seed(0)
    model = tiny_flux1()
    base = state_dict(model)
    model.add_adapter(peft.LoraConfig(r=3, lora_alpha=6, init_lora_weights=False, target_modules=list(targets)))
    model.save_lora_adapter(tmp_path / "dlora")
    model.fuse_lora()
    want = {k.replace(".base_layer.", "."): v.detach().clone() for k, v in model.state_dict().items() if "lora_" not in k}
    fam = get("flux1")
    save_file(original_from_pairs(fam, base), tmp_path / "bfl.safetensors")
    return base, want, original_from_pairs(fam, want)


def merge_with_ckpt(run_ckpt, base, lora, out):
    code, stdout, err = run_ckpt("merge-lora", base, lora, "-o", out, "-q")
    assert code == 0, err
    return load_file(out)
