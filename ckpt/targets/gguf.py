"""`--to gguf-q4_k_m|q8_0|...|f16`: a diffusion model as the GGUF file ComfyUI-GGUF loads (`ckpt.targets.planners.gguf_out`),
or a Hugging Face LLM as the GGUF llama.cpp runs (`ckpt.targets.planners.gguf_llm_out`). One target per llama-quantize
file type and alias (`ckpt.targets.planners.gguf_mixes`). The kind owns the `gguf-` prefix: a `gguf-*` name not
registered (IQ2..., typos) is refused in its own words."""

from __future__ import annotations


from ckpt.targets.planners.gguf_mixes import ALIASES, MIXES, mix
from ckpt.targets.base import Target
from ckpt.errors import CkptError

ORDER = 40
PREFIX = "gguf-"
HELP = "gguf-*: a ComfyUI-GGUF file (diffusion models) or a llama.cpp GGUF (HF LLM folders), typed as llama-quantize."


class GGUF(Target):
    """`mix`: the llama-quantize file type (None: a claimed name that `check` refuses). Files are named as
    ComfyUI-GGUF / llama.cpp name them: `model-Q4_K_M.gguf`."""

    ext, fmt = ".gguf", "gguf"

    def __init__(self, name: str, mix):
        super().__init__(name, suffix=mix.label if mix is not None else name)
        self.mix = mix

    @property
    def canonical(self) -> str:
        return f"gguf-{self.mix.name}" if self.mix is not None else self.name

    def output_format(self, opts, out, ckpt=None, default: str = "safetensors") -> str:
        """GGUF only from --to gguf-*, never from a suffix alone; -o must say .gguf (or be a folder)."""
        from ckpt.run import check_gguf_output

        if opts.format is not None:
            raise CkptError(f"--format {opts.format} with --to {opts.to}: the output is a GGUF file")
        check_gguf_output(out, f"--to {opts.to}")
        return "gguf"

    def check(self, opts) -> None:
        if self.mix is None:
            raise CkptError(f"--to {self.name}: unknown GGUF type (choose {', '.join(_names())})")
        if getattr(opts, "mmproj", False):  # convert's own option (`ckpt.targets.planners.gguf_mmproj_out`)
            from ckpt.targets.planners.gguf_mmproj_out import check_options

            check_options(opts, self.mix)
        if opts.pure and not self.mix.quantized:
            raise CkptError(f"--pure does not apply to --to {opts.to} (nothing is quantized)")
        from ckpt.targets.planners.gguf_quant_flags import QuantFlags

        QuantFlags.from_options(opts, self.mix.quantized)  # refused here, before the input is read
        for flag, given in (("--keep", opts.keep), ("--scaled", opts.scaled), ("--clamp", opts.clamp),
                            ("--config", opts.config), ("--group-size", opts.group_size)):
            if given:
                raise CkptError(f"{flag} does not apply to --to {opts.to} (GGUF types follow ComfyUI-GGUF's rules)")
        if opts.max_shard_size:  # the parts of llama.cpp's gguf-split layout (`plan`): checked before reading
            from ckpt.io.plan import parse_size

            parse_size(opts.max_shard_size, "--max-shard-size")
        if opts.layout is not None:
            raise CkptError(f"--layout with --to {opts.to}: convert the layout first (ComfyUI-GGUF files hold the "
                            "original layout)")

    def plan(self, ckpt, views, opts, report, file_format: str, operation: str):
        """An HF LLM folder as llama.cpp's GGUF (`gguf_llm_out`), any other model as ComfyUI-GGUF's (`gguf_out`);
        then, for either, the parts of --max-shard-size."""
        from ckpt.targets.planners import gguf_llm_out
        from ckpt.targets.planners.gguf_out import plan_gguf
        from ckpt.targets.planners.gguf_quant_flags import QuantFlags

        flags = QuantFlags.from_options(opts, self.mix.quantized)
        if getattr(opts, "mmproj", False):
            from ckpt.targets.planners.gguf_mmproj_out import plan_mmproj

            plan = plan_mmproj(ckpt, views, self.mix, report, operation)
        elif gguf_llm_out.applies(ckpt, views):
            plan = gguf_llm_out.plan_gguf_llm(ckpt, views, self.mix, flags, report, operation)
        else:
            plan = plan_gguf(ckpt, views, self.mix, flags, report, operation)
        if self.heavy(opts, views):
            plan.busy_stage = "compute"  # the encoders are the work; the reader only reads the source
        if opts.max_shard_size:  # every GGUF planner's one file, as llama.cpp's gguf-split parts
            from ckpt.io.gguf_split import split_gguf_plan
            from ckpt.io.plan import parse_size

            plan = split_gguf_plan(plan, parse_size(opts.max_shard_size, "--max-shard-size"))
        return plan

    def heavy(self, opts, views) -> bool:
        """K-quant and IQ4 encoders are ckpt's own torch code (`ckpt.quant.kquants`), worth a GPU; the legacy
        types are encoded by the gguf package on the CPU."""
        from ckpt.targets.planners.gguf_mixes import K_TYPES

        return self.mix.default in K_TYPES or self.mix.default.startswith("IQ")


def _names() -> list[str]:
    return [t.name for t in TARGETS]


TARGETS = tuple(GGUF(f"gguf-{m.name}", m) for m in MIXES) + \
    tuple(GGUF(f"gguf-{alias}", mix(name)) for alias, name in ALIASES.items())


def claim(name: str) -> GGUF:
    return GGUF(name, None)
