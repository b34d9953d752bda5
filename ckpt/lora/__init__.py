"""`ckpt lora`: LoRA operations on the engine (plan from headers, one module at a time, atomic output).

One module per command (`extract`, `resize`, `merge`, `convert`; `reformat` for resize/merge `--format`), the
input modules as the commands see them (`modules`), the linear algebra they share (`svd`), the scratch store
that keeps memory bounded while ranks are still unknown (`store`), the namings an output can take (`formats`,
`naming`, `embeddings`, `unflatten`), the options and report they share (`common`) and the operation string
each records (`operations`). The adapter core they read LoRAs with (kinds, key map, loading) is
`ckpt.adapters`; the click group is `ckpt.cli.lora`.
"""
