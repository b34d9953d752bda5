"""`ckpt convert`: cast every floating tensor of a checkpoint's logical view to one dtype, quantize it to a
ComfyUI format or GGUF, and/or rename it to another layout.

`ConvertOptions` and `convert` are loaded on first use (PEP 562): the CLI reads the target registry
(`ckpt.targets`) while parsing options, which imports this package, and that must not import
torch (tests/test_startup.py)."""

_LAZY = ("ConvertOptions", "convert")


def __getattr__(name):
    if name in _LAZY:
        from ckpt.convert import command

        return getattr(command, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
