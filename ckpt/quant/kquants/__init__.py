"""ggml's block encoders that the `gguf` package lacks (it only dequantizes them): the K-quants (`Q2_K` .. `Q6_K`),
the IQ types, the ternary types, and the importance-matrix (`--imatrix`) paths of every type that has one, each
byte for byte what llama.cpp's `ggml-quants.c` writes (MIT; the llama-cpp-python 0.3.36 vendoring): without an
importance the `quantize_row_*_ref` path `llama-quantize` runs without an imatrix, with one the
`quantize_row_*_impl` path (a different algorithm, not a reweighting).

One module per family of types declares `ENCODERS = {"Q4_K": enc, ...}`; `enc` is a plain function (a torch
encoder of the static path, any device) or an `Encoder` (or a tuple of them: a torch one for CUDA and a compiled
CPU kernel, `ckpt.quant.kquants.jit`). Every encoder function is `fn(rows, qw)`: `rows` an fp32 tensor [r, n] (n a
multiple of the block size), `qw` None or the importance as an fp32 tensor of shape [n] (one per column, the whole
tensor's) or [r, n] (one row each, e.g. the expert slices of a 3-D tensor); it returns the encoded blocks as a uint8
tensor [r, n / block * block bytes] (on the rows' device for a torch encoder, on the CPU for a CPU kernel).
`encoder(type, device, weighted)` picks one (`ckpt.registry` discovery).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from ckpt.registry import entry_modules


@dataclass(frozen=True)
class Encoder:
    """One implementation of one GGML type's encoder."""

    fn: Callable  # fn(rows fp32 [r, n], qw None | fp32 [n] | [r, n]) -> uint8 [r, n / block * block_bytes]
    static: bool = True  # encodes without an importance (qw None): the _ref path
    weighted: bool = False  # encodes with one (qw given): the _impl path
    devices: tuple = ("cpu", "cuda")  # a compiled CPU kernel: ("cpu",) (CUDA rows are brought to the CPU for it)
    rank: int = 0  # where several serve the same type, device and path, the highest rank wins (the fastest)


_ENCODERS: dict[str, tuple[Encoder, ...]] | None = None


def _as_encoders(name: str, value) -> tuple[Encoder, ...]:
    items = value if isinstance(value, (tuple, list)) else (value,)
    out = []
    for e in items:
        if isinstance(e, Encoder):
            out.append(e)
        elif callable(e):  # a plain function: a torch encoder of the static path
            out.append(Encoder(lambda rows, qw=None, f=e: f(rows)))
        else:
            raise RuntimeError(f"encoder {name}: {e!r} is neither a function nor an Encoder")
    return tuple(out)


def encoders() -> dict[str, tuple[Encoder, ...]]:
    """Every type's encoders, by GGML type name."""
    global _ENCODERS
    if _ENCODERS is None:
        found: dict[str, tuple[Encoder, ...]] = {}
        for mod in entry_modules(__name__, __path__, "ENCODERS"):
            for name, value in mod.ENCODERS.items():
                found[name] = found.get(name, ()) + _as_encoders(name, value)
        _ENCODERS = found
    return _ENCODERS


def encoder(type_name: str, device: str = "cpu", weighted: bool = False) -> Encoder | None:
    """The best encoder of `type_name` for rows on `device` ("cpu", "cuda", ...), with an importance (`weighted`) or
    without; a device none runs on gets a CPU one (its rows copied to the CPU). None: ckpt has none (the legacy
    types' static path is the gguf package's, `ckpt.quant.gguf.encode`)."""
    cands = [e for e in encoders().get(type_name, ()) if (e.weighted if weighted else e.static)]
    here = [e for e in cands if device in e.devices] or [e for e in cands if "cpu" in e.devices]
    return max(here, key=lambda e: e.rank, default=None)
