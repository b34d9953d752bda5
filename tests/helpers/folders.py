"""Model folders as tools save them, made small: a diffusers pipeline (model_index.json, weights per
component subfolder, tokenizer and scheduler files)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file


def make_pipeline(root: Path):
    """A diffusers-shaped pipeline folder: model_index.json, weights per subfolder, tokenizer/scheduler."""
    (root / "unet").mkdir(parents=True)
    (root / "text_encoder").mkdir()
    (root / "tokenizer").mkdir()
    (root / "scheduler").mkdir()
    (root / "model_index.json").write_text(json.dumps({"_class_name": "StableDiffusionPipeline"}))
    save_file({"conv.weight": torch.randn(4, 4)}, root / "unet" / "diffusion_pytorch_model.safetensors")
    (root / "unet" / "config.json").write_text(json.dumps({"_class_name": "UNet2DConditionModel"}))
    save_file({"emb.weight": torch.randn(5, 4)}, root / "text_encoder" / "model.safetensors")
    (root / "text_encoder" / "config.json").write_text(
        json.dumps({"architectures": ["CLIPTextModel"], "torch_dtype": "float32"}))
    (root / "tokenizer" / "vocab.json").write_text("{}")
    (root / "tokenizer" / "merges.txt").write_text("#version: 0.2\n")
    (root / "scheduler" / "scheduler_config.json").write_text("{}")
