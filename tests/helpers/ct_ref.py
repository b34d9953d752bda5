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


def _calibrate(module):
    from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam

    args = module.quantization_scheme.weights
    w = module.weight.data.float()
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
