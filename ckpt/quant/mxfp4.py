"""gpt-oss MXFP4 expert banks decoded back to the bf16 parameters transformers' `GptOssForCausalLM` holds.

gpt-oss checkpoints (config.json `quantization_config.quant_method: mxfp4`) store each MoE projection `P` of
`X = model.layers.N.mlp.experts` as two uint8 tensors:
- `X.P_blocks` [E, N, G, 16]: 32 fp4 e2m1 codes per block of the input dim, two per byte, the LOW nibble
  holding the even element (the opposite of comfy-kitchen's NVFP4 order, which `microscaling` decodes);
- `X.P_scales` [E, N, G]: one e8m0 exponent per block, bias 127.
Decoded as transformers 5.24's `integrations/mxfp4.py` `convert_moe_packed_tensors` does on CPU (what
`from_pretrained` runs when no Triton kernels are there): value = ldexp(e2m1, scale - 127), the codes
reshaped to [E, N, K = 32 G] and transposed to the layout the unquantized model expects, [E, K, N]:
`gate_up_proj` [experts, hidden, 2 * intermediate], `down_proj` [experts, intermediate, hidden]. The
`P_bias` tensors are plain and stay as they are.

Exactness: transformers multiplies its bf16 table value by `pow(2.0, exp)` in float32 and rounds once into
the bf16 output. The decoded tensor here is that float32 product (the same table, from `microscaling`, and
the same `ldexp`), with the model's dtype (config.json `torch_dtype`, else bf16) as its natural dtype, so the
one rounding at write time gives transformers' bits, and `--to fp32` / `fp16` give what transformers gives
when it dequantizes into a model of that dtype. Unlike comfy-kitchen, e8m0 code 0 is 2^-127 here (not 0)
and 255 is 2^128 (inf), as `ldexp` makes them.

Bands run along the experts (dim 0): an expert's decoded matrix is the transpose of its stored rows, so one
expert is the smallest band that reads contiguous bytes.

`merge-lora --keep-format`: a changed bank's `P_blocks` and `P_scales` are recomputed from the merged value,
the shared exponents by the OCP MX rule as compressed-tensors 0.20's `generate_mx_scales` applies it
(`ckpt.quant.fp4_encode.Mxfp4BankEncoding`, which says how that differs from triton_kernels' rounding).

Config: the decoder runs when config.json names `mxfp4`; a folder whose config has no quantization_config at
all is decoded too when its `*_blocks` keys are gpt-oss's own expert names (`.experts.gate_up_proj_blocks`,
`.experts.down_proj_blocks`). The decoded shapes are checked against config.json's `num_local_experts`,
`hidden_size` and `intermediate_size` when it has them.
"""

from __future__ import annotations

import re

from ckpt.lazy import torch

from ckpt.io.tensors import Tensor
from ckpt.io.wrapper import Wrapper
from ckpt.quant.common import DecodeContext, Decoded, companion, model_dtype, quant_config, refuse
from ckpt.quant.microscaling import unpack_e2m1
from ckpt.quant.formats import Contradiction, Format

BLOCK = 32  # values per e8m0 scale
BIAS = 127
GPT_OSS_NAMES = re.compile(r"\.experts\.(gate_up_proj|down_proj)_blocks$")

def _swap_nibbles(b: torch.Tensor) -> torch.Tensor:
    """Bytes with their nibbles swapped: gpt-oss puts the even element in the low nibble, `unpack_e2m1`
    (comfy-kitchen's order) reads it from the high one."""
    return (b << 4) | (b >> 4)


def decode_blocks(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """uint8 blocks [..., G, 16] + uint8 e8m0 scales [..., G] -> float32 [..., G, 32]: each e2m1 value
    times 2^(scale - 127), computed as transformers' `ldexp` computes it (float32 product, no rounding
    except below 2^-149)."""
    vals = unpack_e2m1(_swap_nibbles(blocks))  # [..., G, 32]
    exp = (scales.to(torch.int32) - BIAS).unsqueeze(-1)
    return torch.ldexp(vals, exp)


class Mxfp4Experts(Wrapper):
    """An expert bank [E, K, N] decoded from `P_blocks` [E, N, K / 32, 16] (`base`) and `P_scales`."""

    row_align = 1

    def __init__(self, name: str, blocks: Tensor, scales: Tensor, natural):
        self.name, self.base, self.scales, self.home = name, blocks, scales, blocks.home
        e, n, g, _ = blocks.shape
        self.shape = (e, g * BLOCK, n)
        self.dtype, self.natural = torch.float32, natural

    @property
    def source_bytes(self):
        return self.base.source_bytes + self.scales.source_bytes

    def read(self, start, stop, device, scratch=None):
        blocks = self.base.read(start, stop, device)
        scales = self.scales.read(start, stop, device)
        w = decode_blocks(blocks, scales)  # [e, N, G, 32]
        e, n = w.shape[:2]
        return w.reshape(e, n, -1).transpose(1, 2).contiguous()

    @property
    def encoding(self):
        """--keep-format: blocks and e8m0 scales recomputed from the merged bank (`ckpt.quant.fp4_encode`)."""
        from ckpt.quant.fp4_encode import Mxfp4BankEncoding

        return Mxfp4BankEncoding(self, self.base, self.scales, decode_blocks)


def _expected_shape(config: dict | None, name: str) -> tuple[int, int, int] | None:
    """[E, K, N] the unquantized GptOssForCausalLM has for parameter `name`, when config.json says."""
    cfg = config or {}
    e, h, i = (cfg.get(k) for k in ("num_local_experts", "hidden_size", "intermediate_size"))
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in (e, h, i)):
        return None
    if name.endswith(".gate_up_proj"):
        return e, h, 2 * i
    if name.endswith(".down_proj"):
        return e, i, h
    return None


def decode(ctx: DecodeContext) -> Decoded | None:
    """Every `X.P_blocks` becomes `X.P`, its `X.P_scales` consumed; shapes checked against each other and the
    config before anything is read."""
    qc = quant_config(ctx)
    method = str(qc.get("quant_method", "")).lower()
    stems = [k[: -len("_blocks")] for k in ctx.remaining if k.endswith("_blocks")]
    if method == "mxfp4":
        where = "config.json quantization_config"
    elif not qc and stems and all(GPT_OSS_NAMES.search(f"{s}_blocks") for s in stems):
        where = "gpt-oss expert names, no quantization_config"
    else:
        return None
    for key in ctx.remaining:
        if key.endswith("_scales") and key[: -len("_scales")] not in stems:
            raise refuse(ctx, key, f"MXFP4 scales {key!r} have no {key[: -len('_scales')] + '_blocks'!r}")
    if not stems:
        return None
    natural = model_dtype(ctx)
    tensors, consumed, anchors = {}, {}, {}
    for stem in stems:
        bk, sk = f"{stem}_blocks", f"{stem}_scales"
        blocks = companion(ctx, bk, "MXFP4 blocks", dtypes=(torch.uint8,))
        if len(blocks.shape) != 4 or blocks.shape[-1] != BLOCK // 2:
            raise refuse(ctx, bk, f"MXFP4 blocks {bk!r} are {list(blocks.shape)}; expected [experts, out, blocks, "
                                  f"{BLOCK // 2}] (gpt-oss expert banks)")
        companion(ctx, sk, f"MXFP4 scales of {stem!r}", dtypes=(torch.uint8,), shape=blocks.shape[:3])
        if stem in ctx.remaining:
            raise refuse(ctx, stem, f"MXFP4 {stem!r} is stored both plain and as {bk!r}")
        t = Mxfp4Experts(stem, blocks, ctx.remaining[sk], natural)
        want = _expected_shape(ctx.config, stem)
        if want is not None and tuple(t.shape) != want:
            raise refuse(ctx, bk, f"MXFP4 {bk!r} decodes to {list(t.shape)}, but config.json (num_local_experts, "
                                  f"hidden_size, intermediate_size) says {stem.rsplit('.', 1)[-1]} is {list(want)}")
        tensors[stem] = t
        anchors[bk] = stem
        consumed[bk] = f"MXFP4 e2m1 codes of {stem}"
        consumed[sk] = f"MXFP4 e8m0 block scales of {stem}"
    n = len(tensors)
    notes = [f"MXFP4: decoded {n} gpt-oss expert bank{'s' if n != 1 else ''} ({where})"]
    return Decoded("gpt-oss MXFP4", tensors, consumed, notes=notes, anchors=anchors)


def inspect_settings(t, config) -> dict:
    return {"format": "gpt-oss", "type": "mxfp4", "bits": 4, "group_size": BLOCK}

FORMAT = Format("mxfp4", "gpt-oss MXFP4", 110, (decode,), weights=(Mxfp4Experts,), settings=inspect_settings, llm=True,
                contradicts=(Contradiction("MXFP4 blocks", lambda key, keys: key.endswith("_blocks")
                                           and key[: -len("_blocks")] + "_scales" in keys, "mxfp4"),))
