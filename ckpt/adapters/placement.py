"""Where a LoRA module's delta lands in the base: the contract between the key map and the adapters.

The key map (`keymap.py`) is built from the base's own keys: for each base weight it registers every
spelling a LoRA may use for it (kohya `lora_unet_...`, PEFT `base_model.model....`, diffusers names of
fused BFL weights, ...) and maps it to a `Placement`. Adapters (`adapters/`) compute a module's delta in the
module's own shape and add it to `target.rows` of `target.key`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ckpt.families import Transform


@dataclass(frozen=True)
class Placement:
    key: str  # base tensor name, e.g. "double_blocks.0.img_attn.qkv.weight"
    rows: tuple[int, int] | None = None  # [start, stop) rows of a fused weight owned by this module
    # The layout fix-up of the delta before adding (ckpt.families.Transform): SWAP_HALVES (diffusers norm_out
    # scale/shift order vs BFL final_layer.adaLN_modulation), TRANSPOSE (OpenCLIP text_projection), or None.
    # Direction: from the base tensor's rows to the module's layout (its inverse brings a delta back).
    transform: Transform | None = None
    # [start, stop) rows of the module's delta that land on `key`: set when a LoRA made on a fused weight
    # (BFL `img_attn.qkv`, `linear1`) is merged into a base that stores the pieces apart (diffusers
    # `to_q`/`to_k`/`to_v`); such a module has several Targets (`KeyMap.targets`).
    part: tuple[int, int] | None = None

    @property
    def bias_key(self) -> str:
        """The bias beside the weight (`diff_b`, `lora_B.bias` land here, same rows)."""
        if self.key.endswith(".in_proj_weight"):  # OpenCLIP fused attention: in_proj_bias
            return self.key[: -len("_weight")] + "_bias"
        return self.key[: -len(".weight")] + ".bias" if self.key.endswith(".weight") else self.key + ".bias"
