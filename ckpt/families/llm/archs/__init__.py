"""The llama.cpp LLM architectures ckpt writes and reads, one module each (`ARCH = ...`, a
`ckpt.families.llm.arch.LLMArch`), found by `ckpt.families.llm.architectures` as the other registries find theirs.
Adding an architecture is adding its module (and its test against llama.cpp's convert_hf_to_gguf.py)."""
