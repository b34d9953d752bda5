"""Gemma 3's SigLIP tower and projector (Gemma3VisionModel in the reference's conversion/gemma.py): the projector's
RMSNorm + 1, its input projection always F16 and the embeddings F32, the scale factor of a non-default token count.

Google's checkpoints hold the tower under `vision_tower.vision_model.`; transformers 5 saves a Gemma 3 (a fine-tune)
with it under `vision_tower.` (its SigLIP prefix change reversed on save), names gguf's table does not know, so
the reference fails on such a folder ("Can not map tensor"). ckpt reads them as the hub names they stand for: the
projector is the reference's file of the same weights in Google's layout."""

from __future__ import annotations

from ckpt.families.llm.projector import VisionArch, VisionExport, check_value
from ckpt.families.llm.tensors import Shifted
from ckpt.io.tensors import Tensor


class Gemma3Vision(VisionArch):
    def keeps(self, x: VisionExport, name: str) -> str | None:
        if name.startswith("vision_tower.") and not name.startswith("vision_tower.vision_model."):  # transformers 5
            name = "vision_tower.vision_model." + name[len("vision_tower."):]
        if "vision_model.head." in name:  # tinygemma3's redundant pooling head
            return None
        if not name.startswith(("multi_modal_projector.", "vision_tower.", "multimodal_projector.", "vision_model.")):
            return None
        return super().keeps(x, name.replace("_weight", ".weight"))

    def tensors(self, x: VisionExport, name: str, t: Tensor) -> list[tuple[str, Tensor]]:
        if "soft_emb_norm.weight" in name:  # Gemma3RMSNorm scales by 1 + weight; SigLIP's own norms are plain
            t = Shifted(t, 1.0)
        return super().tensors(x, name, t)

    def force_type(self, x: VisionExport, name: str, gname: str) -> str | None:
        if "input_projection" in name:  # llama.cpp issue 13025
            return "F16"
        if ".embeddings." in name:
            return "F32"
        return super().force_type(x, name, gname)

    def parameters(self, w, x: VisionExport) -> None:
        import gguf

        super().parameters(w, x)
        w.add_clip_projector_type(gguf.VisionProjectorType.GEMMA3)
        eps = x.vparam(["layer_norm_eps"], optional=True, what="float")
        w.add_vision_attention_layernorm_eps(1e-6 if eps is None else eps)
        w.add_vision_use_gelu(True)
        seq = check_value(x.preprocessor.get("image_seq_length", 256),
                          f"{x.folder / 'preprocessor_config.json'}: image_seq_length", "int")
        scale = (x.vision["image_size"] // x.vision["patch_size"]) // int(seq ** 0.5)
        if scale > 0 and scale != 4:  # written only where it is not llama.cpp's default (test models)
            w.add_vision_projector_scale_factor(scale)


VISION = Gemma3Vision("Gemma3VisionModel", ("Gemma3ForConditionalGeneration",))
