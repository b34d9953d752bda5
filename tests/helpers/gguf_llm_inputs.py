"""Inputs of the HF LLM -> GGUF export's input tests (tests/test_gguf_llm_hardening.py,
tests/test_gguf_llm_export_fuzz.py): tiny model folders built with `helpers.hf_llm.model_folder`, the edits
that break them, a fingerprint of a folder (inputs unchanged), and llama.cpp loading a written GGUF in a child
process.

Why a child process: llama.cpp asserts on some files (duplicate tokens, more experts used than there are, a
negative epsilon at the first evaluation), and an assert aborts the process that loads the file; the tests
must see that as a failed load, not die with it. The child runs the tests' own loader,
`helpers.llama_ref.logits`, on each file it is sent.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import torch

from helpers.hf_llm import bpe_hash, model_folder

TESTS = Path(__file__).resolve().parent.parent
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
# name -> (HF kind, tokenizer, config overrides): a SentencePiece Llama (tokenizer.model, and the tokenizer.json
# transformers saves beside it), a byte-level BPE Qwen2 with a ChatML template (chat_template.jinja), and a
# Llama 3 style model (BPE tokenizer.json, llama3 RoPE scaling)
BASES = {"llama": ("llama", "spm", {}), "qwen2": ("qwen2", "bpe", {}),
         "llama3": ("llama", "bpe", dict(rope_parameters=LLAMA3_ROPE, tie_word_embeddings=True))}


def build(root: Path, names=tuple(BASES)) -> dict[str, Path]:
    """The base folders under `root`."""
    return {n: model_folder(root / n, BASES[n][0], tokenizer=BASES[n][1], dtype=torch.float32, **BASES[n][2])
            for n in names}


def pre_tokenizers(folders: dict[str, Path]) -> dict[str, str]:
    """The test BPE tokenizers' check-text hashes, each registered as llama.cpp's `qwen2` pre-tokenizer (the split
    `helpers.hf_llm.bpe_tokenizer` trains with), for ckpt's table (`gguf_vocab.PRE_TOKENIZERS`)."""
    return {bpe_hash(f): "qwen2" for n, f in folders.items() if BASES[n][1] == "bpe"}


def copy_folder(src: Path, dst: Path) -> Path:
    """A copy to break: the weights hard-linked (never written by the tests), the small files copied."""
    dst.mkdir(parents=True)
    for p in src.iterdir():
        if p.suffix == ".safetensors":
            os.link(p, dst / p.name)
        else:
            shutil.copy2(p, dst / p.name)
    return dst


def edit_json(path: Path, fn) -> None:
    """Load `path`, let `fn` change the value in place, write it back (NaN / Infinity as Python's json writes
    them, as a config.json can hold them)."""
    value = json.loads(path.read_text())
    fn(value)
    path.write_text(json.dumps(value))


def fingerprint(folder: Path) -> dict[str, str]:
    """name -> sha256 of every file in `folder`: the same before and after a run means the inputs are unchanged."""
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir()) if p.is_file()}


DRIVER = r"""
import sys
sys.path.insert(0, {tests!r})
from helpers import llama_ref
for line in sys.stdin:
    path, run = line.rstrip("\n").split("\t")
    try:
        if run == "1":
            llama_ref.logits(path, [1, 2, 3, 4])
        else:
            llm = llama_ref.load(path, n_ctx=32, n_threads=1)
            llm.tokenize(b"Hello, world!")
            llm.close()
        print("ok", flush=True)
    except BaseException as e:
        print("error " + " ".join(str(e).split())[:300], flush=True)
"""


class LlamaLoader:
    """`load(path, run)`: None where llama.cpp, in a child process, loads the GGUF (weights and vocabulary) and
    tokenizes a text, and with `run` also evaluates a few tokens (`llama_ref.logits`); else why not (its error, or
    how the child died: then the next call starts a new child)."""

    def __init__(self, log: Path):
        self.log, self.proc = log, None

    def _start(self):
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        self.err = open(self.log, "ab")
        self.proc = subprocess.Popen([sys.executable, "-c", DRIVER.format(tests=str(TESTS))], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.err, text=True, env=env)

    def load(self, path: Path, run: bool = True) -> str | None:
        if self.proc is None:
            self._start()
        try:
            self.proc.stdin.write(f"{path}\t{int(run)}\n")
            self.proc.stdin.flush()
            answer = self.proc.stdout.readline().strip()
        except BrokenPipeError:
            answer = ""
        if answer == "ok":
            return None
        if answer:
            return answer
        code = self.proc.wait()
        self.close()
        return f"the loading process died (exit {code}; its log: {self.log})"

    def close(self) -> None:
        if self.proc is not None:
            try:
                self.proc.stdin.close()
            except BrokenPipeError:
                pass
            self.proc.wait()
            self.err.close()
            self.proc = None
