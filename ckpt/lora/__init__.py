"""`ckpt lora`: LoRA operations on the engine (plan from headers, one module at a time, atomic output).

One module per command (`extract`, `resize`, `merge`), the linear algebra they share (`svd`), the
scratch store that keeps memory bounded while ranks are still unknown (`store`), the namings an
output can take (`formats`, `naming`) and the click group (`cli`).
"""
