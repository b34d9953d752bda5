"""Hugging Face causal LM folders as `convert_hf_to_gguf.py` reads them, built in the test (no downloads): a tiny
random model saved with `save_pretrained` (safetensors, config.json) beside a real tokenizer made here, a
SentencePiece model trained with `sentencepiece` (Llama: tokenizer.model + tokenizer_config.json) or a byte-level
BPE `tokenizer.json` trained with `tokenizers` (Qwen2/Qwen3, with a ChatML chat template).

`reference(folder, out, outtype)` runs llama.cpp's own converter (llama-cpp-python 0.3.36's vendored tree,
`helpers.ggml_ref.llama_cpp_tree`) in a subprocess with its own gguf-py. A test BPE tokenizer's pre-tokenizer
hash is in no table; `reference(..., pre=(hash, name))` registers it by wrapping `get_vocab_base_pre` in a tiny
driver script, as the test registers it in ckpt's table.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

TEXT = ("The quick brown fox jumps over the lazy dog. A llama eats grass in the high Andes; "
        "Qwen and Llama are language models. Numbers 0 1 2 3 42 1234 and 3.14 appear here. "
        "Hello, world! How are you today? I'm fine, thanks — and you? Ünïcödé text, 日本語, emoji 🦙. "
        "def f(x):\n    return x * 2\n\nclass A:\n    pass\n")

CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
          "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")

SAMPLES = ["Hello, world!", "The quick brown fox jumps over the lazy dog.", "  leading spaces and\ttabs\n",
           "Numbers 1234 and 3.14", "Ünïcödé 日本語 🦙", "<|im_start|>user\nhi<|im_end|>", "zzqx unseen wörds"]


def _corpus(n: int = 200) -> list[str]:
    import random

    rnd = random.Random(0)
    words = TEXT.split()
    return [TEXT] + [" ".join(rnd.choice(words) for _ in range(12)) for _ in range(n)]


def spm_tokenizer(folder: Path, vocab_size: int = 320) -> int:
    """A Llama SentencePiece tokenizer (byte fallback, <unk>=0 <s>=1 </s>=2) saved as transformers saves one;
    returns its vocabulary size."""
    import io

    import sentencepiece as spm
    from transformers import LlamaTokenizer

    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(_corpus()), model_writer=buf, vocab_size=vocab_size,
                                   model_type="bpe", byte_fallback=True, character_coverage=1.0,
                                   unk_id=0, bos_id=1, eos_id=2, pad_id=-1, split_digits=True,
                                   num_threads=1, minloglevel=2)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "tokenizer.model").write_bytes(buf.getvalue())
    LlamaTokenizer.from_pretrained(folder).save_pretrained(folder)  # converted from tokenizer.model
    return vocab_size


QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|"
               r"\s+(?!\S)|\s+")


def bpe_tokenizer(folder: Path, vocab_size: int = 400) -> int:
    """A byte-level BPE tokenizer.json split as Qwen2's (so llama.cpp's `qwen2` pre-tokenizer is the right one for
    it) with ChatML special tokens and chat template; returns its vocabulary size."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([  # Qwen2's: the split llama.cpp's `qwen2` pre-tokenizer makes
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - len(specials), special_tokens=[],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_corpus(), trainer)
    tok.add_special_tokens(specials)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   bos_token=None, unk_token=None)
    fast.chat_template = CHATML
    folder.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(folder)
    return tok.get_vocab_size()


def model_folder(folder: Path, kind: str, *, tokenizer: str | None = "auto", dtype=torch.float32, **cfg) -> Path:
    """A tiny random `kind` (llama, mistral, qwen2, qwen3, gemma2, gemma3, phi3, mixtral, qwen3_moe) with a real
    tokenizer; norms away from 1."""
    import transformers

    folder.mkdir(parents=True, exist_ok=True)
    if tokenizer == "auto":
        tokenizer = "bpe" if kind.startswith("qwen") else "spm"
    vocab = {"spm": spm_tokenizer, "bpe": bpe_tokenizer, None: lambda f: 320}[tokenizer](folder)
    common = dict(vocab_size=vocab, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5, tie_word_embeddings=False)
    if tokenizer == "bpe":
        common.update(bos_token_id=None, eos_token_id=vocab - 1)
    if kind in ("gemma2", "gemma3"):
        common.update(head_dim=64, query_pre_attn_scalar=64, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    if kind in ("mixtral", "qwen3_moe"):
        common.update(num_experts_per_tok=2, **({"num_local_experts": 4} if kind == "mixtral" else
                                                 {"num_experts": 4, "moe_intermediate_size": 256, "head_dim": 64}))
    if kind == "phi3":
        common.update(pad_token_id=None, bos_token_id=1, eos_token_id=2, original_max_position_embeddings=128)
    common.update(cfg)
    cfg_cls, model_cls = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
                          "gemma2": (transformers.Gemma2Config, transformers.Gemma2ForCausalLM),
                          "gemma3": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM),
                          "phi3": (transformers.Phi3Config, transformers.Phi3ForCausalLM),
                          "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM),
                          "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM),
                          "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
                          "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
                          "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM)}[kind]
    torch.manual_seed(0)
    model = model_cls(cfg_cls(**common)).eval()
    with torch.no_grad():  # norms and biases away from 1 / 0, so a dropped or swapped one shows
        for n, p in model.named_parameters():
            if "norm" in n or n.endswith(".bias"):
                p.add_(torch.randn(p.shape) * 0.1)
    model.to(dtype).save_pretrained(folder)
    return folder


DRIVER = r"""
import runpy, sys
sys.path.insert(0, {tree!r})
sys.path.insert(0, {gguf_py!r})
import conversion.base as base
pre = {pre!r}
if pre:
    orig = base.TextModel.get_vocab_base_pre
    def get_vocab_base_pre(self, tokenizer):
        from hashlib import sha256
        chktok = tokenizer.encode({chktxt!r})
        if sha256(str(chktok).encode()).hexdigest() == pre[0]:
            return pre[1]
        return orig(self, tokenizer)
    base.TextModel.get_vocab_base_pre = get_vocab_base_pre
for outtype, outfile in {runs!r}:
    sys.argv = ["convert_hf_to_gguf.py", {folder!r}, "--outtype", outtype, "--outfile", outfile, *{args!r}]
    runpy.run_path({script!r}, run_name="__main__")
"""


def reference(folder: Path, outs: dict[str, Path], pre: tuple[str, str] | None = None, args: tuple = ()) -> None:
    """llama.cpp's convert_hf_to_gguf.py on `folder` once per `{outtype: outfile}`, in one subprocess with the
    reference's own gguf-py first on the path; a failed run raises AssertionError with its log's tail. `args`:
    further command-line options for every run (`--no-mtp` for Qwen3-Next / Qwen3.5 folders without MTP)."""
    from ckpt.targets.planners.gguf_vocab import CHECK_TEXT

    from helpers.ggml_ref import llama_cpp_tree

    tree = llama_cpp_tree()
    first = next(iter(outs.values()))
    driver = first.parent / f".{first.name}.driver.py"
    driver.write_text(DRIVER.format(tree=str(tree), gguf_py=str(tree / "gguf-py"), pre=pre, chktxt=CHECK_TEXT,
                                    script=str(tree / "convert_hf_to_gguf.py"), folder=str(folder),
                                    runs=[(t, str(p)) for t, p in outs.items()], args=list(args)))
    env = {**os.environ, "PYTHONPATH": str(tree / "gguf-py"), "NO_LOCAL_GGUF": "1", "OMP_NUM_THREADS": "1"}
    try:
        r = subprocess.run([sys.executable, str(driver)], capture_output=True, text=True, env=env, cwd=str(tree))
    finally:
        driver.unlink()
    assert r.returncode == 0, r.stderr[-3000:]


def bpe_hash(folder: Path) -> str:
    """The check-text hash of a folder's tokenizer, as get_vocab_base_pre computes it."""
    from hashlib import sha256

    from transformers import AutoTokenizer

    from ckpt.targets.planners.gguf_vocab import CHECK_TEXT

    return sha256(str(AutoTokenizer.from_pretrained(folder).encode(CHECK_TEXT)).encode()).hexdigest()


def read_gguf(path: Path):
    """(metadata {key: python value}, [(name, type name, shape, bytes)]) of a GGUF, via gguf.GGUFReader."""
    import gguf

    r = gguf.GGUFReader(str(path))
    meta = {}
    for k, f in r.fields.items():
        if k.startswith("GGUF."):
            continue
        v = f.contents()
        meta[k] = (v, [int(t) for t in f.types])
    tensors = [(t.name, t.tensor_type.name, tuple(int(d) for d in t.shape), bytes(t.data.tobytes()))
               for t in r.tensors]
    return meta, tensors


def write_json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj, indent=2))
