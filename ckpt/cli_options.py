"""Click options shared by the single commands and `ckpt batch`, defined once so both spell and
document them the same way."""

from __future__ import annotations

import click

DEVICE = click.option("--device", type=click.Choice(["cpu", "cuda", "auto"]), default="cpu", show_default=True,
                      help="Where the math runs; every operand of an operation is on this device.")
QUIET = click.option("--quiet", "-q", is_flag=True, help="No progress bar and no notes (warnings still print).")
OVERWRITE = click.option("--overwrite", is_flag=True, help="Replace an existing output (never an input).")
MAX_SHARD_SIZE = click.option("--max-shard-size",
                              help='Shard the output, e.g. "5GB" (5e9 bytes). Default: keep the input layout.')
FORMAT = click.option("--format", "fmt", type=click.Choice(["safetensors", "torch"]),
                      help="Output file format: safetensors, or torch (the zip torch.save writes, e.g. LitGPT's "
                           "lit_model.pth). Default: from -o's suffix (.pth/.pt/.bin/.ckpt = torch), else safetensors.")
DRY_RUN = click.option("--dry-run", is_flag=True, help="Plan and report only; write nothing.")

# convert
CONVERT_TARGETS = click.Choice(["fp32", "fp16", "bf16", "fp8_e4m3fn", "nvfp4", "mxfp8", "int8", "int8_rowwise"])
GGUF_TARGETS = ["gguf-q8_0", "gguf-q4_0", "gguf-q4_1", "gguf-q5_0", "gguf-q5_1", "gguf-bf16", "gguf-f16"]


class _WithGGUF(click.Choice):
    """CONVERT_TARGETS plus the GGUF outputs of `ckpt convert`; any other `gguf-<type>` passes through so
    that convert refuses it in one line, naming why (K-quants: no encoder in gguf)."""

    def convert(self, value, param, ctx):
        if isinstance(value, str) and value.startswith("gguf-"):
            return value
        return super().convert(value, param, ctx)


CONVERT_OR_GGUF = _WithGGUF(list(CONVERT_TARGETS.choices) + GGUF_TARGETS)
CONVERT_TO_HELP = ("Target dtype of floating tensors, or a ComfyUI quantized format (nvfp4, mxfp8, int8, int8_rowwise: "
                   "transformer-block Linear weights quantized, the rest kept).")

# dequant
DEQUANT_TO = click.option("--to", "to", type=click.Choice(["bf16", "fp16", "fp32"]),
                          help="Output dtype of floating tensors (default: each weight's original dtype, "
                               "the scale's dtype).")
SHAPES_FROM = click.option("--shapes-from", metavar="REF",
                           help="Local checkpoint or hub id whose headers give the original shapes.")
QTYPE = click.option("--qtype", type=click.Choice(["qint8", "qint4", "qint2", "qfloat8", "qfloat8_e4m3fn",
                                                   "qfloat8_e5m2", "qfloat8_e4m3fnuz", "int8", "int4", "int2",
                                                   "float8"]),
                     help="Weights qtype, when neither quanto_qmap.json nor config.json says (4 vs 2 bits).")

# merge-lora
MERGE_TO = click.option("--to", "to", type=click.Choice(["fp16", "bf16", "fp32"]),
                        help="Write every floating tensor in this dtype (default: keep each tensor's dtype; "
                             "FP8 -> bf16).")
ALLOW_UNMATCHED = click.option("--allow-unmatched", is_flag=True,
                               help="Merge what matches even if some LoRA keys match no base tensor.")
