"""Whole Stable Diffusion pipelines (SD1, SDXL, SD3): which families make up the all-in-one single file
A1111, ComfyUI and kohya load, under which file prefix, and in which naming, beside the diffusers
pipeline folder that holds the same models one per subfolder.

These are facts about the models, not about a command: `convert --layout` on a pipeline
(`ckpt.layout.pipeline`) reads them, and so may anything else that takes a single file apart. They sit
in a subpackage because a pipeline is no `Family` (it is made of families; the family loader does not
enter subpackages). Each part names its family by id (`ckpt.families.get`).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PipelinePart:
    folder: str  # pipeline subfolder
    prefix: str  # key prefix in the single file
    family: str  # family id of the part
    naming: str  # "layout": the family's original layout in the file; "hf": the same HF names in both


# kind -> (the diffusers pipeline class of model_index.json, its parts)
PIPELINES: dict[str, tuple[str, list[PipelinePart]]] = {
    "sd1": ("StableDiffusionPipeline", [
        PipelinePart("unet", "model.diffusion_model.", "sd1", "layout"),
        PipelinePart("vae", "first_stage_model.", "autoencoder_kl", "layout"),
        PipelinePart("text_encoder", "cond_stage_model.transformer.", "clip", "hf"),
    ]),
    "sdxl": ("StableDiffusionXLPipeline", [
        PipelinePart("unet", "model.diffusion_model.", "sdxl", "layout"),
        PipelinePart("vae", "first_stage_model.", "autoencoder_kl", "layout"),
        PipelinePart("text_encoder", "conditioner.embedders.0.transformer.", "clip", "hf"),
        PipelinePart("text_encoder_2", "conditioner.embedders.1.model.", "clip", "layout"),
    ]),
    "sd3": ("StableDiffusion3Pipeline", [
        PipelinePart("transformer", "model.diffusion_model.", "sd3", "layout"),
        PipelinePart("vae", "first_stage_model.", "autoencoder_kl", "layout"),
        PipelinePart("text_encoder", "text_encoders.clip_l.transformer.", "clip", "hf"),
        PipelinePart("text_encoder_2", "text_encoders.clip_g.transformer.", "clip", "hf"),
        PipelinePart("text_encoder_3", "text_encoders.t5xxl.transformer.", "t5", "hf"),
    ]),
}
