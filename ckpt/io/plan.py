"""The whole output decided before any data is read: files, tensor entries, sidecars and index.

Commands turn a checkpoint's logical view into a `Plan` (pure planning over names, dtypes and shapes);
`ckpt.io.output.execute` then writes it. `plan_files` is the one place safetensors and torch weight files
are named, sharded (huggingface_hub's own planner) and indexed.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import PurePosixPath
from typing import Callable

from ckpt.lazy import torch

from ckpt.dtypes import as_torch, nbytes, st_name
from ckpt.errors import CkptError
from ckpt.io.tensors import ByteRange, Tensor
from ckpt.io.writer import Entry, file_size


@dataclass
class OutTensor:
    """One output tensor: `source` read band by band, each band passed through `cast(band, buffers)`; no
    cast: the source's bytes are written as they are read.

    `stateless`: the cast depends on its band alone (it reads no tensor and keeps nothing across bands,
    like `ckpt.cast.Caster`), so the write stages may run it on its compute thread while later bands are
    read (ckpt.io.write_stages); any other cast runs on the reading thread, in band order.

    `dtype` may be a safetensors name ("BF16") instead of a torch dtype: a plan that only copies stored
    bytes (a layout conversion, a rename) is made and written without importing torch."""

    name: str
    dtype: torch.dtype | str
    shape: tuple[int, ...]
    source: Tensor
    cast: Callable[[torch.Tensor, object], torch.Tensor] | None = None
    gguf_type: int | None = None  # GGUF block type: `cast` makes uint8 blocks (ckpt.quant.gguf.encode)
    stateless: bool = False
    # the cast also takes the band's first row of `source` (`cast(band, buffers, start=row)`): a cast whose work
    # depends on where the band lies, still stateless (the importance rows of a 3-D expert tensor, --imatrix)
    positional: bool = False

    @property
    def entry(self) -> Entry:
        return Entry(self.name, self.dtype, self.shape, self.gguf_type)

    @property
    def torch_dtype(self) -> torch.dtype:
        return as_torch(self.dtype)

    def apply(self, x: torch.Tensor, buffers=None, start: int = 0) -> torch.Tensor:
        """The output band of source band `x` (whose first row is `start`): its cast, or `x` itself."""
        return x if self.cast is None else self.band_cast(start)(x, buffers)

    def band_cast(self, start: int):
        """The cast of the band whose first row of `source` is `start`."""
        if self.cast is None or not self.positional:
            return self.cast
        import functools

        return functools.partial(self.cast, start=start)

    def stored_cast(self):
        """(stored byte ranges, `fn(x, buffers) -> y`) where this tensor is a cast of stored bytes that runs without
        torch on numpy bands (`ckpt.cast.BandCast.host`: fp32/fp16/bf16 between each other), else None."""
        host = getattr(self.cast, "host", None)
        if host is None or self.positional:
            return None
        ranges = self.source.byte_ranges()
        if ranges is None or sum(r.length for r in ranges) != nbytes(self.source.dtype_name, self.source.shape):
            return None
        fn = host(self.source.dtype_name)
        return None if fn is None else (ranges, fn)

    def copy_ranges(self) -> list[ByteRange] | None:
        """The stored byte ranges that are exactly this tensor's output bytes (no cast, the source's dtype,
        every byte accounted for), or None: the write stage then copies them with the kernel
        (`ckpt.io.byte_copy`) instead of reading them."""
        if self.cast is not None:
            return None
        ranges = self.source.byte_ranges()
        if ranges is None or self.source.dtype_name != st_name(self.dtype):
            return None
        return ranges if sum(r.length for r in ranges) == self.entry.nbytes else None


FORMATS = ("safetensors", "torch")  # torch: the zip `torch.save` writes (ckpt.io.torchzip)
# Formats whose writer takes byte copies: a torch zip records each tensor's CRC32, which needs its bytes in
# Python anyway, so its tensors are read and written as before.
COPY_FORMATS = ("safetensors", "gguf")
# gguf (ckpt.io.gguf_writer) is chosen by `convert --to gguf-*`, not by --format.


@dataclass
class OutFile:
    relpath: str  # relative to the output root ("" when the output is a single file)
    metadata: dict[str, str]  # safetensors only: a torch zip has no place for it
    tensors: list[OutTensor]
    format: str = "safetensors"
    # torch.save names the zip's top folder after the file's stem; set from the final name
    # (`name_single_file`) when the output is one file.
    archive: str = "archive"
    fields: list = field(default_factory=list)  # gguf only: typed key-values (ckpt.io.gguf_writer.Field)

    def byte_copies(self) -> dict[str, list[ByteRange]]:
        """Tensor name -> the stored ranges the write stage copies with the kernel instead of reading them
        (`OutTensor.copy_ranges`; none in a format whose writer takes no copies: `COPY_FORMATS`)."""
        if self.format not in COPY_FORMATS:
            return {}
        return {t.name: r for t in self.tensors if (r := t.copy_ranges()) is not None}

    @property
    def nbytes(self) -> int:
        entries = [t.entry for t in self.tensors]
        if self.format == "gguf":
            from ckpt.io.gguf_writer import file_size as gguf_size

            return gguf_size(entries, self.fields)
        if self.format == "torch":
            from ckpt.io.torchzip import file_size as zip_size

            return zip_size(entries, self.archive)
        return file_size(entries, self.metadata)


@dataclass
class Plan:
    single_file: bool  # output is one .safetensors file, else a folder
    files: list[OutFile]
    indexes: dict[str, dict] = field(default_factory=dict)  # relpath -> index JSON
    copies: list[tuple[object, str]] = field(default_factory=list)  # (source Path, relpath)
    json_edits: dict[str, Callable[[dict], dict]] = field(default_factory=dict)  # relpath -> edit of a copied JSON
    generated: dict[str, dict | str] = field(default_factory=dict)  # relpath -> JSON (a GGUF's config) or text (a model card)
    notes: list[str] = field(default_factory=list)
    # the write stage that holds the work and gets every core: "read" (a model merge: the reads merge), "compute"
    # (K-quant GGUF: the cast encodes); None: each stage its share (ckpt.io.write_stages.stage_threads)
    busy_stage: str | None = None

    @property
    def nbytes(self) -> int:
        return sum(f.nbytes for f in self.files)

    def byte_copies(self) -> tuple[int, int]:
        """(tensors, bytes) the write stage copies with the kernel instead of reading them (`OutFile.byte_copies`)."""
        copies = [r for f in self.files for r in f.byte_copies().values()]
        return len(copies), sum(x.length for rs in copies for x in rs)


_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
SIZE_UNITS = "KB, MB, GB, TB (powers of 1000, as huggingface_hub counts), KiB, MiB, GiB, TiB (powers of 1024), B"


def parse_size(text: str | int, what: str = "") -> int:
    """"5GB" -> 5e9 bytes (decimal units, as huggingface_hub counts); "5GiB" -> 5 * 2**30; "1000B" bytes;
    units in any case. A number without a unit is refused, never read as bytes: `--max-shard-size 5`
    meant gigabytes, and bytes gave one shard per tensor. (A Python int is a count of bytes: its caller
    said so.) `what` names the option in the message (e.g. "--max-shard-size")."""
    bad = f"{what} {text}" if what else f"invalid size {text!r}"
    if isinstance(text, int) and not isinstance(text, bool):
        n = text
    else:
        m = re.fullmatch(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([A-Za-z]*)\s*", str(text))
        if m and not m[2]:
            raise CkptError(f"{bad}: no unit; write e.g. {m[1]}GB or {m[1]}MB (units: {SIZE_UNITS})")
        if not m or m[2].upper() not in _UNITS:
            raise CkptError(f"{bad}: not a size; write e.g. 5GB, 500MB, 2GiB (units: {SIZE_UNITS})")
        n = int(float(m[1]) * _UNITS[m[2].upper()])
    if n <= 0:
        raise CkptError(f"{bad}: must be positive")
    return n


EXTENSIONS = {"safetensors": ".safetensors", "torch": ".bin"}


def weights_name(stem: str, file_format: str, suffix: str = "") -> str:
    """The weight file a loader looks for: `stem` is the safetensors naming (`model`,
    `diffusion_pytorch_model`, `adapter_model`); torch format turns transformers' `model` into
    `pytorch_model` and `.safetensors` into `.bin` (`suffix`: a shard's `-00001-of-00002`)."""
    return (torch_stem(stem) if file_format == "torch" else stem) + suffix + EXTENSIONS[file_format]


def index_name(stem: str, file_format: str) -> str:
    """The shard index beside `weights_name(stem, format)`: `model.safetensors.index.json`,
    `pytorch_model.bin.index.json`, `diffusion_pytorch_model.safetensors.index.json`, as
    transformers' and diffusers' `save_pretrained` name it and their loaders look for it."""
    return weights_name(stem, file_format) + ".index.json"


def plan_files(tensors: list[OutTensor], stem: str, file_format: str = "safetensors",
               max_shard_size: int | None = None, metadata: dict[str, str] | None = None,
               prefix: str = "") -> tuple[list[OutFile], dict[str, dict]]:
    """The weight files of one output and their index ({} unless sharded): the only place an OutFile's
    name, format and zip archive name are decided together, so a torch request is never written as
    safetensors shards (convert --layout once built OutFiles itself and lost the format).

    `stem` "" is a one-file output: relpath "" (the file is OUT; `name_single_file` sets the archive name
    once OUT is known), never sharded. Otherwise the files are `prefix + weights_name(stem, ...)`, split by
    huggingface_hub's own planner (the names and index `save_pretrained` writes) past `max_shard_size`
    bytes; the archive name is the file's stem, as `torch.save` names it. Each file gets its own copy of
    `metadata` (a writer may add per-file keys)."""
    metadata = metadata or {}
    if not stem:
        if max_shard_size is not None:
            raise ValueError("a one-file output is not sharded: give the folder's file stem")
        return [OutFile("", dict(metadata), tensors, file_format)], {}
    if max_shard_size is None:
        return [weight_file(prefix + weights_name(stem, file_format), metadata, tensors, file_format)], {}
    from huggingface_hub import split_state_dict_into_shards_factory

    by_name = {t.name: t for t in tensors}
    split = split_state_dict_into_shards_factory(
        by_name, get_storage_size=lambda t: t.entry.nbytes,
        filename_pattern=weights_name(stem, file_format, "{suffix}"), max_shard_size=max_shard_size,
    )
    files = [weight_file(prefix + fn, metadata, [by_name[n] for n in names], file_format)
             for fn, names in split.filename_to_tensors.items()]
    if not split.is_sharded:
        return files, {}
    index = {"metadata": dict(split.metadata), "weight_map": dict(split.tensor_to_filename)}
    return files, {prefix + index_name(stem, file_format): index}


def weight_file(relpath: str, metadata: dict[str, str], tensors: list[OutTensor], file_format: str) -> OutFile:
    """One weight file of a folder output, `relpath` already its final name (`plan_files` names them; an
    output that keeps its input's files names them with `output_name`): the archive name is the file's
    stem, as `torch.save` writes it, and the metadata a copy of its own."""
    return OutFile(relpath, dict(metadata), tensors, file_format, archive=PurePosixPath(relpath).stem)


def name_single_file(plan: Plan, out) -> None:
    """A one-file output learns its final name only when OUT is known: the torch zip records it."""
    from pathlib import PurePath

    if plan.single_file and plan.files:
        plan.files[0].archive = PurePath(out).stem or "archive"


def output_name(relpath: str, file_format: str) -> str:
    """The output file name of a stored weight file in the chosen format."""
    if file_format == "torch":
        return torch_name(relpath)
    return safetensors_name(relpath)


def torch_name(relpath: str) -> str:
    """The torch-zip name of a stored weight file inside a folder output: the names transformers and
    diffusers load (`model.safetensors` -> `pytorch_model.bin`, `model-00001-of-00002.safetensors` ->
    `pytorch_model-00001-of-00002.bin`, `diffusion_pytorch_model.safetensors` -> `.bin`; any other
    `x.safetensors` -> `x.bin`); pickles keep their name (`lit_model.pth` stays `lit_model.pth`)."""
    head, _, name = relpath.rpartition("/")
    head = head + "/" if head else ""
    if name.endswith(".gguf"):
        return head + "pytorch_model.bin"
    if not name.endswith(".safetensors"):
        return relpath
    return head + torch_stem(name[: -len(".safetensors")]) + ".bin"


def torch_stem(stem: str) -> str:
    """`model` (transformers' safetensors stem, shard suffix allowed) is `pytorch_model` in torch format."""
    return re.sub(r"^model(?=$|-\d{5}-of-\d{5}$)", "pytorch_model", stem)


def safetensors_name(relpath: str) -> str:
    """The safetensors name for a stored weight file: pickles are renamed the way HF loaders expect."""
    if relpath.endswith(".gguf"):  # a GGUF LLM becomes an HF model folder, whose loaders want model.safetensors
        return relpath[: len(relpath) - len(relpath.rsplit("/", 1)[-1])] + "model.safetensors"
    name = re.sub(r"^pytorch_model", "model", relpath.rsplit("/", 1)[-1])
    name = re.sub(r"\.pth\.lora$", "-lora", name)  # LitGPT's lit_model.pth.lora
    name = re.sub(r"\.(bin|pt|pth|ckpt|safetensors)$", "", name)
    head = relpath.rsplit("/", 1)[0] + "/" if "/" in relpath else ""
    return f"{head}{name}.safetensors"
