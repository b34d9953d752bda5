"""The vision projectors `convert --to gguf-* --mmproj` writes, one module per model class of llama.cpp's converter
(`VISION = ...`), found by `ckpt.families.llm.projectors`."""
