"""`ckpt inspect`: what a checkpoint is (format, family, LoRA kind, storage encodings) and what will break.

`inspect(src, scan=False)` returns the report dict (layout in `ckpt.inspect.summary`); `render_text`
formats it for a terminal.
"""

from ckpt.inspect.render import render_text  # noqa: F401
from ckpt.inspect.summary import inspect  # noqa: F401
