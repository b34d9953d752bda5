"""compressed-tensors checkpoints written by the `compressed-tensors` package itself, and its own decompression.

`build(folder, groups, ignore)` makes a tiny bf16 Llama (no downloads), applies a `QuantizationConfig` with the
package's `apply_quantization_config` (so the package decides which group each module gets), calibrates every
quantized weight with min/max qparams (`calculate_qparams`, NVFP4's global scale from `generate_gparam`: what
llm-compressor's min-max observer computes), compresses with `ModelCompressor.compress_model` and saves as
llm-compressor saves: `model.safetensors` and config.json with the `quantization_config` that
`ModelCompressor.update_config` writes.

The oracle is the package's own per-module decompression of the saved tensors: for each module, its stored
keys (local names) go through `BaseCompressor.get_value_from_registry(scheme.format).decompress(sd, scheme)`,
the call `decompress_module` makes when transformers loads with `run_compressed=False`.

`peft_recompressed(folder, adapter)` is the `merge-lora --keep-format` reference: what a user gets from the
libraries themselves (see its docstring).
"""

from __future__ import annotations

import torch
from safetensors.torch import load_file, save_file


def tiny_llama(hidden=64, inter=128, dtype=torch.bfloat16, seed=0):
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   tie_word_embeddings=False)
    torch.manual_seed(seed)
    return cfg, transformers.LlamaForCausalLM(cfg).to(dtype)


def _calibrate(module, in_model_dtype=False):
    """Min/max qparams of the module's weight, in float32 (the bases here), or `in_model_dtype` as llm-compressor's
    min-max observer hands them to `generate_gparam` / `calculate_qparams`: amin/amax of the weight as the model
    holds it (bf16), so both functions compute in that dtype."""
    from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam

    args = module.quantization_scheme.weights
    w = module.weight.data if in_model_dtype else module.weight.data.float()
    n, k = w.shape
    strategy = str(args.strategy.value if hasattr(args.strategy, "value") else args.strategy)
    if strategy == "tensor":
        lo, hi = w.amin().reshape(1), w.amax().reshape(1)
    elif strategy == "channel":
        lo, hi = w.amin(dim=1, keepdim=True), w.amax(dim=1, keepdim=True)
    else:  # group, tensor_group
        g = w.reshape(n, -1, args.group_size)
        lo, hi = g.amin(-1), g.amax(-1)
    gscale = None
    if strategy == "tensor_group":
        gscale = generate_gparam(w.amin(), w.amax())
        module.weight_global_scale.data.copy_(gscale)
    scale, zp = calculate_qparams(lo, hi, args, global_scale=gscale)
    module.weight_scale.data.copy_(scale.to(module.weight_scale.dtype))
    if hasattr(module, "weight_zero_point"):
        module.weight_zero_point.data.copy_(zp.to(module.weight_zero_point.dtype))


def build(folder, groups: dict, ignore=(), hidden=64, inter=128, dtype=torch.bfloat16, seed=0, fmt=None):
    """Write a compressed-tensors folder; returns {module name: its QuantizationScheme} for every quantized
    module (what the package applied)."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, QuantizationStatus, apply_quantization_config

    folder.mkdir(parents=True, exist_ok=True)
    cfg, model = tiny_llama(hidden, inter, dtype, seed)
    qconfig = QuantizationConfig(config_groups=groups, ignore=list(ignore),
                                 quantization_status=QuantizationStatus.FROZEN)
    apply_quantization_config(model, qconfig, show_progress=False)
    schemes = {}
    for name, module in model.named_modules():
        if getattr(module, "quantization_scheme", None) is not None and module.quantization_scheme.weights:
            _calibrate(module)
            schemes[name] = module.quantization_scheme
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format=fmt)
    compressor.compress_model(model)
    sd = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    save_file(sd, folder / "model.safetensors", metadata={"format": "pt"})
    model.config.save_pretrained(folder)
    compressor.update_config(str(folder))
    return schemes


def oracle(folder, schemes) -> dict[str, torch.Tensor]:
    """{module.weight: the package's decompressed weight} from the saved file, for every quantized module."""
    from compressed_tensors.compressors import BaseCompressor

    stored = load_file(folder / "model.safetensors")
    out = {}
    for name, scheme in schemes.items():
        local = {k[len(name) + 1:]: v for k, v in stored.items()
                 if k.startswith(name + ".") and "." not in k[len(name) + 1:]}
        local.pop("bias", None)
        compressor = BaseCompressor.get_value_from_registry(scheme.format.value if hasattr(scheme.format, "value")
                                                            else scheme.format)
        out[f"{name}.weight"] = compressor.decompress(local, scheme)["weight"]
    return out


def int_args(bits, strategy, group=None, symmetric=True):
    from compressed_tensors.quantization import QuantizationArgs

    return QuantizationArgs(num_bits=bits, type="int", strategy=strategy, group_size=group, symmetric=symmetric)


def linear(args, targets=("Linear",)):
    from compressed_tensors.quantization import QuantizationScheme

    return QuantizationScheme(targets=list(targets), weights=args)


def mixed() -> tuple[dict, list[str]]:
    """A mixed-precision config and its ignore list: exact names beat regexes beat class targets; a later group
    takes over a target an earlier one lists."""
    from compressed_tensors.quantization import QuantizationScheme
    from compressed_tensors.quantization.quant_scheme import NVFP4A16

    schemes = {
        "attn_int8": linear(int_args(8, "channel"), targets=["re:.*self_attn\\.(q|k)_proj$", "model.layers.1.mlp.up_proj"]),
        "mlp_nvfp4": QuantizationScheme(targets=["re:.*mlp\\.(gate|up)_proj$"], **NVFP4A16),
        "rest_int4": linear(int_args(4, "group", 32, False), targets=["Linear"]),
    }
    return schemes, ["lm_head", "re:model\\.layers\\.1\\.self_attn\\.o_proj$", "model.layers.0.mlp.down_proj"]


def peft_recompressed(folder, adapter) -> dict[str, torch.Tensor]:
    """The compressed state dict a user gets from the libraries for `merge-lora --keep-format`: transformers loads
    the compressed-tensors folder dequantized (`CompressedTensorsConfig(dequantize=True)`: the package's
    decompression, in the model's dtype), PEFT's `PeftModel.from_pretrained(adapter).merge_and_unload()` merges,
    the folder's own `quantization_config` is applied again (`apply_quantization_config`), each quantized
    module gets its quantization parameters as ckpt's --keep-format keeps them (integer grids: the base's stored
    `weight_scale` / `weight_zero_point`, packed zero points unpacked; NVFP4: recomputed from the merged weight
    by min/max in the model's dtype, as llm-compressor's observer does), and `ModelCompressor.compress_model`
    compresses (on CPU: the package's torch quantizer)."""
    import json

    import peft
    import transformers
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
    from compressed_tensors.quantization import QuantizationConfig, QuantizationStatus, apply_quantization_config

    model = transformers.AutoModelForCausalLM.from_pretrained(
        folder, quantization_config=transformers.CompressedTensorsConfig(dequantize=True))
    merged = peft.PeftModel.from_pretrained(model, adapter).merge_and_unload()
    qc = QuantizationConfig.model_validate(json.loads((folder / "config.json").read_text())["quantization_config"])
    qc.quantization_status = QuantizationStatus.FROZEN
    apply_quantization_config(merged, qc)
    stored = load_file(folder / "model.safetensors")
    for name, module in merged.named_modules():
        scheme = getattr(module, "quantization_scheme", None)
        if scheme is None or scheme.weights is None:
            continue
        args = scheme.weights
        if str(getattr(args.strategy, "value", args.strategy)) == "tensor_group":
            _calibrate(module, in_model_dtype=True)
            continue
        for key in ("weight_scale", "weight_zero_point"):
            if f"{name}.{key}" not in stored:
                continue
            param = getattr(module, key)
            v = stored[f"{name}.{key}"]
            if key == "weight_zero_point" and v.dtype == torch.int32:  # pack-quantized: packed along dim 0
                v = unpack_from_int32(v, args.num_bits, torch.Size(param.shape), packed_dim=0)
            param.data.copy_(v.reshape(param.shape).to(param.dtype))
    ModelCompressor.from_pretrained_model(merged).compress_model(merged)
    return {k: v.detach().contiguous() for k, v in merged.state_dict().items()}
