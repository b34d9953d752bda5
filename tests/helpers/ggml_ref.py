"""llama.cpp's own quantizers as a test oracle: `ggml/src/ggml-quants.c` as vendored by the llama-cpp-python sdist
(0.3.36, llama.cpp 0c1e57098, MIT), compiled with the system C compiler into a small shared library and called
through ctypes: `quantize(type, rows)` is what `llama-quantize` writes for a tensor without an importance matrix
(`quantize_<type>(src, dst, nrow, n_per_row, NULL)`), `quantize(type, rows, imatrix=qw)` what it writes with one
(`ggml_quantize_chunk`'s call with the tensor's importance, fp32 [n_per_row]), for every type ggml quantizes (the
IQ types' grids are initialised first, as `ggml_quantize_init` does); `dequantize(type, bytes, n)` is what llama.cpp
reads back from such blocks (`dequantize_row_<type>`).

The sdist comes from the package registry (`pip download`, the one network access, once) and is unpacked and built
under `.venv/ggml-ref/` (git-ignored, kept between runs; `CKPT_GGML_REF` names another folder). Only the files the
quantizers need are taken; `stubs.c` stands in for the rest of ggml (`ggml_abort`, and the row sizes of the types
built here). Tests that need it skip with the reason where the registry or a C compiler is missing.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np

VERSION = "0.3.36"
REPO = Path(__file__).resolve().parents[2]
SRC = f"llama_cpp_python-{VERSION}/vendor/llama.cpp/ggml"
FILES = ("src/ggml-quants.c", "src/ggml-quants.h", "src/ggml-common.h", "src/ggml-impl.h",
         "src/ggml-cpu/ggml-cpu-impl.h", "include/")
# type -> (elements per block, bytes per block), as ggml's type traits
BLOCKS = {"q4_0": (32, 18), "q4_1": (32, 20), "q5_0": (32, 22), "q5_1": (32, 24), "q8_0": (32, 34),
          "q2_K": (256, 84), "q3_K": (256, 110), "q4_K": (256, 144), "q5_K": (256, 176), "q6_K": (256, 210),
          "iq4_nl": (32, 18), "iq4_xs": (256, 136),
          "iq2_xxs": (256, 66), "iq2_xs": (256, 74), "iq2_s": (256, 82), "iq3_xxs": (256, 98), "iq3_s": (256, 110),
          "iq1_s": (256, 50), "iq1_m": (256, 56), "tq1_0": (256, 54), "tq2_0": (256, 66), "mxfp4": (32, 17),
          "nvfp4": (64, 36), "q1_0": (128, 18), "q2_0": (64, 18)}
TYPE_IDS = {"q4_0": 2, "q4_1": 3, "q5_0": 6, "q5_1": 7, "q8_0": 8, "q2_K": 10, "q3_K": 11, "q4_K": 12, "q5_K": 13,
            "q6_K": 14, "iq4_nl": 20, "iq4_xs": 23, "iq2_xxs": 16, "iq2_xs": 17, "iq3_xxs": 18, "iq1_s": 19,
            "iq3_s": 21, "iq2_s": 22, "iq1_m": 29, "tq1_0": 34, "tq2_0": 35, "mxfp4": 39, "nvfp4": 40, "q1_0": 41,
            "q2_0": 42}
# ggml_quantize_init: the grids a type's quantizer needs, made once per process
INIT = {"iq2_xxs": ("iq2xs_init_impl", 16), "iq2_xs": ("iq2xs_init_impl", 17), "iq2_s": ("iq2xs_init_impl", 22),
        "iq1_s": ("iq2xs_init_impl", 19), "iq1_m": ("iq2xs_init_impl", 29), "iq3_xxs": ("iq3xs_init_impl", 256),
        "iq3_s": ("iq3xs_init_impl", 512)}
STUBS = r"""
#include <stdio.h>
#include <stdlib.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
void ggml_abort(const char * file, int line, const char * fmt, ...) {
    va_list ap; va_start(ap, fmt); fprintf(stderr, "ggml_abort %s:%d: ", file, line); vfprintf(stderr, fmt, ap);
    va_end(ap); abort();
}
static int64_t blck(int t) { switch (t) { %BLCK% default: abort(); } }
static size_t bytes(int t) { switch (t) { %BYTES% default: abort(); } }
size_t ggml_type_size(int t) { return bytes(t); }
int64_t ggml_blck_size(int t) { return blck(t); }
size_t ggml_row_size(int t, int64_t ne) { return bytes(t) * (ne / blck(t)); }
const char * ggml_type_name(int t) { return "?"; }
"""

_LIB = None


class Unavailable(RuntimeError):
    """The oracle cannot be built here (no registry, no C compiler): tests skip with this reason."""


def _folder() -> Path:
    return Path(os.environ.get("CKPT_GGML_REF") or REPO / ".venv" / "ggml-ref")


def _sdist(root: Path) -> Path:
    """The llama-cpp-python sdist, downloaded once into `root`."""
    root.mkdir(parents=True, exist_ok=True)
    tgz = root / f"llama_cpp_python-{VERSION}.tar.gz"
    if not tgz.exists():
        r = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                            f"llama-cpp-python=={VERSION}", "-d", str(root)], capture_output=True, text=True)
        if r.returncode != 0 or not tgz.exists():
            raise Unavailable(f"pip download llama-cpp-python=={VERSION} failed: {r.stderr.strip()[-200:]}")
    return tgz


def llama_cpp_tree() -> Path:
    """The whole `vendor/llama.cpp` tree of the sdist (convert_hf_to_gguf.py, conversion/, gguf-py/, src/),
    unpacked once under the oracle folder (`llama.cpp/`)."""
    root = _folder()
    tree = root / "llama.cpp"
    if tree.exists():
        return tree
    tgz = _sdist(root)
    top = f"llama_cpp_python-{VERSION}/vendor/llama.cpp/"
    tmp = root / f"llama.cpp.tmp{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    with tarfile.open(tgz) as tf:
        tf.extractall(tmp, members=[m for m in tf.getmembers() if m.name.startswith(top)], filter="data")
    try:
        (tmp / top).rename(tree)  # atomic: a parallel run sees the whole tree or none
    except OSError:
        if not tree.exists():
            raise
    shutil.rmtree(tmp, ignore_errors=True)
    return tree


def _build(root: Path, release: bool = False) -> Path:
    lib = root / ("libggml-quants-release.so" if release else "libggml-quants.so")
    if lib.exists():
        return lib
    tgz = _sdist(root)
    tree = root / "src"
    if not tree.exists():
        tmp = root / "src.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        with tarfile.open(tgz) as tf:
            members = [m for m in tf.getmembers()
                       if any(m.name == f"{SRC}/{f}" or (f.endswith("/") and m.name.startswith(f"{SRC}/{f}"))
                              for f in FILES)]
            tf.extractall(tmp, members=members, filter="data")
        (tmp / SRC).rename(tree)
        shutil.rmtree(tmp)
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise Unavailable("no C compiler (cc) to build ggml-quants.c")
    stubs = root / "stubs.c"
    stubs.write_text(STUBS.replace("%BLCK%", " ".join(f"case {TYPE_IDS[t]}: return {b};" for t, (b, _) in BLOCKS.items()))
                     .replace("%BYTES%", " ".join(f"case {TYPE_IDS[t]}: return {n};" for t, (_, n) in BLOCKS.items())))
    tmp_lib = root / f"{lib.name}.{os.getpid()}"
    r = subprocess.run([cc, "-O2", *(["-DNDEBUG"] if release else []), "-shared", "-fPIC", "-I", str(tree / "include"),
                        "-I", str(tree / "src"),
                        str(tree / "src" / "ggml-quants.c"), str(stubs), "-lm", "-o", str(tmp_lib)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        raise Unavailable(f"building ggml-quants.c failed: {r.stderr.strip()[-300:]}")
    tmp_lib.rename(lib)  # atomic: a parallel run sees the whole library or none
    return lib


def library(release: bool = False) -> ctypes.CDLL:
    """The library; `release`: built with -DNDEBUG as llama.cpp's release builds are (CMake's Release type, the
    published binaries and wheels), whose asserts are off: `nearest_int`'s |x| <= 4194303 aborts the default build
    on rows of values too large for their block scales (1e7 beside small values, 3e38), where a release
    llama-quantize writes what its arithmetic gives."""
    global _LIB
    if _LIB is None:
        _LIB = {}
    if release not in _LIB:
        lib = ctypes.CDLL(str(_build(_folder(), release)))
        for t in BLOCKS:
            fn = getattr(lib, f"quantize_{t}")
            fn.restype = ctypes.c_size_t
            fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
        for fn_name, _ in set(INIT.values()):
            getattr(lib, fn_name).argtypes = [ctypes.c_int]
        lib.ckpt_inited = set()  # the grids made so far (`_init`: on a type's first use; some take seconds)
        _LIB[release] = lib
    return _LIB[release]


def quantize(type_name: str, rows: np.ndarray, release: bool = False, imatrix: np.ndarray | None = None) -> bytes:
    """The bytes `llama-quantize` writes for these fp32 rows (2-D, row length a multiple of the block size) in
    `type_name` (ggml's spelling: q4_K, iq4_xs, ...), without an importance matrix or with `imatrix` (fp32
    [row length]: one importance per column, as llama-quantize passes a 2-D tensor's; `release`: `library`)."""
    x = np.ascontiguousarray(rows, dtype=np.float32)
    qw = None if imatrix is None else np.ascontiguousarray(imatrix, dtype=np.float32).reshape(-1)
    if qw is not None and qw.size != x.shape[1]:
        raise ValueError(f"imatrix of {qw.size} values for rows of {x.shape[1]}")
    nrow, n = x.shape
    blk, nbytes = BLOCKS[type_name]
    if n % blk:
        raise ValueError(f"{type_name}: rows of {n} are not a multiple of {blk}")
    out = np.zeros(nrow * (n // blk) * nbytes, dtype=np.uint8)
    lib = library(release)
    if type_name in INIT and INIT[type_name] not in lib.ckpt_inited:
        fn_name, arg = INIT[type_name]
        getattr(lib, fn_name)(arg)
        lib.ckpt_inited.add(INIT[type_name])
    written = getattr(lib, f"quantize_{type_name}")(x.ctypes.data, out.ctypes.data, nrow, n,
                                                                 None if qw is None else qw.ctypes.data)
    assert written == out.nbytes, (written, out.nbytes)
    return out.tobytes()


def dequantize(type_name: str, raw: bytes | np.ndarray, n_per_row: int, release: bool = False) -> np.ndarray:
    """What llama.cpp reads back from blocks of `type_name` (ggml's `dequantize_row_<type>`, the to_float of its
    type traits): float32 [rows, n_per_row] of whole rows of `n_per_row` values."""
    blk, nbytes = BLOCKS[type_name]
    src = np.ascontiguousarray(np.frombuffer(bytes(raw), dtype=np.uint8))
    if n_per_row % blk or src.size % (n_per_row // blk * nbytes):
        raise ValueError(f"{type_name}: {src.size} bytes are not whole rows of {n_per_row} values")
    n = src.size // nbytes * blk
    out = np.zeros(n, dtype=np.float32)
    fn = getattr(library(release), f"dequantize_row_{type_name}")
    fn.restype = None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
    fn(src.ctypes.data, out.ctypes.data, n)
    return out.reshape(-1, n_per_row)


def ref_name(ggml_type_name: str) -> str:
    """ggml's own spelling (this module's keys) of a gguf type name: Q4_K -> q4_K, IQ4_XS -> iq4_xs."""
    low = ggml_type_name.lower()
    return low[:-2] + "_K" if low.endswith("_k") else low
