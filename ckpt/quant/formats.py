"""The quantized storage formats ckpt decodes, each one registered unit: a decoder module of `ckpt.quant` declares
`FORMAT = Format(...)`, and everything that asks about formats reads this registry (found by listing the package,
`ckpt.registry`, like families, targets and merge methods):

- `ckpt.quant.view.logical_view` runs every format's decoders in `priority` order (and the `last` ones after all),
  then refuses leftover keys by the formats' `refusals` and data a config names the wrong method for
  (`contradicts`);
- `ckpt inspect` asks the format of a decoded weight for its settings (`settings`: bits, group size, ...);
- `merge-lora` writes a base decoded from an LLM quantization format (`llm`) in bf16 without --to;
- the messages and help that list formats read `label`.

Adding a format is adding its module with its FORMAT (and a case in tests/helpers/format_cases.py, which the
conformance test `tests/test_quant_formats.py` requires of every registered format).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Callable


@dataclass(frozen=True)
class Contradiction:
    """Stored data only this format's decoder reads, and only when config.json names its method: left over under a
    quantization_config naming another method (or none), the config contradicts the tensors."""

    what: str  # "MXFP4 blocks"
    found: Callable[[str, dict], bool]  # (stored key, every key left) -> whether the key is such data
    method: str  # the quant_method that decodes it ("mxfp4", "gptq or awq")


@dataclass(frozen=True)
class Format:
    name: str  # registry key ("gptq")
    label: str  # how messages name it ("GPTQ")
    priority: int  # its decoders run in this order among the formats' (lower first)
    decoders: tuple  # decode(ctx) -> Decoded | None, in the format's own order
    weights: tuple = ()  # the classes of the logical tensors its decoders make
    settings: Callable | None = None  # (weight, config.json) -> inspect's settings of one decoded weight: a dict
    # with the format's name under "format" and "bits" or "type" (ckpt.inspect.encodings makes its label of them)
    llm: bool = False  # an LLM quantization: decoded values are its library's compute dtype, merges write bf16
    refusals: dict = field(default_factory=dict)  # name -> (compiled pattern of a leftover key, what is wrong)
    contradicts: tuple = ()  # Contradiction, ...
    last: tuple = ()  # decoders that run after every format's own (claims nobody else made)

    def owns(self, t) -> bool:
        """Whether the logical tensor `t` was decoded by this format."""
        return bool(self.weights) and isinstance(t, self.weights)


_FORMATS: list[Format] | None = None


def formats() -> list[Format]:
    """Every registered format, in decoding order."""
    global _FORMATS
    if _FORMATS is None:
        import ckpt.quant
        from ckpt.registry import entry_modules

        found = [m.FORMAT for m in entry_modules("ckpt.quant", ckpt.quant.__path__, "FORMAT")]
        names = [f.name for f in found]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise RuntimeError(f"quantized format {dup[0]} is registered twice")
        _FORMATS = sorted(found, key=lambda f: (f.priority, f.name))
    return _FORMATS


def get(name: str) -> Format:
    return next(f for f in formats() if f.name == name)


def decoders() -> list:
    """Every decoder in the order `logical_view` runs them."""
    fs = formats()
    return [d for f in fs for d in f.decoders] + [d for f in fs for d in f.last]


def format_of(t) -> Format | None:
    """The format that decoded the logical tensor `t` (None: a plain tensor, or an encoding nobody registered)."""
    return next((f for f in formats() if f.owns(t)), None)


def llm_labels(views) -> list[str]:
    """The LLM quantization formats some tensor of the views was decoded from, by label, sorted."""
    return sorted({f.label for v in views for t in v.tensors.values() if (f := format_of(t)) is not None and f.llm})


def refusals() -> dict[str, tuple[re.Pattern, str]]:
    return {name: r for f in formats() for name, r in f.refusals.items()}


def contradictions() -> list[Contradiction]:
    return [c for f in formats() for c in f.contradicts]


def labels() -> list[str]:
    """Every format's label, in decoding order (for messages that list what ckpt decodes)."""
    return [f.label for f in formats()]
