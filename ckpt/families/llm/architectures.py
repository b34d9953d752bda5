"""The registered llama.cpp LLM architectures (`ckpt.families.llm.archs`, one module each), by what asks for them:
`ARCHS` by llama.cpp architecture name, those ckpt reads back to Hugging Face (`ckpt.quant.gguf_llm`); `EXPORTS` by
config.json class name, what `convert --to gguf-*` writes (`ckpt.targets.planners.gguf_llm_out`)."""

from __future__ import annotations

import ckpt.families.llm.archs as _package
from ckpt.families.llm.arch import LLMArch
from ckpt.registry import entry_modules


def _all() -> list[LLMArch]:
    found = [m.ARCH for m in entry_modules(_package.__name__, _package.__path__, "ARCH")]
    names = [a.arch for a in found]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise RuntimeError(f"LLM architecture {dup[0]} is registered twice")
    return found


ALL: dict[str, LLMArch] = {a.arch: a for a in _all()}
ARCHS: dict[str, LLMArch] = {n: a for n, a in ALL.items() if a.readable}
EXPORTS: dict[str, LLMArch] = {c: a for a in ALL.values() for c in a.hf_classes}
