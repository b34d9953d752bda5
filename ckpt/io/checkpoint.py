"""Opening a checkpoint lazily: what files hold which tensors, and what else travels with them.

A `Checkpoint` is a local file or folder (hub ids are resolved to the local cache first, see
`ckpt.io.hub`). It holds one or more `Component`s: a set of weights with one layout (one file, a
sharded set with its index, or the weights of a model folder). A diffusers pipeline folder has one
component per subfolder. Only headers are read here; tensor data is read later, band by band.

SRC may also name an index file (that sharded set, with its sidecars). In a folder, an index wins over
loose files, safetensors win over pickles, `name.safetensors` wins over `name.<variant>.safetensors`;
weight files left unused that way are noted and never copied unconverted into an output.
"""

from __future__ import annotations

import os
import re
import stat
from dataclasses import dataclass, field
from pathlib import Path

from ckpt.errors import file_error
from ckpt.io.file_kinds import GGUF, LITGPT_LORA, NOT_WEIGHTS, PICKLES, SAFETENSORS, is_training_state
from ckpt.io.header import read_header
from ckpt.io.pickles import load_pickle_state_dict
from ckpt.io.small_inputs import check_regular, json_kind, load_json
from ckpt.io.tensors import FileHandles, PickleTensor, RawTensor, Tensor

@dataclass
class WeightFile:
    relpath: str  # relative to the component folder
    path: Path
    kind: str  # "safetensors" | "pickle" | "gguf"
    metadata: dict[str, str]
    names: list[str]
    gguf: object | None = None  # the GGUFHeader of a .gguf file (typed metadata the decoder reads)

    @property
    def paths(self) -> list[Path]:
        """The files it reads: itself, or every part of a split GGUF (`ckpt.io.gguf.open_split_set`)."""
        return list(self.gguf.parts) if self.gguf is not None and self.gguf.parts else [self.path]


@dataclass
class Component:
    """One set of weights: `subdir` ("" for the top) relative to the checkpoint root."""

    subdir: str
    files: list[WeightFile]
    tensors: dict[str, Tensor]
    index_name: str | None = None
    config: dict | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def sharded(self) -> bool:
        return self.index_name is not None

    @property
    def where(self):
        """The path an error about this component names: its file, or its folder when it has several."""
        return self.files[0].path if len(self.files) == 1 else self.files[0].path.parent


@dataclass
class Checkpoint:
    spec: str
    path: Path
    kind: str  # "file" | "folder" | "pipeline"
    components: list[Component]
    copies: list[str]  # non-weight files (relative to path) that travel with the weights
    handles: FileHandles
    state: list[str] = field(default_factory=list)  # trainer state found beside the weights (never copied)

    @property
    def inputs(self) -> list[Path]:
        """Every file this checkpoint reads or copies, and its folder (unless it is one file): an output
        may never replace one of them, nor lie inside that folder (a second model in it)."""
        weights = [p for c in self.components for f in c.files for p in f.paths]
        indexes = [self.path / c.subdir / c.index_name for c in self.components if c.index_name]
        folder = [self.path] if self.kind != "file" else []
        return folder + weights + indexes + [self.path / rel for rel in self.copies]

    def close(self):
        self.handles.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def open_checkpoint(spec: str) -> Checkpoint:
    """Open SRC: a local file, a local folder, or a hub id `owner/name[@rev][/subfolder]`."""
    from ckpt.io.hub import check_readable, check_source, local_path, resolve_repo

    path = local_path(spec)  # a folder on the way that cannot be entered: "permission denied"
    if path is None:
        check_source(spec)
        path = resolve_repo(spec)
    else:
        check_readable(path)
    if not path.is_dir():
        check_regular(path)  # a FIFO or a device (/dev/zero), or a link to one: said as what it is, never read
    handles = FileHandles()
    try:
        if path.is_file() and path.name.endswith(".index.json"):
            return _open_index(spec, path, handles)
        if path.is_file():
            comp = _component_from_files(path.parent, [path], handles, subdir="")
            return Checkpoint(spec, path, "file", [comp], [], handles)
        return _open_folder(spec, path, handles)
    except BaseException:
        handles.close()
        raise


def _check_entry(p: Path) -> None:
    """Refuse an entry of an input folder that is neither a regular file nor a folder (a FIFO, a device, a
    socket, or a link to one): a weight file, index or config.json that is one would block or be read without
    end, and any other would be left out without a word. A link to nothing is not part of the checkpoint."""
    try:
        st = os.stat(p)
    except OSError:
        return
    if not (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode)):
        check_regular(p)


def _open_folder(spec: str, root: Path, handles: FileHandles) -> Checkpoint:
    top = _component_in(root, root, handles)
    subs = []
    for d in sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")):
        c = _component_in(root, d, handles)
        if c is not None:
            subs.append(c)
    comps = ([top] if top else []) + subs
    if not comps:
        raise file_error(root, "no weights found (no *.safetensors, *.safetensors.index.json, torch pickle or .gguf)")
    kind = "pipeline" if subs else "folder"
    copies, state = _sidecars(root, comps, recursive=True)
    return Checkpoint(spec, root, kind, comps, copies, handles, state)


def _open_index(spec: str, index: Path, handles: FileHandles) -> Checkpoint:
    """An index file named directly: that sharded set, with the sidecars beside it."""
    folder = index.parent
    comp = _component_from_index(folder, index, handles, "")
    copies, state = _sidecars(folder, [comp], recursive=False)
    return Checkpoint(spec, folder, "folder", [comp], copies, handles, state)


def _is_weight_like(p: Path) -> bool:
    return (p.suffix in SAFETENSORS or p.suffix == GGUF or (p.suffix in PICKLES and not NOT_WEIGHTS.search(p.name))
            or p.name.endswith(LITGPT_LORA) or bool(re.search(r"\.(safetensors|bin|pt|pth)\.index(\.\w+)?\.json$", p.name)))


def _sidecars(root: Path, comps: list[Component], recursive: bool) -> tuple[list[str], list[str]]:
    """Non-weight files that travel with the weights, and trainer state that does not (relative to `root`).

    Weight files of a component folder that the component does not use (a `.bin` twin of a
    `.safetensors`, an `*.fp16.safetensors` variant, another index) are left out with a note rather
    than copied unconverted into the output."""
    used = {p for c in comps for f in c.files for p in f.paths} | {root / c.subdir / c.index_name for c in comps if c.index_name}
    comp_dirs = {root / c.subdir for c in comps}
    by_dir = {root / c.subdir: c for c in comps}
    out, state = [], []
    for p in sorted(root.rglob("*") if recursive else root.iterdir()):
        rel = p.relative_to(root)
        if p in used or any(part.startswith(".") for part in rel.parts):
            continue
        _check_entry(p)
        if not p.is_file():
            continue
        if is_training_state(p):
            # Trainer state (optimizer, scheduler, RNG, progress) of a checkpoint-N folder is not part of a model.
            (by_dir.get(p.parent) or comps[0]).notes.append(f"{rel}: training state, not copied")
            state.append(str(rel))
            continue
        if p.parent in comp_dirs and _is_weight_like(p):
            by_dir[p.parent].notes.append(f"{rel}: not used and not copied (the weights come from "
                                          f"{', '.join(f.relpath for f in by_dir[p.parent].files[:2])})")
            continue
        out.append(str(rel))
    return out, state


def _component_in(root: Path, folder: Path, handles: FileHandles) -> Component | None:
    """The weights directly in `folder`: an index wins, then safetensors files, then pickles."""
    subdir = "" if folder == root else str(folder.relative_to(root))
    entries = sorted(p for p in folder.iterdir() if not p.name.startswith("."))
    for p in entries:
        _check_entry(p)
    files = [p for p in entries if p.is_file()]
    indexes = [p for p in files if p.name.endswith(".safetensors.index.json")]
    if not indexes:
        indexes = [p for p in files if re.search(r"\.(bin|pt|pth)\.index\.json$", p.name)]
    if len(indexes) > 1:
        raise file_error(folder, f"several index files ({', '.join(p.name for p in indexes)}); pass one of them")
    if indexes:
        return _component_from_index(folder, indexes[0], handles, subdir)
    st = _without_variants([p for p in files if p.suffix in SAFETENSORS])
    if not st:
        st = [p for p in files if p.suffix in PICKLES and not NOT_WEIGHTS.search(p.name)]
    if not st:
        st = _one_split_set([p for p in files if p.suffix == GGUF])
        if len(st) > 1:  # a repository of quantizations of one model: each file is a whole model
            raise file_error(folder, f"several GGUF files ({', '.join(p.name for p in st[:4])}"
                                     f"{', ...' if len(st) > 4 else ''}); pass the one you mean")
    if not st:  # a LitGPT finetune folder holds only its LoRA: those are its weights
        st = [p for p in files if p.name.endswith(LITGPT_LORA)]
    if not st:
        return None
    return _component_from_files(folder, st, handles, subdir)


def _one_split_set(paths: list[Path]) -> list[Path]:
    """The GGUF files of a folder, or only the first of them when they are all the parts of one split set
    (`m-00001-of-00003.gguf` ...: reading it reads the others)."""
    from ckpt.io.gguf_parts import PART_RE

    parts = [PART_RE.fullmatch(p.name) for p in paths]
    if len(paths) > 1 and all(parts) and len({(m["prefix"], m["count"]) for m in parts}) == 1:
        return [min(paths, key=lambda p: p.name)]
    return paths


def _without_variants(paths: list[Path]) -> list[Path]:
    """Drop `name.<variant>.safetensors` when `name.safetensors` is there too (diffusers variants)."""
    names = {p.name for p in paths}

    def plain(name: str) -> str:  # "v1.5.fp16.safetensors" -> "v1.5.safetensors"
        return name[: -len(".safetensors")].rsplit(".", 1)[0] + ".safetensors"

    return [p for p in paths if not (plain(p.name) != p.name and plain(p.name) in names)]


def _config(folder: Path) -> dict | None:
    """The folder's config.json as a dict. Everything downstream (inspect, convert, --layout, the decoders)
    reads it with `.get`, so a file that is not a JSON object (a list, a string, broken JSON, unreadable)
    is refused here, once, naming the file, rather than failing later as an AttributeError."""
    p = folder / "config.json"
    if not (p.exists() or p.is_symlink()):
        return None
    cfg = load_json(p)  # a regular file of a sane size, valid UTF-8 JSON (`ckpt.io.small_inputs`)
    if not isinstance(cfg, dict):
        raise file_error(p, f"holds a JSON {json_kind(cfg)}, not the JSON object a model config is")
    return cfg


def sniff(path: Path) -> str | None:
    """What a file holds by its first bytes: "safetensors" (an 8-byte little-endian header length, then
    the JSON header's "{"), "gguf" (its magic), "pickle" (torch.save's zip, or a legacy pickle stream), or
    None. For a file whose name does not say (`q4`, `model.v2`): the content decides, as loaders do."""
    try:
        with open(path, "rb") as f:
            head = f.read(16)
    except OSError:
        return None
    if head[:4] == b"GGUF":
        return "gguf"
    if head[:4] == b"PK\x03\x04":
        return "pickle"
    if len(head) >= 9 and head[8:9] == b"{" and int.from_bytes(head[:8], "little") >= 2:
        return "safetensors"
    if head[:1] == b"\x80" and head[1:2] in (b"\x02", b"\x03", b"\x04", b"\x05"):
        return "pickle"
    return None


def file_kind(path: Path) -> str | None:
    """"safetensors" | "pickle" | "gguf" by the file's suffix, else by its content (`sniff`)."""
    if path.suffix in SAFETENSORS:
        return "safetensors"
    if path.suffix in PICKLES or path.name.endswith(LITGPT_LORA):
        return "pickle"
    if path.suffix == GGUF:
        return "gguf"
    return sniff(path)


def _load_file(path: Path, relpath: str, handles: FileHandles, tensors: dict, notes: list) -> WeightFile:
    kind = file_kind(path)
    if kind == "safetensors":
        h = read_header(path)
        _no_duplicates(path, h.tensors, tensors)
        for name, info in h.tensors.items():
            tensors[name] = RawTensor(info, handles, relpath)
        return WeightFile(relpath, path, "safetensors", h.metadata, list(h.tensors))
    if kind == "pickle":
        sd, note, mapped = load_pickle_state_dict(path)
        if note:
            notes.append(note)
        _no_duplicates(path, sd, tensors)
        for name, value in sd.items():
            tensors[name] = PickleTensor(name, value, relpath, mapped)
        return WeightFile(relpath, path, "pickle", {"format": "pt"}, list(sd))
    if kind == "gguf":
        from ckpt.io.gguf import read_gguf_header

        h = read_gguf_header(path, handles, relpath)
        if h.parts:  # a split set: one weight file, named by its first part (`ckpt.io.gguf_split`)
            from ckpt.io.gguf import split_note

            path, relpath = h.path, h.path.name
            notes.append(split_note(h))
        _no_duplicates(path, h.tensors, tensors)
        tensors.update(h.tensors)
        return WeightFile(relpath, path, "gguf", {}, list(h.tensors), gguf=h)
    if not path.suffix:
        raise file_error(path, "no file-name suffix, and its content is not safetensors, GGUF or a torch pickle")
    raise file_error(path, f"unsupported file type {path.suffix!r} (expected .safetensors, .gguf or a torch pickle)")


def _no_duplicates(path: Path, new, seen: dict[str, Tensor]) -> None:
    dup = next((n for n in new if n in seen), None)
    if dup is not None:
        raise file_error(path, f"tensor {dup!r} also appears in {seen[dup].home} in the same folder "
                               "(two copies of one model? pass the file you mean)")


def _component_from_files(folder: Path, paths: list[Path], handles, subdir: str) -> Component:
    tensors: dict[str, Tensor] = {}
    notes: list[str] = []
    files = []
    for p in paths:
        files.append(_load_file(p, p.name, handles, tensors, notes))
    return Component(subdir, files, tensors, None, _config(folder), notes)


def _component_from_index(folder: Path, index: Path, handles, subdir: str) -> Component:
    value = load_json(index)  # a regular file of a sane size, valid UTF-8 JSON (`ckpt.io.small_inputs`)
    weight_map = value.get("weight_map") if isinstance(value, dict) else None
    if not isinstance(weight_map, dict):
        raise file_error(index, "not a valid index (needs a JSON object with a weight_map)")
    tensors: dict[str, Tensor] = {}
    notes: list[str] = []
    files = []
    bad = next(((k, v) for k, v in weight_map.items() if not isinstance(v, str)), None)
    if bad is not None:
        raise file_error(index, f"maps {bad[0]!r} to {bad[1]!r}, which is not a shard file name")
    for shard in dict.fromkeys(weight_map.values()):
        if not isinstance(shard, str) or "/" in shard or "\\" in shard or shard in ("", ".", ".."):
            raise file_error(index, f"names shard {shard!r}, which is not a file name in its folder")
        p = folder / shard
        if not (p.exists() or p.is_symlink()):
            raise file_error(index, f"names shard {shard!r}, which does not exist")
        check_regular(p)  # a shard that is a FIFO or a device: said as what it is
        files.append(_load_file(p, shard, handles, tensors, notes))
    for name, shard in weight_map.items():
        t = tensors.get(name)
        if t is None or t.home != shard:
            raise file_error(index, f"maps {name!r} to {shard!r}, but that shard has no such tensor")
    extra = [n for n in tensors if n not in weight_map]
    if extra:
        raise file_error(index, f"shard {tensors[extra[0]].home!r} holds {extra[0]!r}, which the index does not list")
    return Component(subdir, files, tensors, index.name, _config(folder), notes)
