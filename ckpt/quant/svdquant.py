"""SVDQuant W4A4 layers of ComfyUI `comfy_quant` checkpoints (comfy-kitchen's `svdquant_w4a4`,
`TensorCoreSVDQuantW4A4Layout`), decoded to the dense weight the runtime computes, and a LoRA baked into them
without re-quantization.

A layer `X` with `X.comfy_quant` = `{"format": "svdquant_w4a4"}` (or the same entry in `_quantization_metadata`;
`comfy_quant.decode` hands such layers here) stores, in comfy-kitchen's natural layout:

- `X.weight` int8 (N, K/2): int4 codes two per byte, the low nibble the even column, read as signed [-8, 7];
- `X.weight_scale` (K/64, N) float: one scale per group of 64 inputs per output;
- `X.weight_smooth_factor` (K,) float: the runtime divides the activations by it before quantizing them;
- `X.weight_proj_down` (K, R) and `X.weight_proj_up` (N, R) float: the low-rank branch, on the raw input.

The runtime computes out = (x / smooth) @ (codes * scales).T + x @ proj_down @ proj_up.T + bias, so the dense
weight is W[n, k] = codes[n, k] * scale[k // 64, n] * (1 / smooth[k]) + (proj_down @ proj_up.T)[k, n], in fp32
(the scales' dtype is the model's). comfy-kitchen's own dequantize (the kernel applied to an identity input)
also quantizes the identity's activations, which adds one fp32 rounding (7 * ((1 / s) / 7)): the two agree
within fp32 rounding, bit for bit where that product is exact. Layers marked `"act_unsigned": true`
(nunchaku's post-GELU fc2) get x + 0.171875 on the quantized path, which the dense layer can only hold in its
bias: their `X.bias` decodes to bias + 0.171875 * sum_k codes * scale / smooth (a layer without a bias is
refused). The group size is comfy-kitchen's fixed 64; a config naming another is refused.

`merge-lora --keep-format` bakes a LoRA into the low-rank branch instead of re-quantizing: proj_down gains the
LoRA's down factor as new columns and proj_up its up factor (times ratio * alpha / rank), so the rank grows by
the LoRA's and the effective weight is the base's plus the LoRA's delta exactly (the new factor columns are
rounded once to the stored dtype: exact where they are representable in it, as bf16 LoRAs in a bf16 base with
a power-of-two scale are). Codes, scales, smoothing and the stored columns of the factors are kept byte for
byte. Only LoRA modules can be baked this way (LoHa, LoKr, full deltas, DoRA and model merges are refused).

comfy-kitchen's tile-packed layout (`kitchen_tile_packed_w4a4`, blocks of 128 outputs) is the same format: no
metadata says it, the tensors' rank does, each on its own, as comfy-kitchen's eager kernel reads them
(`_tile_packed_weight_to_row_major` / `_tile_packed_scales_to_natural` / `_tile_packed_lora_up_to_natural`):
`X.weight` (N/128, K/64, 32, 128) int8, `X.weight_scale` (N/128, K/64, 128), `X.weight_proj_up` (N/128, R, 128);
proj_down and the smoothing stay natural. Such tensors are read through natural views (`TilePacked`), so decoding is
the natural layout's; a LoRA bake appends its up factor along the tile-packed proj_up's rank axis (R -> R + r), which
the layout allows: proj_up stays tile-packed and its stored bytes are kept.

Not decoded (refused by name): nunchaku's own files (`qweight`/`wscales`, a tile-swizzled int4 order that no CPU
reference decodes).
"""

from __future__ import annotations

from ckpt.lazy import torch

from ckpt.errors import CkptError
from ckpt.io.plan import OutTensor
from ckpt.io.tensors import ComputedTensor, Tensor, read_rows
from ckpt.io.wrapper import Wrapper
from ckpt.quant.common import DecodeContext, companion, float_scale, read_columns, refuse, st_name
from ckpt.quant.encoding import Encoding, NoEncoder
from ckpt.quant.formats import Format

NAME = "svdquant_w4a4"  # the comfy_quant format
GROUP = 64  # comfy-kitchen's int4 group size (inputs per weight scale)
SHIFT = 0.171875  # comfy-kitchen's (and nunchaku's) shift of an act_unsigned layer's quantized activations
TILE = 128  # outputs per tile of comfy-kitchen's tile-packed layout (`_TILE_PACKED_BLOCK_N`)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """(rows, K/2) bytes -> (rows, K) signed int4 values as float32, the low nibble first (comfy-kitchen's
    row-major packing)."""
    x = packed.contiguous().view(torch.uint8).to(torch.int16)
    v = torch.stack((x & 0x0F, x >> 4), dim=-1).reshape(packed.shape[0], -1)
    return torch.where(v >= 8, v - 16, v).to(torch.float32)


class TilePacked(Wrapper):
    """A tile-packed tensor read as its natural layout: `X.weight` (N/128, K/64, 32, 128) as (N, K/2), `X.weight_scale`
    (N/128, K/64, 128) as (K/64, N) (read whole: it is small), `X.weight_proj_up` (N/128, R, 128) as (N, R). Row
    bands of the codes and proj_up read only the tiles that hold them."""

    row_align = 1

    def __init__(self, base: Tensor, role: str):
        self.base, self.role, self.name, self.home, self.dtype = base, role, base.name, base.home, base.dtype
        s = tuple(base.shape)
        self.shape = {"codes": (s[0] * TILE, s[1] * GROUP // 2), "scale": (s[1], s[0] * TILE),
                      "up": (s[0] * TILE, s[1])}[role]

    def read(self, start, stop, device, scratch=None):
        if self.role == "scale":
            t = read_rows(self.base, 0, self.base.shape[0], device)
            return t.permute(1, 0, 2).reshape(self.shape)[start:stop]
        a, b = start // TILE, -(-stop // TILE)
        t = read_rows(self.base, a, b, device)
        if self.role == "codes":  # (tiles, K/64, 32 quads, 4 rows x 32 bytes) -> (rows, K/2)
            t = t.view(b - a, t.shape[1], TILE // 4, 4, GROUP // 2).permute(0, 2, 3, 1, 4)
        else:  # (tiles, R, 128) -> (rows, R)
            t = t.permute(0, 2, 1)
        t = t.reshape((b - a) * TILE, -1)
        return t[start - a * TILE: stop - a * TILE]


def tile_pack_up(up: torch.Tensor) -> torch.Tensor:
    """A natural proj_up (N, R) in the tile-packed layout (N/128, R, 128): the inverse of `TilePacked`'s view."""
    return up.reshape(up.shape[0] // TILE, TILE, up.shape[1]).permute(0, 2, 1).contiguous()


class SvdQuantWeight(Wrapper):
    """The dense weight of one SVDQuant W4A4 layer (module docstring), float32, read in row (output) bands:
    a band reads its rows of the codes and of proj_up, its columns of the scales, and all of proj_down and
    the smoothing (K and K x R values)."""

    def __init__(self, name: str, codes: Tensor, scale: Tensor, smooth: Tensor, down: Tensor, up: Tensor,
                 act_unsigned: bool):
        self.name, self.base, self.scale, self.smooth, self.down, self.up = name, codes, scale, smooth, down, up
        self.shape, self.home, self.dtype = (codes.shape[0], codes.shape[1] * 2), codes.home, torch.float32
        self.natural, self.row_align = scale.dtype, 1
        self.rank, self.act_unsigned = down.shape[1], act_unsigned

    def main(self, start, stop, device, scratch=None) -> torch.Tensor:
        """Rows [start, stop) of codes * scales / smooth (the quantized path), float32."""
        codes = unpack_int4(self.base.read(start, stop, device, scratch))
        n, k = codes.shape
        s = read_columns(self.scale, start, stop, device).to(torch.float32)  # (K/64, n)
        w = (codes.view(n, k // GROUP, GROUP) * s.t().unsqueeze(-1)).view(n, k)
        return w * (1.0 / self.smooth.read_all(device).to(torch.float32))

    def low_rank(self, start, stop, device, down=None, up=None) -> torch.Tensor:
        """Rows [start, stop) of proj_up @ proj_down.T in float32, summed as comfy-kitchen sums it
        (proj_down @ proj_up.T, transposed); `down`/`up` in place of the stored factors (a baked LoRA)."""
        down = (self.down.read_all(device) if down is None else down).to(torch.float32)
        up = (read_rows(self.up, start, stop, device) if up is None else up[start:stop]).to(torch.float32)
        return (down @ up.t()).t()

    def read(self, start, stop, device, scratch=None):
        return self.main(start, stop, device, scratch) + self.low_rank(start, stop, device)


class ShiftedBias(Wrapper):
    """The bias of an act_unsigned layer as the dense layer needs it: stored bias + SHIFT * each row's sum of
    codes * scales / smooth (the runtime's shifted activations, through the quantized path only)."""

    def __init__(self, bias: Tensor, weight: SvdQuantWeight):
        self.base, self.weight, self.name, self.home = bias, weight, bias.name, bias.home
        self.shape, self.dtype, self.natural, self.row_align = tuple(bias.shape), torch.float32, bias.dtype, 1

    def read(self, start, stop, device, scratch=None):
        b = self.base.read(start, stop, device).to(torch.float32)
        return b + SHIFT * self.weight.main(start, stop, device).sum(dim=1)


def _flag(conf: dict, key: str, default=None):
    """A layer setting, at the top of its config or under `params` (ComfyUI reads both)."""
    params = conf.get("params") if isinstance(conf.get("params"), dict) else {}
    return conf.get(key, params.get(key, default))


def decode_layer(ctx: DecodeContext, layer: str, conf: dict, wkey: str, w: Tensor,
                 consumed: dict[str, str]) -> dict[str, Tensor]:
    """The logical tensors of one svdquant_w4a4 layer (its weight, and an act_unsigned layer's bias), every
    stored part checked (dtype, shape, rank) and consumed."""
    def bad(key, problem):
        return refuse(ctx, key, f"comfy_quant layer {layer!r} ({NAME}): {problem}")

    tiled = len(w.shape) == 4
    if tiled and (w.dtype not in (torch.int8, torch.uint8) or tuple(w.shape[2:]) != (TILE // 4, 4 * GROUP // 2)
                  or 0 in w.shape):
        raise bad(wkey, f"{wkey!r} is {st_name(w.dtype)} {list(w.shape)}; expected comfy-kitchen's tile-packed I8 "
                        f"[out / {TILE}, in / {GROUP}, {TILE // 4}, {4 * GROUP // 2}]")
    if not tiled and (w.dtype not in (torch.int8, torch.uint8) or len(w.shape) != 2):
        raise bad(wkey, f"{wkey!r} is {st_name(w.dtype)} {list(w.shape)}; expected I8 [out, in / 2] (two int4 "
                        "codes per byte) or the tile-packed [out / 128, in / 64, 32, 128]")
    group = _flag(conf, "group_size", GROUP)
    if group != GROUP:
        raise bad(wkey, f"group_size {str(group)[:20]} is not comfy-kitchen's {GROUP}")
    unsigned = _flag(conf, "act_unsigned", False)
    if not isinstance(unsigned, bool):
        raise bad(wkey, f"act_unsigned is {str(unsigned)[:20]!r}, not true or false")
    n, k = (w.shape[0] * TILE, w.shape[1] * GROUP) if tiled else (w.shape[0], w.shape[1] * 2)
    if k % GROUP:
        raise bad(wkey, f"{wkey!r} holds {k} inputs, which the group size {GROUP} does not divide")
    keys = {role: f"{layer}.weight_{role}" for role in ("scale", "smooth_factor", "proj_down", "proj_up")}
    # each of codes, scales and proj_up natural or tile-packed on its own, as comfy-kitchen's kernel reads them
    st = ctx.remaining.get(keys["scale"])
    scale_tiled = st is not None and len(st.shape) == 3 and n % TILE == 0
    scale = companion(ctx, keys["scale"], f"{NAME} group scales of {wkey!r}", dtypes=float_scale,
                      shape=(n // TILE, k // GROUP, TILE) if scale_tiled else (k // GROUP, n))
    smooth = companion(ctx, keys["smooth_factor"], f"{NAME} smoothing of {wkey!r}", dtypes=float_scale, shape=(k,))
    down = companion(ctx, keys["proj_down"], f"{NAME} low-rank down projection of {wkey!r}", dtypes=float_scale)
    up = companion(ctx, keys["proj_up"], f"{NAME} low-rank up projection of {wkey!r}", dtypes=float_scale)
    if len(down.shape) != 2 or down.shape[0] != k:
        raise bad(keys["proj_down"], f"{keys['proj_down']!r} is {list(down.shape)}; expected [{k}, rank]")
    up_tiled = len(up.shape) == 3 and n % TILE == 0
    if up_tiled and (up.shape[0] != n // TILE or up.shape[2] != TILE):
        raise bad(keys["proj_up"], f"{keys['proj_up']!r} is {list(up.shape)}; expected the tile-packed "
                                   f"[{n // TILE}, rank, {TILE}]")
    if not up_tiled and (len(up.shape) != 2 or up.shape[0] != n):
        raise bad(keys["proj_up"], f"{keys['proj_up']!r} is {list(up.shape)}; expected [{n}, rank]")
    rank_up = up.shape[1]
    if rank_up != down.shape[1]:
        raise bad(keys["proj_up"], f"rank mismatch: proj_down has rank {down.shape[1]}, proj_up {rank_up}")
    t = SvdQuantWeight(wkey, TilePacked(w, "codes") if tiled else w, TilePacked(scale, "scale") if scale_tiled
                       else scale, smooth, down, TilePacked(up, "up") if up_tiled else up, unsigned)
    t.encoding = LoraBakeEncoding(t)
    consumed.update({keys["scale"]: f"group scales of {wkey}", keys["smooth_factor"]: f"input smoothing of {wkey}",
                     keys["proj_down"]: f"low-rank branch of {wkey} (added into it)",
                     keys["proj_up"]: f"low-rank branch of {wkey} (added into it)"})
    out = {wkey: t}
    if unsigned:
        bkey = f"{layer}.bias"
        bias = ctx.remaining.get(bkey)
        if bias is None:
            raise bad(wkey, f"act_unsigned layer has no bias {bkey!r} to hold the runtime's activation shift")
        companion(ctx, bkey, f"bias of {wkey!r}", dtypes=float_scale, shape=(n,))
        b = ShiftedBias(bias, t)
        b.encoding = NoEncoder(f"comfy_quant {NAME} bias", "the bias of an act_unsigned SVDQuant layer holds the "
                                                           "runtime's activation shift; ckpt does not re-encode a "
                                                           "changed one")
        out[bkey] = b
    return out


# ---------------------------------------------------------------------------------------------------
# merge-lora --keep-format: the LoRA baked into the low-rank branch


class LoraBakeEncoding(Encoding):
    """A LoRA merged into an SVDQuant layer, stored as SVDQuant: the LoRA's factors appended to proj_down /
    proj_up (module docstring); `resizes`: those two keys grow by the LoRA's rank. The requantization meter
    compares the merged fp32 weight with the one the written factors give, band by band."""

    resizes = True

    def __init__(self, weight: SvdQuantWeight):
        self.weight = weight
        layer = weight.name[: -len(".weight")] if weight.name.endswith(".weight") else weight.name
        self.keys = (f"{layer}.weight_proj_down", f"{layer}.weight_proj_up")
        self.label = f"comfy_quant {NAME} (low-rank bake)"

    def factors(self, value) -> tuple[torch.Tensor, torch.Tensor]:
        """The merge's patches as (up [N, r], down [r, K]) in float32, the ratio and scale in `up`."""
        w = self.weight
        patches = getattr(value, "patches", None)
        if patches is None or getattr(value, "base", None) is not w:
            raise CkptError(f"--keep-format: {w.name} is an SVDQuant layer, which keeps its format only when a LoRA "
                            "is baked into its low-rank branch (merge without --keep-format for a dense file); "
                            "nothing was written")
        cpu = torch.device("cpu")
        ups, downs = [], []
        for p in patches:
            a = p.adapter
            why = ("a DoRA module" if getattr(a, "dora", None) is not None else
                   "a module applied through a layout transform" if p.transform is not None else
                   f"a {a.kind} module" if not hasattr(a, "factors") else None)
            if why:
                raise CkptError(f"--keep-format: {w.name} (SVDQuant) takes only plain LoRA factors into its low-rank "
                                f"branch; {a.module.name!r} is {why}; nothing was written")
            a.device = cpu
            up, down = a.factors()
            r0, r1 = p.rows or (0, w.shape[0])
            full = torch.zeros((w.shape[0], up.shape[1]), dtype=torch.float32)
            full[r0:r1] = up[p.offset: p.offset + r1 - r0] * (p.ratio * a.scale)
            ups.append(full)
            downs.append(down.reshape(down.shape[0], -1))
            a.release()
        return torch.cat(ups, dim=1), torch.cat(downs, dim=0)

    def encode(self, value: Tensor, report, meter) -> list[OutTensor]:
        w = self.weight
        cpu = torch.device("cpu")
        r_new = w.rank + self.factors(value)[0].shape[1]  # refuses here, before anything is written
        made: dict[str, torch.Tensor] = {}

        def both():
            """The grown factors (made once, when the first of the two keys is written), and the meter's pass."""
            if not made:
                up, down = self.factors(value)
                d, u = w.down.read_all(cpu), w.up.read_all(cpu)
                made["down"] = torch.cat((d, down.t().to(d.dtype)), dim=1)
                made["up"] = torch.cat((u, up.to(u.dtype)), dim=1)
                step = max(1, (1 << 20) // max(1, w.shape[1]))
                for a in range(0, w.shape[0], step):
                    b = min(w.shape[0], a + step)
                    meter.add(value.read(a, b, cpu), w.main(a, b, cpu) + w.low_rank(a, b, cpu, made["down"], made["up"]))
                if tiled:  # written as stored: the new columns appended along the tile-packed rank axis
                    made["up"] = tile_pack_up(made["up"])
            return made

        tiled = isinstance(w.up, TilePacked)
        up_shape = (w.shape[0] // TILE, r_new, TILE) if tiled else (w.shape[0], r_new)
        out = []
        for key, role, shape, dtype in ((self.keys[0], "down", (w.shape[1], r_new), w.down.dtype),
                                        (self.keys[1], "up", up_shape, w.up.dtype)):
            src = ComputedTensor(key, lambda role=role: both()[role], dtype, shape, home=w.home)
            out.append(OutTensor(key, dtype, shape, src))
        return out


def inspect_settings(t, config) -> dict:
    """What `ckpt inspect` says of an SVDQuant layer: W4A4, group 64, its low-rank branch's rank."""
    s = {"format": "SVDQuant", "type": "W4A4", "bits": 4, "group_size": GROUP, "rank": t.rank}
    s |= {"layout": "tile-packed"} if isinstance(t.base, TilePacked) else {}
    return s | ({"act_unsigned": True} if t.act_unsigned else {})


# Decoded by comfy_quant's decoder (the layers are comfy_quant layers); registered for its weights and settings.
FORMAT = Format("svdquant", "SVDQuant W4A4 (comfy_quant)", 31, (), weights=(SvdQuantWeight,),
                settings=inspect_settings)
