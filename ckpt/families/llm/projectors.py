"""The registered vision projectors (`ckpt.families.llm.vision`, one module each) by the config.json class name
`convert --to gguf-* --mmproj` writes a projector for (`ckpt.targets.planners.gguf_mmproj_out`)."""

from __future__ import annotations

import ckpt.families.llm.vision as _package
from ckpt.families.llm.projector import VisionArch
from ckpt.registry import entry_modules


def _all() -> list[VisionArch]:
    found = [m.VISION for m in entry_modules(_package.__name__, _package.__path__, "VISION")]
    classes = [c for v in found for c in v.hf_classes]
    dup = sorted({c for c in classes if classes.count(c) > 1})
    if dup:
        raise RuntimeError(f"vision projector class {dup[0]} is registered twice")
    return found


PROJECTORS: dict[str, VisionArch] = {c: v for v in _all() for c in v.hf_classes}
