"""What a loaded adapter is: its modules (name, kind, part tensors, alpha) and the file they came from.

The data types shared by the readers: `ckpt.adapters.loading` (LoRA files of every kind, PEFT folders) and
`ckpt.adapters.litgpt` (LitGPT's fused q/k/v LoRA) both produce them, and merging consumes them.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ckpt.lazy import torch

from ckpt.io.checkpoint import Checkpoint
from ckpt.io.scalars import first_float
from ckpt.io.tensors import Tensor


@dataclass
class LoraModule:
    name: str  # as spelled in the file (kind suffix removed)
    source: str  # the LoRA as the user named it
    kind: str | None
    parts: dict[str, Tensor]
    keys: list[str]
    lookup_names: list[str]  # spellings to try in the key map, best first
    config_alpha: float | None = None
    rslora: bool = False
    fan_in_fan_out: bool = False
    # (start, stop, total): the module changes rows [start, stop) of a fused base weight of `total` rows
    # (one of LitGPT's q/k/v pieces of `attn.qkv`); None: the whole target.
    rows: tuple[int, int, int] | None = None
    scale: float | None = None  # the multiplier itself, when the trainer gives one instead of an alpha (mlx-lm)
    # the trainer's own merge rounds the scaled delta to the weight's dtype before adding it (mlx_lm fuse), which
    # a merge must do too to give its bytes
    delta_in_weight_dtype: bool = False

    def alpha(self) -> float | None:
        if "alpha" in self.parts and self.parts["alpha"].numel:
            stored = first_float(self.parts["alpha"])  # planning without torch where the bytes say it
            if stored is not None:
                return stored
            return float(self.parts["alpha"].read_all(torch.device("cpu")).float().reshape(-1)[0])
        return self.config_alpha


@dataclass
class LoraFile:
    spec: str
    weights: Path
    modules: dict[str, LoraModule]
    unknown: list[str]  # stored keys that are no adapter part
    ckpt: Checkpoint
    litgpt: object | None = None  # ckpt.adapters.litgpt.LitSettings for a LitGPT LoRA
    dtype: torch.dtype | None = None  # the dtype its own merge tool writes (LitGPT: the LoRA's)
    side_files: tuple[Path, ...] = ()  # settings files read beside the weights (mlx-lm's adapter_config.json)

    @property
    def inputs(self) -> list[Path]:
        return self.ckpt.inputs + (list(self.litgpt.files) if self.litgpt is not None else []) + list(self.side_files)

    def close(self):
        self.ckpt.close()
