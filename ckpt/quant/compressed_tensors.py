"""compressed-tensors (llm-compressor) integer and NVFP4 checkpoints decoded back to plain Linear weights.

config.json `quantization_config` (`quant_method: compressed-tensors`) lists `config_groups`, each a scheme
with `targets` (module names, `re:` regexes, or class names such as "Linear"), `weights` args (`num_bits`,
`type` int/float, `symmetric`, `strategy` tensor/channel/group, `group_size`) and a `format`; `ignore` lists
modules left plain. Which group a module gets follows compressed-tensors 0.20's `apply_quantization_config`:
a target that names the module (exact name first, then regexes, each set sorted as `match_targets` sorts it)
wins over a class-name target; when two groups list one target, the later group's scheme holds it; a module
an `ignore` entry names stays plain. The checkpoint has no module classes, so a class-name target is taken
to match every module that carries quantized keys and no name target; several class targets with different
schemes are refused (ckpt cannot tell which class a module is without the model).

Stored layouts (a Linear of N outputs, K inputs), decoded as the package's compressors decompress them:
- `pack-quantized`: `X.weight_packed` int32 [N, ceil(K * bits / 32)], codes + 2^(bits-1) packed densely,
  lowest bits first, 32 codes in exactly `bits` words (codes may straddle words for 3/5/6/7 bits:
  0.20's `pack_to_int32`); `X.weight_shape` [N, K] (checked against `weight_packed`, which
  compressed-tensors does not do: it truncates a wider shape silently); `X.weight_scale` [1] (tensor),
  [N, 1] (channel) or [N, K / group] (group); asymmetric `X.weight_zero_point` packed the same way along
  dim 0 (output rows) for channel/group, an int8 [1] for tensor. A width that only fits the older
  `32 // bits` codes-per-word packing (before 0.20, for 3/5/6/7 bits) is refused by name.
- `naive-quantized` / `int-quantized`: `X.weight` int8 codes (no offset), the same scales and zero points
  unpacked.
- `nvfp4-pack-quantized`: `X.weight_packed` uint8 [N, K / 2], two e2m1 codes per byte, the even element in
  the LOW nibble (the reverse of ComfyUI's order, so bytes are nibble-swapped before ckpt's e2m1 lookup);
  `X.weight_scale` float8_e4m3fn [N, K / 16]; `X.weight_global_scale` fp32 [1] = 448 * 6 / amax (the
  reciprocal of ModelOpt's `weight_scale_2`; it is divided by, never inverted here). Value, as
  `NVFP4PackedCompressor.decompress` computes it: s = bf16(weight_scale) / weight_global_scale (torch's
  type promotion: fp32 for a [1] global scale), W = bf16(e2m1 * s).
- `float-quantized` (FP8 `X.weight` + `X.weight_scale`) is left to `ckpt.quant.fp8`, which decodes it (what
  inspect says of its scheme is `float_settings` here, which reads the config groups).
- `dense` (a model saved before compression, `quantization_status` frozen): `X.weight` is already the float
  weight the package would load; its `weight_scale` / `weight_zero_point` are consumed and listed.
- `X.input_scale`, `X.input_global_scale`, `X.input_zero_point` (static activation quantization) only
  configure inference kernels: consumed and listed as dropped.

Values: integers W = (q - z) * s, computed as the package computes it in the scale's dtype (the difference
of two codes is exact there, the product of a 16-bit scale and a 9-bit integer is exact in float32, so one
rounding to the scale's dtype gives its bits); the decoded dtype is the scale's (what `decompress` returns,
the model's dtype when llm-compressor calibrated it). NVFP4 decodes to bf16, as the package does.

`merge-lora --keep-format` (`CtIntWeight.encoding`, `ckpt.quant.int_pack_encode`): a changed integer weight
keeps `weight_scale`, `weight_zero_point` and `weight_shape` as stored; only its codes (`weight_packed`, or
the naive int8 `weight`) are written again, band by band, as the package's own quantizer computes them on
the merged model in its dtype (the scale's): clamp(round(W / scale + zero), -2^(bits-1), 2^(bits-1) - 1),
each step rounded to that dtype, packed as `pack_to_int32` packs. A changed NVFP4 weight gets its global
scale, block scales and codes recomputed from the merged value (rounded to bf16, the model's dtype) as
compressed-tensors' quantizer and llm-compressor's min-max observer compute them in that dtype
(`CtNvfp4Weight.encoding`, `ckpt.quant.fp4_encode`).

Refused by name: sparse-24 / sparse-bitmask compression (`sparsity_config`, `.bitmask` keys: compressed-
tensors > 0.14 dropped it), `marlin-24`, a `transform_config` (rotated weights need the online transforms),
activation-ordered `X.weight_g_idx` (actorder "group", removed from compressed-tensors), block-strategy
integer weights, num_bits outside 1..8. MXFP4/6/8 groups are left to their own decoder; their keys, like any
compressed-tensors key no decoder consumed, are refused by `unclaimed` (registered last).
"""

from __future__ import annotations

import math
import re

from ckpt.lazy import torch

from ckpt.errors import CkptError
from ckpt.io.small_inputs import json_kind
from ckpt.io.tensors import Tensor
from ckpt.io.wrapper import Wrapper
from ckpt.quant import microscaling as mx
from ckpt.quant.common import (ACTIVATION_SCALES, DecodeContext, Decoded, companion, float_scale, nvfp4_parts,
                               quant_config, refuse, st_name)
from ckpt.quant.formats import Format
from ckpt.quant.int_pack_decode import CACHE_BAND, InputGroups, unpack_codes

METHOD = "compressed-tensors"
PACK, NAIVE, INT, NVFP4, FLOAT = ("pack-quantized", "naive-quantized", "int-quantized", "nvfp4-pack-quantized",
                                  "float-quantized")
DECODED = (PACK, NAIVE, INT, NVFP4)
OTHERS = (FLOAT, "mxfp4-pack-quantized", "mxfp6-pack-quantized", "mxfp8-quantized")  # other decoders' layouts
REFUSED = {"sparse-24-bitmask": "sparse-24 bitmask compression, which compressed-tensors > 0.14 no longer supports",
           "sparse-bitmask": "sparse bitmask compression, which compressed-tensors no longer supports",
           "marlin-24": "the Marlin 2:4 sparse layout, which compressed-tensors no longer supports"}
# keys that only exist beside compressed-tensors codes: one no decoder consumed is refused by `unclaimed`
CT_SUFFIXES = (".weight_packed", ".weight_shape", ".weight_global_scale", ".weight_g_idx", ".input_global_scale",
               ".weight_zero_point", ".input_zero_point", ".output_zero_point", ".bitmask", ".row_offsets")
ACTIVATION_ONLY = ACTIVATION_SCALES | {"input_global_scale", "input_zero_point", "output_zero_point"}



# ---------------------------------------------------------------------------------------------------
# unpacking


def swap_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """Low-nibble-first e2m1 bytes (compressed-tensors, ModelOpt) in ComfyUI's high-first order, which
    `microscaling.unpack_e2m1` reads."""
    return ((packed & 15) << 4) | (packed >> 4)


# ---------------------------------------------------------------------------------------------------
# decoded weights


class CtIntWeight(Wrapper):
    """W [N, K] = (q - z) * s of a pack-quantized or naive-quantized Linear; `base` is the stored codes.
    float32 values (exact products), rounded once to the scale's dtype (`natural`)."""

    row_align = 1

    def __init__(self, name, base: Tensor, shape, bits: int, packed: bool, scale: Tensor, strategy: str,
                 group: int, zero: Tensor | None, zero_packed: bool):
        self.name, self.base, self.shape, self.home = name, base, tuple(shape), base.home
        self.bits, self.packed, self.scale, self.strategy, self.group = bits, packed, scale, strategy, group
        self.zero, self.zero_packed = zero, zero_packed
        self.dtype, self.natural = torch.float32, scale.dtype
        self._zeros = None
        self.band_elems = CACHE_BAND
        self._groups = InputGroups.in_order(self.shape[1], group if strategy == "group" else self.shape[1])

    @property
    def encoding(self):
        from ckpt.quant.int_pack_encode import IntGridEncoding, pack_rows

        bits, half = self.bits, 1 << (self.bits - 1)
        if self.packed:
            label, store = f"compressed-tensors int{bits} pack-quantized", lambda c: pack_rows(c + half, bits)
        else:
            label, store = f"compressed-tensors int{bits} naive", lambda c: c.to(torch.int8)
        return IntGridEncoding(self, label, self.base, bits, -half, half - 1, store, dtype=self.natural)

    def grid(self, start, stop, device) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(scale fp32, zero int32 or None) of output rows [start, stop), broadcastable to [n, K] (group
        strategy: expanded per input): the stored grid `encoding` keeps."""
        z = self._zero_rows(start, stop, device)
        if self.strategy == "tensor":
            s = self.scale.read_all(torch.device("cpu")).to(device=device, dtype=torch.float32).reshape(1, 1)
        else:
            s = self.scale.read(start, stop, device).to(torch.float32).reshape(stop - start, -1)
        if self.strategy == "group":
            s = s.repeat_interleave(self.group, dim=1)
            z = None if z is None else z.repeat_interleave(self.group, dim=1)
        return s, z

    @property
    def source_bytes(self):
        return self.base.source_bytes + self.scale.numel * self.scale.dtype.itemsize

    def _zero_rows(self, start, stop, device):
        if self.zero is None:
            return None
        if self.strategy == "tensor":
            return self.zero.read_all(torch.device("cpu")).to(device=device, dtype=torch.int32).reshape(1, 1)
        if not self.zero_packed:
            return self.zero.read(start, stop, device).to(torch.int32)
        if self._zeros is None:  # [ceil(N * bits / 32), G] words along dim 0: small, unpacked once
            z = self.zero.read_all(torch.device("cpu"))
            z = unpack_codes(z.T, self.bits, self.shape[0]).T.to(torch.int32)
            self._zeros = z - (1 << (self.bits - 1))
        return self._zeros[start:stop].to(device)

    def read(self, start, stop, device, scratch=None):
        """(q - z) * s per group (`ckpt.quant.int_pack_decode`), in float32: packed codes are unpacked unsigned
        (q + 2^(bits-1)), so the offset joins the zero point. Zero points stored as int32 (naive) are taken off
        the codes in int32 first, as before: one past +-2^24 would not be exact in float32."""
        n, k = stop - start, self.shape[1]
        codes = self.base.read(start, stop, device, scratch)
        q = unpack_codes(codes, self.bits, k) if self.packed else codes
        z = self._zero_rows(start, stop, device)
        half = (1 << (self.bits - 1)) if self.packed else 0
        if z is not None and not self.zero_packed and self.zero.dtype == torch.int32:
            q, z = self._groups.dequantize(q, z, None, torch.int32), None
        if self.strategy == "tensor":
            s = self.scale.read_all(torch.device("cpu")).to(device=device, dtype=torch.float32).reshape(1, 1)
        else:
            s = self.scale.read(start, stop, device).to(torch.float32).reshape(n, -1)
        return self._groups.dequantize(q, half if z is None else z + half, s, torch.float32)


class CtNvfp4Weight(Wrapper):
    """W [N, K] of an nvfp4-pack-quantized Linear; `base` is `weight_packed` [N, K / 2]. The block scale
    is divided by the global scale with the package's own torch ops (so its type promotion is kept), then
    multiplied into the e2m1 values; float32 out, rounded once to bf16 (`natural`)."""

    row_align = 1

    def __init__(self, name, base: Tensor, scale: Tensor, global_scale: Tensor):
        self.name, self.base, self.scale, self.global_scale = name, base, scale, global_scale
        self.shape, self.home = (base.shape[0], base.shape[1] * 2), base.home
        self.dtype, self.natural = torch.float32, torch.bfloat16

    def read(self, start, stop, device, scratch=None):
        n = stop - start
        vals = mx.unpack_e2m1(swap_nibbles(self.base.read(start, stop, device, scratch)))  # [n, K] fp32
        g = self.global_scale.read_all(torch.device("cpu")).to(device)
        s = self.scale.read(start, stop, device).to(torch.bfloat16) / g  # [n, K / 16]
        w = vals.to(s.dtype).reshape(n, -1, 16) * s.unsqueeze(-1)
        return w.to(torch.bfloat16).to(torch.float32).reshape(n, -1)

    @property
    def encoding(self):
        """--keep-format: codes, block scales and global scale recomputed as compressed-tensors quantizes
        (`ckpt.quant.fp4_encode`)."""
        from ckpt.quant.fp4_encode import CT, Nvfp4Encoding

        return Nvfp4Encoding(CT, self, self.base, self.scale, self.global_scale)


# ---------------------------------------------------------------------------------------------------
# config: which scheme a module gets


class Scheme:
    """One config group: its name, targets, weight args and storage format."""

    def __init__(self, where: str, name: str, group: dict, default_format: str | None):
        self.name = name
        bad = f"{where}: compressed-tensors config group {name!r}"
        if not isinstance(group, dict):
            raise CkptError(f"{bad} is not an object; nothing was written")
        self.targets = _targets(group, bad)
        w = group.get("weights")
        self.weights = w if isinstance(w, dict) else None
        self.has_input = bool(group.get("input_activations"))
        self.format = group.get("format") or default_format
        if self.weights is None:
            return
        self.bits, self.type = _num_bits(w, bad), str(w.get("type", "int")).lower()
        self.strategy, self.group = _strategy(w, bad)
        self.symmetric = w.get("symmetric", True) is not False
        if self.format in (None, "mixed-precision"):
            self.format = self._inferred()

    def _inferred(self) -> str:
        """compressed-tensors' `infer_module_format` for a Linear (its COMPRESSION_FORMAT_PRIORITY order)."""
        if self.type == "float" and self.bits == 4:
            return NVFP4 if self.group == 16 else "mxfp4-pack-quantized"
        if self.type == "int":
            return INT if self.has_input else PACK
        if self.type == "float" and self.bits == 8:
            return FLOAT if self.has_input else NAIVE
        return NAIVE


def _targets(group: dict, bad: str) -> list[str]:
    """A group's `targets`: a list of names (one name alone is taken as that list)."""
    targets = group.get("targets") or []
    if isinstance(targets, str):
        targets = [targets]
    if not isinstance(targets, list) or not all(isinstance(t, str) for t in targets):
        raise CkptError(f"{bad}: targets {targets!r} is not a list of names; nothing was written")
    return targets


def _num_bits(w: dict, bad: str) -> int:
    """The weights' `num_bits` (8 by default): 1..8, what compressed-tensors packs."""
    bits = w.get("num_bits", 8)
    if isinstance(bits, bool) or not isinstance(bits, int) or not 1 <= bits <= 8:
        raise CkptError(f"{bad}: weights num_bits {bits!r} is not supported (compressed-tensors packs 1 to 8 "
                        "bits); nothing was written")
    return bits


def _strategy(w: dict, bad: str) -> tuple[str, object]:
    """(strategy, group_size) of the weights; without a strategy, the one `group_size` implies, as
    compressed-tensors' QuantizationArgs validator infers it. A group strategy needs a positive group size."""
    gs = w.get("group_size")
    strategy = w.get("strategy")
    if strategy is None:
        strategy = "tensor" if gs is None else "group" if isinstance(gs, int) and gs > 0 else "channel"
    strategy = str(strategy).lower()
    if strategy in ("group", "tensor_group") and (isinstance(gs, bool) or not isinstance(gs, int) or gs <= 0):
        raise CkptError(f"{bad}: strategy {strategy} needs a positive group_size, not {gs!r}; nothing was written")
    return strategy, gs


def _name_match(name: str, target: str) -> bool:
    """compressed-tensors' `match_name`: `re:` targets match from the start (`re.match`), others exactly."""
    if target.startswith("re:"):
        return re.match(target[3:], name) is not None
    return target == name


class Groups:
    """The config's groups and ignore list, and the per-module choice compressed-tensors makes."""

    def __init__(self, qc: dict, where: str):
        self.where = where
        groups = qc.get("config_groups") or {}
        if not isinstance(groups, dict):
            raise CkptError(f"{where}: compressed-tensors config_groups is not an object; nothing was written")
        top = qc.get("format")
        default = top if top not in (None, "mixed-precision") else None
        self.schemes = [Scheme(where, k, g, default) for k, g in groups.items()]
        self.target_to_scheme: dict[str, Scheme] = {}
        for s in self.schemes:  # a later group listing the same target takes it over (an OrderedDict assignment)
            for t in s.targets:
                self.target_to_scheme[t] = s
        ignore = qc.get("ignore") or []
        if not isinstance(ignore, (str, list)):
            raise CkptError(f"{where}: compressed-tensors ignore is {json_kind(ignore)}, not a list of module names "
                            "or patterns; nothing was written")
        self.ignore = [ignore] if isinstance(ignore, str) else list(ignore)

    def ignored(self, name: str) -> bool:
        return any(_name_match(name, i) for i in self.ignore if isinstance(i, str))

    def scheme_for(self, name: str) -> tuple[Scheme | None, str]:
        """(scheme, how it was chosen) of module `name`; (None, why) when no group applies."""
        if self.ignored(name):
            return None, "an ignore entry names it"
        targets = sorted(self.target_to_scheme, key=lambda x: ("re:" in x, x))  # match_targets' order
        named = [t for t in targets if _name_match(name, t)]
        if named:
            return self.target_to_scheme[named[0]], f"target {named[0]!r}"
        classes = [t for t in targets if not t.startswith("re:") and "." not in t and t[:1].isupper()]
        if not classes:
            return None, "no config group targets it"
        schemes = {id(self.target_to_scheme[t]): self.target_to_scheme[t] for t in classes}
        if len(schemes) > 1:
            return None, (f"class targets {classes} belong to different groups, and the checkpoint does not say "
                          "which class the module is")
        return self.target_to_scheme[classes[0]], f"class target {classes[0]!r}"


def ct_config(ctx: DecodeContext) -> dict | None:
    qc = quant_config(ctx)
    return qc if str(qc.get("quant_method", "")).lower() == METHOD else None


def _refuse_sparsity(qc: dict, where: str) -> None:
    """A sparse compression (other than `dense`, none) stores values ckpt cannot rebuild."""
    sparsity = qc.get("sparsity_config") or {}
    fmt = str(sparsity.get("format") or "") if isinstance(sparsity, dict) else ""
    if fmt in REFUSED or (fmt and fmt != "dense"):
        raise CkptError(f"{where}: compressed-tensors sparsity format {fmt!r} is "
                        f"{REFUSED.get(fmt, 'a sparse compression ckpt does not decode')}; nothing was written")


def _refuse_formats(qc: dict, where: str) -> None:
    """A top-level or group format in `REFUSED` is named before any layer is looked at."""
    groups = qc.get("config_groups") or {}
    if not isinstance(groups, dict):
        raise CkptError(f"{where}: compressed-tensors config_groups is not an object; nothing was written")
    for f in [qc.get("format")] + [g.get("format") for g in groups.values() if isinstance(g, dict)]:
        if f in REFUSED:
            raise CkptError(f"{where}: compressed-tensors format {f!r} is {REFUSED[f]}; nothing was written")


def _refuse_transform(qc: dict, where: str) -> None:
    """Weights stored rotated need the online transforms, which a plain checkpoint cannot hold."""
    transform = qc.get("transform_config") or {}
    if isinstance(transform, dict) and transform.get("config_groups"):
        raise CkptError(f"{where}: a compressed-tensors transform_config (Hadamard / rotation transforms) is "
                        "present: its weights are stored rotated and need the online transforms, which a plain "
                        "checkpoint cannot hold; ckpt does not decode it; nothing was written")


def _refuse_bitmask_keys(ctx: DecodeContext) -> None:
    """Sparse-bitmask data found by its keys, even where the config does not say so."""
    for key in ctx.remaining:
        if key.endswith((".bitmask", ".row_offsets")):
            raise refuse(ctx, key, f"{key!r} is compressed-tensors sparse-bitmask data, a compression "
                                   "compressed-tensors > 0.14 no longer supports and ckpt does not decode")


def _refuse_unsupported(ctx: DecodeContext, qc: dict, where: str) -> None:
    """Compressions and transforms ckpt cannot decode, refused by name before any layer is looked at."""
    _refuse_sparsity(qc, where)
    _refuse_formats(qc, where)
    _refuse_transform(qc, where)
    _refuse_bitmask_keys(ctx)


# ---------------------------------------------------------------------------------------------------
# the decoder: integer layers


def _check_int_scheme(ctx, s: Scheme, fmt: str, what: str, key: str) -> None:
    """An integer layout stores int codes of a tensor, channel or group strategy only."""
    if s.type != "int":
        raise refuse(ctx, key, f"{what}: group {s.name!r} has {s.type} weights, which {fmt} does not store")
    if s.strategy not in ("tensor", "channel", "group"):
        raise refuse(ctx, key, f"{what}: weight strategy {s.strategy!r} is not supported (tensor, channel, group)")


def _check_packed_width(ctx, s: Scheme, what: str, packed: Tensor, n: int, k: int, pk: str, hk: str) -> None:
    """`weight_shape` [n, k] must be exactly what `weight_packed` packs densely (compressed-tensors itself
    truncates a wider shape silently); a width only the pre-0.20 `32 // bits` packing gives is named as such."""
    words = -(-k * s.bits // 32)
    if n != packed.shape[0] or k <= 0 or words != packed.shape[1]:
        legacy = -(-k // (32 // s.bits)) if k > 0 else -1
        if n == packed.shape[0] and legacy == packed.shape[1] and legacy != words:
            raise refuse(ctx, pk, f"{what}: weight_packed {list(packed.shape)} holds {32 // s.bits} {s.bits}-bit "
                                  "codes per word, the packing of compressed-tensors before 0.20, which ckpt "
                                  "does not decode (0.20 packs densely)")
        raise refuse(ctx, hk, f"{what}: weight_shape [{n}, {k}] disagrees with weight_packed "
                              f"{list(packed.shape)} (a [{n}, {k}] weight packs {s.bits}-bit codes into "
                              f"[{n}, {words}])")


def _packed_codes(ctx, layer: str, s: Scheme, what: str, consumed: dict) -> tuple[Tensor, int, int]:
    """(`weight_packed`, N, K) of a pack-quantized layer: int32 words [N, ceil(K * bits / 32)], its shape
    from `weight_shape`."""
    pk, hk = f"{layer}.weight_packed", f"{layer}.weight_shape"
    packed = companion(ctx, pk, f"{what} packed weight", dtypes=(torch.int32,))
    if len(packed.shape) != 2:
        raise refuse(ctx, pk, f"{what}: weight_packed is {list(packed.shape)}; expected 2-D [out, in * bits / 32]")
    shape_t = companion(ctx, hk, f"{what} weight_shape", dtypes=(torch.int64, torch.int32), numel=2)
    n, k = (int(v) for v in shape_t.read_all(torch.device("cpu")).reshape(-1))
    _check_packed_width(ctx, s, what, packed, n, k, pk, hk)
    consumed[pk] = f"packed {s.bits}-bit codes of {layer}.weight"
    consumed[hk] = f"shape of {layer}.weight"
    return packed, n, k


def _naive_codes(ctx, layer: str, what: str) -> tuple[Tensor, int, int]:
    """(`weight`, N, K) of a naive- / int-quantized layer: int8 codes, one per weight."""
    wk = f"{layer}.weight"
    base = companion(ctx, wk, f"{what} weight codes", dtypes=(torch.int8,))
    if len(base.shape) != 2:
        raise refuse(ctx, wk, f"{what}: weight is {list(base.shape)}; expected 2-D [out, in]")
    n, k = base.shape
    return base, n, k


def _int_scale(ctx, layer: str, s: Scheme, n: int, k: int, what: str, consumed: dict) -> tuple[Tensor, tuple]:
    """(`weight_scale`, the shape its strategy gives it): [1] (tensor), [N, 1] (channel), [N, K / group]
    (group, K whole groups); a tensor scale of one value in any shape."""
    sk = f"{layer}.weight_scale"
    if s.strategy == "group":
        if k % s.group:
            raise refuse(ctx, sk, f"{what}: {k} inputs are not whole groups of {s.group}")
        sshape = (n, k // s.group)
    else:
        sshape = (n, 1) if s.strategy == "channel" else (1,)
    scale = companion(ctx, sk, f"{what} weight_scale", dtypes=float_scale)
    if tuple(scale.shape) != sshape and not (s.strategy == "tensor" and scale.numel == 1):
        raise refuse(ctx, sk, f"{what}: weight_scale is {list(scale.shape)}; strategy {s.strategy} needs "
                              f"{list(sshape)}")
    consumed[sk] = f"scale of {layer}.weight ({st_name(scale.dtype)})"
    return scale, sshape


def _symmetric_zero(ctx, layer: str, s: Scheme, what: str, consumed: dict) -> None:
    """A symmetric group may still store zero points: consumed when all zero, refused otherwise (dropping
    them would change the values)."""
    zk = f"{layer}.weight_zero_point"
    if zk in ctx.remaining:
        z = ctx.remaining[zk].read_all(torch.device("cpu"))
        if z.numel() and bool((z != 0).any()):
            raise refuse(ctx, zk, f"{what}: group {s.name!r} is symmetric but {zk!r} holds non-zero zero points")
        consumed[zk] = f"zero point of {layer}.weight (symmetric: all zero)"


def _asymmetric_zero(ctx, layer: str, s: Scheme, fmt: str, n: int, sshape: tuple, what: str,
                     consumed: dict) -> tuple[Tensor, bool]:
    """(zero point, packed?) of an asymmetric group: pack-quantized channel/group zero points are packed
    along the output rows like the codes; the others are stored one per scale."""
    zk = f"{layer}.weight_zero_point"
    zero_packed = fmt == PACK and s.strategy in ("channel", "group")
    if zero_packed:
        zshape = (-(-n * s.bits // 32), sshape[1])
        zero = companion(ctx, zk, f"{what} packed zero point", dtypes=(torch.int32,), shape=zshape)
    else:
        zero = companion(ctx, zk, f"{what} zero point", dtypes=(torch.int8, torch.int32))
        if zero.numel != math.prod(sshape):
            raise refuse(ctx, zk, f"{what}: zero point is {list(zero.shape)}; strategy {s.strategy} needs "
                                  f"{list(sshape)}")
    consumed[zk] = f"zero point of {layer}.weight"
    return zero, zero_packed


def _int_layer(ctx, layer, s: Scheme, fmt: str):
    """The decoded weight of one integer layer, every companion checked; and the keys it consumes. Codes,
    then scale, then zero point: each check needs the shape the one before established."""
    pk, wk = f"{layer}.weight_packed", f"{layer}.weight"
    what = f"compressed-tensors {fmt} {layer!r}"
    _check_int_scheme(ctx, s, fmt, what, pk if pk in ctx.remaining else wk)
    consumed = {}
    if fmt == PACK:
        base, n, k = _packed_codes(ctx, layer, s, what, consumed)
    else:
        base, n, k = _naive_codes(ctx, layer, what)
    scale, sshape = _int_scale(ctx, layer, s, n, k, what, consumed)
    zero, zero_packed = None, False
    if s.symmetric:
        _symmetric_zero(ctx, layer, s, what, consumed)
    else:
        zero, zero_packed = _asymmetric_zero(ctx, layer, s, fmt, n, sshape, what, consumed)
    w = CtIntWeight(f"{layer}.weight", base, (n, k), s.bits, fmt == PACK, scale, s.strategy, s.group or 0,
                    zero, zero_packed)
    return w, consumed


def _nvfp4_layer(ctx, layer, s: Scheme):
    """The decoded weight of one NVFP4 layer (a symmetric float 4-bit scheme in groups of 16), its codes,
    block scales and global scale checked; and the keys it consumes."""
    pk, sk, gk = (f"{layer}.{x}" for x in ("weight_packed", "weight_scale", "weight_global_scale"))
    what = f"compressed-tensors nvfp4 {layer!r}"
    if s.type != "float" or s.bits != 4 or s.group != 16 or not s.symmetric:
        raise refuse(ctx, pk, f"{what}: group {s.name!r} ({s.type} {s.bits}-bit, group {s.group}, "
                              f"{'symmetric' if s.symmetric else 'asymmetric'}) is not NVFP4 (symmetric float "
                              "4-bit, groups of 16)")
    packed, scale, glob = nvfp4_parts(ctx, pk, sk, gk, what, "global scale")
    consumed = {pk: f"packed e2m1 codes of {layer}.weight", sk: f"e4m3 block scales of {layer}.weight",
                gk: f"global scale of {layer}.weight (448 * 6 / amax)"}
    if f"{layer}.weight_zero_point" in ctx.remaining:
        raise refuse(ctx, f"{layer}.weight_zero_point", f"{what}: an NVFP4 layer has no zero point")
    return CtNvfp4Weight(f"{layer}.weight", packed, scale, glob), consumed


# ---------------------------------------------------------------------------------------------------
# the decoder: one entry per decoded format


def _int_decoded(ctx, layer: str, s: Scheme):
    """(weight, consumed keys, anchor key or None, summary label) of an integer layer; pack-quantized codes
    are the anchor (where the plain weight stands in the key order)."""
    w, used = _int_layer(ctx, layer, s, s.format)
    anchor = f"{layer}.weight_packed" if s.format == PACK else None
    return w, used, anchor, f"int{s.bits} {s.strategy}{'' if s.symmetric else ' asym'}"


def _nvfp4_decoded(ctx, layer: str, s: Scheme):
    """(weight, consumed keys, anchor key, summary label) of an NVFP4 layer."""
    w, used = _nvfp4_layer(ctx, layer, s)
    return w, used, f"{layer}.weight_packed", "nvfp4"


LAYOUTS = {PACK: _int_decoded, NAIVE: _int_decoded, INT: _int_decoded, NVFP4: _nvfp4_decoded}  # DECODED's


class _Decoding:
    """What `decode` gathers over the layers: decoded weights, consumed keys, anchors, and a count of layers
    per summary label."""

    def __init__(self):
        self.tensors, self.consumed, self.anchors, self.kinds = {}, {}, {}, {}

    def count(self, label: str) -> None:
        self.kinds[label] = self.kinds.get(label, 0) + 1


def _quantized_layers(ctx: DecodeContext) -> list[str]:
    """Every module that stores a `weight_packed` or a `weight_scale`, in stored order."""
    layers = []
    for key in ctx.remaining:
        for suffix in (".weight_packed", ".weight_scale"):
            if key.endswith(suffix) and key[: -len(suffix)] not in layers:
                layers.append(key[: -len(suffix)])
    return layers


def _scheme_of(ctx: DecodeContext, groups: Groups, layer: str) -> tuple[Scheme | None, str, str]:
    """(scheme, how it was chosen, the key a refusal names) of a layer with quantized keys; scheme None
    for FP8 codes with a weight_scale (in a group or outside them), which ckpt.quant.fp8 decodes. A layer
    no group quantizes, or with an activation-ordered group index, is refused."""
    if f"{layer}.weight_g_idx" in ctx.remaining:
        raise refuse(ctx, f"{layer}.weight_g_idx", f"compressed-tensors {layer!r} has an activation-ordered group "
                                                   "index (actorder group), which compressed-tensors removed and "
                                                   "ckpt does not decode")
    s, how = groups.scheme_for(layer)
    key = f"{layer}.weight_packed" if f"{layer}.weight_packed" in ctx.remaining else f"{layer}.weight_scale"
    if s is None:
        w = ctx.remaining.get(f"{layer}.weight")
        if key.endswith("weight_scale") and w is not None and w.dtype in mx_float_dtypes():
            return None, how, key  # an FP8 layer outside the groups: ckpt.quant.fp8 decodes it on its own
        raise refuse(ctx, key, f"compressed-tensors {layer!r} holds quantized weights, but {how}")
    if s.weights is None:
        raise refuse(ctx, key, f"compressed-tensors {layer!r}: its group {s.name!r} quantizes no weights")
    if s.type == "float" and s.bits == 8:
        return None, how, key  # FP8 codes with a weight_scale (float- or naive-quantized): ckpt.quant.fp8's
    return s, how, key


def _already_plain(ctx: DecodeContext, layer: str, s: Scheme) -> bool:
    """A `dense` save (quantization_status frozen, never compressed) whose weight is stored in float: that
    weight is the value the package would load."""
    plain = ctx.remaining.get(f"{layer}.weight")
    return (s.format == "dense" and plain is not None
            and plain.dtype in (torch.float32, torch.float16, torch.bfloat16)
            and f"{layer}.weight_packed" not in ctx.remaining)


def _consume_dense(ctx: DecodeContext, layer: str, consumed: dict) -> None:
    """The qparams of an already-plain layer: consumed and listed, not decoded."""
    for q in ("weight_scale", "weight_zero_point", "weight_global_scale"):  # status frozen: stored in float
        if f"{layer}.{q}" in ctx.remaining:
            consumed[f"{layer}.{q}"] = f"{q} of {layer}.weight, stored uncompressed (format dense)"


def _check_layout(ctx: DecodeContext, layer: str, s: Scheme, how: str, key: str) -> None:
    """The group's format is one ckpt decodes, and the stored keys are that format's: `weight_packed`
    exactly for the packed formats (a config that contradicts the tensors is refused, not reinterpreted)."""
    fmt = s.format
    if fmt not in DECODED:
        raise refuse(ctx, key, f"compressed-tensors {layer!r}: format {fmt!r} of group {s.name!r} is not one "
                               f"ckpt decodes ({', '.join(DECODED)})")
    stored = ctx.remaining.get(f"{layer}.weight_packed")
    if fmt in (NAIVE, INT) and stored is not None:
        raise refuse(ctx, key, f"compressed-tensors {layer!r} has weight_packed, but its group {s.name!r} "
                               f"({how}) says {fmt}")
    if fmt in (PACK, NVFP4) and stored is None:
        raise refuse(ctx, f"{layer}.weight_packed", f"compressed-tensors {layer!r} ({how}, group {s.name!r}, "
                                                    f"{fmt}) has no weight_packed")


def _decode_layer(ctx: DecodeContext, groups: Groups, layer: str, out: _Decoding) -> None:
    """One quantized layer: left to another decoder (FP8, MX layouts), passed through (dense), or decoded by
    its format's `LAYOUTS` entry, its plain weight then absent."""
    s, how, key = _scheme_of(ctx, groups, layer)
    if s is None:
        return
    if _already_plain(ctx, layer, s):
        _consume_dense(ctx, layer, out.consumed)
        out.count("dense (already plain)")
        return
    if s.format in OTHERS:
        return  # FP8 (ckpt.quant.fp8) and MX layouts are other decoders' (what none takes, `unclaimed` refuses)
    _check_layout(ctx, layer, s, how, key)
    w, used, anchor, label = LAYOUTS[s.format](ctx, layer, s)
    if anchor and f"{layer}.weight" in ctx.remaining:
        raise refuse(ctx, f"{layer}.weight", f"compressed-tensors {layer!r} has both a plain weight and "
                                             "weight_packed")
    out.tensors[w.name] = w
    if anchor:
        out.anchors[anchor] = w.name
    out.consumed.update(used)
    out.count(label)


def _consume_activation_params(ctx: DecodeContext, consumed: dict) -> None:
    """Static activation / kv-cache parameters anywhere in the model only configure inference: dropped."""
    for key in ctx.remaining:
        if key not in consumed and key.rsplit(".", 1)[-1] in ACTIVATION_ONLY:
            consumed[key] = "activation quantization parameter (inference only)"


def _notes(out: _Decoding) -> list[str]:
    """The summary's lines: layers decoded per label, activation parameters dropped."""
    kinds = out.kinds
    notes = ["compressed-tensors: decoded " + ", ".join(f"{v} {k}" for k, v in sorted(kinds.items())) + " layer(s)"
             if kinds else "compressed-tensors: no integer or NVFP4 layers to decode"]
    dropped = sum(1 for v in out.consumed.values() if v.startswith("activation"))
    if dropped:
        notes.append(f"compressed-tensors: {dropped} activation quantization parameter(s) dropped (inference only)")
    return notes


def decode(ctx: DecodeContext) -> Decoded | None:
    """Every quantized module of a compressed-tensors checkpoint (integer packs, naive int8, NVFP4) becomes
    its plain `X.weight`; its scheme is the one compressed-tensors would apply, every companion is checked
    against it before anything is read."""
    qc = ct_config(ctx)
    if qc is None:
        return None
    where = "config.json quantization_config"
    _refuse_unsupported(ctx, qc, where)
    groups = Groups(qc, where)
    out = _Decoding()
    for layer in _quantized_layers(ctx):
        _decode_layer(ctx, groups, layer, out)
    _consume_activation_params(ctx, out.consumed)
    if not out.tensors and not out.consumed:
        return None
    return Decoded(f"compressed-tensors {'+'.join(sorted(out.kinds)) or 'config'}", out.tensors, out.consumed,
                   notes=_notes(out), anchors=out.anchors)


def mx_float_dtypes():
    return (torch.float8_e4m3fn, torch.float8_e5m2)


def unclaimed(ctx: DecodeContext) -> None:
    """compressed-tensors keys no decoder consumed (an MX group no decoder took, a `weight_shape` whose
    codes are gone): refused by name, never written as if they were weights."""
    for key in ctx.remaining:
        if key.endswith(CT_SUFFIXES):
            raise refuse(ctx, key, f"compressed-tensors key {key!r} was not decoded (no decoder ckpt has takes "
                                   "its layer)")
    return None


def _ct_quantization_config(config) -> dict | None:
    """config.json's compressed-tensors `quantization_config`, None when it names another method or none."""
    qc = (config or {}).get("quantization_config") if isinstance(config, dict) else None
    return qc if isinstance(qc, dict) and str(qc.get("quant_method", "")).lower() == METHOD else None


def _module_scheme(config, weight: str) -> tuple[Scheme, dict] | None:
    """(scheme, its config group) compressed-tensors applies to the module of the decoded weight `weight`
    (`Groups.scheme_for`, ignore entries included); None outside a compressed-tensors config or any group.
    The decoder already built these groups from the same config, so nothing here can be refused anew."""
    qc = _ct_quantization_config(config)
    if qc is None or not weight.endswith(".weight"):
        return None
    s, _ = Groups(qc, "config.json quantization_config").scheme_for(weight[: -len(".weight")])
    return None if s is None or s.weights is None else (s, qc["config_groups"][s.name])


def _activations(group: dict) -> dict | None:
    """The group's `input_activations` as inspect names them (type, dynamic or static, strategy, group size):
    no decoded tensor carries them (their scales only configure inference kernels), so they come from the
    config, as compressed-tensors and vLLM read them; None for a weight-only scheme (W4A16, NVFP4A16, ...)."""
    a = group.get("input_activations")
    if not isinstance(a, dict):
        return None
    typ = str(a.get("type", "int")).lower()
    bits = a.get("num_bits", 8)
    out = {"type": f"{'fp' if typ == 'float' else typ}{bits}", "dynamic": a.get("dynamic", False),
           "strategy": str(a.get("strategy") or "tensor").lower()}
    return out | ({"group_size": a["group_size"]} if out["strategy"] in ("group", "tensor_group")
                  and a.get("group_size") else {})


def _with_activations(s: dict, config, weight: str) -> dict:
    """`s` and, when the weight's scheme quantizes activations, its `activations` settings."""
    found = _module_scheme(config, weight)
    act = _activations(found[1]) if found is not None else None
    return s | ({"activations": act} if act else {})


def inspect_settings(t, config) -> dict:
    """What `ckpt inspect` says of a decoded compressed-tensors weight: type, packing, strategy and group (the
    decoded weight's), and the activation scheme its config group gives (a W8A8 / W4A8 scheme's)."""
    if isinstance(t, CtNvfp4Weight):
        return _with_activations({"format": "compressed-tensors", "type": "nvfp4", "bits": 4, "group_size": 16,
                                  "packing": "nvfp4-pack-quantized"}, config, t.name)
    s = {"format": "compressed-tensors", "type": f"int{t.bits}", "bits": t.bits,
         "packing": "pack-quantized" if t.packed else "naive-quantized", "strategy": t.strategy, "sym": t.zero is None}
    return _with_activations(s | ({"group_size": t.group} if t.strategy == "group" else {}), config, t.name)


def float_settings(t, config) -> dict | None:
    """What `ckpt inspect` says of an FP8 weight of a compressed-tensors scheme (`float-quantized`, as the
    FP8_DYNAMIC / FP8_BLOCK / FP8 presets write it), which `ckpt.quant.fp8` decodes: the scheme's weight
    strategy (channel, tensor, group, or block with its block structure), sym, and its activation scheme;
    None outside a compressed-tensors config (the other FP8 layouts)."""
    if _ct_quantization_config(config) is None:
        return None
    out = {"format": "compressed-tensors", "type": "fp8", "bits": 8}
    found = _module_scheme(config, t.name)
    if found is None or found[0].type != "float" or found[0].bits != 8:
        return out  # an FP8 layer outside the config groups (ckpt.quant.fp8 decodes it alone): no scheme to name
    s, group = found
    act = _activations(group)
    out |= {"packing": s.format, "strategy": s.strategy}
    if s.strategy in ("group", "tensor_group"):
        out["group_size"] = s.group
    block = s.weights.get("block_structure")
    if s.strategy == "block" and isinstance(block, list):
        out["block"] = block
    return out | {"sym": s.symmetric} | ({"activations": act} if act else {})

FORMAT = Format("compressed-tensors", "compressed-tensors", 50, (decode,), weights=(CtIntWeight, CtNvfp4Weight),
                settings=inspect_settings, llm=True, last=(unclaimed,))
