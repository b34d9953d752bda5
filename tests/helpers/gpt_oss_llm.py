"""Tiny gpt-oss folders as `convert_hf_to_gguf.py` reads them, built in the test (no downloads): a random
`GptOssForCausalLM` (2 layers, 4 experts, attention sinks, biases and norms away from their initial values) beside
a byte-level BPE tokenizer trained here with gpt-oss's own o200k split and its harmony special tokens, saved either
as bf16 (`save_pretrained`) or as the MXFP4 release stores it: the expert banks as `*_blocks` / `*_scales`
(`tests/helpers/mxfp4_ref.py`, triton_kernels' packer) and `quantization_config.quant_method: mxfp4`.

The tokenizer is not OpenAI's o200k_harmony (200k tokens): it is a 400-token BPE split by the same regex, so
llama.cpp's `gpt-4o` pre-tokenizer is the right one for it; its check-text hash is registered under that name for
ckpt and the reference (`helpers.hf_llm.reference(..., pre=...)`), as the other BPE tests do.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from helpers.hf_llm import _corpus

# tiktoken's o200k_base pat_str, which gpt-oss's tokenizer.json splits by (llama.cpp's `gpt-4o` pre-tokenizer)
O200K_SPLIT = "|".join([
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"\p{N}{1,3}", r" ?[^\s\p{L}\p{N}]+[\r\n/]*", r"\s*[\r\n]+", r"\s+(?!\S)", r"\s+"])
# the harmony format's special tokens, in o200k_harmony's order
HARMONY = ["<|startoftext|>", "<|endoftext|>", "<|return|>", "<|constrain|>", "<|channel|>", "<|start|>", "<|end|>",
           "<|message|>", "<|call|>"]
# a short harmony chat template (gpt-oss's own is 300 lines; the GGUF carries whichever the folder has)
HARMONY_TEMPLATE = ("{% for m in messages %}<|start|>{{ m['role'] }}<|message|>{{ m['content'] }}<|end|>{% endfor %}"
                    "{% if add_generation_prompt %}<|start|>assistant{% endif %}")


def harmony_tokenizer(folder: Path, vocab_size: int = 400) -> dict:
    """A byte-level BPE tokenizer.json split as o200k with the harmony special tokens and chat template; returns
    config.json's token ids (bos, eos, pad as gpt-oss's config has them) and the vocabulary size."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(O200K_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - len(HARMONY), special_tokens=[],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_corpus(), trainer)
    tok.add_special_tokens(HARMONY)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|startoftext|>", eos_token="<|return|>",
                                   pad_token="<|endoftext|>", unk_token=None)
    fast.chat_template = HARMONY_TEMPLATE
    folder.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(folder)
    ids = {t: tok.token_to_id(t) for t in HARMONY}
    return dict(vocab_size=tok.get_vocab_size(), bos_token_id=ids["<|startoftext|>"],
                eos_token_id=ids["<|return|>"], pad_token_id=ids["<|endoftext|>"])


def gpt_oss_config(tokens: dict, **cfg):
    import transformers

    common = dict(hidden_size=256, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=64, num_local_experts=4, num_experts_per_tok=2, sliding_window=16,
                  tie_word_embeddings=False, **tokens)
    return transformers.GptOssConfig(**(common | cfg))


def gpt_oss_model(config, dtype=torch.bfloat16):
    """A random GptOssForCausalLM: transformers initialises norms to 1 and biases / sinks to 0 (and the expert
    banks from a normal distribution), so every one is moved off its start, so that a dropped, swapped or
    mis-split one shows."""
    import transformers

    torch.manual_seed(0)
    model = transformers.GptOssForCausalLM(config).eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n or n.endswith(("bias", "sinks")):
                p.add_(torch.randn(p.shape) * 0.1)
            elif n.endswith(("gate_up_proj", "down_proj")):
                p.copy_(torch.randn(p.shape) * 0.05)
    return model.to(dtype)


def gpt_oss_folder(folder: Path, *, mxfp4: bool = False, **cfg) -> Path:
    """A tiny gpt-oss folder: bf16 (`save_pretrained`), or the MXFP4 release's layout (`mxfp4=True`)."""
    tokens = harmony_tokenizer(folder)
    model = gpt_oss_model(gpt_oss_config(tokens, **cfg))
    if not mxfp4:
        model.save_pretrained(folder)
        return folder
    from safetensors.torch import save_file

    from helpers.mxfp4_ref import quantize_bank

    sd = {}
    for k, v in model.state_dict().items():
        if k.endswith(("experts.gate_up_proj", "experts.down_proj")):
            sd[f"{k}_blocks"], sd[f"{k}_scales"] = quantize_bank(v.float())
        else:
            sd[k] = v.contiguous()
    save_file(sd, folder / "model.safetensors", metadata={"format": "pt"})
    qc = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                              "model.embed_tokens", "lm_head"]}
    cfg_dict = model.config.to_dict() | {"architectures": ["GptOssForCausalLM"], "quantization_config": qc,
                                         "torch_dtype": "bfloat16"}
    (folder / "config.json").write_text(json.dumps(cfg_dict, indent=2))
    return folder
