"""llama.cpp itself as a test oracle, through llama-cpp-python (0.3.36, its vendored llama.cpp built into the
venv): `quantize_gguf` is `llama-quantize [flags] SRC DST FTYPE` (same library function and parameters: --pure,
--imatrix, --tensor-type, --output-tensor-type, --token-embedding-type, --leave-output-tensor, --override-kv,
--dry-run), `logits` is what llama.cpp computes for a token sequence. Tests that need them skip with the reason
where `llama_cpp` cannot be imported.
"""

from __future__ import annotations

import ctypes
import re
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


# llama.h / ggml.h numbers the installed gguf package may not have (gguf 0.19 predates ggml's Q2_0)
FTYPE_NUMBERS = {"MOSTLY_Q2_0": 41}
GGML_TYPE_NUMBERS = {"Q2_0": 42}


def ftype_number(ftype: str) -> int:
    """llama.h's `enum llama_ftype` value of a gguf.LlamaFileType member name."""
    import gguf

    return FTYPE_NUMBERS[ftype] if ftype in FTYPE_NUMBERS else int(gguf.LlamaFileType[ftype])


def ggml_type_number(name: str) -> int:
    """ggml.h's `enum ggml_type` value of a type name in any case ("q8_0", "Q4_K", "iq2_xxs")."""
    import gguf

    up = name.upper()
    return GGML_TYPE_NUMBERS[up] if up in GGML_TYPE_NUMBERS else int(gguf.GGMLQuantizationType[up])


def quantize_gguf(src: Path, dst: Path, ftype: str, pure: bool = False, nthread: int = 2,
                  allow_requantize: bool = False, *, imatrix: dict[str, np.ndarray] | None = None,
                  tensor_types: list[tuple[str, str]] = (), output_tensor_type: str | None = None,
                  token_embedding_type: str | None = None, quantize_output_tensor: bool = True,
                  kv_overrides: dict | None = None, dry_run: bool = False) -> str:
    """Quantize `src` into `dst` as `llama-quantize` does; `ftype` is a gguf.LlamaFileType member name
    ("MOSTLY_Q4_K_M"; or "MOSTLY_Q2_0", which gguf 0.19 lacks); `allow_requantize` is its --allow-requantize (an
    already quantized tensor, such as gpt-oss's MXFP4 experts, dequantized and quantized into the mix's type).
    Returns llama.cpp's log of the run (its per-tensor lines and the "falling back" warnings of
    tensor_type_fallback); a failed run raises AssertionError with the log's tail (`quantize_gguf_result` returns
    it instead). The flags of llama-quantize, as its main() hands them to the library:

    - `imatrix`: tensor name -> float32 importances [n_mat * n_per_row] (--imatrix, after its division by the
      counts; an empty dict is no imatrix, as llama-quantize passes none when --include/--exclude-weights leave no
      entry);
    - `tensor_types`: ((pattern, type), ...) as --tensor-type PATTERN=TYPE gives them (llama-quantize lowercases
      the pattern before it reaches the library: pass it lowercased);
    - `output_tensor_type` / `token_embedding_type`: --output-tensor-type / --token-embedding-type (type names);
    - `quantize_output_tensor=False`: --leave-output-tensor;
    - `kv_overrides`: key -> str / int / float / bool, as --override-kv (and the quantize.imatrix.* keys
      llama-quantize adds with an imatrix: pass them here to get its file);
    - `dry_run`: --dry-run (no output file; the log gives each tensor's type)."""
    rc, log = quantize_gguf_result(src, dst, ftype, pure, nthread, allow_requantize, imatrix=imatrix,
                                   tensor_types=tensor_types, output_tensor_type=output_tensor_type,
                                   token_embedding_type=token_embedding_type,
                                   quantize_output_tensor=quantize_output_tensor, kv_overrides=kv_overrides,
                                   dry_run=dry_run)
    assert rc == 0, f"llama_model_quantize {src.name} {ftype} failed ({rc}):\n{log[-2000:]}"
    return log


def quantize_gguf_result(src: Path, dst: Path, ftype: str, pure: bool = False, nthread: int = 2,
                         allow_requantize: bool = False, *, imatrix: dict[str, np.ndarray] | None = None,
                         tensor_types: list[tuple[str, str]] = (), output_tensor_type: str | None = None,
                         token_embedding_type: str | None = None, quantize_output_tensor: bool = True,
                         kv_overrides: dict | None = None, dry_run: bool = False) -> tuple[int, str]:
    """`quantize_gguf`'s call: (llama_model_quantize's return code, its log)."""
    lc = llama_cpp()
    lc.llama_backend_init()
    params = lc.llama_model_quantize_default_params()
    params.ftype = ftype_number(ftype)
    params.pure = pure
    params.allow_requantize = allow_requantize
    params.nthread = nthread
    params.quantize_output_tensor = quantize_output_tensor
    params.dry_run = dry_run
    if output_tensor_type is not None:
        params.output_tensor_type = ggml_type_number(output_tensor_type)
    if token_embedding_type is not None:
        params.token_embedding_type = ggml_type_number(token_embedding_type)
    keep = []  # the arrays and strings the C structs point into, alive until the call returns
    if imatrix:
        entries = (lc.llama_model_imatrix_data * (len(imatrix) + 1))()
        for e, (name, values) in zip(entries, imatrix.items()):
            v = np.ascontiguousarray(values, dtype=np.float32).reshape(-1)
            keep.append(v)
            e.name, e.size = name.encode(), v.size
            e.data = v.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
        keep.append(entries)  # the last entry stays zeroed: name NULL ends the array
        params.imatrix = ctypes.cast(entries, type(params.imatrix))
    if tensor_types:
        tt = (lc.llama_model_tensor_override * (len(tensor_types) + 1))()
        for e, (pattern, type_name) in zip(tt, tensor_types):
            e.pattern, e.type = pattern.encode(), ggml_type_number(type_name)
        tt[len(tensor_types)].type = 43  # GGML_TYPE_COUNT beside the NULL pattern, as llama-quantize ends it
        keep.append(tt)
        params.tt_overrides = ctypes.cast(tt, type(params.tt_overrides))
    if kv_overrides:
        kv = (lc.llama_model_kv_override * (len(kv_overrides) + 1))()
        for e, (key, value) in zip(kv, kv_overrides.items()):
            e.key = key.encode()
            if isinstance(value, bool):
                e.tag, e.value.val_bool = lc.LLAMA_KV_OVERRIDE_TYPE_BOOL, value
            elif isinstance(value, int):
                e.tag, e.value.val_i64 = lc.LLAMA_KV_OVERRIDE_TYPE_INT, value
            elif isinstance(value, float):
                e.tag, e.value.val_f64 = lc.LLAMA_KV_OVERRIDE_TYPE_FLOAT, value
            else:
                e.tag, e.value.val_str = lc.LLAMA_KV_OVERRIDE_TYPE_STR, str(value).encode()[:127]
        keep.append(kv)  # the last entry's key is empty: it ends the array
        params.kv_overrides = ctypes.cast(kv, type(params.kv_overrides))
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
    return rc, "".join(chunks)


# one line of a llama-quantize log per tensor: "[   3/  90]  blk.0.attn_q.weight  - [  256,   256,     1,     1],
# type =    f16, converting to q4_K .. size = ...", or with --dry-run "size = 0.12 MiB -> 0.03 MiB (q4_K)"; a tensor
# it leaves in its type has no "converting to" / "(type)"
_TENSOR_LINE = re.compile(r"\[\s*\d+/\s*\d+\]\s+(\S+)\s+- \[[^\]]*\], type =\s*(\S+?),(.*)")
_TARGET = re.compile(r"converting to (\S+) \.\.|-> +[\d.]+ MiB \((\S+)\)")


def logged_types(log: str) -> dict[str, str]:
    """Each tensor's type in the output as a llama-quantize log says it (ggml's names, upper case), --dry-run's
    included; tensors whose lines a warning interrupts are read from their continuation."""
    out = {}
    pending = None
    for line in log.splitlines():
        m = _TENSOR_LINE.search(line)
        if m:
            pending, rest = (m.group(1), m.group(2)), m.group(3)
        elif pending is not None:
            rest = line
        else:
            continue
        t = _TARGET.search(rest)
        if t:
            out[pending[0]] = (t.group(1) or t.group(2)).upper()
            pending = None
        elif "size =" in rest:
            out[pending[0]] = pending[1].upper()
            pending = None
    return out


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
