"""NVIDIA ModelOpt NVFP4 exports decoded back to plain Linear weights.

ModelOpt's Hugging Face export (`export_hf_checkpoint`) says what it did in `hf_quant_config.json` beside
the weights (`{"producer": {"name": "modelopt"}, "quantization": {"quant_algo": "NVFP4", "group_size": 16,
"exclude_modules": [...]}}`) and, in newer exports, in config.json `quantization_config` (`quant_method:
modelopt`, `quant_algo: NVFP4`). A quantized Linear `X` (N outputs, K inputs) stores:
- `X.weight` uint8 [N, K / 2]: two e2m1 codes per byte, the even element in the low nibble;
- `X.weight_scale` float8_e4m3fn [N, K / 16]: one block scale per 16 inputs;
- `X.weight_scale_2` fp32 scalar = amax / (448 * 6) (the reciprocal of compressed-tensors'
  `weight_global_scale`: multiplied here, as ModelOpt multiplies it);
- `X.input_scale` fp32 scalar: the activations' scale, inference only, dropped (listed).
W = e2m1 * (float(weight_scale) * weight_scale_2), as ModelOpt 0.47's `NVFP4QTensor.dequantize` computes it
(non-fast path): the block scales times the per-tensor scale in float32, the e2m1 values (float32) times
that, then one cast to the output dtype: ComfyUI's NVFP4 arithmetic (`microscaling.nvfp4_decode`, global * block,
then value * total) on ckpt's e2m1 lookup (`microscaling.unpack_e2m1`, after swapping the nibbles into its
high-first order), except that ModelOpt's table holds +0 for code 8 where ckpt's (and compressed-tensors')
holds -0: the sign of that zero is ModelOpt's. The decoded dtype is config.json `torch_dtype` (the model's,
what ModelOpt's `metadata["dtype"]` holds).

Refused by name: other ModelOpt algorithms whose weights are not plain NVFP4 (`NVFP4_AWQ` and `W4A8_AWQ`
carry `pre_quant_scale` smoothing, `MIXED_PRECISION` per-layer algorithms, INT4/INT8/W4A8 packs). ModelOpt
FP8 (`quant_algo: FP8`) is `ckpt.quant.fp8`'s: this decoder leaves it alone.

`merge-lora --keep-format`: a changed weight's codes, block scales and `weight_scale_2` are recomputed from
the merged value as ModelOpt's `NVFP4QTensor.quantize` computes them (`ckpt.quant.fp4_encode`); `input_scale`
is copied as stored.
"""

from __future__ import annotations

from ckpt.lazy import torch

from ckpt.errors import CkptError
from ckpt.io.tensors import Tensor
from ckpt.io.wrapper import Wrapper
from ckpt.quant import microscaling as mx
from ckpt.quant.common import (ACTIVATION_SCALES, DecodeContext, Decoded, method_config, model_dtype, nvfp4_parts,
                               refuse)
from ckpt.quant.formats import Format

SIDE_CONFIG = "hf_quant_config.json"
LEFT_TO_FP8 = ("FP8", "FP8_PB_WO", "FP8_PER_CHANNEL_PER_TOKEN", "FP8_BLOCKWISE", None, "")



def swap_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """Low-nibble-first e2m1 bytes in the high-first order `microscaling` reads."""
    return ((packed & 15) << 4) | (packed >> 4)


class ModelOptNvfp4Weight(Wrapper):
    """W [N, K] of a ModelOpt NVFP4 Linear; `base` is the packed `weight` [N, K / 2]. float32 values,
    rounded once to the model's dtype (`natural`)."""

    row_align = 1

    def __init__(self, name, base: Tensor, scale: Tensor, scale_2: Tensor, natural):
        self.name, self.base, self.scale, self.scale_2 = name, base, scale, scale_2
        self.shape, self.home = (base.shape[0], base.shape[1] * 2), base.home
        self.dtype, self.natural = torch.float32, natural

    def read(self, start, stop, device, scratch=None):
        n = stop - start
        vals = mx.unpack_e2m1(swap_nibbles(self.base.read(start, stop, device, scratch)))
        vals.add_(0.0)  # ModelOpt's e2m1 table holds +0 for code 8 (-0 + 0 = +0; every other value unchanged)
        g = self.scale_2.read_all(torch.device("cpu")).to(device=device, dtype=torch.float32).reshape(())
        total = self.scale.read(start, stop, device).to(torch.float32) * g  # ModelOpt: per-block scale in fp32
        return (vals.reshape(n, -1, 16) * total.unsqueeze(-1)).reshape(n, -1)

    @property
    def encoding(self):
        """--keep-format: codes, block scales and `weight_scale_2` recomputed as ModelOpt's
        `NVFP4QTensor.quantize` computes them (`ckpt.quant.fp4_encode`)."""
        from ckpt.quant.fp4_encode import MODELOPT, Nvfp4Encoding

        return Nvfp4Encoding(MODELOPT, self, self.base, self.scale, self.scale_2)


def modelopt_config(ctx: DecodeContext) -> tuple[str | None, dict, str] | None:
    """(quant_algo, the config's quantization section, where it came from), or None when neither config.json
    nor hf_quant_config.json names ModelOpt."""

    def ours(cfg: dict) -> bool:
        producer = cfg.get("producer") if isinstance(cfg.get("producer"), dict) else {}
        return isinstance(cfg.get("quantization"), dict) and str(producer.get("name", "modelopt")).lower() == "modelopt"

    found = method_config(ctx, "modelopt", SIDE_CONFIG, "a ModelOpt quant config", ours)
    if found is None:
        return None
    cfg, where = found
    sect = cfg.get("quantization") if isinstance(cfg.get("quantization"), dict) else cfg
    return sect.get("quant_algo"), sect, where


def decode(ctx: DecodeContext) -> Decoded | None:
    """Every ModelOpt NVFP4 `X.weight` (uint8 beside `X.weight_scale_2`) becomes its plain value; block and
    per-tensor scales consumed, activation scales dropped."""
    found = modelopt_config(ctx)
    if found is None:
        return None
    algo, sect, where = found
    algo = None if algo is None else str(algo).upper()
    if algo in LEFT_TO_FP8:
        return None
    if algo != "NVFP4":
        raise CkptError(f"{where}: ModelOpt quant_algo {algo!r} is not decoded by ckpt (it decodes NVFP4, and FP8 "
                        "through its FP8 decoder); nothing was written")
    group = sect.get("group_size", 16)
    if group != 16:
        raise CkptError(f"{where}: ModelOpt NVFP4 group_size {group!r} is not 16; nothing was written")
    natural = model_dtype(ctx)
    layers = [k[: -len(".weight_scale_2")] for k in ctx.remaining if k.endswith(".weight_scale_2")]
    tensors, consumed, anchors = {}, {}, {}
    for layer in layers:
        wk, sk, gk = f"{layer}.weight", f"{layer}.weight_scale", f"{layer}.weight_scale_2"
        what = f"ModelOpt NVFP4 {layer!r}"
        if f"{layer}.pre_quant_scale" in ctx.remaining:
            raise refuse(ctx, f"{layer}.pre_quant_scale", f"{what} has an AWQ pre_quant_scale (NVFP4_AWQ), which "
                                                          "ckpt does not decode")
        packed, scale, scale_2 = nvfp4_parts(ctx, wk, sk, gk, what, "per-tensor scale")
        tensors[wk] = ModelOptNvfp4Weight(wk, packed, scale, scale_2, natural)
        consumed[sk] = f"e4m3 block scales of {wk}"
        consumed[gk] = f"per-tensor scale of {wk} (amax / (448 * 6))"
    for key in ctx.remaining:
        if key.rsplit(".", 1)[-1] in ACTIVATION_SCALES:
            consumed[key] = "activation scale (inference only)"
    for key in ctx.remaining:
        if key.endswith(".weight_scale") and key not in consumed:
            raise refuse(ctx, key, f"ModelOpt NVFP4 {key!r} has no {key + '_2'!r} (the per-tensor scale)")
    notes = [f"ModelOpt NVFP4: decoded {len(tensors)} layer(s) ({where})"]
    dropped = sum(1 for v in consumed.values() if v.startswith("activation"))
    if dropped:
        notes.append(f"ModelOpt: {dropped} activation scale(s) dropped (inference only)")
    return Decoded("ModelOpt NVFP4", tensors, consumed, notes=notes, anchors=anchors)


def inspect_settings(t, config) -> dict:
    return {"format": "ModelOpt", "type": "nvfp4", "bits": 4, "group_size": 16}

FORMAT = Format("modelopt", "ModelOpt NVFP4", 60, (decode,), weights=(ModelOptNvfp4Weight,), settings=inspect_settings,
                llm=True)
