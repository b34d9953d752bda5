"""tqdm progress in bytes on stderr, silent with --quiet or when there is little to do."""

from __future__ import annotations

import contextlib
import sys

from tqdm import tqdm


@contextlib.contextmanager
def progress_bar(total: int, desc: str, quiet: bool):
    bar = tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024, file=sys.stderr,
               disable=quiet or None, leave=False, dynamic_ncols=True)
    try:
        yield bar
    finally:
        bar.close()
