"""Which LoRA modules adapt an embedding, and the keys PEFT stores such a module under.

PEFT wraps an `nn.Embedding` in its own layer, whose factors are `NAME.lora_embedding_A` [r, num_embeddings]
and `NAME.lora_embedding_B` [embedding_dim, r] (no `.weight`; delta = (B @ A)^T, the weight's [num_embeddings,
embedding_dim]). It reads only those keys for an embedding: a `lora_A.weight` / `lora_B.weight` pair on one is
an unexpected key, dropped with a warning, and the adapter loads without it. So every output in PEFT's key
spelling (a PEFT adapter folder, a diffusers file) must know which of its modules are embeddings.

A checkpoint does not say: an embedding and a Linear both store a 2-D `.weight`, and a token embedding has
the lm_head's shape. The module's own name does, for the models people adapt: the attribute names
transformers and diffusers give their `nn.Embedding` layers (and its subclasses, the scaled word embeddings),
which no Linear or conv of theirs carries, except the rare ones counted below. A LoRA read with
`lora_embedding_A/B` keys says so itself, whatever the name (`ckpt.lora.convert` keeps that).
"""

from __future__ import annotations

# The last component of the module path. Counted in transformers 5 / diffusers 0.42 sources
# (`self.NAME = nn.Embedding(`): `embed_tokens` 209 embeddings (4 Linear, in one diffusers pipeline's own
# model), `embedding` 22 (2 Linear), the others embeddings only.
EMBEDDING_LEAVES = frozenset({
    "embed_tokens", "embed_positions", "embed_in", "tok_embeddings", "wte", "wpe", "shared",
    "word_embeddings", "position_embeddings", "token_type_embeddings",
    "token_embedding", "position_embedding", "relative_attention_bias",
    "embedding", "embeddings", "embedding_table",
})
DOWN, UP = "lora_embedding_A", "lora_embedding_B"


def is_embedding(module: str) -> bool:
    """Whether the module `module` (a dotted path, any prefix) is an embedding layer by its name."""
    return module.rpartition(".")[2] in EMBEDDING_LEAVES


def embedding_keys(module: str) -> dict[str, str]:
    """role -> stored key of an embedding module's factors in PEFT's spelling (`ckpt.lora.formats.OutModule.keys`;
    the factors themselves are stored transposed: `ckpt.lora.modules.to_layout(..., transposed=True)`)."""
    return {"down": f"{module}.{DOWN}", "up": f"{module}.{UP}"}
