"""`--to gguf-q8_0|q4_0|q4_1|q5_0|q5_1|bf16|f16`: one diffusion model as the GGUF file ComfyUI-GGUF loads
(`ckpt.convert.gguf_out`). The kind owns the `gguf-` prefix: a `gguf-*` name not registered (K-quants,
IQ-quants, typos) is refused by `gguf_out.ggml_type_of` in its own words. A new GGML type with an encoder
is a new module with `TARGETS = (GGUF("gguf-<type>", "<GGML TYPE>"),)`."""

from __future__ import annotations


from ckpt.convert.targets.base import Target
from ckpt.errors import CkptError

ORDER = 40
PREFIX = "gguf-"
HELP = "gguf-*: a ComfyUI-GGUF file."


class GGUF(Target):
    """`ggml`: the GGMLQuantizationType name (None: a claimed name that `check` refuses). Files are
    named as ComfyUI-GGUF / llama.cpp name them: `model-Q8_0.gguf`."""

    ext, fmt = ".gguf", "gguf"

    def __init__(self, name: str, ggml: str | None):
        super().__init__(name, suffix=ggml or name)
        self.ggml = ggml

    @staticmethod
    def written_by() -> str:
        from ckpt.convert import targets

        ours = [t.name for t in targets.all_targets() if isinstance(t, GGUF)]
        shown = ours if len(ours) <= 4 else [*ours[:2], "...", *ours[-2:]]
        return f"GGUF is written by --to {'|'.join(shown)}"

    def output_format(self, opts, out) -> str:
        """GGUF only from --to gguf-*, never from a suffix alone; -o must say .gguf (or be a folder)."""
        from ckpt.run import check_gguf_output

        if opts.format is not None:
            raise CkptError(f"--format does not apply to --to {opts.to} (it writes a .gguf file)")
        check_gguf_output(out, f"--to {opts.to}")
        return "gguf"

    def check(self, opts) -> None:
        from ckpt.convert.gguf_out import ggml_type_of

        ggml_type_of(self.name)  # refuses K-quants and unknown types before anything else
        for flag, given in (("--keep", opts.keep), ("--scaled", opts.scaled), ("--clamp", opts.clamp),
                            ("--max-shard-size", opts.max_shard_size), ("--config", opts.config)):
            if given:
                raise CkptError(f"{flag} does not apply to --to {opts.to} (GGUF types follow ComfyUI-GGUF's rules)")
        if opts.layout is not None:
            raise CkptError(f"--layout with --to {opts.to}: convert the layout first (ComfyUI-GGUF files hold the "
                            "original layout)")

    def plan(self, ckpt, views, opts, report, file_format: str):
        from ckpt.convert.gguf_out import plan_gguf

        return plan_gguf(ckpt, views, self.name, report)

    def heavy(self, opts, views) -> bool:
        return False  # GGUF quantization runs in the gguf package on the CPU whatever the device


TARGETS = tuple(GGUF(f"gguf-{t.lower()}", t) for t in ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "BF16", "F16"))


def claim(name: str) -> GGUF:
    return GGUF(name, None)
