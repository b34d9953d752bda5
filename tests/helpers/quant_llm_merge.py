"""PEFT LoRAs merged into the quantized LLM bases of the decoder tests, and PEFT's own merge on the oracle's
dequantized model (what `ckpt merge-lora` is checked against in tests/test_merge_quant_llm.py).

The bases are the decoder tests' own builders (each packs a tiny Llama with its library's packer and returns that
library's dequantized weights); the adapter is made by PEFT on the unquantized model class (`get_peft_model` on a
`LlamaForCausalLM` of the base's config, lora_B made non-zero) and saved with `save_pretrained`, as a QLoRA run
saves it. The oracle: the base's unquantized tensors plus the library's dequantized weights loaded into an fp32
`LlamaForCausalLM`, wrapped by `PeftModel.from_pretrained(adapter)` and `merge_and_unload()`.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file


def plain_config(folder: Path, cls):
    """The base's config.json without quantization_config, as the model class's config."""
    d = json.loads((folder / "config.json").read_text())
    d.pop("quantization_config", None)
    d.pop("torch_dtype", None)
    d.pop("dtype", None)
    return cls.from_dict(d)


def peft_lora(folder: Path, config, model_cls, lora_config, seed: int = 3, scale: float = 0.05) -> Path:
    """A PEFT adapter folder for the model class of `config`, every LoRA factor made non-zero."""
    import peft

    torch.manual_seed(seed)
    model = model_cls(config)
    pm = peft.get_peft_model(model, lora_config)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * scale)
    pm.save_pretrained(folder)
    return folder


def peft_merged(base: Path, dequantized: dict[str, torch.Tensor], adapter: Path, model_cls, config_cls) -> dict:
    """PEFT's merge_and_unload on the oracle's dequantized model in fp32: {name: fp32 tensor}."""
    import peft

    stored = load_file(base / "model.safetensors")
    model = model_cls(plain_config(base, config_cls)).float()
    own = model.state_dict()
    sd = {k: v.float() for k, v in stored.items() if k in own}
    sd.update({k: v.float() for k, v in dequantized.items()})
    missing, unexpected = model.load_state_dict(sd, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"} and (
        not missing or model.config.tie_word_embeddings), (missing, unexpected)
    pm = peft.PeftModel.from_pretrained(model, adapter)
    merged = pm.merge_and_unload()
    return {k: v.detach().clone() for k, v in merged.state_dict().items()}


def gptoss_with_loras(root: Path) -> dict:
    """A gpt-oss MXFP4 folder `root/q` (helpers.mxfp4_ref) and three PEFT target_parameters LoRAs beside it: `lora`
    (both expert banks + q_proj), `down` (down_proj alone, rslora), `gate_up` (gate_up_proj alone). Returns
    transformers' own dequantization of the banks {bank: tensor}; skips where transformers or PEFT cannot."""
    import peft
    import pytest
    import transformers

    pytest.importorskip("transformers.integrations.mxfp4")
    from helpers import mxfp4_ref
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    if "target_parameters" not in peft.LoraConfig.__dataclass_fields__:
        pytest.skip(f"PEFT {peft.__version__} has no target_parameters (ParamWrapper LoRAs came in PEFT 0.17)")
    packs, _ = mxfp4_ref.build(root / "q")
    dequantized = {stem: convert_moe_packed_tensors(blocks, scales) for stem, (blocks, scales) in packs.items()}
    config = plain_config(root / "q", transformers.GptOssConfig)
    loras = {"lora": (peft.LoraConfig(r=2, lora_alpha=8, target_modules=["q_proj"],
                                      target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]), 3),
             "down": (peft.LoraConfig(r=3, lora_alpha=6, target_modules=[], target_parameters=["mlp.experts.down_proj"],
                                      use_rslora=True), 5),
             "gate_up": (peft.LoraConfig(r=2, lora_alpha=4, target_modules=[],
                                         target_parameters=["mlp.experts.gate_up_proj"]), 6)}
    for name, (cfg, seed) in loras.items():
        peft_lora(root / name, config, transformers.GptOssForCausalLM, cfg, seed=seed)
    return dequantized
