"""How each kind of output is planned from logical tensors: the planners behind the targets of `ckpt.targets`
(scaled fp8, comfy_quant, GGUF for diffusion models and for LLMs with their mixes and vocabularies, and the
base's own encoding for `--keep-format`). Not registry entries: the targets import them when they plan."""
