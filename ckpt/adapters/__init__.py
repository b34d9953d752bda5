"""Adapters (LoRA and its relatives) as every command meets them: reading adapter files and PEFT folders
(`loading`, `litgpt`, `xlabs`), what an adapter is (`files`), the adapter kinds and their deltas (`kinds`), where a
module lands on a base (`keymap`, `placement`), matching adapters to a base's logical tensors (`matching`), the checks
the adapter commands share (`checks`), and a base tensor with adapters baked in (`merged`).

`ckpt merge-lora`, the `ckpt lora` commands and `ckpt merge`'s `model: BASE+LORA` all read adapters through this
package; none of them imports another command.
"""
