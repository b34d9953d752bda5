"""`convert --to nvfp4|mxfp8|int8|int8_rowwise`: ComfyUI `comfy_quant` checkpoints (mixed precision).

Which weights are quantized (the rule, kept in this one table until the model-family registry carries
it as data): the 2-D floating `.weight` of every layer inside the repeated transformer blocks, named by
a block container followed by an index (`double_blocks.3.`, `transformer_blocks.0.`, `layers.11.` ...).
Everything else keeps its dtype: embeddings and input projections (`img_in`, `x_embedder`,
`patch_embedding`...), the final/output layers (`final_layer`, `proj_out`, `head`, `lm_head`), time and
text conditioning MLPs, norms, biases, convolutions, and the bundled VAE / text encoders of an
all-in-one file. These are the layers ComfyUI's quantized releases keep in high precision: small, and
the most sensitive to rounding. `--keep PATTERN` keeps more.

NVFP4 needs both dimensions to be multiples of 16 and MXFP8 of 32 (comfy-kitchen pads otherwise, and the
file would not record the true shape): a block weight that does not fit stays in its dtype, and the run
says how many did. Each quantized layer gets its `X.comfy_quant` config tensor, and each output file
lists its layers in `__metadata__["_quantization_metadata"]` = {"format_version": "1.0", "layers": {...}}
(ComfyUI reads either). The encoders are `ckpt.quant.comfy_quant.encode`.
"""

from __future__ import annotations

import fnmatch
import json
import re

from ckpt.cast import Caster
from ckpt.convert.fp8_out import BUNDLED_PREFIXES
from ckpt.dtypes import is_float
from ckpt.io.plan import OutTensor, Plan
from ckpt.io.tensors import Tensor
from ckpt.quant.comfy_quant import META_KEY, QuantSpec, config_tensor, encode, unencodable
from ckpt.report import Report

TARGETS = {
    "nvfp4": QuantSpec("nvfp4"),
    "mxfp8": QuantSpec("mxfp8"),
    "int8": QuantSpec("int8_tensorwise"),  # one scale per tensor: the layout's default
    "int8_rowwise": QuantSpec("int8_tensorwise", rowwise=True),  # one scale per output row
}

# Containers of repeated transformer blocks, as a path segment followed by the block index.
BLOCK_CONTAINERS = (
    "double_blocks", "single_blocks",  # Flux, Flux.2, Chroma, HunyuanVideo (original names)
    "transformer_blocks", "single_transformer_blocks",  # diffusers DiTs (Flux, SD3, Qwen-Image, ...), UNet attention
    "joint_blocks",  # SD3 / SD3.5 (original names)
    "blocks",  # Wan, LTX(-2), HiDream, PixArt, DiT
    "layers", "noise_refiner", "context_refiner",  # Lumina2, Z-Image; LLM text encoders (model.layers)
)
_IN_BLOCK = re.compile(r"(^|\.)(" + "|".join(BLOCK_CONTAINERS) + r")\.\d+\.")


def in_scope(t: Tensor, keep: list[str]) -> bool:
    """The quantize rule above, before the block-size check."""
    name = t.name
    return (name.endswith(".weight") and len(t.shape) == 2 and is_float(t.dtype) and t.numel > 0
            and _IN_BLOCK.search(name) is not None and "embed" not in name.lower()
            and not name.startswith(BUNDLED_PREFIXES)
            and not any(fnmatch.fnmatchcase(name, pat) for pat in keep))


def comfy_quant_outputs(spec: QuantSpec, report: Report, keep: list[str]):
    """`make(tensor) -> [OutTensor]` for `plan_checkpoint`, and the per-layer record `finish` needs."""
    casters: dict = {}
    layers: dict[str, QuantSpec] = {}
    misfits: list[str] = []

    def make(t: Tensor) -> list[OutTensor]:
        if in_scope(t, keep):
            if unencodable(spec, t.shape) is None:
                layer = t.name[: -len(".weight")]
                layers[layer] = spec
                return encode(spec, t, report) + [config_tensor(layer, spec, t.home)]
            misfits.append(t.name)
        if not is_float(t.dtype):
            return [OutTensor(t.name, t.dtype, tuple(t.shape), t, lambda x, b: x)]
        dst = t.natural_dtype
        c = casters.setdefault(dst, Caster(dst, report))
        return [OutTensor(t.name, dst, tuple(t.shape), t, lambda x, b, n=t.name, c=c: c(x, n, b))]

    def finish(plan: Plan) -> None:
        """List each file's quantized layers in its metadata; say what was quantized and what not."""
        for f in plan.files:
            mine = {n[: -len(".comfy_quant")]: layers[n[: -len(".comfy_quant")]].config
                    for n in (o.name for o in f.tensors) if n.endswith(".comfy_quant")}
            f.metadata.pop(META_KEY, None)
            if mine and f.format == "safetensors":
                f.metadata[META_KEY] = json.dumps({"format_version": "1.0", "layers": mine})
        plan.notes.append(f"{len(layers)} block weights stored as {spec.format}"
                          + (" (row-wise scales)" if spec.rowwise else "")
                          + "; other tensors keep their dtype")
        if misfits:
            block = {"nvfp4": 16, "mxfp8": 32}.get(spec.format)
            shown = ", ".join(misfits[:3]) + (", ..." if len(misfits) > 3 else "")
            plan.notes.append(f"{len(misfits)} block weights kept in high precision: their dimensions are not "
                              f"multiples of {block} ({shown})")

    return make, finish
