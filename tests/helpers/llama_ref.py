"""llama.cpp itself as a test oracle, through llama-cpp-python (0.3.36, its vendored llama.cpp built into the
venv): `quantize_gguf` is `llama-quantize SRC DST FTYPE [--pure]` (same library function, default parameters, no
imatrix), `logits` is what llama.cpp computes for a token sequence. Tests that need them skip with the reason
where `llama_cpp` cannot be imported.
"""

from __future__ import annotations

import ctypes
import threading
from pathlib import Path

import numpy as np
import pytest

_LOCK = threading.Lock()  # llama.cpp's log callback is process-global


def llama_cpp():
    """The `llama_cpp` module, or a pytest skip saying why not."""
    try:
        import llama_cpp as mod
    except Exception as e:  # not installed, or its shared library does not load
        pytest.skip(f"llama-cpp-python is not importable ({type(e).__name__}: {e}); "
                    "pip install llama-cpp-python==0.3.36 (a source build)")
    return mod


def quantize_gguf(src: Path, dst: Path, ftype: str, pure: bool = False, nthread: int = 2,
                  allow_requantize: bool = False) -> str:
    """Quantize `src` into `dst` as `llama-quantize` does; `ftype` is a gguf.LlamaFileType member name
    ("MOSTLY_Q4_K_M"); `allow_requantize` is its --allow-requantize (an already quantized tensor, such as gpt-oss's
    MXFP4 experts, dequantized and quantized into the mix's type). Returns llama.cpp's log of the run (its
    per-tensor lines and the "falling back" warnings of tensor_type_fallback); a failed run raises AssertionError
    with the log's tail."""
    import gguf

    lc = llama_cpp()
    lc.llama_backend_init()
    params = lc.llama_model_quantize_default_params()
    params.ftype = int(gguf.LlamaFileType[ftype])
    params.pure = pure
    params.allow_requantize = allow_requantize
    params.nthread = nthread
    chunks: list[str] = []

    @lc.llama_log_callback
    def capture(level, text, user_data):
        chunks.append(text.decode("utf-8", "replace"))

    with _LOCK:
        lc.llama_log_set(capture, ctypes.c_void_p(0))
        try:
            rc = lc.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params))
        finally:
            _restore_log(lc)
    log = "".join(chunks)
    assert rc == 0, f"llama_model_quantize {src.name} {ftype} failed ({rc}):\n{log[-2000:]}"
    return log


def _restore_log(lc) -> None:
    """Hand the log back to llama-cpp-python's own callback (it prints unless a Llama is quiet)."""
    try:
        from llama_cpp import _logger

        lc.llama_log_set(_logger.llama_log_callback, ctypes.c_void_p(0))
    except ImportError:
        lc.llama_log_set(ctypes.cast(None, lc.llama_log_callback), ctypes.c_void_p(0))


def load(model_path: Path | str, **kwargs):
    """`llama_cpp.Llama(model_path, **kwargs)` on the CPU without ggml's extra buffer types (weight repacking and
    the AMX kernels): on an Intel CPU with AMX, a source build of 0.3.36 enables them and its Q8_0 matrix
    products crash the process inside a VM (seen on a Sapphire Rapids VM, with the kernel granting the tile
    permission). The plain CPU kernels compute the same model; both files under test go through them."""
    lc = llama_cpp()
    low = lc.llama_cpp
    default = low.llama_model_default_params

    def params():
        p = default()
        p.use_extra_bufts = False
        return p

    with _LOCK:
        low.llama_model_default_params = params
        try:
            return lc.Llama(model_path=str(model_path), n_gpu_layers=0, verbose=False, **kwargs)
        finally:
            low.llama_model_default_params = default


def logits(model_path: Path | str, token_ids: list[int], n_ctx: int | None = None) -> np.ndarray:
    """llama.cpp's logits for every position of `token_ids` (one batch from an empty context, CPU), as float32
    [n_tokens, n_vocab]: row i scores the token after token_ids[: i + 1]."""
    llm = load(model_path, logits_all=True, n_ctx=n_ctx or max(32, len(token_ids)),
               n_batch=max(32, len(token_ids)), n_threads=2)
    try:
        llm.eval(list(token_ids))
        return np.array(llm.scores[: len(token_ids)], dtype=np.float32)
    finally:
        llm.close()
