"""The options every command shares, declared once: how a run goes (`RunOptions`: device, overwrite, quiet, dry
run) and, for the commands that write a model, what it is written as (`WriteOptions`: the target of `--to` and the
settings the targets of `ckpt.targets` read). Each command's options extend one of them with its own; the CLI
declares the matching click options once (`ckpt.cli.options.run_options` / `writing_options`)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RunOptions:
    device: str = "cpu"  # "cpu" | "cuda" | "auto" (`ckpt.devices.resolve_device`)
    overwrite: bool = False
    quiet: bool = False
    dry_run: bool = False


@dataclass
class WriteOptions(RunOptions):
    to: str | None = None  # a target of `ckpt.targets` (None: the command's default)
    keep: list[str] = field(default_factory=list)  # --keep PATTERN: tensors left in their dtype
    clamp: bool = False  # saturate values a cast would overflow
    scaled: bool = False  # --to fp8_e4m3fn: ComfyUI's scaled-fp8 layout
    pure: bool = False  # --to gguf-*: llama-quantize --pure
    # --to gguf-*: llama-quantize's other flags (`ckpt.targets.planners.gguf_quant_flags`)
    imatrix: str | None = None
    include_weights: list[str] = field(default_factory=list)
    exclude_weights: list[str] = field(default_factory=list)
    tensor_type: list[str] = field(default_factory=list)
    output_tensor_type: str | None = None
    token_embedding_type: str | None = None
    leave_output_tensor: bool = False
    group_size: int | None = None  # --group-size N: the quantization group of a target that has one (`Target.group_sizes`)
    max_shard_size: str | None = None
    format: str | None = None  # "safetensors" | "torch"; None: from -o's suffix, else the command's default
    layout: str | None = None  # "diffusers" | "original": the model under that layout's names (`ckpt.layout`)
    config: str | None = None  # --config REF: the diffusers config.json for --layout diffusers
    keep_format: bool = False  # the input's own stored encoding and container (`ckpt.targets.keep_format`)
