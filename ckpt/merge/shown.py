"""A config value as an error line shows it: its repr, cut short.

A merge config's values can be anything YAML holds (a 4 MiB string, a list of 100,000 numbers, a mapping of
mappings), and an error line names the value that is wrong: printed whole, one bad value would be a line of
megabytes. `shown` keeps the line short and on one line (repr escapes newlines and control characters).
"""

from __future__ import annotations

WIDTH = 60  # characters of a value's repr an error line shows


def shown(value, width: int = WIDTH) -> str:
    """repr(value), at most `width` characters and `...`; a long list or mapping says how many entries it has."""
    if isinstance(value, (list, tuple, dict)) and len(value) > 8:
        head = list(value.items())[:4] if isinstance(value, dict) else list(value[:4])
        text = _repr(dict(head) if isinstance(value, dict) else head)[:-1]
        text = text if len(text) <= width else text[:width] + "..."
        return text + f", ... ({len(value):,} entries)" + ("}" if isinstance(value, dict) else "]")
    text = _repr(value)
    return text if len(text) <= width else text[:width] + "..."


def _repr(value) -> str:
    try:
        return repr(value)
    except (ValueError, RecursionError):  # an int of more than 4,300 digits; a list that holds itself
        return f"<{type(value).__name__}>"


def cut(text: str, width: int = WIDTH) -> str:
    """A piece of text as written (a flag's value), on one line and at most `width` characters and `...`."""
    text = repr(str(text))[1:-1]
    return text if len(text) <= width else text[:width] + "..."
