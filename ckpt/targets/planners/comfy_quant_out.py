"""`convert --to nvfp4|mxfp8|int8|int8_rowwise|int8_convrot|convrot_w4a4|asym_w4a8_int8`: ComfyUI `comfy_quant` checkpoints (mixed precision).

Which weights are quantized: the 2-D floating `.weight` tensors of the model, except what its family
keeps in high precision (`high_precision` in `ckpt/families/<family>.py`: the input and output layers,
embeddings, conditioning and modulation layers, per layout). A checkpoint of no known family falls back
to one table here: only weights inside the repeated transformer blocks (a block container followed by
an index: `double_blocks.3.`, `transformer_blocks.0.`, `layers.11.` ...). Always kept: names containing
`embed`, the bundled VAE / text encoders of an all-in-one file (ComfyUI loads them without these ops),
and `--keep` matches. These are the layers ComfyUI's quantized releases keep in high precision: small,
and the most sensitive to rounding.

NVFP4 needs both dimensions to be multiples of 16 and MXFP8 of 32 (comfy-kitchen pads otherwise, and the
file would not record the true shape): a weight that does not fit stays in its dtype, and the run says
how many did. Each quantized layer gets its `X.comfy_quant` config tensor, and each output file lists its
layers in `__metadata__["_quantization_metadata"]` = {"format_version": "1.0", "layers": {...}} (ComfyUI
reads either). The encoders are `ckpt.quant.comfy_quant.encode`.
"""

from __future__ import annotations

import fnmatch
import json
import re

from ckpt import families
from ckpt.targets.planners.fp8_out import BUNDLED_PREFIXES
from ckpt.dtypes import is_float
from ckpt.families.prefixes import model_prefix
from ckpt.io.plan import OutTensor, Plan
from ckpt.io.tensors import Tensor
from ckpt.targets.planners.kept import kept
from ckpt.quant.comfy_quant import META_KEY, QuantSpec, config_tensor, encode, unencodable
from ckpt.report import Report, plural

# Fallback for checkpoints of no known family: containers of repeated transformer blocks, as a path
# segment followed by the block index.
BLOCK_CONTAINERS = (
    "double_blocks", "single_blocks",  # Flux, Flux.2, Chroma, HunyuanVideo (original names)
    "transformer_blocks", "single_transformer_blocks",  # diffusers DiTs (Flux, SD3, Qwen-Image, ...), UNet attention
    "joint_blocks",  # SD3 / SD3.5 (original names)
    "blocks",  # Wan, LTX(-2), HiDream, PixArt, DiT
    "layers", "noise_refiner", "context_refiner",  # Lumina2, Z-Image; LLM text encoders (model.layers)
)
_IN_BLOCK = re.compile(r"(^|\.)(" + "|".join(BLOCK_CONTAINERS) + r")\.\d+\.")


class QuantizeRule:
    """Which tensors of one model (a component's logical tensors) are stored quantized; `layout` names the
    layout of the names `quantize` will see when that differs from the input's (`convert --layout`)."""

    def __init__(self, tensors: dict[str, Tensor], keep: list[str], layout: str | None = None):
        self.keep = keep
        self.prefix = model_prefix(tensors, {k: tuple(t.shape) for k, t in tensors.items()})  # single files
        inner = {k[len(self.prefix):]: tuple(t.shape) for k, t in tensors.items() if k.startswith(self.prefix)}
        m = families.detect(inner, inner)
        self.family = m.family if m is not None and m.family.high_precision else None
        self.layout = layout or (m.layout if m is not None else None)
        self.describe = (f"{m.family.label}, {families.layout_name(self.layout)}: the family's high-precision layers kept"
                         if self.family else "family not recognised: weights inside transformer blocks only")

    def quantize(self, t: Tensor) -> bool:
        name = t.name
        if not (name.endswith(".weight") and len(t.shape) == 2 and is_float(t.dtype) and t.numel > 0):
            return False
        if "embed" in name.lower() or name.startswith(BUNDLED_PREFIXES) \
                or any(fnmatch.fnmatchcase(name, pat) for pat in self.keep):
            return False
        inner = name[len(self.prefix):] if name.startswith(self.prefix) else name
        if self.family is not None:
            return not self.family.keeps_high_precision(inner, tuple(t.shape), self.layout)
        return _IN_BLOCK.search(inner) is not None


def comfy_quant_outputs(spec: QuantSpec, report: Report, keep: list[str], views, layout: str | None = None):
    """`make(tensor) -> [OutTensor]` for the planners, and `finish(plan)`, which lists each file's layers in
    its metadata and says what was quantized. `views`: the components' logical views (one rule each)."""
    casters: dict = {}
    layers: dict[str, QuantSpec] = {}
    misfits: list[str] = []
    rules = [QuantizeRule(v.tensors, keep, layout) for v in views]
    rule_of = {id(t): r for r, v in zip(rules, views) for t in v.tensors.values()}

    def make(t: Tensor) -> list[OutTensor]:
        rule = rule_of.get(id(t), rules[0])  # a renamed tensor (convert --layout: one component)
        if rule.quantize(t):
            if unencodable(spec, t.shape) is None:
                layer = t.name[: -len(".weight")]
                layers[layer] = spec
                return encode(spec, t, report) + [config_tensor(layer, spec, t.home)]
            misfits.append(t.name)
        return [kept(t, casters, report)]

    def finish(plan: Plan) -> None:
        """List each file's quantized layers in its metadata; say what was quantized and what not."""
        for f in plan.files:
            mine = {n[: -len(".comfy_quant")]: layers[n[: -len(".comfy_quant")]].config
                    for n in (o.name for o in f.tensors) if n.endswith(".comfy_quant")}
            f.metadata.pop(META_KEY, None)
            if mine and f.format == "safetensors":
                f.metadata[META_KEY] = json.dumps({"format_version": "1.0", "layers": mine})
        plan.notes.append(f"{plural(len(layers), 'weight')} stored as {getattr(spec, 'label', spec.format)}"
                          + (" (row-wise scales)" if spec.rowwise and not getattr(spec, "convrot", False) else "")
                          + f"; other tensors keep their dtype ({'; '.join(sorted({r.describe for r in rules}))})")
        if misfits:
            block = {"nvfp4": 16, "mxfp8": 32}.get(spec.format)
            shown = ", ".join(misfits[:3]) + (", ..." if len(misfits) > 3 else "")
            why = getattr(spec, "misfit", None) or f"dimensions not multiples of {block}"
            plan.notes.append(f"{plural(len(misfits), 'weight')} kept in high precision: {why} ({shown})")

    return make, finish

