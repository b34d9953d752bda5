"""What the adapter commands (`ckpt merge-lora` and `ckpt lora extract|resize|merge|convert`) check and say
the same way, so that one LoRA gets the same answer from each of them:

- numeric options (`--ratio`, `--alpha`, thresholds...) are finite and in range before any file is read:
  a NaN ratio used to merge as if it were 1, or write all-NaN factors, with exit 0;
- an alpha no file gives is an assumption the user must hear about (a PEFT folder without
  adapter_config.json, a diffusers file saved without `lora_adapter_metadata`, kohya files without `.alpha`
  keys): alpha = rank (scale 1) is assumed with a warning naming `--alpha`, which sets it instead;
- warnings that are not per-tensor value counts (`Report.counts`) still reach the printed summary and
  `--report FILE.json`: `Report.warn`.
"""

from __future__ import annotations

import math

from ckpt.errors import CkptError
from ckpt.report import Report, plural

ALPHA_KINDS = ("lora", "loha", "lokr", "glora")  # the families whose scale is alpha / rank


def finite(flag: str, value: float | None) -> None:
    """A numeric option is a finite number (None: not given)."""
    if value is not None and not math.isfinite(value):
        raise CkptError(f"{flag} {value}: not a finite number")


def ratios(given, n: int) -> list[float]:
    """--ratio: once per LoRA, in order (default 1.0 each), each finite (negative subtracts a LoRA)."""
    given = list(given)
    for r in given:
        finite("--ratio", r)
    if not given:
        return [1.0] * n
    if len(given) != n:
        raise CkptError(f"--ratio given {plural(len(given), 'time')} for {plural(n, 'LoRA')} "
                        "(give one per LoRA, in order)")
    return given


def alphas(given, n: int) -> list[float | None]:
    """--alpha: once (every LoRA) or once per LoRA, in order; each finite and > 0. None per LoRA: not given."""
    given = list(given)
    for a in given:
        finite("--alpha", a)
        if a <= 0:
            raise CkptError(f"--alpha {a:g}: an alpha is greater than 0")
    if not given:
        return [None] * n
    if len(given) == 1:
        return given * n
    if len(given) != n:
        raise CkptError(f"--alpha given {plural(len(given), 'time')} for {plural(n, 'LoRA')} "
                        "(give it once for all, or once per LoRA, in order)")
    return given


def settle_alphas(f, alpha: float | None, report: Report) -> None:
    """Modules of LoRA file `f` whose alpha no file gives (no alpha key, adapter_config.json or
    lora_adapter_metadata): alpha = `alpha` (--alpha) when given, else alpha = rank (scale 1), assumed
    with a warning. PEFT's own default (lora_alpha 8) differs from that, so the assumption is never silent."""
    missing = [m for m in f.modules.values() if m.kind in ALPHA_KINDS and m.alpha() is None]
    names = {m.name for m in missing}  # LitGPT's q/k/v pieces are one stored module
    if not names:
        return
    n = len(names)
    if alpha is not None:
        for m in missing:
            m.config_alpha = alpha
        report.note(f"{f.spec}: {plural(n, 'module')} without an alpha of {'its' if n == 1 else 'their'} own: "
                    f"alpha {alpha:g} (--alpha)")
        return
    report.warn(f"{f.spec}: {plural(n, 'module')} carr{'ies' if n == 1 else 'y'} no alpha (no alpha key, "
                "adapter_config.json or lora_adapter_metadata): assumed alpha = rank (scale 1); pass --alpha A "
                "to set the alpha it was trained with")
