"""`ckpt dequant`: quantized checkpoints back to plain state dicts (`ckpt.dequant.command`)."""
