"""ggml's K-quant and IQ4 block encoders (`Q2_K` .. `Q6_K`, `IQ4_NL`, `IQ4_XS`), byte for byte what llama.cpp's
reference quantizers (`quantize_row_*_ref` in `ggml/src/ggml-quants.c`, what `llama-quantize` runs without an
importance matrix) write, vectorized over blocks with torch so they run on every core and on CUDA. The `gguf`
package has no encoder for these types (it only dequantizes them).

One module per family of types declares `ENCODERS = {"Q4_K": fn, ...}`; `fn(rows)` takes an fp32 tensor of shape
[rows, n] (n a multiple of the block size) and returns the encoded blocks as a uint8 tensor [rows, n / block *
block bytes] on the same device. `encoders()` collects them (`ckpt.registry`).
"""

from __future__ import annotations

from ckpt.registry import entry_modules

_ENCODERS: dict | None = None


def encoders() -> dict:
    global _ENCODERS
    if _ENCODERS is None:
        found: dict = {}
        for mod in entry_modules(__name__, __path__, "ENCODERS"):
            for name, fn in mod.ENCODERS.items():
                if name in found:
                    raise RuntimeError(f"encoder {name} is defined twice ({mod.__name__})")
                found[name] = fn
        _ENCODERS = found
    return _ENCODERS
