"""`--to ct-fp8-dynamic|ct-fp8-block|ct-w4a16|ct-w8a16|ct-nvfp4a16`: a Hugging Face LLM folder as the compressed-tensors
checkpoint vLLM and SGLang serve, what llm-compressor 0.14's data-free path writes for llm-compressor's preset of
that name (`ckpt.targets.planners.ct_out`). Only the integer presets have a group to choose (`--group-size`, 128 by
default as in the presets); FP8 is per channel or per 128 x 128 block, NVFP4's group is the format's 16."""

from __future__ import annotations

from ckpt.errors import CkptError
from ckpt.targets.base import Target

ORDER = 35
PREFIX = "ct-"
GROUPS = (32, 64, 128)  # the group sizes vLLM's W4A16/W8A16 (Marlin) kernels take


class CompressedTensors(Target):
    """One preset (`ct_out.PRESETS`); `group_sizes` where it has a group to choose. A claimed unknown `ct-*`
    name has no preset, and `check` refuses it."""

    saturates = True

    def __init__(self, name: str, group_sizes=None, known: bool = True):
        super().__init__(name)
        self.group_sizes, self.known = group_sizes, known

    def output_format(self, opts, out, ckpt=None, default: str = "safetensors") -> str:
        if opts.format == "torch":
            raise CkptError(f"--format torch with --to {opts.to}: compressed-tensors checkpoints are safetensors")
        return super().output_format(opts, out, ckpt, default)

    def check(self, opts) -> None:
        if not self.known:
            raise CkptError(f"--to {self.name}: unknown compressed-tensors scheme (choose "
                            f"{', '.join(t.name for t in TARGETS)})")
        if opts.layout is not None:
            raise CkptError(f"--layout with --to {opts.to}: a compressed-tensors checkpoint keeps the model's own names")
        super().check(opts)

    def outputs(self, views, opts, report):
        from ckpt.targets.planners.ct_out import ct_outputs

        return ct_outputs(self.name, getattr(opts, "group_size", None), report, opts.keep, views)

    def plan(self, ckpt, views, opts, report, file_format: str, operation: str):
        from ckpt.targets.planners.ct_out import is_llm

        if not is_llm(ckpt, views):
            raise CkptError(f"{ckpt.path}: --to {self.name} writes a Hugging Face LLM folder, and this is none (no "
                            "config.json naming a causal LM, nor an LLM GGUF)")
        return super().plan(ckpt, views, opts, report, file_format, operation)

    def heavy(self, opts, views) -> bool:
        return True  # encoding


TARGETS = (
    CompressedTensors("ct-fp8-dynamic"),
    CompressedTensors("ct-fp8-block"),
    CompressedTensors("ct-w4a16", GROUPS),
    CompressedTensors("ct-w8a16", GROUPS),
    CompressedTensors("ct-nvfp4a16"),
)
HELP = (f"a compressed-tensors checkpoint for vLLM ({', '.join(t.name for t in TARGETS)}: llm-compressor's data-free "
        "presets, an HF LLM's Linear weights quantized, lm_head kept)")


def claim(name: str) -> CompressedTensors:
    return CompressedTensors(name, known=False)
