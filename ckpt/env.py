"""Settings ckpt reads from the environment (`CKPT_HUB_TIMEOUT`, `CKPT_RAY_TIMEOUT`), parsed one way: a
bad value is a one-line error naming the variable, never a traceback or a silent default."""

from __future__ import annotations

import math
import os

from ckpt.errors import CkptError


def seconds(name: str, default: float) -> float:
    """The positive, finite number of seconds in environment variable `name`, or `default` when unset."""
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    try:
        t = float(text)
    except ValueError:
        t = math.nan
    if not (0 < t < math.inf):
        raise CkptError(f"{name}={text}: not a positive number of seconds")
    return t
