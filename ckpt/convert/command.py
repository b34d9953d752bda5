"""Planning and running a conversion. Also the Python API that `ckpt batch` calls."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ckpt import targets
from ckpt.devices import resolve_device
from ckpt.errors import CkptError
from ckpt.io.checkpoint import open_checkpoint
from ckpt.options import WriteOptions
from ckpt.quant.view import logical_view
from ckpt.report import Report
from ckpt.targets.casts import KEEP
from ckpt.run import default_output, file_ext, output_path, write


@dataclass
class ConvertOptions(WriteOptions):
    """convert's options are the writing options (`to` None: keep each tensor's dtype, only with --layout), and
    `mmproj`: a VLM folder's vision projector instead of its text model (`ckpt.targets.planners.gguf_mmproj_out`)."""

    mmproj: bool = False
    # --executor ray: the tensors written by a Ray cluster's workers (`ckpt.convert.ray_shares`), same bytes
    executor: str = "local"
    ray_address: str | None = None


def convert_operation(opts: ConvertOptions) -> str:
    """The `ckpt_operation` convert records in its outputs' metadata (`ckpt.io.checkpoint_plan.provenance`). The one
    spelling of it: batch's resume recognises a killed run's finished outputs by comparing with this."""
    to = targets.canonical(opts.to)
    return ("convert" + (f" --layout {opts.layout}" if opts.layout else "") + (f" --to {to}" if to else "")
            + (" --scaled" if opts.scaled else "") + (" --pure" if opts.pure else "")
            + "".join(f" {flag} {v}" for flag, v in _gguf_flag_values(opts))
            + (" --mmproj" if opts.mmproj else ""))


def _gguf_flag_values(opts):
    """(flag, value) of llama-quantize's flags given (`gguf_quant_flags.FLAGS`), in that order; the imatrix by its
    file name (the operation string is recorded in outputs: no directory of the user's)."""
    from pathlib import Path

    from ckpt.targets.planners.gguf_quant_flags import FLAGS

    for flag, key in FLAGS:
        v = getattr(opts, key, None)
        if not v:
            continue
        for one in (v if isinstance(v, list) else [v]):
            if one is True:
                yield flag, ""
            else:
                yield flag, Path(one).name if key == "imatrix" else one


MMPROJ_TO = "--mmproj writes a llama.cpp projector GGUF: give --to gguf-f16 (or gguf-bf16, gguf-f32, gguf-q8_0)"


def _target(opts: ConvertOptions):
    if opts.mmproj and opts.to is None:
        raise CkptError(MMPROJ_TO)
    if opts.to is None and opts.layout is None:
        raise CkptError("convert: give --to DTYPE, --layout diffusers|original, or both")
    if opts.keep_format:
        raise CkptError("--keep-format: convert changes no value; give --to DTYPE or --layout")
    target = targets.choose(opts, KEEP)
    if opts.mmproj and target.fmt != "gguf":
        raise CkptError(f"{MMPROJ_TO}, not --to {opts.to}")
    return target


def plan_convert(ckpt, opts: ConvertOptions, report: Report, file_format: str = "safetensors"):
    """The output's Plan and the inputs' logical views, planned by the output side (`ckpt.targets`)."""
    target = _target(opts)
    views = [logical_view(c) for c in ckpt.components]
    return targets.plan_output(target, ckpt, views, opts, report, file_format, convert_operation(opts)), views


def check_executor(opts, fmt: str) -> None:
    """--executor and --ray-address, refused before the input is opened (one line each)."""
    executor = getattr(opts, "executor", "local")
    if executor not in ("local", "ray"):
        raise CkptError(f"--executor {str(executor)[:40]}: not local or ray")
    if getattr(opts, "ray_address", None) and executor != "ray":
        raise CkptError("--ray-address: only with --executor ray")
    if executor == "ray" and fmt == "torch":
        raise CkptError("--executor ray: a torch file (--format torch) is written in order by one process (its "
                        "running CRC32); write safetensors or GGUF, or use --executor local")


def _output_format(opts: ConvertOptions, out) -> str:
    """safetensors / torch from --format and -o; a format of the target's own (GGUF) only from --to, never
    from a suffix alone. Decided before the input is opened (an unknown --to is refused here, in one line)."""
    return _target(opts).output_format(opts, out)


def convert(src: str, out: str | Path | None, opts: ConvertOptions, report: Report | None = None,
            cluster=None) -> tuple[Path, Report]:
    """Convert SRC; returns (output path, report). Raises CkptError on bad input (nothing written). `cluster`, with
    `opts.executor` "ray": what writes the tensors instead of this process, called as
    `cluster(src, opts, fmt, plan, out_path, report)` once the output is planned (`ckpt.batch.ray_shares.RayShares`;
    injected by the CLI: a command never imports batch or Ray)."""
    report = report or Report()
    # refuses --device cuda without one before reading; the CPU is None until a tensor is computed (a plan of
    # byte copies never imports torch)
    device = resolve_device(opts.device, heavy=False) if opts.device.startswith("cuda") else None
    fmt = _output_format(opts, out)
    check_executor(opts, fmt)
    with open_checkpoint(src) as ckpt:
        plan, views = plan_convert(ckpt, opts, report, fmt)
        target = _target(opts)
        if opts.device == "auto" and target.heavy(opts, views):  # a GPU only where there is math: decoding or
            device = resolve_device("auto")  # encoding quantized weights
        suffix = "-".join(x for x in (opts.layout, "mmproj" if opts.mmproj else None, target.suffix) if x)
        derived = default_output(src, ckpt.path, suffix, folder=not plan.single_file, ext=target.ext or file_ext(fmt))
        desc = "convert -> " + " ".join(x for x in (opts.layout, "mmproj" if opts.mmproj else None, target.label) if x)
        out_path = output_path(out, derived, plan)
        shares = None
        if opts.executor == "ray" and not opts.dry_run:  # connected before anything is written
            if cluster is None:
                raise CkptError("--executor ray: pass convert(cluster=ckpt.batch.ray_shares.RayShares), as the CLI does")
            shares = cluster(src, opts, fmt, plan, out_path, report)
        try:
            out_path = write(plan, out_path, inputs=ckpt.inputs, report=report, desc=desc, device=device,
                             overwrite=opts.overwrite, dry_run=opts.dry_run, quiet=opts.quiet, shares=shares)
        finally:
            if shares is not None:
                shares.close()
    return out_path, report
