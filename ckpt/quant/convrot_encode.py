"""ConvRot layers, encoded: one logical weight -> its stored comfy_quant tensors (`ckpt.quant.convrot` decodes them),
byte for byte what comfy-kitchen 0.2.40's eager quantizers make of the same float32 values, data-free (rotation and
round to nearest, stochastic rounding off):

- `int8_tensorwise` + convrot: `quantize_int8_convrot_weight` (rotate, per-row amax / 127, round half to even);
- `convrot_w4a4`: `quantize_convrot_w4a4_weight` (rotate, per-row amax / 7 at least 1e-10, codes in [-7, 7]);
- `asym_w4a8_int8`: `quantize_w4a8_int8_weight` with its defaults (symmetric, e4m3 group scales, a codebook: the
  frozen Lloyd-Max table unless the rotated groups are heavy-tailed, then a fitted one; two ALS passes of the
  group scales; codes assigned on the int8 grid), rows rotated in comfy-kitchen's own chunks of 2**22 values.
  A re-encoded layer (`merge-lora --keep-format`) passes its base's codebook and scale dtype, as ComfyUI's
  requantize does (`requantize_kwargs`); so does an asymmetric base (min/max codes and a per-group correction, in
  the base's correction dtype) and a W6A8 one (uniform 6-bit levels, two ALS passes, no scale search: requantize
  turns it off).

Like decoding, encoding takes the whole weight: the rotation's float32 matmul gives per-row results that depend on
how many rows one call holds, so the rows are rotated in exactly the calls comfy-kitchen makes. The stored
tensors of a layer are computed once, together, and handed out key by key (`_LayerTensors`).
The arithmetic is restated from comfy-kitchen (Apache-2.0), the oracle of tests/test_convrot.py.
"""

from __future__ import annotations

from ckpt.lazy import torch

from ckpt.io.plan import OutTensor
from ckpt.io.tensors import Tensor
from ckpt.quant.convrot import INT4_MAX, W4A4_QUANT_GROUP, ConvRotSpec, rotate, unpack_codes, unpack_signed4, \
    w4a8_dequantize
from ckpt.quant.encoding import Encoding
from ckpt.report import Report

# comfy-kitchen's W4A8 constants (backends/eager/w4a8_int8.py, tensor/w4a8_packed.py)
FIXED_LUT = (
    -0.980602, -0.794529, -0.638165, -0.500986, -0.377321, -0.263187, -0.155210, -0.050720,
    0.052541, 0.156985, 0.265284, 0.379533, 0.502636, 0.638953, 0.794876, 0.980671,
)
GATE_KURTOSIS = -0.1
KURTOSIS_SAMPLE = 1 << 19
ALS_ITERS = 2
ROW_ELEM_BUDGET = 1 << 22
CODEBOOK_SAMPLE_ELEMS = 1 << 22
W6_LEVELS = 31  # W6A8's uniform levels -31..31, stored as code + 32


def unencodable(spec: ConvRotSpec, shape) -> str | None:
    """Why a weight of `shape` cannot be stored as `spec`, or None (comfy-kitchen's own shape checks)."""
    if len(shape) != 2 or 0 in shape:
        return "not a non-empty 2-D weight"
    k = shape[1]
    if k % spec.convrot_groupsize:
        return f"input width {k} is not a multiple of convrot_groupsize {spec.convrot_groupsize}"
    if spec.format == "convrot_w4a4" and k % W4A4_QUANT_GROUP:
        return f"input width {k} is not a multiple of {W4A4_QUANT_GROUP}"
    if spec.format == "asym_w4a8_int8" and (k % 16 or k % spec.group_size):
        return f"input width {k} is not a multiple of 16 and of group_size {spec.group_size}"
    if spec.format == "asym_w4a8_int8" and spec.bits == 6 and (k % 32 or spec.group_size % 16):
        return "6-bit storage needs an input width divisible by 32 and a group_size multiple of 16"
    return None


# ---------------------------------------------------------------------------------------------------
# the quantizers (float32 [out, in] -> stored tensors by suffix)


def quantize_int8(w: torch.Tensor, g: int) -> dict[str, torch.Tensor]:
    x = rotate(w, g)
    scale = (x.abs().amax(dim=-1, keepdim=True).float() / 127.0).clamp(min=1e-30)
    s = torch.where(scale == 0, torch.full_like(scale, torch.finfo(x.dtype).tiny), scale)
    q = (x / s).nan_to_num_(0.0).round_().clamp_(-128.0, 127.0).to(torch.int8)
    return {"weight": q, "weight_scale": scale}


def quantize_w4a4(w: torch.Tensor, g: int) -> dict[str, torch.Tensor]:
    x = rotate(w, g)
    scales = x.abs().amax(dim=-1, keepdim=True).clamp(min=1e-10) / INT4_MAX
    q = (x / scales).nan_to_num_(0.0).round_().clamp_(-INT4_MAX, INT4_MAX).to(torch.int8)
    return {"weight": _pack4(q), "weight_scale": scales.reshape(w.shape[0]).to(torch.float32)}


def _pack4(values: torch.Tensor) -> torch.Tensor:
    lo = values[..., 0::2].to(torch.int32) & 0x0F
    hi = values[..., 1::2].to(torch.int32) & 0x0F
    return (lo | (hi << 4)).to(torch.int8)


def quantize_w4a8(w: torch.Tensor, spec: ConvRotSpec, codebook: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """comfy-kitchen's `_quantize_w4a8_chunked` (4 bits, symmetric, stochastic rounding off): one codebook for
    the whole tensor (`codebook`: the base's; None: decided from an evenly strided row sample), then chunks of
    2**22 values rotated and quantized each."""
    n, k = w.shape
    g, gs = spec.convrot_groupsize, spec.group_size
    scale_dtype = torch.float32 if spec.s_rel_dtype == "float32" else torch.float8_e4m3fn
    override = None
    if spec.bits == 4 and not spec.asymmetric and not spec.uniform:
        override = codebook.to(torch.float32) if codebook is not None else _decide_codebook(w, g, gs)
    block = max(1, ROW_ELEM_BUDGET // max(k, 1))
    parts = [_quantize_rotated(rotate(w[r: r + block].contiguous(), g), gs, scale_dtype, override, spec)
             for r in range(0, n, block)]
    out = {"weight": torch.cat([p[0] for p in parts]), "weight_s_rel": torch.cat([p[1] for p in parts]),
           "weight_s_channel": torch.cat([p[2] for p in parts])}
    if spec.asymmetric:  # comfy-kitchen's correction is the weight's dtype (float32 here): stored as the base's
        out["weight_correction"] = torch.cat([p[3] for p in parts], dim=1).to(getattr(torch, spec.correction_dtype))
    if override is not None:
        out["weight_codebook"] = override.contiguous()
    return out


def _decide_codebook(w: torch.Tensor, g: int, gs: int) -> torch.Tensor:
    n, k = w.shape
    max_rows = max(1, CODEBOOK_SAMPLE_ELEMS // max(k, 1))
    sample = w.index_select(0, torch.linspace(0, n - 1, max_rows).long()) if n > max_rows else w
    grouped = rotate(sample.contiguous(), g).float().view(sample.shape[0], k // gs, gs)
    return _codebook_for(grouped / grouped.abs().amax(dim=-1, keepdim=True).clamp(min=1e-8))


def _codebook_for(normalized: torch.Tensor) -> torch.Tensor:
    """The frozen table unless the group-normalized rotated weight is heavy-tailed (excess kurtosis above
    -0.1), then a Lloyd-Max fit."""
    x = normalized.detach().flatten()
    if x.numel() > KURTOSIS_SAMPLE:
        gen = torch.Generator(device=x.device).manual_seed(0)
        x = x[torch.randint(0, x.numel(), (KURTOSIS_SAMPLE,), device=x.device, generator=gen)]
    x = x.float()
    excess = ((x - x.mean()) / (x.std() + 1e-9)).pow(4).mean() - 3.0
    if excess.item() <= GATE_KURTOSIS:
        return torch.tensor(FIXED_LUT, device=normalized.device, dtype=torch.float32)
    return _fit_codebook(normalized)


def _fit_codebook(normalized: torch.Tensor, levels: int = 16, iterations: int = 25,
                  sample_size: int = 300000) -> torch.Tensor:
    samples = normalized.flatten()
    if samples.numel() > sample_size:
        gen = torch.Generator(device=samples.device).manual_seed(0)
        samples = samples[torch.randint(0, samples.numel(), (sample_size,), device=samples.device, generator=gen)]
    samples = samples.float()
    codebook = torch.quantile(samples, torch.linspace(0, 1, levels, device=samples.device))
    for _ in range(iterations):
        assignments = (samples.unsqueeze(-1) - codebook).abs().argmin(-1)
        updated = codebook.clone()
        for index in range(levels):
            selected = assignments == index
            if selected.any():
                updated[index] = samples[selected].mean()
        codebook = updated
    return codebook.contiguous()


def _assign_codes(normalized: torch.Tensor, codebook: torch.Tensor) -> torch.Tensor:
    last = codebook.numel() - 1
    pos = torch.searchsorted(codebook, normalized.contiguous())
    lo, hi = (pos - 1).clamp(0, last), pos.clamp(0, last)
    dlo, dhi = (normalized - codebook[lo]).abs_(), (normalized - codebook[hi]).abs_()
    return torch.where(dhi < dlo, hi, lo).to(torch.int32)


def _grid_levels(table: torch.Tensor, s_rel: torch.Tensor) -> torch.Tensor:
    return (table.view(1, 1, -1) * s_rel.float().unsqueeze(-1)).round_().clamp_(-127, 127)


def _assign_grid(weight: torch.Tensor, levels: torch.Tensor, s_channel: torch.Tensor) -> torch.Tensor:
    n, groups, gsize = weight.shape
    last = levels.shape[-1] - 1
    lv = levels.reshape(n * groups, last + 1).contiguous()
    tg = (weight / s_channel.view(-1, 1, 1)).reshape(n * groups, gsize).contiguous()
    pos = torch.searchsorted(lv, tg)
    lo, hi = (pos - 1).clamp(0, last), pos.clamp(0, last)
    dlo = tg.sub(torch.gather(lv, 1, lo)).abs_()
    dhi = tg.sub(torch.gather(lv, 1, hi)).abs_()
    return torch.where(dhi < dlo, hi, lo).to(torch.int32).reshape(n, groups, gsize)


def _quantize_rotated(weight: torch.Tensor, gs: int, scale_dtype, table: torch.Tensor | None, spec: ConvRotSpec):
    """comfy-kitchen's `_quantize_rotated_w4a8_int8_weight`, stochastic rounding and scale search off:
    (packed, s_rel, s_channel, correction or None)."""
    n, k = weight.shape
    grouped = weight.float().view(n, k // gs, gs)
    correction = None
    if spec.bits == 6:  # uniform levels -31..31: the ALS loop with rounding as the assignment
        table = torch.arange(-W6_LEVELS, W6_LEVELS + 1, dtype=torch.float32)

        def assign(x):
            return (x.round_().clamp_(-W6_LEVELS, W6_LEVELS) + W6_LEVELS).to(torch.int32)

        group_scale = (grouped.abs().amax(dim=-1, keepdim=True) / W6_LEVELS).clamp(min=1e-8)
        quantized = assign(grouped / group_scale)
        for _ in range(ALS_ITERS):
            ql = table[quantized]
            group_scale = ((grouped * ql).sum(-1, keepdim=True)
                           / (ql * ql).sum(-1, keepdim=True).clamp(min=1e-8)).clamp(min=1e-8)
            quantized = assign(grouped / group_scale)
        shifted = table[quantized] * group_scale
    elif spec.asymmetric:  # min/max codes 0..15, decoded as code - 8 plus the group's correction
        minimum = grouped.amin(dim=-1, keepdim=True)
        group_scale = ((grouped.amax(dim=-1, keepdim=True) - minimum) / 15.0).clamp(min=1e-8)
        unsigned = ((grouped - minimum) / group_scale).round().clamp(0, 15).to(torch.int32).view(n, k)
        shifted = (unsigned.view(n, k // gs, gs) - 8) * group_scale
        correction = (8.0 * group_scale + minimum).squeeze(-1).t().contiguous()
    elif table is not None:
        group_scale = grouped.abs().amax(dim=-1, keepdim=True).clamp(min=1e-8)
        quantized = _assign_codes(grouped / group_scale, table)
        for _ in range(ALS_ITERS):
            ql = table[quantized]
            group_scale = ((grouped * ql).sum(-1, keepdim=True)
                           / (ql * ql).sum(-1, keepdim=True).clamp(min=1e-8)).clamp(min=1e-8)
            quantized = _assign_codes(grouped / group_scale, table)
        shifted = table[quantized] * group_scale
    else:  # uniform codes: signed = round(w / (amax / 7)), stored + 8
        group_scale = (grouped.abs().amax(dim=-1, keepdim=True) / 7.0).clamp(min=1e-8)
        signed = (grouped / group_scale).round().clamp(-8, 7).to(torch.int32)
        unsigned = (signed + 8).view(n, k)
        shifted = signed * group_scale
    s_channel = (shifted.abs().amax(dim=(1, 2)) / 127.0).clamp(min=1e-8)
    s_rel = (group_scale.squeeze(-1) / s_channel.unsqueeze(1)).float().contiguous()
    if scale_dtype != torch.float32:
        s_rel = s_rel.to(scale_dtype).contiguous()
    if table is not None:
        unsigned = _assign_grid(grouped, _grid_levels(table, s_rel), s_channel).view(n, k)
        if spec.bits == 6:
            unsigned = unsigned + 1  # level index 0..62 -> stored code 1..63
    return _pack_codes(unsigned, spec.bits), s_rel, s_channel.float().contiguous(), correction


def _pack_codes(unsigned: torch.Tensor, bits: int) -> torch.Tensor:
    """[n, k] unsigned codes -> the nibble plane (even column low), at 6 bits followed by the top-2-bit plane."""
    low = ((unsigned[:, 0::2] & 0xF) | ((unsigned[:, 1::2] & 0xF) << 4)).to(torch.int8)
    if bits == 4:
        return low.contiguous()
    hi = (unsigned[:, 0::4] >> 4) & 0x3
    for j in range(1, 4):
        hi |= ((unsigned[:, j::4] >> 4) & 0x3) << (2 * j)
    return torch.cat([low, hi.to(torch.int8)], dim=1).contiguous()


def quantize(spec: ConvRotSpec, w: torch.Tensor, codebook: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """The stored tensors (by suffix) of the float32 weight `w` in the layout `spec`."""
    if spec.format == "int8_tensorwise":
        return quantize_int8(w, spec.convrot_groupsize)
    if spec.format == "convrot_w4a4":
        return quantize_w4a4(w, spec.convrot_groupsize)
    return quantize_w4a8(w, spec, codebook)


def dequantize(spec: ConvRotSpec, stored: dict[str, torch.Tensor]) -> torch.Tensor:
    """What the stored tensors decode to (float32), for the requantization error meter."""
    g = spec.convrot_groupsize
    if spec.format == "int8_tensorwise":
        return rotate(stored["weight"].float() * stored["weight_scale"], g)
    if spec.format == "convrot_w4a4":
        return rotate(unpack_signed4(stored["weight"]).float() * stored["weight_scale"].reshape(-1, 1), g)
    k = stored["weight_s_rel"].shape[1] * spec.group_size
    return w4a8_dequantize(unpack_codes(stored["weight"], k, spec.bits), stored["weight_s_rel"],
                           stored["weight_s_channel"], stored.get("weight_codebook"), stored.get("weight_correction"),
                           spec.group_size, g, spec.bits)


# ---------------------------------------------------------------------------------------------------
# stored tensors of one layer


class _LayerTensors:
    """The stored tensors of one layer, computed once from the whole value when the first is read and dropped
    when each has been handed out."""

    def __init__(self, spec, value: Tensor, name: str, report: Report, meter, codebook, wanted: set[str]):
        self.spec, self.value, self.name, self.report, self.meter = spec, value, name, report, meter
        self.codebook, self.left, self.done = codebook, set(wanted), None

    def get(self, suffix: str, device) -> torch.Tensor:
        if self.done is None:
            x = self.value.read(0, self.value.rows, torch.device("cpu")).to(torch.float32)
            bad = 0 if bool(torch.isfinite(x.sum())) else int((~torch.isfinite(x)).sum())
            self.report.count("nonfinite_quantized", self.name, bad)
            if bad:
                x = x.nan_to_num(0.0, 0.0, 0.0)
            cb = None if self.codebook is None else self.codebook.read_all(torch.device("cpu")).to(torch.float32)
            self.done = quantize(self.spec, x, cb)
            if self.meter is not None:
                self.meter.add(x, dequantize(self.spec, self.done))
        out = self.done[suffix]
        self.left.discard(suffix)
        if not self.left:
            self.done = {suffix: out}
        return out.to(device)


class _Part(Tensor):
    """One stored tensor of a `_LayerTensors` (read whole)."""

    row_align = None

    def __init__(self, layer: _LayerTensors, suffix: str, name: str, dtype, shape, home: str, view=None):
        self.layer, self.suffix, self.name, self.dtype, self.shape = layer, suffix, name, dtype, tuple(shape)
        self.home, self.view = home, view

    @property
    def source_bytes(self):
        return 0

    def read(self, start, stop, device, scratch=None):
        x = self.layer.get(self.suffix, device)
        return (x.view(self.view) if self.view is not None else x)[start:stop]


def encode(spec: ConvRotSpec, t: Tensor, report: Report, name: str | None = None, meter=None,
           codebook: Tensor | None = None, s_rel_stored=None) -> list[OutTensor]:
    """The stored tensors of the logical weight `t` (`X.weight` and its scales; the W4A8 codebook only when it is
    chosen here, not when `codebook`, the base's, is kept). `X.comfy_quant` is not among them."""
    name = name or t.name
    why = unencodable(spec, t.shape)
    if why:
        raise ValueError(f"{name}: cannot encode as {spec.format}: {why}")
    layer = name[: -len(".weight")] if name.endswith(".weight") else name
    rows, cols = t.shape
    if spec.format == "int8_tensorwise":
        shapes = {"weight": (torch.int8, (rows, cols)), "weight_scale": (torch.float32, (rows, 1))}
    elif spec.format == "convrot_w4a4":
        shapes = {"weight": (torch.int8, (rows, cols // 2)), "weight_scale": (torch.float32, (rows,))}
    else:
        s_rel = torch.float32 if spec.s_rel_dtype == "float32" else torch.float8_e4m3fn
        groups = cols // spec.group_size
        shapes = {"weight": (torch.int8, (rows, cols * spec.bits // 8)), "weight_s_rel": (s_rel, (rows, groups)),
                  "weight_s_channel": (torch.float32, (rows,))}
        if spec.asymmetric:
            shapes["weight_correction"] = (getattr(torch, spec.correction_dtype), (groups, rows))
        elif spec.bits == 4 and not spec.uniform and codebook is None:
            shapes["weight_codebook"] = (torch.float32, (16,))
    lt = _LayerTensors(spec, t, name, report, meter, codebook, set(shapes))
    out = []
    for suffix, (dtype, shape) in shapes.items():
        key = name if suffix == "weight" else f"{layer}.{suffix}"
        view = None
        if suffix == "weight_s_rel" and s_rel_stored == torch.uint8:  # the base stored its e4m3 bytes as U8
            dtype, view = torch.uint8, torch.uint8
        out.append(OutTensor(key, dtype, shape, _Part(lt, suffix, key, dtype, shape, t.home, view)))
    return out


class ConvRotEncoding(Encoding):
    """A new value of a ConvRot layer stored as its base is: same format and parameters (rotation group, W4A8
    group size, bit depth, symmetric or not, scale and correction dtypes), the base's W4A8 codebook kept (its
    stored key copied as it is), quantized as comfy-kitchen requantizes with stochastic rounding off.
    `X.comfy_quant` is copied as stored."""

    def __init__(self, spec: ConvRotSpec, wkey: str, shape, s_rel_dtype, codebook: Tensor | None,
                 asymmetric: bool, scalar_scale: bool):
        self.spec, self.wkey, self.shape = spec, wkey, tuple(shape)
        self.s_rel_dtype, self.codebook = s_rel_dtype, codebook
        self.asymmetric, self.scalar_scale = asymmetric, scalar_scale
        layer = wkey[: -len(".weight")] if wkey.endswith(".weight") else wkey
        extra = ("weight_s_rel", "weight_s_channel") if spec.format == "asym_w4a8_int8" else ("weight_scale",)
        extra += ("weight_correction",) if spec.asymmetric else ()
        self.keys = (wkey,) + tuple(f"{layer}.{s}" for s in extra)
        self.label = f"comfy_quant {spec.label}"

    @classmethod
    def of(cls, t) -> "ConvRotEncoding":
        """The encoding of a decoded `ckpt.quant.convrot.ConvRotWeight`."""
        return cls(t.spec, t.name, t.shape, t.s_rel_stored, t.parts.get("weight_codebook"), t.asymmetric,
                   t.scalar_scale)

    def why_not(self) -> str | None:
        if self.asymmetric and self.codebook is not None:
            return ("an asymmetric W4A8 layer with a codebook: comfy-kitchen's requantize drops the codebook "
                    "(asymmetric codes are uniform), which --keep-format cannot")
        if self.scalar_scale:
            return "a ConvRot int8 layer with one scale for the whole tensor is not what comfy-kitchen re-encodes"
        return unencodable(self.spec, self.shape)

    def encode(self, value: Tensor, report: Report, meter) -> list[OutTensor]:
        return encode(self.spec, value, report, name=self.wkey, meter=meter, codebook=self.codebook,
                      s_rel_stored=self.s_rel_dtype)
