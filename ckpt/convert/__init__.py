"""`ckpt convert`: cast every floating tensor of a checkpoint's logical view to one dtype."""

from ckpt.convert.command import ConvertOptions, convert  # noqa: F401
