"""What every writing command shares once it has a plan: the per-tensor casts and the write stage.

convert, dequant and merge-lora differ only in the logical tensors they feed in and the dtype each
output gets; choosing the output path, reporting, the dry run, the free-space and never-overwrite
checks, the progress bar and the atomic write are the same, and live here once.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

from ckpt.dtypes import ST_FLOAT, is_float, st_name
from ckpt.errors import CkptError
from ckpt.io.output import execute, preflight, target_state, published_paths
from ckpt.io.file_kinds import LITGPT_LORA, PICKLES, WEIGHT_SUFFIXES
from ckpt.io.gguf_split import partial_sets
from ckpt.io.plan import FORMATS, OutTensor, Plan
from ckpt.io.previous_output import is_previous_output, planned_relpaths
from ckpt.io.publish import CLEANED, cleanup_notes
from ckpt.io.tensors import Tensor
from ckpt.lazy import torch
from ckpt.progress import progress_bar
from ckpt.report import Report, plural


def cast_outputs(report: Report, dtype_of: Callable[[Tensor], torch.dtype | str | None], *, clamp: bool = False,
                 source_of: Callable[[Tensor], Tensor] = lambda t: t):
    """`make` for `plan_checkpoint`: each logical tensor written as `dtype_of(t)` (a torch dtype or its
    safetensors name; None: the dtype it had before any storage encoding, `natural_dtype`), rounded once by
    a Caster (which counts overflow and NaN/Inf); non-floating tensors pass through unchanged. `source_of(t)`
    may wrap the tensor first (merge-lora's MergedTensor).

    A tensor that keeps the dtype it is stored in, read from stored bytes without computing anything
    (`Tensor.byte_ranges`: a stored, renamed or sliced tensor, one a merge leaves alone), is written with no
    cast: its bytes are copied by the kernel (`ckpt.io.byte_copy`), never read, so its NaN/Inf values are
    not counted (`ckpt inspect --scan` counts them). Deciding that asks only the header's dtype names: a
    plan that copies every tensor needs no torch."""
    casters: dict = {}

    def make(t: Tensor) -> list[OutTensor]:
        src = source_of(t)
        dst = dtype_of(t)
        stored = src.byte_ranges() is not None and src.dtype_name == t.dtype_name
        if stored and (t.dtype_name not in ST_FLOAT or dst is None or st_name(dst) == t.dtype_name):
            return [OutTensor(t.name, t.dtype_name, tuple(t.shape), src)]
        if not is_float(t.dtype_name):
            return [OutTensor(t.name, t.dtype, tuple(t.shape), src)]
        dst = st_name(dst) if dst is not None else t.natural_dtype_name  # names: planned without torch
        from ckpt.cast import Caster

        c = casters.setdefault(dst, Caster(dst, report, clamp=clamp))
        return [OutTensor(t.name, dst, tuple(t.shape), src, c.band(t.name), stateless=True)]

    return make


def decoded_notes(ckpt, views) -> list[str]:
    """One line per component whose stored encoding was decoded, with how many keys it consumed."""
    lines = []
    for c, v in zip(ckpt.components, views):
        if v.formats:
            where = f"{c.subdir}: " if c.subdir else ""
            used = f"; {plural(len(v.consumed), 'stored key')} consumed (scales, markers, quantized data, renamed keys)"
            lines.append(f"{where}decoded {', '.join(v.formats)}" + (used if v.consumed else ""))
    return lines


def output_format(fmt: str | None, out: str | Path | None, default: str = "safetensors") -> str:
    """--format as given; else what -o's suffix says (`.pth`/`.pt`/`.bin`/`.ckpt` -> the torch zip,
    `.safetensors` -> safetensors); else `default`."""
    suffix = Path(out).suffix if out else ""
    implied = ("torch" if suffix in PICKLES or str(out or "").endswith(LITGPT_LORA) else
               "safetensors" if suffix == ".safetensors" else None)
    if fmt is None:
        return implied or default
    if fmt not in FORMATS:
        raise CkptError(f"--format {fmt}: choose one of {', '.join(FORMATS)}")
    if implied is not None and implied != fmt:
        raise CkptError(f"-o {out} names a {implied} file but --format is {fmt}")
    return fmt


def check_gguf_output(out: str | Path | None, what: str) -> None:
    """A GGUF output is one .gguf file: -o must end in .gguf, have no suffix, or be a folder to put it in.
    `what` says why the output is GGUF (`--to gguf-q8_0`, `--keep-format on a GGUF base`)."""
    if out and Path(out).suffix not in ("", ".gguf") and not Path(out).is_dir():
        raise CkptError(f"-o {out}: {what} writes a GGUF file; name it .gguf")


def file_ext(fmt: str) -> str:
    return ".pth" if fmt == "torch" else ".safetensors"


FOLDER_FORMAT_TAGS = {".pth": "torch"}  # default_output: a folder output's format, named (safetensors: untagged)


def default_output(src: str, ckpt_path: Path, suffix: str, folder: bool, ext: str = ".safetensors") -> Path:
    """Where the output goes when -o is not given, named after SRC with `-{suffix}`:
    `x.safetensors` / `x.ckpt` -> `x-fp16.safetensors` beside it (`x-fp16/` when the output is a
    folder); a folder `d` (or an index file in `d`) -> `d-fp16/` beside it; a hub id -> `./name-fp16`
    (`./name-sub-fp16` for a subfolder) in the current folder, never inside the hub cache. A name
    starting with "checkpoint" takes the suffix in front instead (`fp16-checkpoint-500/`, see `tagged`).

    The name carries what tells two outputs of SRC apart, so that runs differing only in that never meet
    at one default name ("already exists"): the target (in `suffix`) and the format. A file's format is
    its extension (`x-fp16.safetensors`, `x-fp16.pth`, `x-Q8_0.gguf`); a folder has none, so a folder in
    torch format is tagged (`d-fp16-torch/` beside `d-fp16/`)."""
    if folder and ext != ".safetensors":
        suffix = f"{suffix}-{FOLDER_FORMAT_TAGS.get(ext, ext.lstrip('.'))}"
    from ckpt.io.hub import local_path

    p = Path(src).expanduser()
    if local_path(src) is None:  # hub id: name it after the repo (and subfolder), write it here
        from ckpt.io.hub import parse_repo_spec

        repo, _, sub = parse_repo_spec(src)
        if ckpt_path.is_file() and not ckpt_path.name.endswith(".index.json"):
            name = ckpt_path.stem  # `owner/name/model.safetensors` -> ./model-fp16.safetensors
        else:
            name = "-".join([repo.split("/")[1]] + [s for s in (sub or "").split("/") if s])
        base = Path.cwd() / name
    elif p.is_file() and p.name.endswith(".index.json"):
        base = p.parent
    elif p.is_file() and p.name.endswith(LITGPT_LORA):  # lit_model.pth.lora: not `lit_model.pth-fp16...`
        stem = p.name[: -len(LITGPT_LORA)]
        if ext == ".pth" and not folder:  # torch format keeps LitGPT's LoRA suffix
            return p.parent / f"{stem}-{suffix}{LITGPT_LORA}"
        base = p.parent / f"{stem}-lora"
    elif p.is_file() and p.suffix == ".gguf":  # a part of a split GGUF names its set: `m-00002-of-00003.gguf` -> m
        from ckpt.io.gguf_parts import set_prefix

        base = p.parent / (set_prefix(p.name) or p.stem)
    elif p.is_file():
        base = p.parent / p.stem
    else:
        base = p
    if not base.name or base.name == "..":  # "." or "..": name it after the real folder
        base = base.resolve()
    name = tagged(base.name, suffix)
    return base.parent / (name if folder else f"{name}{ext}")


def tagged(name: str, tag: str) -> str:
    """`name-tag`; but `tag-name` for a name starting with "checkpoint": trainers (diffusers and
    accelerate scripts, SimpleTuner, HF Trainer) take every `checkpoint*` entry of their output folder for
    one of their own, resume from the newest and delete the oldest, so an output must never look like one
    (`checkpoint-4000` -> `dequant-checkpoint-4000`)."""
    return f"{tag}-{name}" if name.lower().startswith("checkpoint") else f"{name}-{tag}"


def output_path(out: str | Path | None, derived: Path, plan: Plan) -> Path:
    """-o as given, or the derived default. One rule for `-o` naming an existing folder, whatever the
    command (ckpt.io.previous_output): the output goes inside it under the default name, unless the
    output is a folder and that folder is a previous ckpt output (then it is the output itself, which
    --overwrite replaces). `-o path/` (ending in "/") for a one-file output also means "inside" (a missing
    folder is created, like any missing parent of -o)."""
    if not out:
        return derived
    p = Path(out).expanduser()
    is_dir = p.is_dir() and not p.is_symlink()
    if plan.single_file and (is_dir or str(out).endswith(("/", os.sep))):
        return p / derived.name
    if not plan.single_file and is_dir and not is_previous_output(p, planned_relpaths(plan)):
        return p / derived.name
    return p


def write(plan: Plan, out_path: Path, *, inputs: list[Path], report: Report, desc: str, device: torch.device,
          overwrite: bool, dry_run: bool, quiet: bool, shares=None) -> Path:
    """Report the plan's notes, check the target (never an input, free space, --overwrite), then either
    say what a dry run would write or write it atomically with a progress bar (`shares`: the tensors written by
    other processes, `ckpt.io.output.execute`)."""
    for n in plan.notes:
        report.note(n)
    parts = published_paths(plan, out_path)
    if len(parts) > 1:
        report.note(f"split GGUF of {len(parts)} parts beside each other: {', '.join(p.name for p in parts[:3])}"
                    f"{', ...' if len(parts) > 3 else ''} (llama.cpp loads the first; ckpt reads any)")
        partial = {p.name for s in partial_sets(out_path) for p in s.parts}  # refused, or replaced: not staying
        others = [n for n in _other_splits(parts) if n not in partial]
        if others:
            report.note(f"{plural(len(others), 'part')} of another split of this name stay beside the new ones "
                        f"({', '.join(others[:2])}{', ...' if len(others) > 2 else ''}): delete them, so that "
                        "nothing mixes the two sets")
    elif plan.single_file and plan.files and plan.files[0].format == "gguf" and _split_input(inputs):
        report.note("the split GGUF input is written as one GGUF file (convert --to gguf-* --max-shard-size "
                    "writes parts)")
    need = preflight(plan, out_path, inputs=inputs, overwrite=overwrite, dry_run=dry_run)
    note_byte_copies(plan, report, dry_run)
    if not plan.single_file and out_path.suffix in WEIGHT_SUFFIXES and not out_path.is_dir():
        raise CkptError(f"-o {out_path} names a file, but the output is a folder of {plural(len(plan.files), 'weight file')} "
                        "and their configs: name a folder")
    if dry_run:  # never refused for an existing output: says what a real run would do with it
        n_files = len(plan.files)
        kinds = " and ".join(sorted({f.format for f in plan.files})) or "weight"
        states = [(p, target_state(p, overwrite)) for p in parts]
        report.note(f"dry run: would write {plural(n_files, kinds + ' file')}, "
                    f"{len(plan.indexes)} index and {plural(len(plan.copies), 'other file')}, {human_size(need)}"
                    + "".join(f"; {p}: {state}" for p, state in states if state != "new"))
        return parts[0]
    since = len(CLEANED)
    with progress_bar(plan.nbytes, desc, quiet) as bar:
        execute(plan, out_path, inputs=inputs, overwrite=overwrite, device=device, progress=bar, shares=shares)
    for n in cleanup_notes(since):  # what stopped runs left that this one removed
        report.note(n)
    return parts[0]  # a split GGUF: its first part, the file llama.cpp loads


def note_byte_copies(plan: Plan, report: Report, dry_run: bool = False) -> None:
    """Say how many output tensors are stored bytes the kernel copies unread (`ckpt.io.byte_copy`), also in
    `--report` (`byte_copied`)."""
    from ckpt.io import output

    n, size = plan.byte_copies() if output.BYTE_COPY else (0, 0)
    report.byte_copied = {"tensors": n, "bytes": size}
    if n:
        verb = "would be" if dry_run else "was" if n == 1 else "were"
        report.note(f"{plural(n, 'tensor')} ({human_size(size)}) {verb} copied byte for byte from the input by the "
                    "kernel, unread (values unchanged; NaN/Inf in them not counted)")


def _other_splits(parts: list[Path]) -> list[str]:
    """Files beside the new parts named as parts of another split of the same name (another part count)."""
    from ckpt.io.gguf_parts import PART_RE

    prefix = PART_RE.fullmatch(parts[0].name)["prefix"]
    try:
        names = sorted(p.name for p in parts[0].parent.iterdir())
    except OSError:
        return []
    return [n for n in names if (m := PART_RE.fullmatch(n)) and m["prefix"] == prefix
            and int(m["count"]) != len(parts)]


def _split_input(inputs: list[Path]) -> bool:
    """Whether the inputs include parts of a split GGUF (`ckpt.io.gguf_split`; the reader checked the set)."""
    from ckpt.io.gguf_parts import PART_RE

    return any((m := PART_RE.fullmatch(Path(p).name)) is not None and int(m["count"]) > 1 for p in inputs)


def human_size(n: int) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} bytes"
