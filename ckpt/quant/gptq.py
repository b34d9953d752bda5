"""GPTQ integer packs (AutoGPTQ, GPTQModel, optimum / transformers) decoded back to plain Linear weights.

A quantized Linear `X` (out features N, in features K) is stored as
- `X.qweight` int32 [K * bits / 32, N]: the codes packed along the input dim, 32 / bits per word with the
  lowest input in the lowest bits; 3-bit packs 32 inputs into 3 words, two codes crossing a word boundary
  (inputs 10 and 21 of each block: AutoGPTQ's `QuantLinear.pack`);
- `X.qzeros` int32 [G, N * bits / 32]: one zero point per group and output, packed the same way along the
  output dim;
- `X.scales` [G, N] (fp16 as AutoGPTQ writes them; GPTQModel may write bf16): one scale per group and output;
- `X.g_idx` int32 [K]: the group of each input (`desc_act` / act-order permutes it; without act-order it is
  i // group_size), G = ceil(K / group_size), group_size -1 meaning one group;
- `X.bias`, when the Linear has one: a plain tensor, left as it is.
W[n, k] = scales[g, n] * (q[k, n] - z[g, n]) with g = g_idx[k], computed in the scales' dtype: the product
of a 16-bit scale and an integer below 2^9 is exact in float32, so one rounding gives what AutoGPTQ's torch
path (`scales[g_idx] * (weight - zeros[g_idx])`, fp16) and GPTQModel's `model_dequant` (float32, then
`.to(fp16)`) both give, bit for bit. The decoded tensor has that dtype; another `--to` casts it once.

Zero points: v1 (`checkpoint_format` "gptq" or absent, everything AutoGPTQ and optimum write) stores z - 1
in each field; it decodes as (field + 1) & (2^bits - 1), per field, as GPTQModel's `model_dequant` and
AutoGPTQ's `qlinear_cuda_old` torch path (2/4/8 bits) do. The packer does not clamp, so an asymmetric zero
of 0 is stored as -1 and sets every higher field of its word; those fields then decode as 0, which is what
the libraries give. (AutoGPTQ's `qlinear_cuda` path and its 3-bit paths add 1 after masking instead, so the
overflowed field gives 2^bits there: the two AutoGPTQ paths disagree, and ckpt follows the masked form,
the only one in which the overflowed zero itself comes back.) v2 (`checkpoint_format: gptq_v2`) stores z.

The config is config.json `quantization_config` (`quant_method: gptq`) or AutoGPTQ's `quantize_config.json`
beside the weights. Each layer's bits come from its shapes (`g_idx` gives K) and must agree with the config's
`bits`, unless GPTQModel's per-module `dynamic` overrides are present (then the shapes decide). Refused by
name: GPTQModel's planar 5/6/7-bit (`gptq_p`) and Marlin / BitBLAS repacked layouts, and non-int32 packing.

Bands run along the output rows (dim 0 of the decoded [N, K] weight), which are columns of every stored
tensor: a band [a, b) reads only columns a..b of `qweight` and `scales`, the words of `qzeros` that hold
them, and `g_idx` (K values), with one positioned read per stored row (`read_columns`).

`merge-lora --keep-format` (`GptqWeight.encoding`, `ckpt.quant.int_pack_encode`): a changed weight keeps its
scales, qzeros and g_idx as stored; only `qweight` is written again, each code clamp(round(W / scale) +
zero, 0, 2^bits - 1) on that grid (GPTQ's own quantizer), packed as `QuantLinear.pack` packs. `qweight`
holds output rows as columns, so it is encoded per whole tensor (memory: the packed tensor plus one band).
"""

from __future__ import annotations

import re


from ckpt.lazy import torch

from ckpt.errors import CkptError
from ckpt.io.tensors import Tensor
from ckpt.io.wrapper import Wrapper
from ckpt.quant.common import (DecodeContext, Decoded, companion, float_scale, method_config, read_columns, refuse,
                               st_name)
from ckpt.quant.formats import Contradiction, Format
from ckpt.quant.int_pack_decode import CACHE_BAND, InputGroups, compute_dtype, unpack_codes

SIDE_CONFIG = "quantize_config.json"  # AutoGPTQ / GPTQModel's own config beside the weights
BITS = (2, 3, 4, 8)
PLANAR_BITS = (5, 6, 7)
V1_FORMATS = ("gptq", "")  # absent: AutoGPTQ < 0.8 and optimum write v1 without naming it
V2_FORMATS = ("gptq_v2",)
REPACKED = {"marlin": "Marlin-repacked", "bitblas": "BitBLAS-repacked", "gptq_p": "planar (gptq_p)",
            "ipex": "IPEX-repacked", "qqq": "QQQ"}


# ---------------------------------------------------------------------------------------------------
# unpacking


def words_for(n: int, bits: int) -> int:
    """int32 words holding n codes (n a whole number of words' worth)."""
    return n * bits // 32


def packs(n: int, bits: int) -> bool:
    """n codes fill whole words (3 bits: whole 3-word blocks of 32)."""
    return n % 32 == 0 if bits == 3 else n % (32 // bits) == 0


def code_block(bits: int) -> int:
    """Codes per indivisible run of words: 32 for 3 bits (3 words), else 32 / bits (one word)."""
    return 32 if bits == 3 else 32 // bits


# ---------------------------------------------------------------------------------------------------
# the decoded weight


class GptqWeight(Wrapper):
    """W [N, K] of one GPTQ Linear; `base` is `qweight`. Values in the scales' dtype (`natural` too)."""

    row_align = 1

    def __init__(self, name: str, qweight: Tensor, qzeros: Tensor, scales: Tensor, g_idx: Tensor | None,
                 bits: int, group_size: int, v1: bool):
        self.name, self.base, self.qzeros, self.scales, self.g_idx = name, qweight, qzeros, scales, g_idx
        self.bits, self.group_size, self.v1 = bits, group_size, v1
        self.in_features = qweight.shape[0] * 32 // bits
        self.shape, self.home = (qweight.shape[1], self.in_features), qweight.home
        self.dtype = self.natural = scales.dtype
        self.band_elems, self._groups = CACHE_BAND, None

    @property
    def source_bytes(self):
        return self.base.numel * 4 + self.scales.numel * self.scales.dtype.itemsize + self.qzeros.numel * 4

    def groups(self, device) -> torch.Tensor:
        if self.g_idx is None:
            return torch.arange(self.in_features, device=device) // self.group_size
        return self.g_idx.read_all(torch.device("cpu")).to(device=device, dtype=torch.int64)

    def input_groups(self) -> InputGroups:
        """The inputs' groups prepared for decoding (`ckpt.quant.int_pack_decode`), made on the first band."""
        if self._groups is None:
            n_groups = self.scales.shape[0]
            self._groups = (InputGroups.in_order(self.in_features, self.group_size) if self.g_idx is None
                            else InputGroups(self.groups(torch.device("cpu")), n_groups))
        return self._groups

    @property
    def encoding(self):
        from ckpt.quant.int_pack_encode import IntGridEncoding, pack_rows

        bits = self.bits
        return IntGridEncoding(self, f"GPTQ {bits}-bit", self.base, bits, 0, (1 << bits) - 1,
                               lambda codes: pack_rows(codes, bits).T, per_column=1)

    def zeros(self, start, stop, device) -> torch.Tensor:
        """The zero points [G, n] of outputs [start, stop) as integers (v1's stored z - 1 undone per field)."""
        bits, blk = self.bits, code_block(self.bits)
        c0, c1 = start // blk * blk, min(self.shape[0], -(-stop // blk) * blk)  # outputs whose words we read
        words = read_columns(self.qzeros, words_for(c0, bits), words_for(c1, bits), device)
        z = unpack_codes(words, bits, c1 - c0)[:, start - c0: stop - c0].to(torch.int32)
        if self.v1:
            z = (z + 1) & ((1 << bits) - 1)
        return z

    def grid(self, start, stop, device) -> tuple[torch.Tensor, torch.Tensor]:
        """(scale fp32, zero int32), each [n, K], of outputs [start, stop): the stored grid `encoding` keeps."""
        g = self.groups(device)
        s = read_columns(self.scales, start, stop, device).to(torch.float32)[g].T
        return s, self.zeros(start, stop, device)[g].T

    def read(self, start, stop, device, scratch=None):
        """Codes unpacked along the inputs from the band's words transposed ([n, K * bits / 32]), then
        (q - z) * s per group (`ckpt.quant.int_pack_decode`)."""
        q = unpack_codes(read_columns(self.base, start, stop, device).T, self.bits, self.in_features)  # [n, K]
        s = read_columns(self.scales, start, stop, device).T  # [n, G]
        w = self.input_groups().dequantize(q, self.zeros(start, stop, device).T, s, compute_dtype(s.dtype))
        return w.to(self.dtype)


# ---------------------------------------------------------------------------------------------------
# config


def gptq_config(ctx: DecodeContext) -> tuple[dict, str] | None:
    """(the GPTQ config, where it came from), or None when neither config.json nor quantize_config.json
    names GPTQ."""
    return method_config(ctx, "gptq", SIDE_CONFIG, "a GPTQ quantize config",
                         lambda cfg: str(cfg.get("quant_method", "gptq")).lower() == "gptq")


def _int(cfg, key, where, default=None):
    v = cfg.get(key, default)
    if isinstance(v, bool) or not isinstance(v, int):
        raise CkptError(f"{where}: GPTQ {key} {v!r} is not an integer; nothing was written")
    return v


def _settings(cfg: dict, where: str) -> tuple[int, int, bool, bool]:
    """(bits, group_size, v1, dynamic) of the config, refusing the layouts ckpt does not decode."""
    fmt = str(cfg.get("checkpoint_format", cfg.get("format")) or "").lower()
    if cfg.get("is_marlin_format"):
        fmt = "marlin"
    if fmt in REPACKED:
        raise CkptError(f"{where}: GPTQ checkpoint_format {fmt!r} is GPTQModel/AutoGPTQ's {REPACKED[fmt]} layout, "
                        "which ckpt does not decode (save it in the plain gptq format first); nothing was written")
    if fmt not in V1_FORMATS + V2_FORMATS:
        raise CkptError(f"{where}: unknown GPTQ checkpoint_format {fmt!r} (ckpt decodes gptq and gptq_v2); "
                        "nothing was written")
    bits = _int(cfg, "bits", where, 4)
    if bits in PLANAR_BITS:
        raise CkptError(f"{where}: {bits}-bit GPTQ is GPTQModel's planar layout, which ckpt does not decode "
                        "(ckpt decodes 2, 3, 4 and 8 bits); nothing was written")
    if bits not in BITS:
        raise CkptError(f"{where}: GPTQ bits {bits} is not supported (2, 3, 4 or 8); nothing was written")
    group = _int(cfg, "group_size", where, 128)
    if group != -1 and group <= 0:
        raise CkptError(f"{where}: GPTQ group_size {group} is neither -1 nor positive; nothing was written")
    pack = str(cfg.get("pack_dtype", "int32")).replace("torch.", "")
    if pack != "int32":
        raise CkptError(f"{where}: GPTQ pack_dtype {pack} is not supported (ckpt decodes int32 words); "
                        "nothing was written")
    return bits, group, fmt in V1_FORMATS, bool(cfg.get("dynamic"))


# ---------------------------------------------------------------------------------------------------
# the decoder


def _layer_bits(ctx, layer, qw, g_idx, bits, dynamic) -> int:
    """The layer's bits: from its shapes when g_idx gives K, checked against the config's unless GPTQModel's
    `dynamic` overrides may change them per module."""
    if g_idx is None:
        return bits
    k = g_idx.numel
    found = [b for b in (*BITS, *PLANAR_BITS) if k and qw.shape[0] * 32 == k * b]
    if not found:
        raise refuse(ctx, f"{layer}.qweight", f"GPTQ {layer!r}: qweight {list(qw.shape)} does not pack the "
                                               f"{k} inputs of g_idx at any bit width")
    if dynamic:
        if found[0] in PLANAR_BITS:
            raise refuse(ctx, f"{layer}.qweight", f"GPTQ {layer!r} is {found[0]}-bit: GPTQModel's planar layout, "
                                                   "which ckpt does not decode")
        return found[0]
    if found[0] != bits:
        raise refuse(ctx, f"{layer}.qweight", f"GPTQ {layer!r}: qweight {list(qw.shape)} and g_idx [{k}] are "
                                               f"{found[0]}-bit, but the config says bits {bits}")
    return bits


def decode(ctx: DecodeContext) -> Decoded | None:
    """Every `X.qweight` of a GPTQ checkpoint becomes `X.weight`, its qzeros, scales and g_idx consumed; each
    shape is checked against the others and the config before anything is read."""
    found = gptq_config(ctx)
    layers = [k[: -len(".qweight")] for k in ctx.remaining if k.endswith(".qweight")]
    if found is None or not layers:
        return None
    cfg, where = found
    bits, group, v1, dynamic = _settings(cfg, where)
    for key in ctx.remaining:  # a companion whose codes are gone would be written as a plain tensor
        for suffix in (".qzeros", ".g_idx"):
            if key.endswith(suffix) and key[: -len(suffix)] not in layers:
                raise refuse(ctx, key, f"GPTQ {key!r} has no {key[: -len(suffix)] + '.qweight'!r}")
    tensors, consumed, anchors, kinds = {}, {}, {}, set()
    for layer in layers:
        qk, zk, sk, gk = (f"{layer}.{s}" for s in ("qweight", "qzeros", "scales", "g_idx"))
        qw = companion(ctx, qk, "GPTQ packed weight", dtypes=(torch.int32,))
        if len(qw.shape) != 2:
            raise refuse(ctx, qk, f"GPTQ packed weight {qk!r} is {list(qw.shape)}; expected 2-D [in * bits / 32, out]")
        g_idx = ctx.remaining.get(gk)
        if g_idx is None and cfg.get("desc_act"):
            raise refuse(ctx, qk, f"GPTQ {layer!r} has no group index {gk!r}, which desc_act (act-order) needs")
        if g_idx is not None:
            companion(ctx, gk, f"GPTQ group index of {layer!r}", dtypes=(torch.int32, torch.int64))
            if len(g_idx.shape) != 1:
                raise refuse(ctx, gk, f"GPTQ group index {gk!r} is {list(g_idx.shape)}; expected 1-D [in]")
        b = _layer_bits(ctx, layer, qw, g_idx, bits, dynamic)
        if (qw.shape[0] * 32) % b:
            raise refuse(ctx, qk, f"GPTQ packed weight {qk!r} {list(qw.shape)} is not whole {b}-bit blocks of inputs")
        k, n = qw.shape[0] * 32 // b, qw.shape[1]
        gs = k if group == -1 else group
        n_groups = -(-k // gs) if k else 0
        if not packs(n, b):
            raise refuse(ctx, qk, f"GPTQ {layer!r}: {n} outputs do not fill whole {b}-bit zero-point words")
        sc = ctx.remaining.get(sk)
        if sc is not None and g_idx is not None and dynamic:
            n_groups = sc.shape[0] if len(sc.shape) == 2 else n_groups  # group size may be overridden too
        companion(ctx, sk, f"GPTQ scales of {layer!r}", dtypes=float_scale, shape=(n_groups, n))
        companion(ctx, zk, f"GPTQ zero points of {layer!r}", dtypes=(torch.int32,), shape=(n_groups, words_for(n, b)))
        if g_idx is not None:
            gi = g_idx.read_all(torch.device("cpu"))
            if gi.numel() and (int(gi.min()) < 0 or int(gi.max()) >= n_groups):
                raise refuse(ctx, gk, f"GPTQ group index {gk!r} has values outside [0, {n_groups}) (the scales' groups)")
        name = f"{layer}.weight"
        if name in ctx.remaining:
            raise refuse(ctx, name, f"GPTQ layer {layer!r} has both a plain {name!r} and packed {qk!r}")
        tensors[name] = GptqWeight(name, qw, ctx.remaining[zk], ctx.remaining[sk], g_idx, b, gs, v1)
        anchors[qk] = name
        consumed[qk] = f"packed {b}-bit codes of {name}"
        consumed[zk] = f"zero points of {name}"
        consumed[sk] = f"scales of {name} ({st_name(ctx.remaining[sk].dtype)})"
        if g_idx is not None:
            consumed[gk] = f"group index of {name}"
        kinds.add(b)
    label = "+".join(f"{b}" for b in sorted(kinds))
    notes = [f"GPTQ: decoded {len(tensors)} {label}-bit layer{'s' if len(tensors) != 1 else ''} "
             f"({'v1' if v1 else 'v2'} zero points, {where})"]
    missing = [x for x in layers if f"{x}.g_idx" not in consumed]
    if missing:
        notes.append(f"GPTQ: {len(missing)} layer(s) have no g_idx; inputs grouped in order by group_size")
    return Decoded(f"GPTQ {label}-bit", tensors, consumed, notes=notes, anchors=anchors)


def inspect_settings(t: GptqWeight, config) -> dict:
    """What `ckpt inspect` says of a decoded GPTQ weight: its bits, group size, act-order (a permuted g_idx) and
    zero-point convention, and sym where config.json's quantization_config says (no tensor carries it)."""
    cpu = torch.device("cpu")
    groups = t.groups(cpu)
    sequential = groups.numel() == 0 or bool((groups == torch.arange(t.in_features) // t.group_size).all())
    qc = (config or {}).get("quantization_config") if isinstance(config, dict) else None
    sym = qc.get("sym") if isinstance(qc, dict) and isinstance(qc.get("sym"), bool) else None
    s = {"format": "GPTQ", "bits": t.bits, "group_size": -1 if t.group_size >= t.in_features else t.group_size,
         "act_order": not sequential, "zero_points": "v1" if t.v1 else "v2"}
    return s | ({"sym": sym} if sym is not None else {})

FORMAT = Format("gptq", "GPTQ", 90, (decode,), weights=(GptqWeight,), settings=inspect_settings, llm=True,
                refusals={"GPTQ/AWQ int packs": (
                    re.compile(r"\.(qweight|qzeros|g_idx)$"),
                    "no config.json quantization_config (or AutoGPTQ's quantize_config.json, AutoAWQ's quant_config.json) "
                    "names quant_method gptq or awq, and the packs alone do not say which")},
                contradicts=(Contradiction("GPTQ/AWQ int packs", lambda key, keys: key.endswith((".qweight", ".qzeros", ".g_idx")),
                                           "gptq or awq"),))
