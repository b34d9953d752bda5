"""`ckpt merge-lora`: adapters baked into a base checkpoint, streamed tensor by tensor."""
