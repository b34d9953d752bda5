"""`convert --to fp8_e4m3fn --scaled`: fp8 weights with per-tensor scales, ComfyUI legacy scaled-fp8 layout.

For every floating 2-D `.weight` (not matched by --keep): `X.weight` = round(W / s) as float8_e4m3fn and
`X.scale_weight` = s = amax(|W|) / 448 (fp32 scalar, shape []), so W ~ codes * s, which is how ComfyUI
(and `ckpt convert` reading the file back) decodes it. One `scaled_fp8` marker (an empty float8_e4m3fn
tensor) tells loaders the layout. Other tensors keep their dtype.

Only Linear-shaped weights are scaled because ComfyUI's scaled-fp8 ops apply `scale_weight` in Linear
layers only: a scaled conv or embedding weight would load unscaled there. For the same reason
embeddings (names with "embed", T5's `shared.weight`) and the bundled text encoders / VAE of an
all-in-one checkpoint (ComfyUI reads the marker under `model.diffusion_model.` only) stay as they are.

The scale must be known before the first band of codes is produced, so each scaled weight is read twice:
one pass band by band for amax, then the encoding pass; memory stays bounded by one band.
"""

from __future__ import annotations

import fnmatch

from ckpt.lazy import torch

from ckpt.cast import Caster
from ckpt.dtypes import FP8, is_float
from ckpt.io.plan import OutTensor
from ckpt.io.tensors import ComputedTensor, Tensor
from ckpt.report import Report

FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max: the scaled-fp8 codes are e4m3fn
COMFY_PREFIX = "model.diffusion_model."  # ComfyUI all-in-one checkpoints: the marker sits under it
# The other parts of an all-in-one checkpoint, loaded by ComfyUI without the scaled-fp8 ops.
BUNDLED_PREFIXES = ("cond_stage_model.", "conditioner.", "text_encoders.", "first_stage_model.", "vae.")


class AmaxScale:
    """s = amax(|finite W|) / 448 of one tensor, computed once on first use by streaming its bands."""

    def __init__(self, source: Tensor):
        self.source = source
        self._value: torch.Tensor | None = None

    def value(self, device: torch.device | str = "cpu") -> torch.Tensor:
        if self._value is None:
            from ckpt.quant.comfy_quant import finite_amax

            amax = finite_amax(self.source, torch.device(device))
            s = amax / FP8_MAX
            # All-zero tensor: any scale decodes to zero; keep 1. Tiny amax: keep the scale a normal fp32.
            self._value = torch.where(amax > 0, torch.clamp(s, min=torch.finfo(torch.float32).tiny),
                                      torch.ones((), dtype=torch.float32))
        return self._value

    def encode(self, x: torch.Tensor, name: str, report: Report) -> torch.Tensor:
        """One band of W -> fp8 codes: round(W / s) saturated at +-448 (values a rounding step over 448
        are expected: s is rounded); NaN stays NaN, +-inf saturates and is counted as bad input."""
        s = self.value(x.device).to(x.device)
        y = (x.float() if x.dtype in FP8 else x.to(torch.float32)) / s
        finite = torch.isfinite(y)
        bad = ~torch.isfinite(x.float() if x.dtype in FP8 else x)
        report.count("nonfinite_input", name, int(bad.sum()))
        y = torch.where(finite, y.clamp(-FP8_MAX, FP8_MAX), y)
        return y.to(torch.float8_e4m3fn)


def _scalable(t: Tensor, keep: list[str]) -> bool:
    name = t.name
    linear = (name == "weight" or name.endswith(".weight")) and len(t.shape) == 2
    embedding = "embed" in name.lower() or name == "shared.weight" or name.endswith(".shared.weight")
    kept = any(fnmatch.fnmatchcase(name, pat) for pat in keep) or name.startswith(BUNDLED_PREFIXES)
    return linear and not embedding and not kept and is_float(t.dtype) and t.numel > 0


def scaled_fp8_outputs(report: Report, keep: list[str]):
    """`make(tensor) -> [OutTensor]` for `plan_checkpoint`: scaled weights, their scales, one marker."""
    marker_done = False

    def make(t: Tensor) -> list[OutTensor]:
        nonlocal marker_done
        if not _scalable(t, keep):
            if not is_float(t.dtype):
                return [OutTensor(t.name, t.dtype, t.shape, t)]
            dst = t.natural_dtype
            c = Caster(dst, report)
            return [OutTensor(t.name, dst, t.shape, t, c.band(t.name), stateless=True)]
        scale = AmaxScale(t)
        sname = t.name[: -len("weight")] + "scale_weight"
        outs = [
            OutTensor(t.name, torch.float8_e4m3fn, t.shape, t, lambda x, b, n=t.name, s=scale: s.encode(x, n, report)),
            OutTensor(sname, torch.float32, (), ComputedTensor(sname, scale.value, torch.float32, (), home=t.home),
                      lambda x, b: x),
        ]
        if not marker_done:
            marker_done = True
            mname = (COMFY_PREFIX if t.name.startswith(COMFY_PREFIX) else "") + "scaled_fp8"
            marker = ComputedTensor(mname, lambda: torch.empty(0, dtype=torch.float8_e4m3fn), torch.float8_e4m3fn, (0,), home=t.home)
            outs.append(OutTensor(mname, torch.float8_e4m3fn, (0,), marker))
        return outs

    return make
