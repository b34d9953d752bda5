"""ckpt: streamed checkpoint conversion, decoding and merging with bounded memory."""

__version__ = "0.1.0"
