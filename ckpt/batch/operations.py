"""What each batch operation does to one checkpoint, through the same Python API as its single command.

An `Operation` is rebuilt from (name, params) in a worker process, so params hold only JSON values. It
knows its manifest signature (the op and the options that change the result), where an output goes
(mirrored under OUTDIR, or beside the input with the single command's default name), how much memory
one job may need at its peak, and how to run.
"""

from __future__ import annotations

import math
from pathlib import Path

from ckpt.batch.discover import Found, fingerprint
from ckpt.errors import CkptError
from ckpt.report import Report

FIXED_BYTES = 300 << 20  # interpreter, torch and the writer's band buffers


def _weight_files(path: Path) -> list[Path]:
    from ckpt.batch.discover import is_weight_file

    if path.is_file():
        return [path]
    return sorted(p for p in path.rglob("*") if p.is_file() and is_weight_file(p)
                  and not any(part.startswith(".") for part in p.relative_to(path).parts))


def header_estimate(path: Path, bytes_per_elem: int = 4, copies: int = 2) -> int:
    """Peak memory from headers alone: the largest tensor held `copies` times at `bytes_per_elem`
    (fp32 math), plus whole pickles (torch.load may materialise them), plus fixed buffers."""
    from ckpt.io.header import read_header

    largest, pickled = 0, 0
    for f in _weight_files(path):
        if f.suffix == ".safetensors":
            try:
                h = read_header(f)
            except CkptError:
                continue  # this job will fail with that error; it needs no memory
            for info in h.tensors.values():
                largest = max(largest, math.prod(info.shape))
        else:
            pickled += f.stat().st_size
    return largest * bytes_per_elem * copies + pickled + FIXED_BYTES


def plan_estimate(plan) -> int:
    """Peak memory of executing a plan: the largest tensor read and written at once (x2), plus buffers."""
    largest = 0
    for f in plan.files:
        for t in f.tensors:
            largest = max(largest, t.entry.nbytes, t.source.numel * t.source.dtype.itemsize)
    return 2 * largest + FIXED_BYTES


class Operation:
    name = ""
    writes = True  # False: nothing but the manifest and the report is produced (inspect)

    def __init__(self, params: dict):
        self.params = dict(params)

    def check_available(self) -> None:
        """Raise a CkptError when the operation cannot run at all (merge-lora: its fixed --lora or --base is missing)."""

    @property
    def signature(self) -> str:
        raise NotImplementedError

    @property
    def title(self) -> str:
        """The operation as the summary names it."""
        return self.signature

    def output_is_folder(self, item: Found) -> bool:
        return item.is_folder

    @property
    def ext(self) -> str:
        """The file suffix of an output that is one file."""
        return ".safetensors"

    def excluded_inputs(self) -> list[Path]:
        """Paths under FOLDER that are not jobs (merge-lora's fixed --lora or --base)."""
        return []

    def default_output(self, item: Found) -> Path:
        raise NotImplementedError

    def mirrored_output(self, item: Found, outdir: Path) -> Path:
        """OUTDIR/<the input's relative path>; a pickle becomes `.safetensors` (`ext`: `.gguf` for a GGUF
        output), a file whose output is a folder loses its suffix, a folder whose output is one file gains one."""
        p = outdir / item.rel
        if self.output_is_folder(item):
            return p if item.is_folder else p.with_suffix("")
        return p.with_name(p.name + self.ext) if item.is_folder else p.with_suffix(self.ext)

    def estimate(self, item: Found) -> int:
        return header_estimate(item.path)

    def owns(self, provenance: str | None, item: Found) -> bool:
        """Whether an output of ITEM whose `ckpt_operation` metadata reads `provenance` is what this operation
        writes (resume recognises a killed run's finished outputs by it)."""
        return provenance is not None and provenance == self.provenance(item)

    def provenance(self, item: Found) -> str:
        """The `ckpt_operation` ITEM's output carries: made by the command's own function (each command's
        `*_operation`), never spelt again here, so that what resume compares is what the command wrote."""
        return self.name

    def run(self, src: Path, out: Path | None, overwrite: bool) -> tuple[Path | None, Report, dict | None]:
        """(output path, report, a summary row for read-only operations)."""
        raise NotImplementedError


def _flag(name: str, value) -> str:
    if value is None or value is False or value == [] or value == ():
        return ""
    if value is True:
        return f" {name}"
    if isinstance(value, (list, tuple)):
        return "".join(f" {name} {v}" for v in value)
    return f" {name} {value}"


class ConvertOp(Operation):
    """params: ConvertOptions fields (to, keep, clamp, scaled, pure, layout, max_shard_size, device). Every
    --to the single command takes, GGUF included, and --layout: each output is named and shaped (one file or
    a folder) as `ckpt convert` names and shapes it."""

    name = "convert"

    def _options(self, **extra):
        from ckpt.convert import ConvertOptions

        return ConvertOptions(**{**self.params, **extra})

    def _target(self):
        from ckpt import targets

        return targets.resolve(self.params.get("to"), bool(self.params.get("scaled")))

    def check_available(self) -> None:
        """What convert refuses before opening an input, refused once for the whole batch (nothing runs):
        no --to and no --layout, an unknown --to, options its target refuses; and split GGUF parts, whose
        names depend on each model's size (a batch plans every output name before it runs)."""
        from ckpt import targets

        opts = self._options()
        if opts.to is None and opts.layout is None:
            raise CkptError("batch convert: give --to DTYPE, --layout diffusers|original, or both")
        if opts.to is not None and targets.get(opts.to) is None:
            raise CkptError(f"--to {opts.to}: unknown target (choose {', '.join(targets.unprefixed_names())})")
        self._target().check(opts)
        if opts.max_shard_size and self._target().fmt == "gguf":
            raise CkptError(f"batch convert: --max-shard-size with --to {opts.to} writes split GGUF parts, whose "
                            "names depend on each model's size; convert those models one by one")

    @property
    def signature(self) -> str:
        p = self.params
        return ("convert" + _flag("--layout", p.get("layout")) + _flag("--to", p.get("to"))
                + _flag("--keep", sorted(p.get("keep") or [])) + _flag("--clamp", p.get("clamp"))
                + _flag("--scaled", p.get("scaled")) + _flag("--pure", p.get("pure"))
                + _flag("--max-shard-size", p.get("max_shard_size")))

    @property
    def suffix(self) -> str:
        """The default name's tag: `[LAYOUT-]TARGET`, as `ckpt convert` tags its output."""
        scaled = bool(self.params.get("scaled"))
        target = self._target()
        # a --scaled the target refuses still names the output as asked; each run fails with the refusal
        tag = target.suffix + ("-scaled" if scaled and not target.is_scaled else "")
        return "-".join(x for x in (self.params.get("layout"), tag) if x)

    @property
    def ext(self) -> str:
        return self._target().ext or ".safetensors"

    def provenance(self, item: Found) -> str:
        from ckpt.convert.command import convert_operation

        return convert_operation(self._options())

    def output_is_folder(self, item: Found) -> bool:
        """A GGUF is one file; `--layout diffusers` writes a model (or pipeline) folder, `--layout original`
        one file (shards in a folder with --max-shard-size); otherwise the input's own shape."""
        shards = bool(self.params.get("max_shard_size"))
        if self._target().fmt == "gguf":
            return False
        layout = self.params.get("layout")
        if layout == "diffusers":
            return True
        if layout == "original":
            return shards
        return item.is_folder or shards

    def default_output(self, item: Found) -> Path:
        from ckpt.run import default_output

        return default_output(str(item.path), item.path, self.suffix, folder=self.output_is_folder(item),
                              ext=self.ext)

    def estimate(self, item: Found) -> int:
        from ckpt.convert.command import plan_convert
        from ckpt.io.checkpoint import open_checkpoint
        from ckpt.io.file_kinds import PICKLES

        if any(f.suffix in PICKLES for f in _weight_files(item.path)):
            return header_estimate(item.path)  # opening would load the pickle just to plan
        try:
            with open_checkpoint(str(item.path)) as ckpt:
                plan, _ = plan_convert(ckpt, self._options(quiet=True), Report())
        except CkptError:
            return FIXED_BYTES  # fails at once when run
        return plan_estimate(plan)

    def run(self, src, out, overwrite):
        from ckpt.convert import convert

        return (*convert(str(src), out, self._options(overwrite=overwrite, quiet=True)), None)


class DequantOp(Operation):
    """params: DequantOptions fields (to, shapes_from, qtype, max_shard_size, device). A checkpoint with
    nothing quantized is a success with no output (the API writes nothing and says what it holds)."""

    name = "dequant"

    def _options(self, **extra):
        from ckpt.dequant.command import DequantOptions

        return DequantOptions(**{**self.params, **extra})

    @property
    def signature(self) -> str:
        p = self.params
        return ("dequant" + _flag("--to", p.get("to")) + _flag("--shapes-from", p.get("shapes_from"))
                + _flag("--qtype", p.get("qtype")) + _flag("--max-shard-size", p.get("max_shard_size")))

    def provenance(self, item: Found) -> str:
        from ckpt.dequant.command import dequant_operation

        return dequant_operation(self._options())

    def output_is_folder(self, item: Found) -> bool:
        return item.is_folder or bool(self.params.get("max_shard_size"))

    def default_output(self, item: Found) -> Path:
        from ckpt.run import default_output

        suffix = "dequant" + (f"-{self.params['to']}" if self.params.get("to") else "")
        return default_output(str(item.path), item.path, suffix, folder=self.output_is_folder(item))

    def estimate(self, item: Found) -> int:
        from ckpt.io.checkpoint import open_checkpoint
        from ckpt.io.file_kinds import PICKLES
        from ckpt.dequant.command import plan_dequant

        if any(f.suffix in PICKLES for f in _weight_files(item.path)):
            return header_estimate(item.path)
        try:
            with open_checkpoint(str(item.path)) as ckpt:
                plan, _ = plan_dequant(ckpt, self._options(quiet=True), Report())
        except CkptError:
            return FIXED_BYTES
        return plan_estimate(plan) if plan is not None else FIXED_BYTES

    def run(self, src, out, overwrite):
        from ckpt.dequant.command import dequant

        return (*dequant(str(src), out, self._options(overwrite=overwrite, quiet=True)), None)


class MergeLoraOp(Operation):
    """params: `lora` (that one LoRA merged into every discovered base) or `base` (every discovered LoRA
    merged into that base), and MergeLoraOptions fields (ratios: one value, to, allow_unmatched, device)."""

    name = "merge-lora"
    OWN = ("lora", "base")

    def _options(self, **extra):
        from ckpt.merge_lora.command import MergeLoraOptions

        return MergeLoraOptions(**{k: v for k, v in self.params.items() if k not in self.OWN}, **extra)

    def check_available(self):
        role, path = self.fixed
        if not path.exists():
            raise CkptError(f"--{role} {path}: no such file or directory")

    @property
    def fixed(self) -> tuple[str, Path]:
        if self.params.get("lora"):
            return "lora", Path(self.params["lora"])
        return "base", Path(self.params["base"])

    def excluded_inputs(self) -> list[Path]:
        return [self.fixed[1]]

    @property
    def signature(self) -> str:
        """Names the fixed side with its fingerprint: when that LoRA or base changes, everything is redone."""
        role, path = self.fixed
        size, mtime = fingerprint(path)
        p = self.params
        return (f"merge-lora --{role} {path.resolve()} [{size} bytes, mtime_ns {mtime}]"
                + _flag("--ratio", p.get("ratios")) + _flag("--to", p.get("to"))
                + _flag("--allow-unmatched", p.get("allow_unmatched")))

    def provenance(self, item: Found) -> str:
        """merge-lora records the LoRA's file name and ratio: `merge-lora NAME@R [--to X]`."""
        from ckpt.merge_lora.command import merge_operation

        role, path = self.fixed
        lora = path if role == "lora" else item.path
        return merge_operation([lora.name], (self.params.get("ratios") or [1.0])[:1], self._options())

    @property
    def title(self) -> str:
        role, path = self.fixed
        return self.signature.split(" [", 1)[0].replace(str(path.resolve()), str(path)) + \
            self.signature.split("]", 1)[1]

    @property
    def gguf(self) -> bool:
        """--to gguf-TYPE: the merged model as one .gguf file, as `ckpt merge-lora --to gguf-TYPE` writes it."""
        return str(self.params.get("to") or "").startswith("gguf-")

    @property
    def ext(self) -> str:
        return ".gguf" if self.gguf else ".safetensors"

    def output_is_folder(self, item: Found) -> bool:
        role, path = self.fixed
        if self.gguf:
            return False
        return item.is_folder if role == "lora" else path.is_dir()

    def _pair_name(self, item: Found) -> str:
        """Many LoRAs into one base: `<base>+<lora>`, so that each output says what it holds."""
        _, base = self.fixed
        base_stem = base.name if base.is_dir() else base.stem
        lora_stem = item.path.name if item.is_folder else item.path.stem
        name = f"{base_stem}+{lora_stem}"
        if name.lower().startswith("checkpoint"):  # never a name a trainer takes for its own (ckpt.run.tagged)
            name = f"merged-{name}"
        return name if self.output_is_folder(item) else f"{name}{self.ext}"

    def default_output(self, item: Found) -> Path:
        role, _ = self.fixed
        if role == "lora":  # the single command's default: BASE-merged beside BASE
            from ckpt.run import default_output

            return default_output(str(item.path), item.path, "merged", folder=self.output_is_folder(item),
                                  ext=self.ext)
        return item.path.parent / self._pair_name(item)

    def mirrored_output(self, item: Found, outdir: Path) -> Path:
        role, _ = self.fixed
        if role == "lora":
            return super().mirrored_output(item, outdir)
        return (outdir / item.rel).parent / self._pair_name(item)

    def estimate(self, item: Found) -> int:
        role, path = self.fixed
        base = item.path if role == "lora" else path
        lora = path if role == "lora" else item.path
        # base tensor, delta and result in fp32, plus the LoRA factors
        return header_estimate(base, 4, 3) + sum(f.stat().st_size for f in _weight_files(lora))

    def run(self, src, out, overwrite):
        from ckpt.merge_lora.command import merge_lora

        role, path = self.fixed
        opts = self._options(overwrite=overwrite, quiet=True)
        base, lora = (src, path) if role == "lora" else (path, src)
        out_path, report = merge_lora(str(base), [str(lora)], out, opts)
        for line in getattr(report, "summary", []):
            report.note(line)
        return out_path, report, None


class InspectOp(Operation):
    """Reads headers only (values too with `scan`) and returns one flat summary row per checkpoint,
    for the CSV; it writes no output and keeps no manifest (it is cheap to redo)."""

    name = "inspect"
    writes = False
    COLUMNS = ("input", "status", "kind", "model_kind", "family", "encodings", "dtypes", "tensors",
               "parameters", "bytes", "components", "warnings", "error")

    @property
    def signature(self) -> str:
        return "inspect" + _flag("--scan", self.params.get("scan"))

    def default_output(self, item):
        return None

    def mirrored_output(self, item, outdir):
        return None

    def estimate(self, item):
        return header_estimate(item.path, 4, 1) if self.params.get("scan") else header_estimate(item.path, 0, 0)

    def run(self, src, out, overwrite):
        from ckpt.inspect import inspect

        rep = inspect(str(src), scan=bool(self.params.get("scan")))
        comps = rep["components"]
        dtypes: dict[str, int] = {}
        for c in comps:
            for name, d in c["dtypes"].items():
                dtypes[name] = dtypes.get(name, 0) + d["tensors"]

        def joined(key):
            return "; ".join(dict.fromkeys(str(v) for c in comps for v in
                                           (c[key] if isinstance(c[key], list) else [c[key]]) if v))

        row = {"kind": rep["kind"], "model_kind": joined("kind"), "family": joined("family"),
               "encodings": joined("encodings"), "dtypes": "; ".join(f"{k}:{v}" for k, v in sorted(dtypes.items())),
               **rep["totals"], "components": len(comps), "warnings": " | ".join(rep["warnings"])}
        report = Report()
        for w in rep["warnings"]:
            report.note(f"warning: {w}")
        return None, report, row


OPERATIONS = {op.name: op for op in (ConvertOp, DequantOp, MergeLoraOp, InspectOp)}


def make_operation(name: str, params: dict) -> Operation:
    try:
        return OPERATIONS[name](params)
    except KeyError:
        raise CkptError(f"batch: unknown operation {name!r} (choose {', '.join(OPERATIONS)})") from None
