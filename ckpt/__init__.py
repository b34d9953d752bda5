"""ckpt: streamed checkpoint conversion, decoding and merging with bounded memory."""

__version__ = "0.1.0"
# The distribution's name (`pip install ckpt-toolkit`): the registry's "ckpt" is another project. The command
# and the import package are `ckpt`.
DIST = "ckpt-toolkit"
