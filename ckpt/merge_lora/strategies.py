"""The three ways merge-lora writes its result, chosen once per run: plain, --keep-format and LitGPT.

Matching LoRA modules to base tensors and reporting on it is the same for every run (`ckpt.merge_lora.command`);
what differs is what happens around it, and each strategy answers the same four questions:

- `output_format`: the container written (from --format / -o, else the strategy's default);
- `prepare`: checks and rewrites of the base's logical views before matching (returns the notes its plan
  prints after its own, e.g. LitGPT's renamed `attn.attn` tensors);
- `plan`: the write plan from the matched patches (one `{view key: [Patch, ...]}` per component);
- `default_output`: the output path when -o is not given (and the plan's final shape: a LitGPT folder);

plus `finish`, what the strategy adds to the report once the output is written.

The patches matched to an expert bank by a PEFT `target_parameters` LoRA come with their expert adapter already
(`match_loras` applies `ckpt.adapters.kinds.experts.experts_patches`, for merge-lora and `ckpt merge` alike).

`Plain` casts every logical tensor to one dtype (--to, else the model's own; bf16 for a base decoded from an LLM
quantization format, `ckpt.quant.formats`: GPTQ, AWQ, compressed-tensors, ...); `KeepFormat` writes the base's
stored encoding again (`ckpt.targets.planners.keep_format`); `LitGPT` wraps either one with what a LitGPT LoRA brings:
older `attn.attn` bases read as `attn.qkv`, the LoRA's dtype and the torch container as defaults, and a
finetune folder merged into a LitGPT checkpoint folder. Choosing once keeps these decisions out of the
matching code, where they used to be woven through the plain path.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch

from ckpt.dtypes import FP8, TARGETS, is_float, short_name
from ckpt.errors import CkptError
from ckpt.io.checkpoint import WEIGHT_SUFFIXES
from ckpt.io.checkpoint_plan import plan_checkpoint
from ckpt.io.wrapper import Wrapper
from ckpt.adapters import litgpt
from ckpt.adapters.matching import Patches
from ckpt.adapters.merged import Patched
from ckpt.options import WriteOptions
from ckpt.quant.formats import format_of, llm_labels
from ckpt.run import cast_outputs, check_gguf_output, decoded_notes, default_output, file_ext, output_format

FP8_DEFAULT = torch.bfloat16  # what an FP8 base is written as without --to
# A base decoded from an LLM quantization format (`ckpt.quant.formats`: `llm`) is written in bf16 without --to: the
# decoded values are in the format's compute dtype (fp16 scales for GPTQ/AWQ/HQQ...), but fine-tuners merge a QLoRA
# into them to get the bf16 model back, as PEFT users do.
LLM_QUANT_DEFAULT = torch.bfloat16


class AsComputed(Wrapper):
    """A decoded LLM-quantization weight as its library computes it: rounded once to the format's compute dtype
    (`natural_dtype`) where the decoder gives exact fp32 products (compressed-tensors int packs). That value is the
    weight the QLoRA was trained against and the one PEFT merges into (`merge_and_unload` on the library's
    dequantized model), so merges start from it rather than from the unrounded product."""

    def __init__(self, base):
        self.base, self.name, self.home = base, base.name, base.home
        self.shape, self.row_align, self.dtype = tuple(base.shape), base.row_align, base.natural_dtype

    def read(self, start, stop, device, scratch=None):
        return self.base.read(start, stop, device, scratch).to(self.dtype)


def as_computed(views):
    """The views with every LLM-quantization weight whose decoder reads wider than its compute dtype wrapped in
    AsComputed; other tensors as they are."""
    def fix(t):
        fmt = format_of(t)
        if fmt is not None and fmt.llm and is_float(t.dtype) and is_float(t.natural_dtype) \
                and t.natural_dtype != t.dtype:
            return AsComputed(t)
        return t

    return [replace(v, tensors={k: fix(t) for k, t in v.tensors.items()}) for v in views]



class Strategy:
    """What plain and --keep-format share: no view rewrites, and the output named after the base."""

    to: str | None = None

    def output_format(self, ckpt, out) -> str:
        raise NotImplementedError

    def prepare(self, ckpt, views) -> list[str]:
        return []

    def plan(self, ckpt, views, patches: Patches, report, operation: str, file_format: str, notes: list[str]):
        raise NotImplementedError

    def default_output(self, base: str, ckpt, plan, file_format: str, out, report) -> Path:
        ext = ".gguf" if file_format == "gguf" else file_ext(file_format)
        tag = "merged" + (f"-{self.to}" if self.to else "")  # `--to bf16` beside a plain merge: no collision
        return default_output(base, ckpt.path, tag, folder=not plan.single_file, ext=ext)

    def finish(self, report, dry_run: bool) -> None:
        pass


class Plain(Strategy):
    """Every logical tensor cast to --to, else to `dtype` (the LitGPT LoRA's, said in a note), else to the
    model's own dtype (an FP8 base as FP8_DEFAULT; a base of an LLM quantization format, every floating tensor as
    LLM_QUANT_DEFAULT, said in a note); the patched ones merged in fp32 first."""

    def __init__(self, to: str | None, fmt: str | None, container: str = "safetensors",
                 dtype: torch.dtype | None = None, dtype_source: str = ""):
        self.to, self.fmt, self.container = to, fmt, container
        self.dtype, self.dtype_source = dtype, dtype_source

    def output_format(self, ckpt, out) -> str:
        return output_format(self.fmt, out, self.container)

    def plan(self, ckpt, views, patches: Patches, report, operation: str, file_format: str, notes: list[str]):
        target = TARGETS[self.to] if self.to else None
        dtype_note = None
        if target is None and self.dtype is not None and is_float(self.dtype):
            target = self.dtype
            dtype_note = f"written in {short_name(self.dtype)}, {self.dtype_source} (pass --to to choose)"
        fp8_seen = any(is_float(t.dtype) and (t.natural_dtype in FP8 or t.dtype in FP8)
                       for v in views for t in v.tensors.values())
        quant = llm_labels(views) if target is None else []
        if quant:
            target = LLM_QUANT_DEFAULT
            dtype_note = (f"{', '.join(quant)} base: merged in fp32 and written as {short_name(target)} "
                          "(pass --to to choose)")

        def out_dtype(t) -> torch.dtype:
            if target is not None:
                return target
            return FP8_DEFAULT if t.natural_dtype in FP8 else t.natural_dtype

        make = cast_outputs(report, out_dtype, source_of=lambda t: t.merged() if isinstance(t, Patched) else t)
        # The patches travel on the tensors of the views planned from (`make` sees only a tensor).
        patched = [replace(v, tensors={k: Patched(t, ps[k]) if k in ps else t for k, t in v.tensors.items()})
                   for v, ps in zip(as_computed(views), patches)]
        cfg_dtype = target or (FP8_DEFAULT if fp8_seen else None)
        plan = plan_checkpoint(ckpt, patched, make, operation=operation, file_format=file_format,
                               output_dtype=lambda c: cfg_dtype)
        plan.notes += decoded_notes(ckpt, views) + notes
        if dtype_note:
            plan.notes.append(dtype_note)
        if fp8_seen and target is None and not quant:
            plan.notes.append(f"FP8 base: merged in fp32 and written as {short_name(FP8_DEFAULT)} (pass --to to choose)")
        return plan


class KeepFormat(Strategy):
    """--keep-format: the base's own container and stored encoding, changed tensors re-encoded."""

    def __init__(self, fmt: str | None):
        self.fmt = fmt

    def output_format(self, ckpt, out) -> str:
        """A .gguf base stays GGUF; safetensors and torch pickles keep theirs unless -o / --format name the
        other one."""
        from ckpt.targets.planners.keep_format import container

        kind = container(ckpt)
        if kind == "gguf":
            if self.fmt is not None:
                raise CkptError(f"--format {self.fmt} with --keep-format: the base is a GGUF file, and so is the output")
            check_gguf_output(out, "--keep-format on a GGUF base")
            return "gguf"
        return output_format(self.fmt, out, kind)

    def prepare(self, ckpt, views) -> list[str]:
        from ckpt.targets.planners.keep_format import refuse_plain

        refuse_plain(ckpt, views)
        return []

    def plan(self, ckpt, views, patches: Patches, report, operation: str, file_format: str, notes: list[str]):
        from ckpt.targets.planners.keep_format import plan_keep_format
        from ckpt.adapters.merged import MergedTensor

        # the merge starts from the value a plain merge starts from (the library's own, in its compute dtype)
        changed = [{k: MergedTensor(v.tensors[k], ps) for k, ps in comp.items()}
                   for v, comp in zip(as_computed(views), patches)]
        plan, report.meters, own = plan_keep_format(ckpt, views, changed, report, operation, file_format)
        plan.notes += own + notes
        return plan

    def finish(self, report, dry_run: bool) -> None:
        from ckpt.targets.planners.keep_format import summarize

        lines, facts = summarize(report.meters)
        report.summary += lines[:1] if dry_run else lines
        report.requantization = {} if dry_run else facts


class GGUF(Strategy):
    """`--to gguf-<type>`: the merged model written as the GGUF `ckpt convert --to gguf-<type>` writes (ComfyUI-GGUF
    for a diffusion model, llama.cpp for an HF LLM folder): the convert target plans it from the merged views, so
    merging and quantizing are one pass."""

    def __init__(self, to: str, fmt: str | None):
        from ckpt import targets

        self.to, self.target = to, targets.get(to)
        if fmt is not None:
            raise CkptError(f"--format {fmt} with --to {to}: the output is a GGUF file")

    def output_format(self, ckpt, out) -> str:
        check_gguf_output(out, f"--to {self.to}")
        return "gguf"

    def plan(self, ckpt, views, patches: Patches, report, operation: str, file_format: str, notes: list[str]):
        from ckpt.adapters.merged import MergedTensor

        opts = WriteOptions(to=self.to)
        self.target.check(opts)
        merged = [replace(v, tensors={k: MergedTensor(t, ps[k]) if k in ps else t for k, t in v.tensors.items()})
                  for v, ps in zip(views, patches)]
        plan = self.target.plan(ckpt, merged, opts, report, file_format, operation)
        plan.notes += notes
        return plan

    def default_output(self, base: str, ckpt, plan, file_format: str, out, report) -> Path:
        return default_output(base, ckpt.path, f"merged-{self.target.suffix}", folder=False, ext=".gguf")


class LitGPT(Strategy):
    """A LitGPT LoRA around the plain or --keep-format strategy (`inner`): the base's older `attn.attn`
    tensors read as `attn.qkv` before matching, and a finetune folder (`ckpt merge-lora FINETUNE_DIR`)
    written as a LitGPT checkpoint folder, or as the one file -o names."""

    def __init__(self, inner: Strategy, settings, finetune_dir: Path | None, base_dir: Path):
        self.inner, self.settings, self.finetune_dir, self.base_dir = inner, settings, finetune_dir, base_dir

    def output_format(self, ckpt, out) -> str:
        return self.inner.output_format(ckpt, out)

    def prepare(self, ckpt, views) -> list[str]:
        return self.inner.prepare(ckpt, views) + litgpt.current_layout(views, self.settings)

    def plan(self, ckpt, views, patches: Patches, report, operation: str, file_format: str, notes: list[str]):
        return self.inner.plan(ckpt, views, patches, report, operation, file_format, notes)

    def default_output(self, base: str, ckpt, plan, file_format: str, out, report) -> Path:
        fdir = self.finetune_dir
        if fdir is None:
            return self.inner.default_output(base, ckpt, plan, file_format, out, report)
        if out and Path(out).suffix in WEIGHT_SUFFIXES:
            # `-o merged/lit_model.pth` is that one file (never a folder named lit_model.pth)
            names = [n for _, n in litgpt.sidecars(fdir, self.base_dir)]
            report.note(f"-o {out} names a file: only the merged weights are written there; a LitGPT checkpoint "
                        f"folder also holds {', '.join(names) or 'its config files'} (-o FOLDER writes them too)")
            return default_output(str(fdir), fdir, "merged", folder=False, ext=file_ext(file_format))
        # a LitGPT checkpoint folder: weights + the finetune folder's files
        litgpt.as_folder(plan, "lit_model" + file_ext(file_format), litgpt.sidecars(fdir, self.base_dir))
        return default_output(str(fdir), fdir, "merged", folder=True)

    def finish(self, report, dry_run: bool) -> None:
        self.inner.finish(report, dry_run)


def choose(opts, files, finetune_dir: Path | None, base_dir: Path) -> Strategy:
    """The strategy for this run, from the options (`MergeLoraOptions`) and the loaded LoRAs: --keep-format or
    plain, inside LitGPT when a LoRA is LitGPT's (without --to, a plain merge then writes every floating
    tensor in that LoRA's dtype, in a torch file, as litgpt merge_lora does)."""
    lit = next((f for f in files if f.litgpt is not None), None)
    if opts.to is not None and opts.to.startswith("gguf-"):
        if lit is not None:
            raise CkptError(f"--to {opts.to} with a LitGPT LoRA: merge into the LitGPT checkpoint first, convert its "
                            "HF export to GGUF")
        return GGUF(opts.to, opts.format)
    if opts.keep_format:
        inner: Strategy = KeepFormat(opts.format)
    elif lit is not None:
        inner = Plain(opts.to, opts.format, "torch", lit.dtype, "the LitGPT LoRA's dtype, as litgpt merge_lora does")
    else:
        inner = Plain(opts.to, opts.format)
    return LitGPT(inner, lit.litgpt, finetune_dir, base_dir) if lit is not None else inner
