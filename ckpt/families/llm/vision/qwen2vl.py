"""Qwen2-VL and Qwen2.5-VL's vision tower and merger (Qwen2VLVisionModel in the reference's conversion/qwenvl.py):
the fused qkv split into q, k and v, the Conv3D patch kernel split into its two temporal Conv2D kernels
(`v.patch_embd.weight` and `.weight.1`), Qwen2.5-VL's window-attention pattern."""

from __future__ import annotations

from ckpt.errors import CkptError
from ckpt.families.llm.projector import VisionArch, VisionExport, check_value
from ckpt.families.llm.tensors import Picked
from ckpt.io.tensors import RowSlice, Tensor

PROJECTORS = {"qwen2_vl": "QWEN2VL", "qwen2_5_vl": "QWEN25VL"}  # global model_type -> gguf.VisionProjectorType


def patch_kernels(x: VisionExport, name: str, t: Tensor) -> list[tuple[str, Tensor]]:
    """A Conv3D patch kernel [out, in, 2, h, w] as the two Conv2D kernels llama.cpp runs (one per frame of a
    temporal patch); the reference supports a temporal patch size of 2 only, and so does ckpt."""
    import gguf

    if len(t.shape) != 5 or t.shape[2] != 2:
        raise CkptError(f"{x.where}: tensor {name!r} is {list(t.shape)}, not a Conv3D kernel with a temporal patch "
                        "size of 2 (the only one llama.cpp's converter writes)")
    base = gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.V_ENC_EMBD_PATCH] + ".weight"
    return [(base, Picked(t, 2, 0, base)), (base + ".1", Picked(t, 2, 1, base + ".1"))]


class Qwen2VLVision(VisionArch):
    def prepare(self, x: VisionExport) -> None:
        v = x.vision
        v["image_size"] = v.get("image_size", 560)
        v["num_attention_heads"] = v.get("num_heads")  # config.json's names, renamed as the reference renames them
        v["num_hidden_layers"] = v.get("depth")
        if "embed_dim" in v:  # Qwen2-VL: its hidden_size is the MLP width
            v["intermediate_size"] = v.get("hidden_size")
            v["hidden_size"] = v.get("embed_dim")

    def keeps(self, x: VisionExport, name: str) -> str | None:
        return super().keeps(x, name) if name.startswith("visual.") else None

    def tensors(self, x: VisionExport, name: str, t: Tensor) -> list[tuple[str, Tensor]]:
        if ".qkv." in name:
            rows = t.shape[0] if t.shape else 0
            if rows % 3:
                raise CkptError(f"{x.where}: tensor {name!r} has {rows} rows, not q, k and v of one size")
            c = rows // 3
            out = []
            for i, part in enumerate("qkv"):
                out += super().tensors(x, name.replace("qkv", part), RowSlice(t, i * c, (i + 1) * c))
            return out
        if "patch_embed.proj.weight" in name:
            return patch_kernels(x, name, t)
        return super().tensors(x, name, t)

    def force_type(self, x: VisionExport, name: str, gname: str) -> str | None:
        if ".position_embd." in gname:
            return "F32"
        return super().force_type(x, name, gname)

    def parameters(self, w, x: VisionExport) -> None:
        import gguf

        super().parameters(w, x)
        model_type = x.config.get("model_type")
        if model_type not in PROJECTORS:
            raise CkptError(f"{x.config_path}: model_type {_show(model_type)} is not a Qwen-VL that "
                            f"llama.cpp's converter writes a projector for ({', '.join(PROJECTORS)})")
        w.add_clip_projector_type(getattr(gguf.VisionProjectorType, PROJECTORS[model_type]))
        if model_type == "qwen2_5_vl":
            w.add_vision_use_silu(True)
            w.add_vision_n_wa_pattern(window_pattern(x))
        eps = x.config.get("rms_norm_eps", 1e-6)  # the top-level one, as the reference reads it
        w.add_vision_attention_layernorm_eps(check_value(eps, f"{x.config_path}: rms_norm_eps", "float"))


def window_pattern(x: VisionExport) -> int:
    """Qwen2.5-VL's n_wa_pattern: full attention every n-th layer (fullatt_block_indexes evenly spaced)."""
    full = x.vision.get("fullatt_block_indexes")
    label = f"{x.config_path}: vision_config.fullatt_block_indexes"
    if not isinstance(full, list) or not full or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0
                                                         for i in full):
        raise CkptError(f"{label} is {_show(full)}, not a list of layer numbers (Qwen2.5-VL "
                        "needs it)")
    n = full[0] + 1
    if any(b - a != n for a, b in zip(full, full[1:])):
        raise CkptError(f"{label} is {_show(full)}: not evenly spaced (full attention once every {n} layers, the one "
                        "window pattern llama.cpp runs)")
    return n


def _show(v) -> str:
    from ckpt.families.llm.config_keys import show

    return show(v)


VISION = Qwen2VLVision("Qwen2VLVisionModel", ("Qwen2VLForConditionalGeneration", "Qwen2_5_VLForConditionalGeneration"))
