"""`Target`: what a model is written as, the one interface every writing command plans through (convert, dequant,
merge-lora, merge): a `--to` name, the command's default when `--to` is not given (`ckpt.targets.casts.Natural`),
or `--keep-format` (`ckpt.targets.keep_format`).

A target names itself, the suffix of the default output name (`x-fp16.safetensors`, `x-Q8_0.gguf`) and
the file suffix it writes when it writes a format of its own; it refuses the options that do not apply
to it and plans the output from the command's logical views (decoded, merged: whatever the command made of
its inputs). Defining one imports no torch: the registry is read by `ckpt --help`.
"""

from __future__ import annotations

from pathlib import Path

from ckpt.errors import CkptError


class Target:
    """The interface, and the defaults of the targets that write safetensors / torch files tensor by tensor
    through the planners (`plan_checkpoint`, or `plan_layout` with --layout)."""

    name: str | None  # --to NAME (None: a command's default, or --keep-format)
    suffix: str  # default output name: SRC-[LAYOUT-]SUFFIX
    label: str  # the progress bar's "convert -> [LAYOUT ]LABEL"
    ext: str | None = None  # the one file suffix of a target writing its own format (".gguf"); None: safetensors/torch
    fmt: str | None = None  # that format's name for the writer ("gguf")
    scaled_variant: Target | None = None  # what --scaled makes of this target, where it applies
    is_scaled = False  # this is a --scaled variant
    saturates = False  # encodes with saturation by design: --clamp refused
    decodes = True  # its output holds the decoded values (a note says which encodings were decoded)
    # --group-size: the group sizes this target can write (None: it has no group, the option is refused); a target
    # whose valid sizes depend on the tensors checks them when it plans
    group_sizes: tuple[int, ...] | None = None

    def __init__(self, name: str | None, suffix: str | None = None, label: str | None = None):
        self.name = name
        self.suffix = (name or "") if suffix is None else suffix
        self.label = self.suffix if label is None else label

    @property
    def canonical(self) -> str | None:
        """The name outputs record (`ckpt.targets.canonical`): an alias's target's own."""
        return self.name

    def __repr__(self):
        return f"{type(self).__name__}({self.name!r})"

    @property
    def in_batch(self) -> bool:
        """`ckpt batch convert` offers it: it names outputs SRC-SUFFIX.safetensors (a file or folder)."""
        return self.ext is None

    # ---- before the input is opened

    def output_format(self, opts, out, ckpt=None, default: str = "safetensors") -> str:
        """safetensors / torch from --format and -o (else `default`), checked before the input is opened: an -o
        naming another container (NAME.gguf) is refused by the one rule of every command
        (`ckpt.io.output.check_container`). `ckpt`: the input, where it is open already."""
        from ckpt.io.output import check_container
        from ckpt.run import output_format

        fmt = output_format(opts.format, out, default)
        if out:
            check_container(Path(out), fmt)
        return fmt

    # ---- planning

    def check(self, opts) -> None:
        """Refuse the options that do not apply (in this order: the messages tests pin name the first)."""
        if opts.config and opts.layout != "diffusers":
            raise CkptError("--config applies to --layout diffusers only")
        if opts.scaled and not self.is_scaled:
            raise CkptError("--scaled applies to --to fp8_e4m3fn only")
        if opts.clamp and self.saturates:
            raise CkptError(f"--clamp applies to dtype targets; --to {opts.to} saturates by design")
        if opts.pure:
            raise CkptError("--pure applies to --to gguf-* only")
        self.check_group_size(opts)
        from ckpt.targets.planners.gguf_quant_flags import given

        if flags := given(opts):
            raise CkptError(f"{flags[0]} applies to --to gguf-* only (llama-quantize's flags)")
        if getattr(opts, "keep_format", False):
            raise CkptError("--keep-format writes the input's own encoding: no --to with it")

    def check_group_size(self, opts) -> None:
        """--group-size N: refused where this target has no group, or where N is not one it can write."""
        n = getattr(opts, "group_size", None)
        if n is None:
            return
        if self.group_sizes is None:
            raise CkptError(f"--group-size does not apply to --to {opts.to or self.name} (it quantizes in no groups)")
        if n not in self.group_sizes:
            raise CkptError(f"--group-size {n}: --to {self.name} takes {', '.join(map(str, self.group_sizes))}")

    def outputs(self, views, opts, report):
        """(make, finish): `make(tensor) -> [OutTensor]` for the planners; `finish(plan)` or None, run on
        the whole plan (per-file metadata, notes)."""
        raise NotImplementedError

    def output_dtype(self, views):
        """The model dtype the planner records in config.json files (plan_checkpoint's `output_dtype`)."""
        return None

    def plan(self, ckpt, views, opts, report, file_format: str, operation: str):
        """The output's Plan (checks already made); `operation` is the command's `ckpt_operation` string."""
        from ckpt.io.checkpoint_plan import plan_checkpoint
        from ckpt.io.plan import parse_size

        make, finish = self.outputs(views, opts, report)
        shard_size = parse_size(opts.max_shard_size) if opts.max_shard_size else None
        if opts.layout is not None:
            from ckpt.layout.plan import plan_layout

            plan = plan_layout(ckpt, views, make, layout=opts.layout, operation=operation, config_ref=opts.config,
                               max_shard_size=shard_size, file_format=file_format)
        else:
            plan = plan_checkpoint(ckpt, views, make, operation=operation, max_shard_size=shard_size, file_format=file_format,
                                   output_dtype=lambda c: self.output_dtype(views))
        if finish is not None:
            finish(plan)
        return plan

    def heavy(self, opts, views) -> bool:
        """Whether the run does math worth a GPU (--device auto): decoding quantized inputs, encoding."""
        return any(v.formats for v in views)

    def finish(self, report, dry_run: bool) -> None:
        """What the target adds to the report once the output is written (--keep-format: the requantization)."""
