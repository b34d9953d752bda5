"""llama-quantize's flags on every GGUF output (`--to gguf-*` of convert, merge-lora and merge): `--pure`,
`--imatrix FILE` with `--include-weights` / `--exclude-weights`, `--tensor-type PATTERN=TYPE`,
`--output-tensor-type`, `--token-embedding-type`, `--leave-output-tensor`, with llama-quantize's meaning
(tools/quantize/quantize.cpp and src/llama-quant.cpp of the llama.cpp the llama-cpp-python 0.3.36 sdist vendors).

`QuantFlags` is what the GGUF planners read: the mix's keyword arguments (`mix_kwargs`, for `llm_types` and
`ImageMix`), each quantized tensor's importance (`importance`: llama-quant.cpp's lookup and checks), and the
`quantize.imatrix.*` key-values llama-quantize writes (`fields`).

What llama-quantize does with an imatrix, per tensor it quantizes (its type changes): the entry of the tensor's
name is used where its size is `ne[0] * ne[2]` (the row length times the experts of a 3-D tensor: one slice per
expert); an entry of another size is an error ("imatrix size ... is different from tensor size ..."), except for
the token embedding, which is then quantized without one; a tensor without an entry is quantized without one (an
info line in llama.cpp; a counted warning here), unless its type requires one (IQ1/IQ2 types: an error). A file
none of whose entries names a tensor of the model is refused here (the issue's "imatrix of another model";
llama-quantize would quantize everything without it, silently).

Torch-free: the CLI checks the flags before any tensor is read.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ckpt.errors import CkptError

# (flag, WriteOptions field): the GGUF-only options, refused by every other target in this order
FLAGS = (("--imatrix", "imatrix"), ("--include-weights", "include_weights"),
         ("--exclude-weights", "exclude_weights"), ("--tensor-type", "tensor_type"),
         ("--output-tensor-type", "output_tensor_type"), ("--token-embedding-type", "token_embedding_type"),
         ("--leave-output-tensor", "leave_output_tensor"))


def given(opts) -> list[str]:
    """The GGUF-only flags `opts` sets (for the refusals of targets they do not apply to)."""
    return [flag for flag, key in FLAGS if getattr(opts, key, None)]


def writable_type_names() -> list[str]:
    """The GGML types ckpt can write (plain, the gguf package's legacy encoders, `ckpt.quant.kquants`), by ggml's
    names, in type-number order."""
    from ckpt.io.ggml_types import gguf_package
    from ckpt.quant.gguf import WRITABLE_FALLBACKS
    from ckpt.quant.kquants import encoders

    T = gguf_package().GGMLQuantizationType
    ours = encoders()
    return [t.name for t in T if t.name in ("F32", "F16", "BF16") or t.name in WRITABLE_FALLBACKS or t.name in ours]


@dataclass
class QuantFlags:
    pure: bool = False
    imatrix: object = None  # ckpt.io.imatrix.Imatrix
    imatrix_arg: str | None = None  # the path as given (llama-quantize writes it as quantize.imatrix.file)
    tensor_types: tuple = ()  # ((pattern, GGML type name), ...)
    output_tensor_type: str | None = None
    token_embedding_type: str | None = None
    quantize_output_tensor: bool = True
    used: set = field(default_factory=set)  # imatrix entries a planned tensor takes
    unmatched: list = field(default_factory=list)  # quantized tensors the imatrix has no entry for
    filtered_out: object = None  # the imatrix whose entries --include/--exclude-weights all left out

    @classmethod
    def from_options(cls, opts, quantized: bool = True) -> "QuantFlags":
        """The flags of `opts`, checked (the imatrix file read: header and index only). `quantized`: whether the
        target quantizes at all (the flags that choose types or importances need it)."""
        picked = [f for f in given(opts) if f != "--include-weights" and f != "--exclude-weights"]
        if picked and not quantized:
            raise CkptError(f"{picked[0]} does not apply to --to {opts.to} (nothing is quantized)")
        if (getattr(opts, "include_weights", None) or getattr(opts, "exclude_weights", None)) \
                and not getattr(opts, "imatrix", None):
            flag = "--include-weights" if getattr(opts, "include_weights", None) else "--exclude-weights"
            raise CkptError(f"{flag} chooses which tensors use the importance matrix: give --imatrix FILE")
        if getattr(opts, "include_weights", None) and getattr(opts, "exclude_weights", None):
            raise CkptError("--include-weights and --exclude-weights: choose one (llama-quantize takes one of them)")
        from ckpt.families.llm.tensor_type_option import ggml_type, parse_tensor_type

        imatrix, filtered_out = None, None
        if getattr(opts, "imatrix", None):
            imatrix = _load(opts.imatrix, tuple(opts.include_weights or ()), tuple(opts.exclude_weights or ()))
            if not imatrix.names():  # llama-quantize: an empty imatrix is no imatrix (no keys written either)
                imatrix, filtered_out = None, imatrix.path
        tensor_types = tuple(parse_tensor_type(t) for t in (getattr(opts, "tensor_type", None) or ()))
        writable = writable_type_names()
        for flag, t in ([("--tensor-type", t) for _, t in tensor_types]
                        + [(f, getattr(opts, k, None)) for f, k in (("--output-tensor-type", "output_tensor_type"),
                                                                    ("--token-embedding-type", "token_embedding_type"))]):
            if t and ggml_type(t, flag) not in writable:
                raise CkptError(f"{flag} {t}: ckpt cannot write {ggml_type(t, flag)} tensors (it has no encoder for "
                                "that type)")
        return cls(filtered_out=filtered_out,
            pure=bool(opts.pure), imatrix=imatrix, imatrix_arg=getattr(opts, "imatrix", None),
            tensor_types=tensor_types,
            output_tensor_type=(ggml_type(opts.output_tensor_type, "--output-tensor-type")
                                if getattr(opts, "output_tensor_type", None) else None),
            token_embedding_type=(ggml_type(opts.token_embedding_type, "--token-embedding-type")
                                  if getattr(opts, "token_embedding_type", None) else None),
            quantize_output_tensor=not getattr(opts, "leave_output_tensor", False))

    @property
    def has_imatrix(self) -> bool:
        return self.imatrix is not None

    def mix_kwargs(self) -> dict:
        """The keyword arguments of `llm_types` / `ImageMix` these flags give."""
        return dict(pure=self.pure, has_imatrix=self.has_imatrix,
                    imatrix_names=set(self.imatrix.names()) if self.imatrix is not None else None,
                    tensor_types=self.tensor_types, output_tensor_type=self.output_tensor_type,
                    token_embedding_type=self.token_embedding_type,
                    quantize_output_tensor=self.quantize_output_tensor)

    def importance(self, name: str, ggml_shape: tuple, ggml_type: str, report=None):
        """The importance llama-quantize gives `name` (stored as `ggml_type`, ggml dims `ggml_shape` = ne reversed,
        outermost first): float32 [n_mat, ne0] with n_mat the experts of a 3-D tensor (1 otherwise), or None (no
        imatrix, no entry, or a type whose quantizer takes none)."""
        if self.imatrix is None or ggml_type in ("F32", "F16", "BF16", "Q8_0"):
            return None
        if name not in self.imatrix:
            self.unmatched.append(name)
            return None
        ne0 = ggml_shape[-1]
        n_mat = ggml_shape[0] if len(ggml_shape) >= 3 else 1
        n_mat_file, n_file = self.imatrix.shape(name)
        if n_mat_file * n_file != ne0 * n_mat:
            msg = (f"imatrix size {n_mat_file * n_file} is different from tensor size {ne0 * n_mat} for {name} "
                   "(an importance matrix of another model?)")
            if name == "token_embd.weight" or name.endswith("token_embd.weight"):  # llama-quantize: a warning
                if report is not None:
                    report.warn(f"{self.imatrix.path}: {msg}; {name} quantized without it, as llama-quantize does")
                return None
            raise CkptError(f"{self.imatrix.path}: {msg}")
        self.used.add(name)
        return self.imatrix.importance(name).reshape(n_mat, ne0)

    def check_used(self, quantized_names: list[str]) -> None:
        """An imatrix none of whose entries names a quantized tensor: refused (module docstring)."""
        if self.imatrix is None or not quantized_names or self.used:
            return
        some = ", ".join(repr(n) for n in self.imatrix.names()[:2]) or "none"
        raise CkptError(f"{self.imatrix.path}: no entry of the importance matrix names a tensor of this model "
                        f"(it has {some}...; the model has {quantized_names[0]!r}...): an imatrix of another model?")

    def notes(self) -> list[str]:
        """The summary lines of the imatrix's use."""
        if self.filtered_out is not None:
            return [f"importance matrix {self.filtered_out.name}: --include-weights / --exclude-weights left no entry; "
                    "quantized without one, as llama-quantize does"]
        if self.imatrix is None:
            return []
        out = [f"importance matrix {self.imatrix.path.name}: {len(self.used)} tensors quantized with it"]
        if self.unmatched:
            out.append(f"{len(self.unmatched)} quantized tensors have no entry in it and were quantized without one "
                       f"(e.g. {self.unmatched[0]!r}), as llama-quantize does")
        return out

    def fields(self) -> list:
        """llama-quantize's `quantize.imatrix.*` key-values (its kv_overrides, set after the model's own keys):
        the file as given (at most 127 bytes), the first dataset, the entry count, the chunk count where known."""
        if self.imatrix is None:
            return []
        from ckpt.io.gguf_writer import string, uint32

        im = self.imatrix
        out = [string("quantize.imatrix.file", _c_string(self.imatrix_arg or str(im.path)))]
        if im.datasets:
            out.append(string("quantize.imatrix.dataset", _c_string(im.datasets[0])))
        out.append(uint32("quantize.imatrix.entries_count", im.entries_count))
        if im.chunk_count and im.chunk_count > 0:
            out.append(uint32("quantize.imatrix.chunks_count", im.chunk_count))
        return out


_LOADED: dict = {}


def _load(path: str, include: tuple, exclude: tuple):
    """`load_imatrix`, once per run: the target checks the flags before the input is read and plans with them
    after, and loading reads and checks every kept entry's values; the same file (path, size, mtime) with the
    same filters is the same Imatrix."""
    import os

    from ckpt.io.imatrix import load_imatrix

    try:
        st = os.stat(path)
        key = (os.path.abspath(path), st.st_size, st.st_mtime_ns, include, exclude)
    except OSError:  # load_imatrix says what is wrong with it
        key = None
    if key is not None and key in _LOADED:
        return _LOADED[key]
    imatrix = load_imatrix(path, include=include, exclude=exclude)
    if key is not None:
        _LOADED.clear()  # one file at a time: a batch run does not keep every imatrix it met
        _LOADED[key] = imatrix
    return imatrix


def _c_string(s: str) -> str:
    """strncpy(val_str, s, 127): the first 127 bytes of the UTF-8 (cut inside a character as C cuts it; the reader
    then sees the bytes gguf writes, decoded leniently)."""
    b = s.encode("utf-8")[:127]
    return b.decode("utf-8", "ignore")
