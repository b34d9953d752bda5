"""Vision-language folders as `convert_hf_to_gguf.py` reads them for their text model, built in the test (no
downloads): a tiny random `Mistral3ForConditionalGeneration` / `Gemma3ForConditionalGeneration` saved with
`save_pretrained` beside a tokenizer trained here (`helpers.hf_llm`). The vision tower has more layers than the
language model, so a converter that counted its `layers.N` as blocks would show it.

transformers 5 saves these models under their original checkpoint names (`language_model.model.layers.N`,
`vision_tower.*`, `multi_modal_projector.*`); `names="model"` renames them as newer releases store them
(`model.language_model.layers.N`, `model.vision_tower.*`, `lm_head.weight`), which transformers loads too.

Gemma 3n (`gemma3n_folder`): a tiny `Gemma3nForCausalLM`, or its weights as a `Gemma3nForConditionalGeneration`
folder (`model.language_model.*`, the config's text_config, and vision / audio tensors under the release's prefixes:
the vision tower is a timm MobileNet, and timm is not installed, so the VLM is assembled rather than instantiated).
"""

from __future__ import annotations

from pathlib import Path

import torch

from helpers.hf_llm import bpe_tokenizer, spm_tokenizer

TEXT = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=64, max_position_embeddings=1024, rms_norm_eps=1e-5)
VISION = {"mistral3": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=2,
                           image_size=32, patch_size=8, head_dim=32),
          "gemma3": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=2,
                         image_size=32, patch_size=8)}


def vlm_folder(folder: Path, kind: str, *, tokenizer: str = "spm", dtype=torch.float32, names: str = "legacy",
               extra_vocab: int = 0, **text) -> Path:
    """A tiny random `kind` VLM ("mistral3", "gemma3") with a real tokenizer; `text` overrides the text config
    (`model_type="ministral3"` for a Ministral 3), `extra_vocab` embedding rows beyond the tokenizer's (Gemma 3's
    padding); norms and biases away from 1 / 0."""
    import transformers

    folder.mkdir(parents=True, exist_ok=True)
    vocab = {"spm": spm_tokenizer, "bpe": bpe_tokenizer}[tokenizer](folder)
    tcfg = dict(TEXT, vocab_size=vocab + extra_vocab)
    if tokenizer == "bpe":
        tcfg.update(bos_token_id=None, eos_token_id=vocab - 1, pad_token_id=None)
    if kind == "mistral3":
        tcfg.update(tie_word_embeddings=False)
        tcfg.update(text)
        cfg = transformers.Mistral3Config(text_config=tcfg, vision_config=VISION[kind], image_token_index=10,
                                          tie_word_embeddings=False)
        cls = transformers.Mistral3ForConditionalGeneration
    elif kind == "gemma3":
        tcfg.update(query_pre_attn_scalar=64, pad_token_id=0, bos_token_id=1, eos_token_id=2)
        tcfg.update(text)
        cfg = transformers.Gemma3Config(text_config=tcfg, vision_config=VISION[kind], mm_tokens_per_image=4,
                                        image_token_index=5, boi_token_index=3, eoi_token_index=4)
        cls = transformers.Gemma3ForConditionalGeneration
    else:
        raise ValueError(kind)
    torch.manual_seed(0)
    model = cls(cfg).eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n or n.endswith(".bias"):
                p.add_(torch.randn(p.shape) * 0.1)
    model.to(dtype).save_pretrained(folder)
    if names == "model":
        rename_to_model_prefix(folder)
    return folder


def rename_to_model_prefix(folder: Path) -> None:
    """`language_model.model.X` -> `model.language_model.X`, `language_model.lm_head` -> `lm_head`, the vision side
    under `model.` (the layout of newer VLM releases)."""
    from safetensors.torch import load_file, save_file

    path = folder / "model.safetensors"
    sd = load_file(path)

    def renamed(n: str) -> str:
        if n.startswith("language_model.model."):
            return "model.language_model." + n.removeprefix("language_model.model.")
        if n.startswith("language_model.lm_head."):
            return n.removeprefix("language_model.")
        return "model." + n

    save_file({renamed(n): v for n, v in sd.items()}, path, metadata={"format": "pt"})


def text_logits(folder: Path, ids: list[int]) -> torch.Tensor:
    """The VLM's logits for a text-only input (float32): what its language model computes."""
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits[0]


def causal_lm_logits(folder: Path, ids: list[int]) -> tuple[str, torch.Tensor]:
    """A read-back folder loaded strictly (no missing, unexpected or mismatched key) by transformers' causal LM
    class: (its class name, its float32 logits)."""
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs")), info
    with torch.no_grad():
        return type(model).__name__, model.eval()(input_ids=torch.tensor([ids])).logits[0]


# (the per-layer input size and LAuReL rank as the releases have them: llama.cpp's gemma3n fixes them at 256 and 64)
GEMMA3N = dict(hidden_size=128, hidden_size_per_layer_input=256, intermediate_size=256, num_hidden_layers=4,
               num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
               rms_norm_eps=1e-6, sliding_window=8, layer_types=["sliding_attention", "full_attention"] * 2,
               laurel_rank=64, num_kv_shared_layers=2, activation_sparsity_pattern=[0.95, 0.95, 0.0, 0.0],
               altup_num_inputs=4, pad_token_id=0, bos_token_id=1, eos_token_id=2, final_logit_softcapping=30.0)
# a few tensors of each multimodal part, under the names Gemma 3n releases use
GEMMA3N_MULTIMODAL = {"model.vision_tower.timm_model.conv_stem.conv.weight": (8, 3, 3, 3),
                      "model.vision_tower.timm_model.blocks.0.0.layer_scale.gamma": (8,),
                      "model.embed_vision.embedding.weight": (16, 128),
                      "model.embed_vision.hard_embedding_norm.weight": (128,),
                      "model.audio_tower.conformer.0.attention.attn.per_dim_scale": (16,),
                      "model.audio_tower.subsample_conv_projection.conv_0.conv.weight": (8, 1, 3, 3),
                      "model.embed_audio.embedding_projection.weight": (128, 32),
                      "model.embed_audio.soft_embedding_norm.weight": (32,)}


def gemma3n_folder(folder: Path, *, vlm: bool = False, dtype=torch.float32, extra_vocab: int = 16, **text) -> Path:
    """A tiny random Gemma 3n language model (AltUp, LAuReL, per-layer inputs, KV sharing unless
    `num_kv_shared_layers=0`) with a SentencePiece tokenizer and `extra_vocab` embedding rows beyond it (the per-layer
    embeddings have the tokenizer's rows, as the releases' vocab_size_per_layer_input); `vlm`: saved as the
    `Gemma3nForConditionalGeneration` folder that holds it."""
    import json

    import transformers
    from safetensors.torch import load_file, save_file

    folder.mkdir(parents=True, exist_ok=True)
    vocab = spm_tokenizer(folder)
    cfg = transformers.Gemma3nTextConfig(**{**GEMMA3N, "vocab_size": vocab + extra_vocab,
                                            "vocab_size_per_layer_input": vocab, **text})
    torch.manual_seed(0)
    model = transformers.Gemma3nForCausalLM(cfg).eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n or n.endswith((".bias", "_scale")):
                p.add_(torch.randn(p.shape) * 0.1)
    model.to(dtype).save_pretrained(folder)
    if vlm:
        path = folder / "model.safetensors"
        sd = {"model.language_model." + n.removeprefix("model."): v for n, v in load_file(path).items()}
        gen = torch.Generator().manual_seed(1)
        sd.update({n: torch.randn(shape, generator=gen).to(dtype) for n, shape in GEMMA3N_MULTIMODAL.items()})
        save_file(sd, path, metadata={"format": "pt"})
        full = transformers.Gemma3nConfig(text_config=cfg.to_dict(), vision_config={"hidden_size": 128},
                                          audio_config={"hidden_size": 32})
        full.architectures = ["Gemma3nForConditionalGeneration"]
        full.dtype = dtype
        (folder / "config.json").write_text(json.dumps(full.to_dict(), indent=2, default=str))
    return folder
