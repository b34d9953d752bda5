"""AWQ integer packs (AutoAWQ; transformers and vLLM read the same files) decoded back to plain Linear weights.

AutoAWQ writes 4-bit codes with zero points, a Linear `X` (out features N, in features K, group size g,
G = K / g groups) in one of two packings, named by config.json `quantization_config.version`:
- GEMM (`version: gemm`, nearly every AWQ model on the hub): `X.qweight` int32 [K, N / 8], eight outputs per
  word in the interleaved nibble order [0, 2, 4, 6, 1, 3, 5, 7] (nibble i holds output 8c + order[i]);
  `X.qzeros` int32 [G, N / 8] packed the same way; `X.scales` fp16 [G, N].
- GEMV (`version: gemv`): `X.qweight` int32 [N, K / 8], eight inputs per word in natural order; `X.qzeros`
  int32 [N, w] and `X.scales` fp16 [N, 8 w], with w = `calculate_zeros_width(K, g)`: ceil(G / 8) rounded up
  to a multiple of 2 (g = 64) or 4 (g = 32); the columns past G are AutoAWQ's zero padding, read past.
W[n, k] = scales[k / g, n] * (q[k, n] - z[k / g, n]) (GEMV: indexed [n, k / g]), zero points stored as they
are (no offset), each field masked to 4 bits (AutoAWQ's packer does not clamp, its dequantizer masks). The
value is computed as AutoAWQ's `dequantize_gemm` computes it, `(iweight - izeros) * scales` in fp16: the
product is exact in float32, so one rounding to the scales' dtype gives its bits. AutoAWQ has no CPU GEMV
dequantizer; GEMV decodes by the same formula on `WQLinear_GEMV.from_linear`'s layout.

Config: config.json `quantization_config` (`quant_method: awq`, `bits`, `group_size`, `zero_point`,
`version`) or older AutoAWQ's `quant_config.json` (`w_bit`, `q_group_size`, `zero_point`, `version`).
Refused by name: other versions (GEMVFast, Marlin, exllama/ipex repacks are kernels' layouts), bits other
than 4, and `zero_point: false` (AutoAWQ writes no such checkpoint).

Bands: GEMM output rows are columns of every stored tensor (read with `common.read_columns`: only the words of the
band); GEMV output rows are stored rows.

`merge-lora --keep-format` (the weights' `encoding`, `ckpt.quant.int_pack_encode`): a changed weight keeps its
scales and qzeros as stored; only `qweight` is written again, each code clamp(round(W / scale) + zero, 0, 15)
on that grid (AutoAWQ's `pseudo_quantize_tensor`), packed as `from_linear` packs (GEMM's interleave; GEMV in
order). GEMM's `qweight` holds output rows as columns, so it is encoded per whole tensor (memory: the packed
tensor plus one band); GEMV band by band.
"""

from __future__ import annotations

from ckpt.lazy import torch

from ckpt.errors import CkptError
from ckpt.io.tensors import Tensor
from ckpt.io.wrapper import Wrapper
from ckpt.quant.common import DecodeContext, Decoded, companion, method_config, read_columns, refuse
from ckpt.quant.formats import Format
from ckpt.quant.int_pack_decode import CACHE_BAND, InputGroups, compute_dtype, unpack_codes

SIDE_CONFIG = "quant_config.json"  # AutoAWQ < 0.1.7 saved its config beside the weights
ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ GEMM: nibble i holds output order[i] of its word
REVERSE = (0, 4, 1, 5, 2, 6, 3, 7)  # output j sits in nibble REVERSE[j]
LAYOUTS = ("gemm", "gemv")


def zeros_width(k: int, group: int) -> int:
    """AutoAWQ's `calculate_zeros_width`: int32 words of GEMV zero points per output row."""
    mult = 1 if group >= 128 else {64: 2, 32: 4}.get(group)
    if mult is None:
        raise ValueError(group)
    base = -(-(k // group) // 8)
    return -(-base // mult) * mult


def _gemm_codes(words: torch.Tensor) -> torch.Tensor:
    """GEMM words [R, C] (eight outputs per word, interleaved) -> the codes of its 8 C outputs, [8 C, R] uint8:
    output 8 c + j is field REVERSE[j] of word column c. The words are transposed first (a quarter of the bytes
    of the codes), each field shifted out straight into uint8."""
    wt = words.T.contiguous()
    out = torch.empty((wt.shape[0], 8, wt.shape[1]), dtype=torch.uint8, device=words.device)
    for j, field in enumerate(REVERSE):
        torch.bitwise_right_shift(wt, 4 * field, out=out[:, j])  # the low byte: masked below
    return out.bitwise_and_(15).reshape(-1, wt.shape[1])


def _gemv_codes(words: torch.Tensor, n: int) -> torch.Tensor:
    """GEMV words [R, C] (eight inputs per word, in order) -> the first n codes of each row, uint8 [R, n]."""
    return unpack_codes(words, 4, n)


class AwqGemmWeight(Wrapper):
    """W [N, K] of an AutoAWQ GEMM Linear; `base` is `qweight` [K, N / 8]."""

    row_align = 1

    def __init__(self, name: str, qweight: Tensor, qzeros: Tensor, scales: Tensor, group: int):
        self.name, self.base, self.qzeros, self.scales, self.group = name, qweight, qzeros, scales, group
        self.shape, self.home = (qweight.shape[1] * 8, qweight.shape[0]), qweight.home
        self.dtype = self.natural = scales.dtype
        self.band_elems, self.groups = CACHE_BAND, InputGroups.in_order(self.shape[1], group)

    @property
    def encoding(self):
        from ckpt.quant.int_pack_encode import IntGridEncoding, pack_rows

        def store(codes):  # [n, K] -> [K, n / 8]: eight outputs per word, interleaved
            k = codes.shape[1]
            return pack_rows(codes.T.reshape(k, -1, 8)[:, :, list(ORDER)].reshape(k, -1), 4)

        return IntGridEncoding(self, "AWQ 4-bit GEMM", self.base, 4, 0, 15, store, per_column=8)

    def grid(self, start, stop, device) -> tuple[torch.Tensor, torch.Tensor]:
        """(scale fp32, zero int32), each [n, K], of outputs [start, stop): the stored grid `encoding` keeps."""
        w0, w1 = start // 8, -(-stop // 8)
        z = _gemm_codes(read_columns(self.qzeros, w0, w1, device))[start - 8 * w0: stop - 8 * w0].to(torch.int32)
        g = torch.arange(self.shape[1], device=device) // self.group
        return read_columns(self.scales, start, stop, device).to(torch.float32).T[:, g], z[:, g]

    def read(self, start, stop, device, scratch=None):
        """Codes [n, K] from the band's word columns transposed, then (q - z) * s per group
        (`ckpt.quant.int_pack_decode`)."""
        w0, w1 = start // 8, -(-stop // 8)
        a, b = start - 8 * w0, stop - 8 * w0
        q = _gemm_codes(read_columns(self.base, w0, w1, device))[a:b]  # [n, K]
        z = _gemm_codes(read_columns(self.qzeros, w0, w1, device))[a:b]  # [n, G]
        s = read_columns(self.scales, start, stop, device).T  # [n, G]
        return self.groups.dequantize(q, z, s, compute_dtype(s.dtype)).to(self.dtype)


class AwqGemvWeight(Wrapper):
    """W [N, K] of an AutoAWQ GEMV Linear; `base` is `qweight` [N, K / 8] (rows are output rows)."""

    row_align = 1

    def __init__(self, name: str, qweight: Tensor, qzeros: Tensor, scales: Tensor, group: int):
        self.name, self.base, self.qzeros, self.scales, self.group = name, qweight, qzeros, scales, group
        self.shape, self.home = (qweight.shape[0], qweight.shape[1] * 8), qweight.home
        self.dtype = self.natural = scales.dtype
        self.band_elems, self.groups = CACHE_BAND, InputGroups.in_order(self.shape[1], group)

    @property
    def encoding(self):
        from ckpt.quant.int_pack_encode import IntGridEncoding, pack_rows

        return IntGridEncoding(self, "AWQ 4-bit GEMV", self.base, 4, 0, 15, lambda codes: pack_rows(codes, 4))

    def grid(self, start, stop, device) -> tuple[torch.Tensor, torch.Tensor]:
        """(scale fp32, zero int32), each [n, K], of outputs [start, stop) (the padding columns read past)."""
        groups = self.shape[1] // self.group
        g = torch.arange(self.shape[1], device=device) // self.group
        z = _gemv_codes(self.qzeros.read(start, stop, device), groups).to(torch.int32)
        return self.scales.read(start, stop, device)[:, :groups].to(torch.float32)[:, g], z[:, g]

    def read(self, start, stop, device, scratch=None):
        """Codes [n, K] unpacked along the rows, then (q - z) * s per group (`ckpt.quant.int_pack_decode`); the
        zero points' and scales' padding columns are read past."""
        k = self.shape[1]
        groups = k // self.group
        q = _gemv_codes(self.base.read(start, stop, device, scratch), k)  # [n, K]
        z = _gemv_codes(self.qzeros.read(start, stop, device), groups)  # [n, G]
        s = self.scales.read(start, stop, device)[:, :groups]
        return self.groups.dequantize(q, z, s, compute_dtype(s.dtype)).to(self.dtype)


def awq_config(ctx: DecodeContext) -> tuple[dict, str] | None:
    """(bits, group_size, zero_point, version) as a dict, and where it came from; None when no config names
    AWQ."""
    found = method_config(ctx, "awq", SIDE_CONFIG, "an AutoAWQ quant config",
                          lambda cfg: "w_bit" in cfg or str(cfg.get("quant_method", "")).lower() == "awq")
    if found is None or found[1] == "config.json quantization_config":
        return found
    cfg, where = found  # AutoAWQ's own older names
    return {"bits": cfg.get("w_bit", cfg.get("bits")), "group_size": cfg.get("q_group_size", cfg.get("group_size")),
            "zero_point": cfg.get("zero_point", True), "version": cfg.get("version", "gemm")}, where


def _settings(cfg: dict, where: str) -> tuple[int, str]:
    version = str(cfg.get("version") or "gemm").lower()
    if version not in LAYOUTS:
        raise CkptError(f"{where}: AWQ version {version!r} is not a layout ckpt decodes (gemm, gemv); "
                        "nothing was written")
    bits = cfg.get("bits", 4)
    if bits != 4 or isinstance(bits, bool):
        raise CkptError(f"{where}: AWQ bits {bits!r} is not supported (AutoAWQ writes 4 bits); nothing was written")
    if cfg.get("zero_point", True) is False:
        raise CkptError(f"{where}: AWQ zero_point false is not supported (AutoAWQ writes zero points); "
                        "nothing was written")
    group = cfg.get("group_size", 128)
    if isinstance(group, bool) or not isinstance(group, int) or (group != -1 and group <= 0):
        raise CkptError(f"{where}: AWQ group_size {group!r} is neither -1 nor positive; nothing was written")
    return group, version


def decode(ctx: DecodeContext) -> Decoded | None:
    """Every `X.qweight` of an AWQ checkpoint becomes `X.weight`, its qzeros and scales consumed, each shape
    checked against the others and the config before anything is read."""
    found = awq_config(ctx)
    layers = [k[: -len(".qweight")] for k in ctx.remaining if k.endswith(".qweight")]
    if found is None or not layers:
        return None
    cfg, where = found
    group, version = _settings(cfg, where)
    for key in ctx.remaining:
        if key.endswith((".qzeros", ".g_idx")) and key.rsplit(".", 1)[0] not in layers:
            raise refuse(ctx, key, f"AWQ {key!r} has no {key.rsplit('.', 1)[0] + '.qweight'!r}")
    tensors, consumed, anchors = {}, {}, {}
    for layer in layers:
        qk, zk, sk = (f"{layer}.{s}" for s in ("qweight", "qzeros", "scales"))
        if f"{layer}.g_idx" in ctx.remaining:
            raise refuse(ctx, f"{layer}.g_idx", f"{layer + '.g_idx'!r} is a GPTQ group index, but the config says AWQ")
        qw = companion(ctx, qk, "AWQ packed weight", dtypes=(torch.int32,))
        if len(qw.shape) != 2:
            raise refuse(ctx, qk, f"AWQ packed weight {qk!r} is {list(qw.shape)}; expected 2-D")
        if version == "gemm":
            k, n = qw.shape[0], qw.shape[1] * 8
        else:
            n, k = qw.shape[0], qw.shape[1] * 8
        gs = k if group == -1 else group
        if k % gs:
            raise refuse(ctx, qk, f"AWQ {layer!r}: {k} inputs are not whole groups of {gs}")
        groups = k // gs
        if version == "gemm":
            companion(ctx, sk, f"AWQ scales of {layer!r}", dtypes=(torch.float16, torch.bfloat16, torch.float32),
                      shape=(groups, n))
            companion(ctx, zk, f"AWQ zero points of {layer!r}", dtypes=(torch.int32,), shape=(groups, n // 8))
            cls = AwqGemmWeight
        else:
            try:
                zw = zeros_width(k, gs)
            except ValueError:
                raise refuse(ctx, qk, f"AWQ GEMV {layer!r}: group size {gs} has no AutoAWQ GEMV layout "
                                      "(32, 64 or 128 and up)") from None
            companion(ctx, sk, f"AWQ scales of {layer!r}", dtypes=(torch.float16, torch.bfloat16, torch.float32),
                      shape=(n, zw * 8))
            companion(ctx, zk, f"AWQ zero points of {layer!r}", dtypes=(torch.int32,), shape=(n, zw))
            cls = AwqGemvWeight
        name = f"{layer}.weight"
        if name in ctx.remaining:
            raise refuse(ctx, name, f"AWQ layer {layer!r} has both a plain {name!r} and packed {qk!r}")
        tensors[name] = cls(name, qw, ctx.remaining[zk], ctx.remaining[sk], gs)
        anchors[qk] = name
        consumed[qk] = f"packed 4-bit codes of {name}"
        consumed[zk] = f"zero points of {name}"
        consumed[sk] = f"scales of {name}"
    notes = [f"AWQ: decoded {len(tensors)} 4-bit {version.upper()} layer{'s' if len(tensors) != 1 else ''} ({where})"]
    return Decoded(f"AWQ 4-bit {version.upper()}", tensors, consumed, notes=notes, anchors=anchors)


def inspect_settings(t, config) -> dict:
    """What `ckpt inspect` says of a decoded AWQ weight (always 4-bit with zero points)."""
    return {"format": "AWQ", "bits": 4, "group_size": t.group, "sym": False,
            "version": "GEMM" if isinstance(t, AwqGemmWeight) else "GEMV"}

FORMAT = Format("awq", "AWQ", 100, (decode,), weights=(AwqGemmWeight, AwqGemvWeight), settings=inspect_settings,
                llm=True)
