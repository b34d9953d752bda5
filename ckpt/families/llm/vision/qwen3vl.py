"""Qwen3-VL's vision tower, merger and DeepStack mergers (Qwen3VLVisionModel in the reference's
conversion/qwen3vl.py): `model.visual.*` read as `visual.*`, the qkv kept fused, the merger's two linears as
`mm.0` / `mm.2` (Qwen2-VL's places), each DeepStack merger under the vision layer it taps, the Conv3D patch kernel
split as Qwen2-VL's, the image size derived from the position table where the config has none."""

from __future__ import annotations

from ckpt.errors import CkptError
from ckpt.families.llm.projector import VisionArch, VisionExport, check_value
from ckpt.families.llm.vision.qwen2vl import patch_kernels
from ckpt.io.tensors import Tensor

MERGER_FC = {"linear_fc1": 0, "linear_fc2": 2}  # Qwen3-VL's merger linears at Qwen2-VL's mm.N indices
DEEPSTACK = {"norm": "V_DS_NORM", "linear_fc1": "V_DS_FC1", "linear_fc2": "V_DS_FC2"}  # gguf.MODEL_TENSOR


def _name(key: str, bid: int | None, suffix: str) -> str:
    """format_tensor_name: gguf's name for MODEL_TENSOR `key` (block `bid`), with `suffix`."""
    import gguf

    name = gguf.TENSOR_NAMES[gguf.MODEL_TENSOR[key]]
    return (name.format(bid=bid) if "{bid}" in name else name) + suffix


class Qwen3VLVision(VisionArch):
    def prepare(self, x: VisionExport) -> None:
        v = x.vision
        if "image_size" not in v:  # num_position_embeddings = (image_size / patch_size) ** 2
            n_pos = check_value(v.get("num_position_embeddings", 2304),
                                f"{x.config_path}: vision_config.num_position_embeddings", "int")
            patch = check_value(v.get("patch_size", 16), f"{x.config_path}: vision_config.patch_size", "int")
            v["image_size"] = int(n_pos ** 0.5 * patch)
        v["num_attention_heads"] = v.get("num_heads")
        v["num_hidden_layers"] = v.get("depth")
        depth = check_value(v["num_hidden_layers"], f"{x.config_path}: vision_config.depth", "int")
        x.state["deepstack"] = layers = [False] * depth
        for i in self.deepstack_indexes(x):
            layers[i] = True

    def deepstack_indexes(self, x: VisionExport) -> list[int]:
        idx = x.vision.get("deepstack_visual_indexes", [])
        depth = x.vision["num_hidden_layers"]
        if not isinstance(idx, list) or not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < depth
                                                for i in idx):
            raise CkptError(f"{x.config_path}: vision_config.deepstack_visual_indexes is {_show(idx)}, not a list of "
                            f"vision layer numbers below its depth {depth}")
        return idx

    def keeps(self, x: VisionExport, name: str) -> str | None:
        if name.startswith(("lm_head.", "mtp.")):
            return None
        if name.startswith("model.visual."):
            name = name.replace("model.visual.", "visual.", 1)
        return super().keeps(x, name) if name.startswith("visual.") else None

    def tensors(self, x: VisionExport, name: str, t: Tensor) -> list[tuple[str, Tensor]]:
        if name.startswith("visual.deepstack_merger_list."):
            number, rest = name.split(".", maxsplit=3)[2:]
            idx = self.deepstack_indexes(x)
            part, _, suffix = rest.partition(".")
            if not number.isdecimal() or int(number) >= len(idx) or part not in DEEPSTACK or not suffix:
                raise CkptError(f"{x.where}: tensor {name!r} is not one of the {len(idx)} DeepStack mergers' "
                                f"{'/'.join(DEEPSTACK)} (deepstack_visual_indexes in config.json)")
            return super().tensors(x, _name(DEEPSTACK[part], idx[int(number)], "." + suffix), t)
        if name.startswith("visual.merger."):
            rest = name.split(".", 2)[2]
            part, _, suffix = rest.partition(".")
            if part in MERGER_FC and suffix:
                return [(_name("V_MMPROJ", MERGER_FC[part], "." + suffix), t)]
            if part == "norm" and suffix:
                return [(_name("V_POST_NORM", None, "." + suffix), t)]
            raise CkptError(f"{x.where}: tensor {name!r} is not one of Qwen3-VL's merger tensors (linear_fc1, "
                            "linear_fc2, norm)")
        if name == "visual.patch_embed.proj.weight":
            return patch_kernels(x, name, t)
        if name == "visual.patch_embed.proj.bias":
            return [(_name("V_ENC_EMBD_PATCH", None, ".bias"), t)]
        return super().tensors(x, name, t)

    def parameters(self, w, x: VisionExport) -> None:
        import gguf

        super().parameters(w, x)
        w.add_clip_projector_type(gguf.VisionProjectorType.QWEN3VL)
        w.add_vision_use_gelu(True)
        if (merge := x.vision.get("spatial_merge_size")) is not None:
            w.add_vision_spatial_merge_size(check_value(merge, f"{x.config_path}: vision_config.spatial_merge_size",
                                                        "int"))
        text = x.config.get("text_config") if isinstance(x.config.get("text_config"), dict) else {}
        w.add_vision_attention_layernorm_eps(check_value(text.get("rms_norm_eps", 1e-6),
                                                         f"{x.config_path}: text_config.rms_norm_eps", "float"))
        if x.state["deepstack"]:
            w.add_vision_is_deepstack_layers(x.state["deepstack"])


def _show(v) -> str:
    from ckpt.families.llm.config_keys import show

    return show(v)


VISION = Qwen3VLVision("Qwen3VLVisionModel", ("Qwen3VLForConditionalGeneration", "Qwen3VLMoeForConditionalGeneration",
                                              "Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForConditionalGeneration"))
