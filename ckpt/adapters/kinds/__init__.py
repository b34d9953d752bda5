"""One small module per adapter kind behind one interface (`base.Adapter`).

`make_adapter(module)` picks the kind from the parts a LoRA module carries (see
`ckpt.adapters.loading` for how stored keys become parts).
"""

from __future__ import annotations

from ckpt.errors import CkptError
from ckpt.adapters.kinds.base import Adapter
from ckpt.adapters.kinds.full import Full
from ckpt.adapters.kinds.glora import GLoRA
from ckpt.adapters.kinds.ia3 import IA3
from ckpt.adapters.kinds.loha import LoHa
from ckpt.adapters.kinds.lokr import LoKr
from ckpt.adapters.kinds.lora import LoRA
from ckpt.adapters.kinds.replace import Replace

KINDS: dict[str, type[Adapter]] = {"lora": LoRA, "loha": LoHa, "lokr": LoKr, "full": Full, "ia3": IA3, "glora": GLoRA,
                                   "replace": Replace}


def make_adapter(module) -> Adapter:
    try:
        adapter = KINDS[module.kind](module)
    except (IndexError, ValueError, TypeError) as e:  # tensors of the wrong rank: name the module
        shapes = ", ".join(f"{k} {list(t.shape)}" for k, t in zip(module.keys, module.parts.values()))
        raise CkptError(f"{module.source}: module {module.name!r}: malformed {module.kind} weights "
                        f"({shapes}): {e}") from None
    if "dora_scale" in module.parts and getattr(adapter, "dora", None) is None:
        raise adapter.error(f"dora_scale on a {module.kind} module is not supported")
    return adapter
