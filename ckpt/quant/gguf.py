"""GGUF blocks <-> logical tensors: the decoder of `.gguf` files and the block encoder of `--to gguf-*`.

Values are `gguf.quants.dequantize` / `gguf.quants.quantize` of llama.cpp's own Python package, so every
type it knows decodes (F32, F16, BF16, Q4_0/1, Q5_0/1, Q8_0, the K-quants, the IQ-quants, TQ, MXFP4,
NVFP4), bit for bit as gguf does, and every type it can encode is written exactly as gguf writes it.
Dequantized values are float32 and rounded once to the output dtype by the caller's cast.

Bands: GGUF blocks run along the innermost dimension and a row's length is a multiple of the block
size, so a band of whole rows is a whole number of blocks. A tensor whose logical shape differs from
its stored shape (ComfyUI-GGUF's SD1/SDXL reshapes, recorded in `comfy.gguf.orig_shape.<name>`) is
read in bands that start on a stored row: `row_align` makes sure of it.

Two kinds of GGUF are read (`decode`):
- diffusion models (ComfyUI-GGUF layout): tensors keep the model's own names (original BFL/SAI/Wan
  layout); `general.architecture` says flux, sd3, wan... ; orig_shape metadata restores reshaped tensors;
- llama.cpp LLMs: `blk.N.attn_q.weight` names, mapped to Hugging Face names (ckpt.quant.gguf_llm).
"""

from __future__ import annotations

import math
import os
import threading
from collections import Counter

from ckpt.lazy import numpy as np, torch

from ckpt.errors import CkptError, file_error
from ckpt.dtypes import ST_TO_TORCH
from ckpt.io.ggml_types import block_size, plain_names, plain_types, type_name
from ckpt.io.gguf import GGUFStored
from ckpt.io.header import read_into
from ckpt.io.tensors import Tensor
from ckpt.io.wrapper import Wrapper
from ckpt.quant.encoding import Encoding
from ckpt.quant.common import DecodeContext, Decoded
from ckpt.report import plural
from ckpt.quant.formats import Format

ORIG_SHAPE = "comfy.gguf.orig_shape."  # ComfyUI-GGUF: original torch shape of a reshaped tensor


def _gguf():
    """The gguf package, with the types it lacks added (`ckpt.io.ggml_types.gguf_package`)."""
    from ckpt.io.ggml_types import gguf_package

    return gguf_package()


class GGUFValues(Tensor):
    """The values of one stored GGUF tensor, seen with `shape` (its stored shape, or the original shape
    ComfyUI-GGUF recorded): plain types as they are stored, block types dequantized by gguf in float32."""

    def __init__(self, stored: GGUFStored, shape=None, natural: str = "BF16", name: str | None = None):
        """`natural`: the safetensors dtype name block types are written as by default (dtypes by name
        here, so that planning and inspect need no torch)."""
        self.stored, self.ggml_type = stored, stored.ggml_type
        self.name, self.home = name or stored.name, stored.home
        self.shape = tuple(stored.stored_shape if shape is None else shape)
        plain = plain_names().get(self.ggml_type)
        self._dtype_name = plain or "F32"  # block types dequantize to float32
        self._natural = plain or natural
        self.row_len = stored.stored_shape[-1] if stored.stored_shape else 1  # elements per stored row
        if not self.shape or self.numel == 0:
            self.row_align = None
        else:
            per_row = math.prod(self.shape[1:])
            self.row_align = self.row_len // math.gcd(per_row, self.row_len)

    @property
    def dtype(self) -> torch.dtype:
        return ST_TO_TORCH[self._dtype_name]

    @property
    def dtype_name(self) -> str:
        return self._dtype_name

    @property
    def natural_dtype(self):
        return ST_TO_TORCH[self._natural]

    @property
    def source_bytes(self):
        return self.stored.info.nbytes

    @property
    def type_name(self) -> str:
        return type_name(self.ggml_type)

    @property
    def encoding(self):
        """A new value stored as this tensor is: same name, type and stored shape (`GGUFEncoding`)."""
        return GGUFEncoding(self.stored)

    def read(self, start, stop, device, scratch=None):
        out_shape = (stop - start, *self.shape[1:]) if self.shape else ()
        if self.numel == 0:  # a dim of 0 (ggml allows it; gguf reads it as an empty array): nothing to read
            return torch.empty(out_shape, dtype=self.dtype, device=device)
        per_row = math.prod(self.shape[1:]) if self.shape else 1
        e0, e1 = (start * per_row, stop * per_row) if self.shape else (0, 1)
        blk, size = block_size(self.ggml_type)
        if e0 % self.row_len or (e1 % self.row_len and e1 != self.numel):
            raise ValueError(f"{self.name}: band {start}:{stop} does not start on a stored row")
        b0, b1 = e0 // blk * size, e1 // blk * size
        n = b1 - b0
        buf = scratch.get("raw", n)[:n] if scratch is not None else torch.empty(n, dtype=torch.uint8)
        if n:
            info = self.stored.info
            read_into(self.stored.handles.fd(info.path), memoryview(buf.numpy()), info.start + b0, info.path)
        if self.ggml_type in plain_types():
            vals = buf.view(self.dtype)
        else:
            vals = dequantize(buf, self.ggml_type, self.row_len)
        vals = vals.reshape(out_shape)
        return vals if device.type == "cpu" else vals.to(device)


# Values per call of gguf's (de)quantize. Its dequantize keeps every 16-row piece of its result and then
# their concatenation (two copies of a band's fp32 values), and the ErrorMeter widens what it measures to
# float64: done per band, these temporaries were most of `merge-lora --keep-format`'s peak memory on a
# GGUF base (about 8 fp32 bands over a plain merge). In chunks of rows they stay a few MB.
CHUNK_ELEMS = 1 << 20


def _row_chunks(n_rows: int, row_len: int):
    step = max(1, CHUNK_ELEMS // max(1, row_len))
    for a in range(0, n_rows, step):
        yield a, min(n_rows, a + step)


def dequantize(raw: torch.Tensor, ggml_type: int, row_len: int) -> torch.Tensor:
    """uint8 blocks (whole rows of `row_len` elements) -> float32 values, by gguf's own dequantize (ckpt's for
    the types it cannot decode: `ckpt.quant.ggml_dequant_extra`), a chunk of rows at a time into one output
    (`CHUNK_ELEMS`)."""
    from ckpt.quant.ggml_dequant_extra import DEQUANTIZE

    blk, size = block_size(ggml_type)
    if raw.numel() == 0:
        return torch.empty(0, dtype=torch.float32)
    rows = raw.numpy().reshape(-1, row_len // blk * size)
    out = torch.empty(rows.shape[0] * row_len, dtype=torch.float32)
    values = out.numpy().reshape(-1, row_len)
    ours = DEQUANTIZE.get(type_name(ggml_type))
    with np.errstate(invalid="ignore", over="ignore"):  # NaN/Inf blocks (counted where they were encoded)
        for a, b in _row_chunks(rows.shape[0], row_len):
            if ours is not None:
                values[a:b] = ours(rows[a:b]).reshape(b - a, row_len)
            else:
                values[a:b] = _gguf().quants.dequantize(rows[a:b], ggml_type)
    return out


def encode(values: torch.Tensor, ggml_type: int, qw: torch.Tensor | None = None) -> torch.Tensor:
    """One band (or a whole tensor) of values -> the bytes GGUF stores for it in `ggml_type`: uint8 blocks
    for block types, the plain dtype otherwise. Blocks run along the last dimension, which must be a
    multiple of the block size. This is the one call that (re-)encodes a tensor in a GGUF type.

    `qw`: the importance (`--imatrix`) of this band's columns, fp32 [n] or [rows, n] (one row of importance per
    row of the band: the expert slices of a 3-D tensor), or None. A type with an importance path
    (`ckpt.quant.kquants.Encoder.weighted`) then runs it, as ggml's `quantize_<type>(..., imatrix)` does; the
    types whose ggml quantizer ignores the importance (Q8_0, the plain types) ignore it here too.

    The encoder is ckpt's own where it has one (`ckpt.quant.kquants`: compiled CPU kernels, torch ones for CUDA);
    the legacy types' static path (Q4_0/1, Q5_0/1, Q8_0) is gguf's own quantize, run on pieces of the band by
    every core the caller's stage has (`_quantize_pieces`); bf16 values reach it as they are (widened piece by
    piece there, not copied to a whole fp32 band first).

    NaN/Inf values make gguf's numpy arithmetic warn ("invalid value encountered in multiply / cast") on
    stderr; every caller counts them into its Report (`nonfinite_input`), which says it once, so numpy's
    warnings are silenced here."""
    plain = plain_types().get(ggml_type)
    v = values.detach()
    ours = kquant_encoder(ggml_type, v.device.type, weighted=qw is not None)
    if ours is None and qw is not None:
        if plain is None and type_name(ggml_type) != "Q8_0":
            raise ValueError(f"no importance-matrix encoder for {type_name(ggml_type)}")
        qw = None  # ggml's Q8_0 and the plain types take no importance
        ours = kquant_encoder(ggml_type, v.device.type)
    if plain is None and ours is None and v.dtype in (torch.bfloat16, torch.float32):
        x = v.to("cpu").contiguous()  # bf16: half the bytes of a device->host copy, and no fp32 band copy
    else:
        x = v.to(v.device if ours else "cpu", torch.float32).contiguous()
    if plain is not None:
        return x.to(plain)
    blk, size = block_size(ggml_type)
    row = x.shape[-1] if x.dim() else 1
    if row % blk:
        raise ValueError(f"rows of {row} values are not a whole number of {type_name(ggml_type)} blocks of {blk}")
    if x.numel() == 0:
        return torch.empty(0, dtype=torch.uint8)
    if ours is not None:
        # NaN/Inf (counted by the caller) make ggml's C block math undefined; a NaN is encoded as 0 (the rest of its
        # block survives), an Inf as the largest finite float32 (its block's fp16 scale then overflows, as in C)
        x = torch.nan_to_num(x, nan=0.0)
        rows = x.reshape(-1, row)
        if rows.device.type not in ours.devices:  # a CPU kernel for CUDA rows
            rows = rows.cpu()
        if qw is not None:
            qw = qw.to(rows.device, torch.float32)
            qw = qw.reshape(row) if qw.numel() == row else qw.reshape(-1, row)
        return ours.fn(rows, qw).reshape(-1).cpu()
    return _quantize_pieces(x.reshape(-1), ggml_type)


# Values per gguf.quants.quantize call of the legacy encoders (`_quantize_pieces`), and the unit its workers
# take: pieces cut anywhere on a block boundary give gguf's bytes for the whole band (blocks are independent).
# Small enough that numpy's temporaries stay in the heap: measured on the 2-core dev box with ckpt imported
# (18432x3072 fp32, min of 5, 1 worker), Q8_0 took 0.31 s in pieces of 2^16 values but 0.73 s in pieces of
# 2^17 or 2^18 (its 0.5-1 MB temporaries were trimmed from the heap and faulted back in for every piece:
# 263,000 page faults a call instead of 15,000); the other types fault little at 2^17, where they run 6-8%
# faster than at 2^16 (Q4_0 0.25 s vs 0.27 s: fewer numpy calls).
PIECE_ELEMS = 1 << 17
PIECE_ELEMS_OF = {"Q8_0": 1 << 16}


_pool = None
_pool_lock = threading.Lock()


def helper_pool():
    """The persistent threads that quantize pieces beside the caller (one fewer than the cores: the caller
    is a worker too), made on first use."""
    global _pool
    with _pool_lock:
        if _pool is None:
            from concurrent.futures import ThreadPoolExecutor

            _pool = ThreadPoolExecutor(max(1, (os.cpu_count() or 1) - 1), thread_name_prefix="ckpt-gguf-quant")
        return _pool


def quant_workers(pieces: int) -> int:
    """Threads that quantize a band of `pieces` pieces: the torch threads of the calling stage (the cores
    `ckpt.io.write_stages` gave it: all of them where the plan's busy stage is "compute", its share otherwise,
    so the pool never adds threads to cores another stage holds), at most the cores and the pieces."""
    return max(1, min(pieces, torch.get_num_threads(), os.cpu_count() or 1))


def _quantize_pieces(flat: torch.Tensor, ggml_type: int) -> torch.Tensor:
    """gguf.quants.quantize of a flat band (fp32, or bf16 widened a piece at a time: bf16 -> fp32 is the
    same bit shift torch does, NaN payloads kept) in pieces of `PIECE_ELEMS` values (`PIECE_ELEMS_OF` by
    type), taken in turn by `quant_workers` threads: the caller and the pool's helpers. Blocks are
    independent, so every piece's bytes are those of the single-threaded call, in the same place, however
    the pieces fall.

    Why threads and not torch: numpy releases the GIL inside its ufunc loops, which are nearly all of gguf's
    quantizers, so two threads ran 1.5-1.9x as fast as one on the 2-core dev box (18432x3072 fp32, min of 4:
    Q8_0 0.30 -> 0.21 s, Q4_0 0.27 -> 0.15 s, Q4_1 0.39 -> 0.21 s, Q5_0 0.29 -> 0.19 s, Q5_1 0.43 -> 0.23 s;
    from bf16 the whole-band fp32 copy this replaced cost another 0.03-0.08 s), while a torch port of these
    encoders was no faster than numpy on that CPU and changed the bytes of NaN/Inf blocks (reverted in
    3ef180e)."""
    quantize = _gguf().quants.quantize
    blk, size = block_size(ggml_type)
    n = flat.numel()
    bf16 = flat.dtype == torch.bfloat16
    src = flat.view(torch.int16).numpy().view(np.uint16) if bf16 else flat.numpy()
    out = torch.empty(n // blk * size, dtype=torch.uint8)
    dst = out.numpy()
    step = max(blk, PIECE_ELEMS_OF.get(type_name(ggml_type), PIECE_ELEMS) // blk * blk)

    def piece(a: int, b: int) -> None:
        # errstate is per thread (numpy keeps it in a context variable)
        with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
            v = np.left_shift(src[a:b], 16, dtype=np.uint32).view(np.float32) if bf16 else src[a:b]
            dst[a // blk * size: b // blk * size] = quantize(v.reshape(1, -1), ggml_type).reshape(-1)

    run_pieces(n, step, piece)
    return out


def run_pieces(n: int, step: int, piece) -> None:
    """`piece(a, b)` over [0, n) in pieces of `step`, taken in turn by `quant_workers` threads: the caller and the
    pool's helpers (`helper_pool`); for work that releases the GIL (numpy's loops, compiled kernels) and whose
    pieces are independent, so the result does not depend on which thread took which piece."""
    starts = iter(range(0, n, step))
    lock = threading.Lock()
    stop = []  # set when the caller is done (or failed): helpers take no further pieces

    def work():
        while not stop:
            with lock:
                a = next(starts, None)
            if a is None:
                return
            piece(a, min(n, a + step))

    workers = quant_workers(-(-n // step))
    helpers = [helper_pool().submit(work) for _ in range(workers - 1)]
    try:
        work()
    finally:
        stop.append(True)
        # a helper not started yet (the pool busy with another caller's band) is not waited for
        for f in helpers:
            if not f.cancel():
                f.exception()  # wait; an error of its own is raised just below
    for f in helpers:
        if not f.cancelled() and f.exception() is not None:
            raise f.exception()


def kquant_encoder(ggml_type: int, device: str = "cpu", weighted: bool = False):
    """ckpt's own encoder (`ckpt.quant.kquants.Encoder`) of a type for rows on `device`, with an importance or
    without, or None (the gguf package's quantize, or nothing, writes it)."""
    from ckpt.quant.kquants import encoder

    return encoder(type_name(ggml_type), device, weighted)


def stored_output(stored: GGUFStored, name: str | None = None):
    """A stored GGUF tensor written again unchanged: same type, shape and block bytes (for tensors an
    operation leaves alone when writing GGUF)."""
    from ckpt.io.plan import OutTensor

    if stored.quantized:
        return OutTensor(name or stored.name, torch.uint8, stored.stored_shape, stored,
                         gguf_type=stored.ggml_type)
    return OutTensor(name or stored.name, stored.dtype, stored.stored_shape, stored)


WRITABLE_FALLBACKS = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")  # general-purpose types gguf can write


def bits_per_weight(ggml_type: int) -> float:
    blk, size = block_size(ggml_type)
    return size * 8 / blk


def nearest_writable(ggml_type: int) -> int:
    """The type a tensor of a type nothing here can write without an importance (IQ1_S, IQ2_XXS, IQ2_XS, NVFP4)
    is written in again: the
    general-purpose writable type with the fewest bits per weight above the source's (those types pack
    their bits better than a legacy type, so equal bits would lose precision); Q8_0 when none has more."""
    T = _gguf().GGMLQuantizationType
    bpw = bits_per_weight(ggml_type)
    cands = sorted((bits_per_weight(T[n]), int(T[n])) for n in WRITABLE_FALLBACKS)
    return next((t for b, t in cands if b > bpw), int(T.Q8_0))


class BlockRows(Wrapper):
    """A tensor read in bands that hold whole rows of `row_len` values (its GGUF stored rows)."""

    def __init__(self, base: Tensor, row_len: int):
        self.base, self.name, self.home = base, base.name, base.home
        self.dtype, self.shape = base.dtype, tuple(base.shape)
        per_row = math.prod(self.shape[1:]) if self.shape else 1
        if base.row_align is None or not self.shape or not per_row or not row_len:  # empty: nothing to align
            self.row_align = None
        else:
            self.row_align = math.lcm(base.row_align, row_len // math.gcd(per_row, row_len))


class GGUFEncoding(Encoding):
    """A new value of a stored GGUF tensor: the same name and stored shape (rows of the stored row length,
    also where ComfyUI-GGUF reshaped it), encoded in the stored type (`encode`), or, for a type nothing here
    can write without an importance (IQ1_S, IQ2_XXS, IQ2_XS), in `nearest_writable` of it, with a note. Block
    types carry their scales inside each block, so every band is encoded on its own (one pass)."""

    def __init__(self, stored: GGUFStored):
        self.stored = stored
        self.keys = (stored.name,)
        t = stored.ggml_type
        self.out_type = t if can_encode(t) else nearest_writable(t)
        self.label = f"GGUF {type_name(t)}" if self.out_type == t else \
            f"GGUF {type_name(t)} -> {type_name(self.out_type)}"
        self.note = None if self.out_type == t else (
            f"GGUF {type_name(t)} tensors changed by the LoRA are written as {type_name(self.out_type)} "
            f"(ckpt has no {type_name(t)} encoder); unchanged ones keep "
            f"{type_name(t)}")

    def why_not(self) -> str | None:
        row = self.stored.stored_shape[-1] if self.stored.stored_shape else 1
        blk = block_size(self.out_type)[0]
        if row % blk:
            return f"rows of {row} values are not whole {type_name(self.out_type)} blocks"
        return None

    def encode(self, value: Tensor, report, meter):
        from ckpt.io.plan import OutTensor

        s, t = self.stored, self.out_type
        row_len = s.stored_shape[-1] if s.stored_shape else 1
        plain = plain_types().get(t)

        def cast(x, buffers):
            v = x.to(torch.float32).reshape(-1, row_len)
            report.count("nonfinite_input", s.name, int((~torch.isfinite(v)).sum()) if v.numel() else 0)
            q = encode(v, t)
            # measured a chunk of rows at a time: the meter's float64 copies of a whole band were the peak
            decoded = q.reshape(v.shape[0], -1)
            for a, b in _row_chunks(v.shape[0], row_len):
                meter.add(v[a:b], decoded[a:b] if plain is not None else dequantize(decoded[a:b], t, row_len))
            return q

        src = BlockRows(value, row_len)
        if plain is not None:
            return [OutTensor(s.name, plain, s.stored_shape, src, cast)]
        return [OutTensor(s.name, torch.uint8, s.stored_shape, src, cast, gguf_type=t)]


def can_encode(ggml_type: int) -> bool:
    """Whether this type can be written without an importance matrix: by gguf's Python package (plain and legacy
    types), or by ckpt's own static encoders (`ckpt.quant.kquants`: every type but IQ1_S, IQ2_XXS and IQ2_XS,
    whose ggml quantizers require an importance, and NVFP4)."""
    if ggml_type in plain_types() or kquant_encoder(ggml_type) is not None:
        return True
    quants = _gguf().quants
    cls = quants._type_traits.get(ggml_type)  # the package's registry of block types
    if cls is None:
        return False
    try:
        quants.quantize(np.zeros((1, cls.block_size), dtype=np.float32), ggml_type)
    except NotImplementedError:
        return False
    return True


def natural_dtype(stored: dict[str, GGUFStored]) -> str:
    """What a dequantized weight is written as by default (a safetensors dtype name): the float type most of
    the file's unquantized matrices use (the model's own dtype before quantization, as ComfyUI-GGUF's first
    step keeps it), else bf16."""
    plain = plain_names()
    kinds = Counter(plain[t.ggml_type] for t in stored.values()
                    if t.ggml_type in plain and len(t.stored_shape) >= 2 and plain[t.ggml_type] in ("F16", "BF16"))
    return kinds.most_common(1)[0][0] if kinds else "BF16"


def orig_shape(header, name: str, stored: GGUFStored):
    """ComfyUI-GGUF's recorded original shape of `name` (ARRAY of INT32), checked against the data."""
    key = ORIG_SHAPE + name
    if key not in header.fields:
        return None
    gguf = _gguf()
    types = header.field_type(key)
    if types != [gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.INT32]:
        raise file_error(header.path, f"metadata {key!r} should be an array of INT32, not "
                                      f"{'/'.join(t.name for t in types)}")
    shape = tuple(int(d) for d in header.value(key))
    if any(d < 0 for d in shape) or math.prod(shape) != math.prod(stored.stored_shape):
        raise file_error(header.path, f"metadata {key!r} gives shape {list(shape)} for a tensor of "
                                      f"{math.prod(stored.stored_shape)} values")
    return shape


def type_summary(tensors) -> str:
    counts = Counter(type_name(t.ggml_type) for t in tensors)
    return ", ".join(f"{k} {n}" for k, n in counts.most_common())


def decode(ctx: DecodeContext) -> Decoded | None:
    files = [f for f in ctx.component.files if f.kind == "gguf"]
    if not files:
        return None
    if len(ctx.component.files) > 1:
        raise CkptError(f"{files[0].path}: a GGUF file holds a whole model; pass it alone "
                        "(not together with other weight files)")
    header = files[0].gguf
    stored = {k: t for k, t in ctx.remaining.items() if isinstance(t, GGUFStored)}
    natural = natural_dtype(stored)
    from ckpt.quant import gguf_llm

    if gguf_llm.is_llm(header, stored):
        return gguf_llm.decode(header, stored, lambda t, name: GGUFValues(t, None, natural, name=name),
                               type_summary(stored.values()))
    tensors, notes = {}, []
    reshaped = 0
    for name, t in stored.items():
        shape = orig_shape(header, name, t)
        reshaped += shape is not None
        if t.quantized or shape is not None:
            tensors[name] = GGUFValues(t, shape, natural)
    arch = header.architecture or "no general.architecture"
    if reshaped:
        notes.append(f"{files[0].relpath}: {plural(reshaped, 'tensor')} restored to "
                     f"{'its original shape' if reshaped == 1 else 'their original shapes'} "
                     f"({ORIG_SHAPE}* metadata)")
    quantized = any(t.quantized for t in stored.values())
    return Decoded(f"GGUF {arch} ({type_summary(stored.values())})", tensors, {}, dequantized=quantized,
                   notes=notes)


FORMAT = Format("gguf", "GGUF", 10, (decode,), weights=(GGUFValues,))
