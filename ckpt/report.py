"""What a run saw that the user must hear about: counted warnings and notes, printed at the end."""

from __future__ import annotations

import threading
from collections import defaultdict
from dataclasses import dataclass, field

_LOCK = threading.Lock()  # counts arrive from the write stages' reading and compute threads


def plural(n: int, word: str) -> str:
    """`1 tensor`, `2 tensors`, `1,024 tensors`, `2 entries` (`word` is the singular; a consonant + "y" ends
    in "ies", `key` stays `keys`). The one wording of counts in every message."""
    if n == 1:
        return f"{n:,} {word}"
    if word.endswith("y") and word[-2:-1] not in ("a", "e", "i", "o", "u", ""):
        return f"{n:,} {word[:-1]}ies"
    return f"{n:,} {word}s"


def listed(names, show: int = 10) -> str:
    """The first `show` names, comma-separated, then `... (N more)`: the one wording of a name list cut short
    in a summary line (`--report FILE.json` holds the whole list)."""
    names = list(names)
    return ", ".join(names[:show]) + (f", ... ({len(names) - show} more)" if len(names) > show else "")


@dataclass
class Report:
    notes: list[str] = field(default_factory=list)
    # kind -> tensor name -> count, e.g. "overflow" -> {"x.weight": 12}
    counts: dict[str, dict[str, int]] = field(default_factory=lambda: defaultdict(dict))
    # warnings that are no per-tensor count (an assumed alpha, modules that change nothing), each said once
    warned: list[str] = field(default_factory=list)
    # output tensors whose bytes the kernel copied from the input unread (ckpt.io.byte_copy), and their bytes
    byte_copied: dict[str, int] = field(default_factory=lambda: {"tensors": 0, "bytes": 0})

    def count(self, kind: str, name: str, n: int) -> None:
        n = int(n)
        if n:
            with _LOCK:
                self.counts[kind][name] = self.counts[kind].get(name, 0) + n

    def note(self, text: str) -> None:
        self.notes.append(text)

    def warn(self, text: str) -> None:
        """A warning that is no count; `warnings()` (what the CLI prints and `--report FILE.json` stores)
        gives it first, once however often it is said."""
        if text not in self.warned:
            self.warned.append(text)

    DESCRIBE = {  # kind -> (one, several)
        "overflow": ("value overflowed to inf in the target dtype (convert --to fp16|bf16 --clamp saturates them instead)",
                     "values overflowed to inf in the target dtype (convert --to fp16|bf16 --clamp saturates them instead)"),
        "clamped": ("value was clamped to the target dtype's finite range",
                    "values were clamped to the target dtype's finite range"),
        "clamped_to_grid": ("value fell outside the base's integer grid and was clamped to its ends (its scales are "
                            "kept)", "values fell outside the base's integer grid and were clamped to its ends (its "
                            "scales are kept)"),
        "saturated": ("value saturated at the fp8 maximum (448)", "values saturated at the fp8 maximum (448)"),
        "nonfinite_input": ("NaN/Inf value was already in the input (kept as it is)",
                            "NaN/Inf values were already in the input (kept as they are)"),
        "nonfinite_quantized": ("NaN/Inf input value was quantized (Inf saturates; NaN is stored as 0, or as NaN in "
                                "fp8 codes) and left out of the scales",
                                "NaN/Inf input values were quantized (Inf saturates; NaN is stored as 0, or as NaN "
                                "in fp8 codes) and left out of the scales"),
        "nonfinite_skipped": ("NaN/Inf value was in a module left out of the output (--skip-nonfinite)",
                              "NaN/Inf values were in modules left out of the output (--skip-nonfinite)"),
        "nonfinite_decoded": ("finite value decodes as NaN/Inf: its GGUF block's fp16 scale overflowed or is NaN "
                              "(too large for the type, or a NaN/Inf in the block; llama.cpp writes the same bytes)",
                              "finite values decode as NaN/Inf: their GGUF blocks' fp16 scales overflowed or are NaN "
                              "(too large for the type, or a NaN/Inf in the block; llama.cpp writes the same bytes)"),
    }

    def warnings(self) -> list[str]:
        out = [f"warning: {w}" for w in self.warned]
        for kind, per in self.counts.items():
            total = sum(per.values())
            worst = sorted(per.items(), key=lambda kv: -kv[1])[:5]
            listed = ", ".join(f"{k} ({v})" for k, v in worst) + (", ..." if len(per) > 5 else "")
            what = self.DESCRIBE.get(kind, (kind, kind))[total != 1]
            out.append(f"warning: {total:,} {what} in {plural(len(per), 'tensor')}: {listed}")
        return out

    def as_dict(self) -> dict:
        return {"notes": self.notes, "counts": {k: dict(v) for k, v in self.counts.items()}}
