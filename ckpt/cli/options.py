"""Click options shared by the single commands and `ckpt batch`, defined once so both spell and
document them the same way; the checks of the paths and sizes they take, made as the command line is
read (before torch is imported, before any input is opened); and the command classes that make click's
usage errors one `error: ...` line."""

from __future__ import annotations

import os
from pathlib import Path

import click

from ckpt.errors import CkptError


class OneLine:
    """Turns click's usage errors (a missing argument, an unknown option, a value not in a choice) into a
    CkptError, printed as one line `error: ckpt batch convert: ...` with exit 2 by ckpt.cli.main, like
    every other bad input, instead of click's usage block and `Error: ...`."""

    def make_context(self, info_name, args, parent=None, **extra):
        try:
            return super().make_context(info_name, args, parent=parent, **extra)
        except click.exceptions.NoArgsIsHelpError:
            raise  # a group alone: its help text, as `ckpt` alone prints it
        except click.UsageError as e:
            raise CkptError(f"{command_path(info_name, parent)}: {' '.join(e.format_message().split())}") from None


def command_path(info_name, parent) -> str:
    path = [info_name]
    while parent is not None:
        path.insert(0, parent.info_name)
        parent = parent.parent
    return " ".join(p for p in path if p)


class OneLineCommand(OneLine, click.Command):
    pass


class OneLineGroup(OneLine, click.Group):
    """A group whose subcommands are OneLineCommands, and whose unknown subcommand is one line too."""

    command_class = OneLineCommand

    def resolve_command(self, ctx, args):
        try:
            return super().resolve_command(ctx, args)
        except click.UsageError as e:
            raise CkptError(f"{ctx.command_path}: {' '.join(e.format_message().split())}") from None


def check_size(ctx, param, value):
    """--max-shard-size: a number with a unit (`ckpt.io.plan.parse_size`), refused as it is read; the text
    itself is passed on (the commands' options hold it as given)."""
    if value is not None:
        from ckpt.io.plan import parse_size

        parse_size(value, param.opts[0])
    return value


def check_source_option(ctx, param, value):
    """An option naming a checkpoint that is local or a hub id (--shapes-from, --config): a folder on the way
    that cannot be entered is "permission denied", a local-looking path that is missing "no such file"."""
    if value is not None:
        from ckpt.io.hub import check_source

        check_source(value, f"{param.opts[0]} ")
    return value


def check_local_input(ctx, param, value):
    """A path that must exist here (batch FOLDER, --lora, --base): "permission denied" for a folder on the
    way that cannot be entered or an input that cannot be read; a missing one is left to the command."""
    if value is not None:
        from ckpt.io.hub import local_input

        local_input(value, "" if param.param_type_name == "argument" else f"{param.opts[0]} ")
    return value


def check_output(ctx, param, value):
    """-o (and --csv): "permission denied" when a folder on the way cannot be entered or the place the
    output goes takes no new file, before anything is read or written. The place: an existing folder
    (outputs go in it); else the folder an existing file is replaced in (by a rename), or the nearest
    existing folder above a new path, found as `ckpt.io.output.check_target` finds it. A command that never
    writes GGUF refuses `-o NAME.gguf` here (`ckpt.io.output.check_container`); one that may, once it knows."""
    if value is not None:
        from ckpt.io.hub import local_path
        from ckpt.io.publish import missing_parents
        from ckpt.io.side_files import unwritable

        what = f"{param.opts[0]} "
        p = local_path(value, what)
        if p is not None and p.is_dir():
            folder = p
        else:
            target = Path(os.path.abspath(Path(value).expanduser()))
            folder = (missing_parents(target) or [target])[0].parent
        why = unwritable(folder) if folder.is_dir() else None
        if why:
            raise CkptError(f"{what}{value}: cannot write in {folder} ({why})")
        if param.name == "out" and Path(value).suffix.lower() == ".gguf":
            from ckpt.io.output import check_container, running_command

            if running_command()[1] is None:  # a command that never writes GGUF: -o NAME.gguf is refused at once
                check_container(Path(value), None)
    return value

DEVICE = click.option("--device", type=click.Choice(["cpu", "cuda", "auto"]), default="cpu", show_default=True,
                      help="Where the math runs; every operand of an operation is on this device.")
QUIET = click.option("--quiet", "-q", is_flag=True, help="No progress bar and no notes (warnings still print).")
OVERWRITE = click.option("--overwrite", is_flag=True, help="Replace an existing output (never an input).")
SIZE_HELP = ("a number with a unit: KB, MB, GB, TB (powers of 1000, as huggingface_hub counts), KiB, MiB, GiB, TiB "
             "(powers of 1024) or B, in any case; a number alone is refused")
MAX_SHARD_SIZE = click.option("--max-shard-size", metavar="SIZE", callback=check_size,
                              help=f'Shard the output, e.g. "5GB" (5e9 bytes): {SIZE_HELP}. '
                                   "Default: keep the input layout; --layout diffusers: 10GB, as diffusers saves.")
BATCH_MAX_SHARD_SIZE = click.option("--max-shard-size", metavar="SIZE", callback=check_size,
                                    help=f'Shard each output, e.g. "5GB": {SIZE_HELP}.')
FORMAT = click.option("--format", "fmt", type=click.Choice(["safetensors", "torch"]),
                      help="Output file format: safetensors, or torch (the zip torch.save writes, e.g. LitGPT's "
                           "lit_model.pth). Default: from -o's suffix (.pth/.pt/.bin/.ckpt = torch), else safetensors.")
DRY_RUN = click.option("--dry-run", is_flag=True, help="Plan and report only; write nothing.")

# convert: the --to names and their help come from the target registry (ckpt.targets), which imports
# no torch; a new target module shows up here, in `ckpt batch convert` and in the messages by itself.


def _targets():
    from ckpt import targets

    return targets


class TargetChoice(click.Choice):
    """Every registered --to name; any other name under a prefix a target kind owns (`gguf-<type>`) passes
    through so that convert refuses it in one line, naming why. `help`:
    --to's help text for these choices."""

    def __init__(self, choices, prefixes=(), help=""):
        super().__init__(choices)
        self.prefixes, self.help = tuple(prefixes), help

    def convert(self, value, param, ctx):
        if isinstance(value, str) and self.prefixes and value.startswith(self.prefixes):
            return value
        return super().convert(value, param, ctx)


CONVERT_OR_GGUF = TargetChoice(_targets().names(), _targets().prefixes(), help=_targets().help_text(batch=False))
LAYOUT = click.option("--layout", type=click.Choice(["diffusers", "original"]),
                      help="Rename to the model family's diffusers layout (a model folder with config.json) or its "
                           "original layout (one file with the reference keys).")
MMPROJ = click.option("--mmproj", is_flag=True,
                      help="With --to gguf-f16|bf16|f32|q8_0 on a vision-language model folder: its vision projector "
                           "(the mmproj GGUF llama.cpp's convert_hf_to_gguf.py --mmproj writes) instead of the text "
                           "model. Default name: SRC-mmproj-F16.gguf.")
PURE = click.option("--pure", is_flag=True,
                    help="With --to gguf-<quant>: every quantizable tensor in the one type, as llama-quantize --pure "
                         "(no per-tensor mix rules; row fallbacks apply).")
IMATRIX = click.option("--imatrix", metavar="FILE",
                       help="With --to gguf-<quant>: quantize with this importance matrix, as llama-quantize --imatrix "
                            "(llama-imatrix's imatrix.gguf or legacy imatrix.dat); the IQ1/IQ2 types need one.")
INCLUDE_WEIGHTS = click.option("--include-weights", "include_weights", multiple=True, metavar="NAME",
                               help="With --imatrix: use it only for these tensors (repeatable; llama-quantize's).")
EXCLUDE_WEIGHTS = click.option("--exclude-weights", "exclude_weights", multiple=True, metavar="NAME",
                               help="With --imatrix: use it for every tensor but these (repeatable; llama-quantize's).")
TENSOR_TYPE = click.option("--tensor-type", "tensor_type", multiple=True, metavar="PATTERN=TYPE",
                           help="With --to gguf-<quant>: tensors whose name matches PATTERN (a regex) get TYPE "
                                "(repeatable; llama-quantize's --tensor-type).")
OUTPUT_TENSOR_TYPE = click.option("--output-tensor-type", "output_tensor_type", metavar="TYPE",
                                  help="With --to gguf-<quant>: output.weight's type (llama-quantize's).")
TOKEN_EMBEDDING_TYPE = click.option("--token-embedding-type", "token_embedding_type", metavar="TYPE",
                                    help="With --to gguf-<quant>: token_embd.weight's type (llama-quantize's).")
LEAVE_OUTPUT_TENSOR = click.option("--leave-output-tensor", "leave_output_tensor", is_flag=True,
                                   help="With --to gguf-<quant>: leave output.weight unquantized (llama-quantize's).")
GGUF_FLAGS = [IMATRIX, INCLUDE_WEIGHTS, EXCLUDE_WEIGHTS, TENSOR_TYPE, OUTPUT_TENSOR_TYPE, TOKEN_EMBEDDING_TYPE,
              LEAVE_OUTPUT_TENSOR]

GROUP_SIZE = click.option("--group-size", "group_size", type=click.IntRange(min=1), metavar="N",
                          help="With a target that quantizes in groups (the ConvRot targets, mlx-*, ct-w4a16...): "
                               "the group size instead of the target's default (each target says which it takes).")

CONFIG = click.option("--config", "config", metavar="REF", callback=check_source_option,
                      help="With --layout diffusers: the config.json to write (a file, a model folder or a hub id) "
                           "instead of the one derived from the shapes.")
KEEP = click.option("--keep", multiple=True, metavar="PATTERN",
                    help="Glob on tensor names to leave in their dtype (repeatable).")
CLAMP = click.option("--clamp", is_flag=True, help="Saturate values that overflow the target instead of making them inf.")
SCALED = click.option("--scaled", is_flag=True,
                      help="With --to fp8_e4m3fn: per-tensor scales, ComfyUI scaled-fp8 layout.")
KEEP_FORMAT = click.option("--keep-format", is_flag=True,
                           help="Write the input's own format (the base's, the reference's): changed tensors "
                                "re-encoded in its quantization (GGUF, scaled fp8, comfy_quant, quanto, GPTQ, AWQ, "
                                "compressed-tensors, NVFP4, MXFP4), everything else copied as stored.")
# What every command that writes a model takes, in this order (`writing_options`); the names are WriteOptions'.
WRITE_KEYS = ("to", "layout", "config", "keep", "clamp", "scaled", "pure", "group_size", "imatrix", "include_weights",
              "exclude_weights", "tensor_type", "output_tensor_type", "token_embedding_type", "leave_output_tensor",
              "keep_format", "max_shard_size", "format", "dry_run", "device", "overwrite", "quiet")
LIST_KEYS = ("keep", "include_weights", "exclude_weights", "tensor_type")  # repeatable: lists in WriteOptions


def writing_options(*, to_help: str, keep_format: bool = False):
    """The options of a command that writes a model (convert, dequant, merge-lora, merge), declared once: --to (every
    target of `ckpt.targets`), --layout, --config, --keep, --clamp, --scaled, --pure, --group-size, llama-quantize's flags
    (--imatrix ... `GGUF_FLAGS`), (--keep-format), --max-shard-size,
    --format, --dry-run, --device, --overwrite, --quiet. The command function gets them as one `write` dict of
    `ckpt.options.WriteOptions` fields; whether an option applies to a target is the target's to say."""
    import functools

    to = click.option("--to", "to", type=CONVERT_OR_GGUF, help=CONVERT_OR_GGUF.help + " " + to_help)
    opts = [to, LAYOUT, CONFIG, KEEP, CLAMP, SCALED, PURE, GROUP_SIZE, *GGUF_FLAGS] + ([KEEP_FORMAT] if keep_format else []) + [
        MAX_SHARD_SIZE, FORMAT, DRY_RUN, DEVICE, OVERWRITE, QUIET]

    def decorate(f):
        @functools.wraps(f)
        def command(*args, **kw):
            write = {k: kw.pop(k if k != "format" else "fmt") for k in WRITE_KEYS if (k if k != "format" else "fmt") in kw}
            for k in LIST_KEYS:
                write[k] = list(write.get(k, ()))
            return f(*args, write=write, **kw)

        for o in reversed(opts):
            command = o(command)
        return command

    return decorate


# batch: the dequant and merge-lora jobs name their outputs from a dtype or a GGUF type (ckpt.batch.operations)
BATCH_DEQUANT_TO = click.option("--to", "to", type=click.Choice(["bf16", "fp16", "fp32"]),
                                help="Output dtype of floating tensors (default: each weight's original dtype, "
                                     "the scale's dtype).")
BATCH_MERGE_LORA_TO = click.option("--to", "to", type=click.Choice(["fp16", "bf16", "fp32"] + [
                                       n for n in _targets().names() if n.startswith("gguf-")]),
                                   help="Write every floating tensor in this dtype (default: keep each tensor's dtype; "
                                        "FP8 -> bf16), or gguf-TYPE: the merged model as `convert --to gguf-TYPE` "
                                        "writes it.")

# dequant
SHAPES_FROM = click.option("--shapes-from", metavar="REF", callback=check_source_option,
                           help="Local checkpoint or hub id whose headers give the original shapes.")
QTYPE = click.option("--qtype", type=click.Choice(["qint8", "qint4", "qint2", "qfloat8", "qfloat8_e4m3fn",
                                                   "qfloat8_e5m2", "qfloat8_e4m3fnuz", "int8", "int4", "int2",
                                                   "float8"]),
                     help="Weights qtype, when neither quanto_qmap.json nor config.json says (4 vs 2 bits).")

# merge-lora
ALLOW_UNMATCHED = click.option("--allow-unmatched", is_flag=True,
                               help="Merge what matches even if some LoRA keys match no base tensor.")
