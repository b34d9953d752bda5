"""llama.cpp's own importance-matrix loader as a test oracle: what `llama-quantize --imatrix FILE` hands its
quantizers, computed by llama.cpp's code, not a transcription of it.

Built from the llama.cpp tree the llama-cpp-python 0.3.36 sdist vendors (tests/helpers/ggml_ref.py unpacks it;
MIT): `common/imatrix-loader.cpp` (common_imatrix_load: the GGUF and the legacy `.dat` readers) compiled as it is,
and `load_imatrix` + `prepare_imatrix` cut verbatim out of `tools/quantize/quantize.cpp` (normalisation by the
counts, `--include-weights` / `--exclude-weights`), into a small executable linked against the `libggml-base.so`
llama-cpp-python installs (the gguf API). An executable, not a library: llama-quantize's loader calls `exit(1)` on a
file it refuses. Two things are written here, not cut out: the logging (`common_log_add` prints to stderr; log.cpp
drags in the JSON and terminal code of common/) and the check `llama_model_quantize` makes next
(src/llama-quant.cpp: "imatrix contains non-finite value", exit code 3 here), three lines of it. The key-values
llama-quantize then writes (`quantize_kv`) are its main()'s arithmetic, transcribed below.

Built once under the oracle folder (`.venv/ggml-ref/imatrix-ref-<hash of the driver>`); tests skip with the reason where it cannot be
built (no C++ compiler, no llama-cpp-python, the sdist unavailable).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import struct
import subprocess
from dataclasses import dataclass
from importlib.util import find_spec
from pathlib import Path

import numpy as np

from helpers import ggml_ref

Unavailable = ggml_ref.Unavailable

DRIVER = r"""
#include "imatrix-loader.h"

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <unordered_map>
#include <map>
#include <vector>

// ---- tools/quantize/quantize.cpp, verbatim: load_imatrix and prepare_imatrix
%QUANTIZE%
// ---- end of the verbatim part

static void put_u32(FILE * f, uint32_t v) { fwrite(&v, 4, 1, f); }
static void put_str(FILE * f, const std::string & s) {
    put_u32(f, (uint32_t) s.size());
    fwrite(s.data(), 1, s.size(), f);
}

// usage: imatrix-ref OUT FILE [+INCLUDE | -EXCLUDE]...
int main(int argc, char ** argv) {
    if (argc < 3) { return 64; }
    std::vector<std::string> included, excluded;
    for (int i = 3; i < argc; ++i) {
        (argv[i][0] == '+' ? included : excluded).emplace_back(argv[i] + 1);
    }
    std::vector<std::string> datasets;
    std::unordered_map<std::string, std::vector<float>> data;
    const int m_last_call = prepare_imatrix(argv[2], datasets, included, excluded, data);
    // src/llama-quant.cpp, llama_model_quantize_impl: "check imatrix for nans or infs" (there: a runtime_error)
    for (const auto & kv : data) {
        for (float f : kv.second) {
            if (!std::isfinite(f)) {
                fprintf(stderr, "imatrix contains non-finite value %f\n", f);
                return 3;
            }
        }
    }
    FILE * out = fopen(argv[1], "wb");
    if (!out) { return 65; }
    put_u32(out, (uint32_t) m_last_call);
    put_u32(out, (uint32_t) datasets.size());
    for (const auto & d : datasets) { put_str(out, d); }
    std::map<std::string, const std::vector<float> *> sorted;
    for (const auto & kv : data) { sorted[kv.first] = &kv.second; }
    put_u32(out, (uint32_t) sorted.size());
    for (const auto & kv : sorted) {
        put_str(out, kv.first);
        put_u32(out, (uint32_t) kv.second->size());
        fwrite(kv.second->data(), sizeof(float), kv.second->size(), out);
    }
    return fclose(out) == 0 ? 0 : 66;
}
"""

LOG_SHIM = r"""
#include "log.h"
#include <cstdarg>
#include <cstdio>
// common/log.cpp stands in here: every message to stderr
struct common_log * common_log_main() { return nullptr; }
int common_log_get_verbosity_thold() { return 0; }
void common_log_add(struct common_log *, enum ggml_log_level, const char * fmt, ...) {
    va_list ap; va_start(ap, fmt); vfprintf(stderr, fmt, ap); va_end(ap);
}
"""


def _libdir() -> Path:
    spec = find_spec("llama_cpp")
    if spec is None or not spec.origin:
        raise Unavailable("llama-cpp-python is not installed (its libggml-base.so has the gguf API)")
    lib = Path(spec.origin).parent / "lib"
    if not (lib / "libggml-base.so").exists():
        raise Unavailable(f"no libggml-base.so in {lib}")
    return lib


def _quantize_part(tree: Path) -> str:
    """`load_imatrix` and `prepare_imatrix` of tools/quantize/quantize.cpp, as they are there."""
    text = (tree / "tools" / "quantize" / "quantize.cpp").read_text()
    start = text.find("static int load_imatrix(")
    end = text.find("static ggml_type parse_ggml_type(")
    if start < 0 or end < start or "static int prepare_imatrix(" not in text[start:end]:
        raise Unavailable("tools/quantize/quantize.cpp has no load_imatrix/prepare_imatrix where expected")
    return text[start:end]


_EXE: Path | None = None


def executable() -> Path:
    """The oracle, built once (see the module docstring)."""
    global _EXE
    if _EXE is not None:
        return _EXE
    tree = ggml_ref.llama_cpp_tree()
    root = tree.parent
    exe = root / f"imatrix-ref-{hashlib.sha256((DRIVER + LOG_SHIM).encode()).hexdigest()[:12]}"  # a new driver: rebuilt
    if exe.exists():
        _EXE = exe
        return exe
    libdir = _libdir()
    cxx = shutil.which("c++") or shutil.which("g++")
    if cxx is None:
        raise Unavailable("no C++ compiler (c++) to build llama.cpp's imatrix loader")
    work = root / f"imatrix-ref.build{os.getpid()}"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    (work / "main.cpp").write_text(DRIVER.replace("%QUANTIZE%", _quantize_part(tree)))
    (work / "log_shim.cpp").write_text(LOG_SHIM)
    # the loader compiled from its own folder: its "common.h" / "log.h" are common/'s
    tmp = work / "imatrix-ref"
    r = subprocess.run([cxx, "-std=c++17", "-O1", "-I", str(tree / "common"), "-I", str(tree / "include"),
                        "-I", str(tree / "ggml" / "include"), str(work / "main.cpp"),
                        str(tree / "common" / "imatrix-loader.cpp"), str(work / "log_shim.cpp"),
                        "-L", str(libdir), "-lggml-base", f"-Wl,-rpath,{libdir}", "-o", str(tmp)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        shutil.rmtree(work, ignore_errors=True)
        raise Unavailable(f"building llama.cpp's imatrix loader failed: {r.stderr.strip()[-300:]}")
    tmp.rename(exe)  # atomic: a parallel run sees the whole executable or none
    shutil.rmtree(work, ignore_errors=True)
    _EXE = exe
    return exe


@dataclass
class Loaded:
    """What llama-quantize took from the file: `entries` (name -> float32 importance, flat as its quantizer reads
    it), `datasets`, `chunk_count` (its `m_last_call`)."""

    entries: dict
    datasets: list
    chunk_count: int

    def quantize_kv(self, imatrix_arg: str) -> dict:
        """The `quantize.imatrix.*` key-values llama-quantize's main() writes (tools/quantize/quantize.cpp:
        strncpy(val_str, ..., 127), written as UINT32 by llama-quant.cpp), none when no entry is left."""
        if not self.entries:
            return {}
        out = {"quantize.imatrix.file": imatrix_arg.encode()[:127]}
        if self.datasets:
            out["quantize.imatrix.dataset"] = self.datasets[0][:127]
        out["quantize.imatrix.entries_count"] = len(self.entries)
        if self.chunk_count > 0:
            out["quantize.imatrix.chunks_count"] = self.chunk_count
        return out


class Refused(Exception):
    """llama.cpp's loader refused the file (or aborted on it): `code` its exit status, `message` its stderr."""

    def __init__(self, code: int, message: str):
        super().__init__(f"exit {code}: {message}")
        self.code, self.message = code, message


def load(path, include=(), exclude=(), tmp: Path | None = None) -> Loaded:
    """llama-quantize's loading of `path` with these `--include-weights` / `--exclude-weights`; `Refused` where
    it gives up (exit 1: the loader's refusal, 3: the non-finite check, a signal: a crash or an abort)."""
    exe = executable()
    out = Path(tmp or Path(path).parent) / f".imatrix-ref-{os.getpid()}.bin"
    args = [str(exe), str(out), str(path), *(f"+{p}" for p in include), *(f"-{p}" for p in exclude)]
    try:
        r = subprocess.run(args, capture_output=True, timeout=120)
        if r.returncode != 0:
            raise Refused(r.returncode, r.stderr.decode(errors="replace").strip()[-400:])
        raw = out.read_bytes()
    finally:
        out.unlink(missing_ok=True)
    return _parse(raw)


def _parse(raw: bytes) -> Loaded:
    pos = 0

    def u32() -> int:
        nonlocal pos
        v = struct.unpack_from("<I", raw, pos)[0]
        pos += 4
        return v

    def string() -> bytes:
        nonlocal pos
        n = u32()
        s = raw[pos:pos + n]
        pos += n
        return s

    chunk_count = struct.unpack("<i", struct.pack("<I", u32()))[0]
    datasets = [string() for _ in range(u32())]
    entries = {}
    for _ in range(u32()):
        name = string().decode("utf-8", "surrogateescape")
        n = u32()
        entries[name] = np.frombuffer(raw, dtype="<f4", count=n, offset=pos).astype(np.float32)
        pos += 4 * n
    assert pos == len(raw)
    return Loaded(entries, datasets, chunk_count)
