"""What a run saw that the user must hear about: counted warnings and notes, printed at the end."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field


@dataclass
class Report:
    notes: list[str] = field(default_factory=list)
    # kind -> tensor name -> count, e.g. "overflow" -> {"x.weight": 12}
    counts: dict[str, dict[str, int]] = field(default_factory=lambda: defaultdict(dict))

    def count(self, kind: str, name: str, n: int) -> None:
        if n:
            self.counts[kind][name] = self.counts[kind].get(name, 0) + int(n)

    def note(self, text: str) -> None:
        self.notes.append(text)

    DESCRIBE = {
        "overflow": "values overflowed to inf in the target dtype (use --clamp to saturate)",
        "clamped": "values were clamped to the target dtype's finite range",
        "saturated": "values saturated at the fp8 maximum (448)",
        "nonfinite_input": "NaN/Inf values were already in the input (kept as they are)",
    }

    def warnings(self) -> list[str]:
        out = []
        for kind, per in self.counts.items():
            total = sum(per.values())
            worst = sorted(per.items(), key=lambda kv: -kv[1])[:5]
            listed = ", ".join(f"{k} ({v})" for k, v in worst) + (", ..." if len(per) > 5 else "")
            out.append(f"warning: {total} {self.DESCRIBE.get(kind, kind)} in {len(per)} tensors: {listed}")
        return out

    def as_dict(self) -> dict:
        return {"notes": self.notes, "counts": {k: dict(v) for k, v in self.counts.items()}}
