"""Tiny GLM-4.5 (`Glm4MoeForCausalLM`) and MiniMax-M2 (`MiniMaxM2ForCausalLM`) folders as `convert_hf_to_gguf.py`
reads them, built in the test (no downloads): a random transformers model saved with `save_pretrained` (which
writes the experts one matrix each, as the released checkpoints have them) beside a byte-level BPE tokenizer
trained here with the special tokens the reference's vocabulary code looks up (GLM's `[gMASK]`, `<|user|>`,
`<|endoftext|>`, `<|observation|>`).

GLM-4.5's release also holds its NextN/MTP layer as `model.layers.{num_hidden_layers}.*` (a whole decoder layer
plus `eh_proj`, `enorm`, `hnorm`, `embed_tokens`, `shared_head.{head,norm}`), which transformers' model does not
have: `mtp=True` appends such a layer to the saved weights, as the release ships it.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch

from helpers.hf_llm import QWEN2_SPLIT, TEXT

GLM_SPECIALS = ["<|endoftext|>", "[MASK]", "[gMASK]", "[sMASK]", "<sop>", "<eop>", "<|system|>", "<|user|>",
                "<|assistant|>", "<|observation|>"]
MINIMAX_SPECIALS = ["]!p~[", "]~b]", "[e~[", "]!d~["]
GLM_TEMPLATE = ("[gMASK]<sop>{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}{% endfor %}"
                "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
MINIMAX_TEMPLATE = ("]~b]{% for m in messages %}{{ m['role'] }}\n{{ m['content'] }}[e~[\n{% endfor %}"
                    "{% if add_generation_prompt %}]~b]ai\n{% endif %}")


def bpe_tokenizer(folder: Path, specials: list[str], eos: str, template: str, vocab_size: int = 400,
                  seed: int = 0) -> int:
    """A byte-level BPE tokenizer.json (Qwen2's split) whose added tokens are `specials`, trained on a corpus drawn
    with `seed` (tokenizers of two seeds tokenize the pre-tokenizer check text differently, so each registers its
    own llama.cpp pre-tokenizer name); returns its size."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    rnd = random.Random(seed)
    words = TEXT.split()
    corpus = [TEXT] + [" ".join(rnd.choice(words) for _ in range(12)) for _ in range(200)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - len(specials), special_tokens=[],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus, trainer)
    tok.add_special_tokens(specials)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos, pad_token=specials[0], bos_token=None,
                                   unk_token=None)
    fast.chat_template = template
    folder.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(folder)
    return tok.get_vocab_size()


def _away_from_defaults(model) -> None:
    """Norms, biases and the routers' score corrections away from 1 / 0, so a dropped or swapped one shows."""
    with torch.no_grad():
        for n, p in list(model.named_parameters()) + list(model.named_buffers()):
            if "norm" in n or n.endswith(".bias") or n.endswith("e_score_correction_bias"):
                p.add_(torch.randn(p.shape) * 0.1)


def glm_folder(folder: Path, *, dtype=torch.float32, mtp: bool = False, **cfg) -> Path:
    """A tiny GLM-4.5: 3 layers (the first dense), 4 routed experts + 1 shared, partial rotary 0.5 (rows of 256:
    llama-quantize's K-quants apply to most tensors)."""
    import transformers

    vocab = bpe_tokenizer(folder, GLM_SPECIALS, "<|endoftext|>", GLM_TEMPLATE)
    common = dict(vocab_size=vocab, hidden_size=256, intermediate_size=512, moe_intermediate_size=256,
                  num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                  n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
                  max_position_embeddings=512, rms_norm_eps=1e-5, routed_scaling_factor=2.5, n_group=1,
                  topk_group=1, tie_word_embeddings=False, eos_token_id=[vocab - 10, vocab - 3, vocab - 1],
                  pad_token_id=vocab - 10, bos_token_id=None)  # <|endoftext|>, <|user|>, <|observation|>
    common.update(cfg)
    torch.manual_seed(0)
    model = transformers.Glm4MoeForCausalLM(transformers.Glm4MoeConfig(**common)).eval()
    _away_from_defaults(model)
    model.to(dtype).save_pretrained(folder)
    if mtp:
        add_mtp_layer(folder)
    return folder


def add_mtp_layer(folder: Path) -> None:
    """GLM-4.5's NextN layer as the release stores it: `model.layers.{n}` = a copy of the last layer's tensors
    (random values) + eh_proj, enorm, hnorm, embed_tokens, shared_head.head / .norm."""
    from safetensors.torch import load_file, save_file

    cfg = json.loads((folder / "config.json").read_text())
    n, hidden, vocab = cfg["num_hidden_layers"], cfg["hidden_size"], cfg["vocab_size"]
    sd = load_file(folder / "model.safetensors")
    g = torch.Generator().manual_seed(7)
    last = f"model.layers.{n - 1}."
    dtype = sd["model.embed_tokens.weight"].dtype
    for k in [k for k in sd if k.startswith(last)]:
        sd[f"model.layers.{n}." + k[len(last):]] = torch.randn(sd[k].shape, generator=g).to(sd[k].dtype) * 0.05
    for name, shape in (("eh_proj.weight", (hidden, 2 * hidden)), ("enorm.weight", (hidden,)),
                        ("hnorm.weight", (hidden,)), ("embed_tokens.weight", (vocab, hidden)),
                        ("shared_head.head.weight", (vocab, hidden)), ("shared_head.norm.weight", (hidden,))):
        sd[f"model.layers.{n}.{name}"] = (torch.randn(shape, generator=g) * 0.05 + (len(shape) == 1)).to(dtype)
    save_file(sd, folder / "model.safetensors", metadata={"format": "pt"})


def minimax_folder(folder: Path, *, dtype=torch.float32, **cfg) -> Path:
    """A tiny MiniMax-M2: 2 layers of 4 experts, q/k norms over all heads, rotary_dim half the head."""
    import transformers

    vocab = bpe_tokenizer(folder, MINIMAX_SPECIALS, "[e~[", MINIMAX_TEMPLATE, seed=1)
    common = dict(vocab_size=vocab, hidden_size=256, intermediate_size=256, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=64, rotary_dim=32, num_local_experts=4,
                  num_experts_per_tok=2, max_position_embeddings=512, rms_norm_eps=1e-6, scoring_func="sigmoid",
                  use_qk_norm=True, qk_norm_type="per_layer", use_routing_bias=True, tie_word_embeddings=False,
                  bos_token_id=vocab - 3, eos_token_id=vocab - 2)
    common.update(cfg)
    torch.manual_seed(0)
    model = transformers.MiniMaxM2ForCausalLM(transformers.MiniMaxM2Config(**common)).eval()
    _away_from_defaults(model)
    model.to(dtype).save_pretrained(folder)
    return folder
