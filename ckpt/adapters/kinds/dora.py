"""DoRA (weight-decomposed LoRA) as a post-step of the LoRA-family adapters.

W' = m * V / ||V|| with V = W + scale * dW. The norm runs per output row (LyCORIS `dora_scale`
[out, 1, ...], PEFT `lora_magnitude_vector` [out] on a plain Linear/Conv) or per input channel over
all rows (LyCORIS `dora_scale` [1, in, ...]; PEFT magnitude on a layer stored transposed: embeddings,
GPT-2 Conv1D with fan_in_fan_out). For fused targets V is the module's own slice.

No epsilon is added to the norm (PEFT's merge adds none). With ratio r != 1 the result is interpolated
W + r * (W' - W), as ComfyUI does; r = 1 is exactly the trained model.
"""

from __future__ import annotations

from ckpt.lazy import torch


class Dora:
    def __init__(self, adapter, role: str, axis: str):
        self.adapter, self.role, self.axis = adapter, role, axis
        self.row_local = axis == "rows"

    def apply(self, w: torch.Tensor, a: int, b: int, ratio: float) -> None:
        ad = self.adapter
        v = w.clone()
        ad.add_delta(v, a, b, ad.scale)
        m = ad.part(self.role).reshape(-1)
        if self.axis == "rows":
            target = v.mul_((m[a:b] / v.norm(dim=1)).unsqueeze(1))
        else:
            v3 = v.view(v.shape[0], m.numel(), -1)
            norm = v3.pow(2).sum(dim=(0, 2)).sqrt()
            target = v3.mul_((m / norm).view(1, -1, 1)).view(v.shape)
        if ratio == 1:
            w.copy_(target)
        else:
            w.add_(target.sub_(w), alpha=ratio)


def dora_for(adapter) -> Dora | None:
    """The DoRA step of an adapter from the parts it carries, or None. The axis follows the shape."""
    parts = adapter.module.parts
    if "dora_scale" in parts:
        shape = parts["dora_scale"].shape
        if len(shape) >= 2 and shape[0] == 1 and adapter.rows != 1:
            if adapter.cols % shape[1]:
                raise adapter.error(f"dora_scale shape {list(shape)} does not fit the delta")
            return Dora(adapter, "dora_scale", "cols")
        if shape and shape[0] == adapter.rows:
            return Dora(adapter, "dora_scale", "rows")
        raise adapter.error(f"dora_scale shape {list(shape)} fits neither axis of the delta")
    if "magnitude" in parts:
        n = parts["magnitude"].shape[0] if parts["magnitude"].shape else 1
        transposed = getattr(adapter, "transposed", False)
        if n != (adapter.cols if transposed else adapter.rows):
            raise adapter.error(f"lora_magnitude_vector has {n} entries, the layer has "
                                f"{adapter.cols if transposed else adapter.rows} outputs")
        return Dora(adapter, "magnitude", "cols" if transposed else "rows")
    return None
