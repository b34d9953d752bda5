"""`--to fp32|fp16|bf16`: every floating tensor cast to one dtype (not matched by --keep); with no --to
(`convert --layout` alone), each tensor keeps its dtype. Quantized inputs are decoded on the way."""

from __future__ import annotations

from ckpt.targets.base import Target

ORDER = 10
HELP = "Target dtype of floating tensors"


class Cast(Target):
    """Cast floating tensors to `torch.<torch_name>` (None: keep each tensor's dtype)."""

    def __init__(self, name: str | None, torch_name: str | None):
        super().__init__(name)
        self.torch_name = torch_name

    def dtype(self):
        from ckpt.lazy import torch

        return getattr(torch, self.torch_name) if self.torch_name else None

    def outputs(self, views, opts, report):
        import fnmatch

        from ckpt.dtypes import ST_TORCH_NAMES
        from ckpt.run import cast_outputs

        # the target by its safetensors name: a tensor already in it is copied, and deciding so needs no torch
        target = {v: k for k, v in ST_TORCH_NAMES.items()}[self.torch_name] if self.torch_name else None

        def out_dtype(t):
            keep = target is None or any(fnmatch.fnmatchcase(t.name, pat) for pat in opts.keep)
            return None if keep else target  # None: its natural dtype (stored bytes kept so are copied)

        return cast_outputs(report, out_dtype, clamp=opts.clamp), None

    def output_dtype(self):
        from ckpt.lazy import torch

        d = self.dtype()
        return d if d in (torch.float16, torch.bfloat16, torch.float32) else None


TARGETS = (Cast("fp32", "float32"), Cast("fp16", "float16"), Cast("bf16", "bfloat16"))
KEEP = Cast(None, None)  # no --to: not a name, so not registered
