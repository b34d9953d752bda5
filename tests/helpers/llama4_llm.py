"""Tiny Llama 4 folders as `convert_hf_to_gguf.py` reads them, built in the test (no downloads): a random
`Llama4ForConditionalGeneration` (text model + a one-layer vision tower and projector, as transformers 5 saves it:
`language_model.model.layers.N`, `vision_model.*`, `multi_modal_projector.*`) or a text-only `Llama4ForCausalLM`,
beside the byte-level BPE tokenizer `helpers.hf_llm.bpe_tokenizer` trains. Sizes are the smallest that keep
llama.cpp's K-quant blocks whole (rows of 256): 4 experts, MoE and dense layers interleaved by default.
"""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

import torch

from helpers.hf_llm import bpe_tokenizer

# Llama 3 RoPE scaling with a smoothed band (3 of the 32 frequencies at head_dim 64), and Llama 4 Scout's (low and
# high frequency factors equal: no band)
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
SCOUT_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 16.0, "low_freq_factor": 1.0,
              "high_freq_factor": 1.0, "original_max_position_embeddings": 8192}
VISION = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64, image_size=28,
              patch_size=14, vision_output_dim=32, projector_input_dim=32, projector_output_dim=32)


def text_config(vocab: int, **over) -> dict:
    cfg = dict(vocab_size=vocab, hidden_size=256, intermediate_size=256, intermediate_size_mlp=512,
               num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=64, num_local_experts=4,
               num_experts_per_tok=1, interleave_moe_layer_step=2, max_position_embeddings=16384, rms_norm_eps=1e-5,
               rope_parameters=dict(LLAMA3_ROPE), bos_token_id=None, eos_token_id=vocab - 1, pad_token_id=None,
               tie_word_embeddings=False)
    cfg.update(over)
    return cfg


def llama4_folder(folder: Path, kind: str = "conditional", dtype=torch.float32, **over) -> Path:
    """A tiny random Llama 4 (`kind` "conditional": Llama4ForConditionalGeneration, "causal": Llama4ForCausalLM)
    with the BPE tokenizer; norms away from 1, so a dropped or swapped one shows."""
    import transformers

    vocab = bpe_tokenizer(folder)
    text = text_config(vocab, **over)
    torch.manual_seed(0)
    if kind == "causal":
        model = transformers.Llama4ForCausalLM(transformers.Llama4TextConfig(**text))
    else:
        model = transformers.Llama4ForConditionalGeneration(
            transformers.Llama4Config(text_config=text, vision_config=VISION, tie_word_embeddings=False))
    model.eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n:
                p.add_(torch.randn(p.shape) * 0.1)
    if dtype != torch.float32:  # (the vision tower's complex RoPE buffer is not saved: no cast of it)
        model.to(dtype)
    model.save_pretrained(folder)
    return folder


def text_logits(folder: Path, ids: list[int], dtype=torch.float32) -> torch.Tensor:
    """transformers' logits of the folder's language model for `ids` (a Llama4ForConditionalGeneration's through
    its text model: no image)."""
    import transformers

    if "ForCausalLM" in (folder / "config.json").read_text():
        model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
    else:  # (its own forward needs image outputs in transformers 5.24)
        model = transformers.Llama4ForConditionalGeneration.from_pretrained(folder, dtype=dtype).language_model
    model.eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


def edited_gguf(src: Path, dst: Path, **kv) -> Path:
    """A copy of the GGUF `src` with metadata values replaced (`key=value`, "." in a key written "__"), each
    keeping its GGUF type (gguf's own gguf_new_metadata copier)."""
    import gguf
    from gguf.scripts.gguf_new_metadata import MetadataDetails, copy_with_new_metadata

    reader = gguf.GGUFReader(str(src))
    new = {}
    for key, value in kv.items():
        key = key.replace("__", ".")
        new[key] = MetadataDetails(reader.fields[key].types[0], value)
    arch = reader.fields["general.architecture"].contents()
    with contextlib.redirect_stderr(io.StringIO()):  # (its progress bar)
        copy_with_new_metadata(reader, gguf.GGUFWriter(str(dst), arch=arch), new, [])
    return dst
