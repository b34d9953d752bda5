"""The text model of a vision-language folder as llama.cpp's converter reads it without `--mmproj`.

A VLM checkpoint (Mistral 3, Gemma 3, ...) holds its language model under a prefix (`language_model.model.layers.N`
as transformers saves it, `model.language_model.layers.N` in newer files) beside the vision tower and the
multimodal projector. The reference's text model class sees the folder through `TextModel.filter_tensors` and
`ModelBase.filter_tensors` (conversion/base.py): the vision / audio / projector tensors are never indexed, and
`language_model.` is cut from every other name, so that the language model's tensors have their causal LM names
and gguf's table names them as it names a text model's. `text_model_name` is that filter; an architecture that
serves a VLM class returns it from `LLMArch.source_name`. (The projector is the other file, `--mmproj`.)
"""

from __future__ import annotations

# TextModel.filter_tensors: "Skip multimodal tensors" (a name starting with one of these, or containing one)
STARTS = ("mlp", "vit.", "vpm.", "siglip2.", "conformer.", "merger.", "resampler.", "sound_encoder.",
          "sound_projection.", "speech_embeddings.")
CONTAINS = ("visual.", "vision.", "audio.", "talker.", "vision_", "audio_", "token2wav.", "code2wav.", "projector.",
            "pre_mm_projector_norm", "image_newline", "view_seperator", "patch_embed", "patch_embedding",
            "patch_merger.", "patch_merge_mlp.", "model.connector.")


def text_model_name(name: str) -> str | None:
    """TextModel.filter_tensors then ModelBase.filter_tensors: None for a tensor of the vision / audio side,
    else the name the converter maps (`language_model.` removed, `e_score_correction_bias` as a bias)."""
    if name.startswith(STARTS) or any(part in name for part in CONTAINS):
        return None
    if name.endswith("e_score_correction_bias"):
        name = name.replace("e_score_correction_bias", "e_score_correction.bias")
    return name.replace("language_model.", "")
