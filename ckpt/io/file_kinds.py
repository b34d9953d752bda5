"""What a file's name says it is: weights (safetensors, pickles, GGUF), LitGPT's LoRA file, or a trainer's state
saved beside the weights. Facts about names only, so that checking a path (`ckpt.io.hub`, before torch or a
header is read), opening a checkpoint (`ckpt.io.checkpoint`), naming outputs (`ckpt.run`) and batch discovery
share one list."""

from __future__ import annotations

import re
from pathlib import Path

SAFETENSORS = (".safetensors",)
PICKLES = (".ckpt", ".pt", ".pth", ".bin")
GGUF = ".gguf"  # llama.cpp / ComfyUI-GGUF files, one model each (ckpt.io.gguf)
# LitGPT's LoRA-only state dict (`lit_model.pth.lora`, a torch zip): read when named, never picked
# from a folder as the model's weights.
LITGPT_LORA = ".pth.lora"
# An -o ending like this names one file, never a folder (`ckpt.run.output_path`).
WEIGHT_SUFFIXES = SAFETENSORS + PICKLES + (".gguf",)
# Files that are never weights even though they end like a pickle.
NOT_WEIGHTS = re.compile(r"(optimizer|scheduler|scaler|rng_state|random_states|training_args)[^/]*$")
# Trainer state that is not a pickle by its suffix: accelerate's RNG states, the trainers' progress files
# (SimpleTuner training_state.json, HF Trainer trainer_state.json, kohya train_state.json).
TRAINER_FILES = re.compile(r"(random_states_\d+\.pkl|custom_checkpoint_\d+\.pkl|training_state[\w.-]*\.json|"
                           r"trainer_state\.json|train_state\.json)")


def is_training_state(p: Path) -> bool:
    """Optimizer, scheduler, scaler, RNG and progress files a trainer saves beside the weights: never part
    of a model, so never copied into an output (a converted checkpoint is a model, not a resumable run)."""
    return (p.suffix in PICKLES and bool(NOT_WEIGHTS.search(p.name))) or bool(TRAINER_FILES.fullmatch(p.name))
