"""`--to fp32|fp16|bf16`: every floating tensor cast to one dtype (not matched by --keep); and, without --to, each
command's default: every tensor in the dtype its model has (`Natural`): `convert --layout` alone and `dequant` keep
each tensor's own (a decoded weight: the dtype its format decodes to), a merge writes what it merged the way the
people who merge expect it back (an FP8 model in bf16; a model of an LLM quantization format in bf16, as PEFT's
merge_and_unload gives it; a LitGPT LoRA's model in the LoRA's dtype, as litgpt merge_lora does), each said in a
note. Quantized inputs are decoded on the way."""

from __future__ import annotations

from ckpt.targets.base import Target

ORDER = 10
HELP = "Target dtype of floating tensors"


class Cast(Target):
    """Cast floating tensors to `torch.<torch_name>`."""

    def __init__(self, name: str | None, torch_name: str | None):
        super().__init__(name)
        self.torch_name = torch_name

    @property
    def st_dtype(self) -> str | None:
        """The target by its safetensors name ("BF16"): what planning decides with, without torch."""
        from ckpt.dtypes import ST_TORCH_NAMES

        return next((k for k, v in ST_TORCH_NAMES.items() if v == self.torch_name), None)

    def outputs(self, views, opts, report):
        import fnmatch

        from ckpt.run import cast_outputs

        target = self.st_dtype  # a tensor already in it is copied, and deciding so needs no torch

        def out_dtype(t):
            keep = any(fnmatch.fnmatchcase(t.name, pat) for pat in opts.keep)
            return None if keep else target  # None: its natural dtype (stored bytes kept so are copied)

        return cast_outputs(report, out_dtype, clamp=opts.clamp), None

    def output_dtype(self, views):
        from ckpt.dtypes import ST_CONFIG_NAMES

        return self.st_dtype if self.st_dtype in ST_CONFIG_NAMES else None  # a name: config.json planned without torch


class Natural(Target):
    """No --to: each tensor in its natural dtype (the stored one; a decoded weight's: its format's), but
    - `fp8`: tensors whose natural dtype is an fp8 one written in this dtype instead (a merge's FP8 base);
    - `llm`: when a tensor was decoded from an LLM quantization format (`ckpt.quant.formats`: `llm`), every
      floating tensor in this dtype;
    - `dtype`: every floating tensor in this dtype, because `dtype_source` says so (a LitGPT LoRA's dtype).
    `role` names the input in the notes ("base", "reference")."""

    def __init__(self, *, fp8=None, llm=None, dtype=None, dtype_source: str = "", role: str = "base"):
        super().__init__(None, suffix="")
        self.fp8, self.llm, self.fixed, self.dtype_source, self.role = fp8, llm, dtype, dtype_source, role

    def _choice(self, views):
        """(one dtype for every floating tensor or None, its note, whether an FP8 input is mapped), asked of the
        decoded views the command's views were made from (`View.origin`: a merged tensor is no format's)."""
        from ckpt.dtypes import ST_FP8, is_float, short_name
        from ckpt.quant.formats import llm_labels

        views = [v.origin or v for v in views]
        if self.fixed is not None and is_float(self.fixed):
            return self.fixed, f"written in {short_name(self.fixed)}, {self.dtype_source} (pass --to to choose)", False
        quant = llm_labels(views) if self.llm is not None else []
        if quant:
            return self.llm, (f"{', '.join(quant)} {self.role}: merged in fp32 and written as "
                              f"{short_name(self.llm)} (pass --to to choose)"), False
        fp8 = self.fp8 is not None and any(is_float(t.dtype_name) and (t.natural_dtype_name in ST_FP8
                                                                        or t.dtype_name in ST_FP8)
                                           for v in views for t in v.tensors.values())  # names: no torch
        return None, None, fp8

    def outputs(self, views, opts, report):
        from ckpt.dtypes import ST_FP8
        from ckpt.run import cast_outputs

        every, note, fp8 = self._choice(views)

        def out_dtype(t):
            if every is not None:
                return every
            return self.fp8 if fp8 and t.natural_dtype_name in ST_FP8 else None  # None: its natural dtype

        def finish(plan):
            if note:
                plan.notes.append(note)
            elif fp8:
                from ckpt.dtypes import short_name

                plan.notes.append(f"FP8 {self.role}: merged in fp32 and written as {short_name(self.fp8)} (pass --to "
                                  "to choose)")

        return cast_outputs(report, out_dtype, clamp=opts.clamp), finish

    def output_dtype(self, views):
        every, _, fp8 = self._choice(views)
        return every if every is not None else (self.fp8 if fp8 else None)


TARGETS = (Cast("fp32", "float32"), Cast("fp16", "float16"), Cast("bf16", "bfloat16"))
KEEP = Natural()  # no --to and no mapping: each tensor keeps the dtype it has (`convert --layout` alone, `dequant`)
