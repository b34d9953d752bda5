"""mlx-lm LoRA adapter folders: `adapters.safetensors` + `adapter_config.json`, as `mlx_lm lora` writes them.

What the files mean (mlx-lm 0.32, `mlx_lm/tuner/lora.py`, `tuner/utils.py`, `fuse.py`):
- each adapted layer `X` (a Linear, or a quantized one, under its module path `model.layers.N.self_attn.q_proj`)
  stores `X.lora_a` [in, r] and `X.lora_b` [r, out]: transposed against PEFT's lora_A [r, in] / lora_B [out, r];
- adapter_config.json: `fine_tune_type` (lora, dora or full), `num_layers` (the last N blocks; -1 all),
  `lora_parameters` {rank, scale, dropout, keys}: `scale` is the multiplier itself (no alpha: alpha = scale * rank
  in PEFT's terms, which is what `lora convert` writes);
- `mlx_lm fuse` (LoRALinear.fuse): W' = W + ((scale * lora_b.T) @ lora_a.T).astype(W.dtype), so the delta is
  rounded to the weight's dtype *before* the add (`LoraModule.delta_in_weight_dtype`); on a quantized base W is
  `mx.dequantize` of it and W' is quantized again with the layer's bits and group (`--keep-format`:
  `ckpt.quant.mlx.MlxEncoding`), or kept (`--dequantize`: `--to bf16`).
Refused by name: `fine_tune_type` dora (mlx-lm's DoRA fuse computes the magnitude in float32 and writes its fused
layers in float32 whatever the model's dtype: not merged here) and full (adapters.safetensors then holds whole
weights, not an adapter), 3-D factors (LoRASwitchLinear: MoE experts stacked, which ckpt's MLX decoder does not
read) and LoRA embeddings (mlx-lm's LoRAEmbedding stores its factors the other way round: lora_a [vocab, r]).
"""

from __future__ import annotations

import math
from pathlib import Path

from ckpt.errors import file_error
from ckpt.io.checkpoint import open_checkpoint
from ckpt.io.small_inputs import load_json_object
from ckpt.io.tensors import Transposed
from ckpt.adapters.files import LoraFile, LoraModule

WEIGHTS = "adapters.safetensors"
CONFIG = "adapter_config.json"
TYPES = ("lora", "dora", "full")  # mlx_lm lora --fine-tune-type


def _short(v) -> str:
    s = repr(v)
    return s if len(s) <= 40 else s[:40] + "..."


def is_adapter(path: Path) -> bool:
    """An mlx-lm adapter folder (it holds adapters.safetensors), or its adapters.safetensors."""
    return (path.is_dir() and (path / WEIGHTS).exists()) or (path.name == WEIGHTS and path.is_file())


def folder_of(path: Path) -> Path:
    return path if path.is_dir() else path.parent


def read_config(folder: Path) -> tuple[float, int, list[str] | None, int]:
    """(scale, rank, keys or None, num_layers) from adapter_config.json, refused unless a LoRA mlx-lm fuses."""
    cfg_path = folder / CONFIG
    if not cfg_path.exists():
        raise file_error(folder, f"an mlx-lm adapter folder needs {CONFIG} beside {WEIGHTS} (lora_parameters: "
                                 "rank and scale); mlx_lm lora writes it")
    cfg = load_json_object(cfg_path)
    kind = cfg.get("fine_tune_type", "lora")
    if kind not in TYPES:
        raise file_error(cfg_path, f"fine_tune_type {_short(kind)} is not one mlx-lm writes (lora, dora, full)")
    if kind == "dora":
        raise file_error(cfg_path, "fine_tune_type 'dora' is not merged: ckpt merges mlx-lm LoRA adapters "
                                   "(mlx_lm fuse writes DoRA layers in float32 from a float32 magnitude)")
    if kind == "full":
        raise file_error(cfg_path, f"fine_tune_type 'full': {WEIGHTS} holds whole weights, not an adapter "
                                   "(load them as a model; ckpt merges mlx-lm LoRA adapters)")
    params = cfg.get("lora_parameters")
    if not isinstance(params, dict):
        raise file_error(cfg_path, f"lora_parameters must be an object with rank and scale (found {_short(params)})")
    rank, scale = params.get("rank"), params.get("scale")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank <= 0:
        raise file_error(cfg_path, f"lora_parameters rank must be a positive integer (found {_short(rank)})")
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
        hint = " (mlx-lm's LoRA config uses scale, not alpha)" if "alpha" in params and scale is None else ""
        raise file_error(cfg_path, f"lora_parameters scale must be a finite number (found {_short(scale)}){hint}")
    keys = params.get("keys")
    if keys is not None and (not isinstance(keys, list) or not all(isinstance(k, str) for k in keys)):
        raise file_error(cfg_path, f"lora_parameters keys must be a list of module paths (found {_short(keys)})")
    layers = cfg.get("num_layers", -1)
    if isinstance(layers, bool) or not isinstance(layers, int):
        raise file_error(cfg_path, f"num_layers must be an integer (found {_short(layers)})")
    return float(scale), rank, keys, layers


def fused_delta(up, down):
    """(scale * lora_b.T) @ lora_a.T as mlx computes it on the CPU: `up` [rows, r] (scale applied) times `down`
    [r, cols] in float32, summed over the rank in order, each product rounded before its add (no FMA). torch's
    matmul sums in another order and differs in the last bit of about half the values, which moves one in
    thousands of them to the next bf16 value after the rounding fuse does; this order gives mlx's bits."""
    from ckpt.lazy import torch

    out = torch.zeros((up.shape[0], down.shape[1]), dtype=torch.float32, device=up.device)
    for k in range(up.shape[1]):
        out.add_(up[:, k:k + 1] * down[k:k + 1])
    return out


def _in_keys(name: str, keys: list[str]) -> bool:
    """mlx-lm's `linear_to_lora_layers`: a key names a module path inside a block (`self_attn.q_proj`) or from
    the model's root (`model.embed_tokens`)."""
    return any(name == k or name.endswith("." + k) for k in keys)


def load(spec: str) -> LoraFile:
    """An mlx-lm adapter folder as a `LoraFile` of LoRA modules (factors read transposed, lazily)."""
    folder = folder_of(Path(spec).expanduser())
    scale, rank, keys, _ = read_config(folder)
    weights = folder / WEIGHTS
    ckpt = open_checkpoint(str(weights))
    try:
        tensors = ckpt.components[0].tensors
        pairs: dict[str, dict[str, str]] = {}
        unknown = []
        for key in tensors:
            head, _, last = key.rpartition(".")
            if last in ("lora_a", "lora_b") and head:
                pairs.setdefault(head, {})[last] = key
            else:
                unknown.append(key)
        if not pairs:
            raise file_error(weights, f"holds no lora_a / lora_b tensors (keys such as {_short(next(iter(tensors), ''))})")
        modules: dict[str, LoraModule] = {}
        for name, ks in pairs.items():
            if len(ks) != 2:
                raise file_error(weights, f"module {_short(name)} has {', '.join(ks)} only (needs lora_a and lora_b)")
            a, b = tensors[ks["lora_a"]], tensors[ks["lora_b"]]
            if len(a.shape) != 2 or len(b.shape) != 2:
                what = ("stacked experts (LoRASwitchLinear) are not merged" if len(a.shape) == 3
                        else "not 2-D")
                raise file_error(weights, f"module {_short(name)}: lora_a {list(a.shape)} / lora_b {list(b.shape)}: "
                                          f"{what}")
            if a.shape[1] != rank or b.shape[0] != rank:
                raise file_error(weights, f"module {_short(name)}: lora_a {list(a.shape)} / lora_b {list(b.shape)} "
                                          f"do not have rank {rank} ({CONFIG} lora_parameters rank)")
            if name.rpartition(".")[2] in ("embed_tokens", "wte", "embed", "tok_embeddings"):
                raise file_error(weights, f"module {_short(name)}: mlx-lm LoRA embeddings (lora_a [vocab, r]) are "
                                          "not merged")
            if keys is not None and not _in_keys(name, keys):
                raise file_error(weights, f"module {_short(name)} is not one of {CONFIG} lora_parameters keys "
                                          "(mlx_lm fuse refuses it too)")
            modules[name] = LoraModule(name, spec, "lora", {"down": Transposed(a), "up": Transposed(b)},
                                       [ks["lora_a"], ks["lora_b"]], [name], config_alpha=scale * rank,
                                       scale=scale, delta_in_weight_dtype=True)
        return LoraFile(spec, weights, modules, unknown, ckpt, side_files=(folder / CONFIG,))
    except BaseException:
        ckpt.close()
        raise
