"""`--keep-format`: the model written in its input's own stored encoding and container (`merge-lora` into the
base, `merge` into the reference): the tensors the command changed are re-encoded as their stored tensors were,
every other stored key is copied as stored (`ckpt.targets.planners.keep_format`).

It is a target of its own rather than a `--to` name: it writes no fixed format, the input's. A command hands it
the views it made: each changed tensor says which decoded tensor it `replaces`, and each view its `origin` (the
decoded view it was made from), so the stored keys behind a changed tensor are found and the rest kept.
"""

from __future__ import annotations

from ckpt.errors import CkptError
from ckpt.targets.base import Target

ORDER = 90
HELP = ""  # not a --to name: the commands' --keep-format flag
TARGETS = ()


class KeepFormat(Target):
    decodes = False  # the stored encoding is kept

    def __init__(self):
        super().__init__(None, suffix="", label="keep-format")

    def output_format(self, opts, out, ckpt=None, default: str = "safetensors") -> str:
        """A GGUF input stays GGUF; safetensors and torch pickles keep theirs unless -o / --format name the other."""
        from ckpt.run import check_gguf_output, output_format
        from ckpt.targets.planners.keep_format import container

        kind = container(ckpt)
        if kind == "gguf":
            if opts.format is not None:
                raise CkptError(f"--format {opts.format} with --keep-format: the input ({ckpt.spec}) is a GGUF file, and "
                                "so is the output")
            check_gguf_output(out, "--keep-format on a GGUF input")
            return "gguf"
        return output_format(opts.format, out, kind)

    def check(self, opts) -> None:
        from ckpt.targets.planners.gguf_quant_flags import FLAGS as GGUF_FLAGS

        for flag, given in (("--layout", opts.layout), ("--scaled", opts.scaled), ("--clamp", opts.clamp),
                            ("--pure", opts.pure), ("--keep", opts.keep), ("--config", opts.config),
                            ("--max-shard-size", opts.max_shard_size), ("--group-size", opts.group_size),
                            *((flag, getattr(opts, key, None)) for flag, key in GGUF_FLAGS)):
            if given:
                raise CkptError(f"{flag} and --keep-format: choose one (--keep-format writes the input's own files: "
                                "its layout, encoding and shards)")

    def plan(self, ckpt, views, opts, report, file_format: str, operation: str):
        from ckpt.targets.planners.keep_format import plan_keep_format

        origins, changed = [], []
        for v in views:
            if v.origin is None:
                raise RuntimeError("--keep-format needs the decoded view each view was made from (View.origin)")
            origins.append(v.origin)
            changed.append({k: t for k, t in v.tensors.items() if getattr(t, "replaces", None) is not None})
        plan, report.meters, notes = plan_keep_format(ckpt, origins, changed, report, operation, file_format)
        plan.notes += notes
        return plan

    def heavy(self, opts, views) -> bool:
        return True

    def finish(self, report, dry_run: bool) -> None:
        from ckpt.targets.planners.keep_format import summarize

        lines, facts = summarize(report.meters)
        report.summary += lines[:1] if dry_run else lines
        report.requantization = {} if dry_run else facts


KEEP_FORMAT = KeepFormat()
