"""`ckpt convert HF_FOLDER --to gguf-*` checks its inputs (issue 31, items 8 and 9): a broken tokenizer.model,
a missing tokenizer library, config.json values of the wrong type or range or at odds with the weights,
malformed tokenizer files and chat templates are each refused through the CLI in one line naming the file (and
the key), exit 2, nothing written, the inputs unchanged; never a traceback, a huge allocation or a GGUF
llama.cpp refuses to load.

For the values llama.cpp's own converter writes without complaint into a GGUF llama.cpp then refuses (head
counts that do not divide q's rows, 3 blocks for 2, 100 tokens for 320 embedding rows, a negative epsilon, a
template that is not Jinja), `intact_loads` shows the folder's intact twin converting and loading in llama.cpp
(`helpers.llama_ref.logits`): what is refused is the edit, not the model.
"""

from __future__ import annotations

import os
import random
import sys
import tracemalloc

import pytest

from helpers.gguf_llm_inputs import LLAMA3_ROPE, build, copy_folder, edit_json, fingerprint, pre_tokenizers
from helpers.refusals import assert_refused


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    return build(tmp_path_factory.mktemp("bases"))


@pytest.fixture(autouse=True)
def registered(folders, monkeypatch):
    """The test BPE vocabularies' hashes in ckpt's pre-tokenizer table (see tests/test_gguf_llm_export.py)."""
    from ckpt.targets.planners import gguf_vocab

    for h, name in pre_tokenizers(folders).items():
        monkeypatch.setitem(gguf_vocab.PRE_TOKENIZERS, h, name)


_LOADED: dict[str, bool] = {}


@pytest.fixture
def intact_loads(folders, run_ckpt, tmp_path_factory):
    """`intact_loads(base)`: the unedited folder converts (exit 0) and llama.cpp loads and runs the GGUF (once
    per base and session)."""
    from helpers import llama_ref

    def check(base: str) -> None:
        if base not in _LOADED:
            llama_ref.llama_cpp()  # skips, saying why, where llama-cpp-python does not import
            out = tmp_path_factory.mktemp("twin") / f"{base}.gguf"
            code, _, err = run_ckpt("convert", folders[base], "--to", "gguf-f16", "-o", out, "-q")
            assert code == 0, err
            assert llama_ref.logits(out, [1, 2, 3, 4]).shape[0] == 4
            _LOADED[base] = True

    return check


# ---- edits: each a function of the copied folder


def config(**changes):
    def edit(folder):
        edit_json(folder / "config.json", lambda c: c.update(changes))
    return edit


def rope(**changes):
    def edit(folder):
        edit_json(folder / "config.json", lambda c: c["rope_parameters"].update(changes))
    return edit


def tokenizer_json(fn):
    return lambda folder: edit_json(folder / "tokenizer.json", fn)


def tokenizer_config(**changes):
    return lambda folder: edit_json(folder / "tokenizer_config.json", lambda c: c.update(changes))


def write(name: str, data):
    def edit(folder):
        value = data(folder / name) if callable(data) else data
        (folder / name).write_bytes(value if isinstance(value, bytes) else value.encode())
    return edit


def llama3_rope_scaling_factor_x(folder):
    """A Llama 3 config as older transformers saved it: `rope_scaling` (here with a factor that is no number)."""
    def fn(c):
        del c["rope_parameters"]
        c["rope_scaling"] = {**LLAMA3_ROPE, "factor": "x"}
    edit_json(folder / "config.json", fn)


def vocab(fn):
    return tokenizer_json(lambda t: fn(t["model"]))


def duplicate_piece(folder):
    """An added token whose text is another id's SentencePiece piece: the vocabulary holds it twice."""
    import sentencepiece

    sp = sentencepiece.SentencePieceProcessor()
    sp.LoadFromFile(str(folder / "tokenizer.model"))
    piece = sp.IdToPiece(100)
    edit_json(folder / "tokenizer_config.json",
              lambda c: c.update(added_tokens_decoder={"300": {"content": piece, "special": False}}))


RANDOM = random.Random(31).randbytes(5000)

# id -> (base, edit, culprit file, problem)
TRACEBACKS = {  # llama.cpp's converter (and ckpt before) raised a traceback
    "tokenizer.model truncated": ("llama", write("tokenizer.model", lambda p: p.read_bytes()[:1000]),
                                  "tokenizer.model", "not a SentencePiece model (its model proto does not parse)"),
    "tokenizer.model random bytes": ("llama", write("tokenizer.model", RANDOM), "tokenizer.model",
                                     "not a SentencePiece model"),
    "tokenizer.model empty": ("llama", write("tokenizer.model", b""), "tokenizer.model",
                              "not a SentencePiece model (unk is not defined.)"),
    "num_attention_heads 0": ("llama", config(num_attention_heads=0), "config.json",
                              "num_attention_heads is 0, not an integer from 1 to 2^32 - 1"),
    "num_key_value_heads 0": ("llama", config(num_key_value_heads=0), "config.json",
                              "num_key_value_heads is 0, not an integer from 1"),
    "qwen2 num_key_value_heads 0": ("qwen2", config(num_key_value_heads=0), "config.json",
                                    "num_key_value_heads is 0, not an integer from 1"),
    "max_position_embeddings -1": ("llama", config(max_position_embeddings=-1), "config.json",
                                   "max_position_embeddings is -1, not an integer from 1 to 2^32 - 1"),
    "max_position_embeddings 2**40": ("llama", config(max_position_embeddings=2**40), "config.json",
                                      "max_position_embeddings is 1099511627776, not an integer from 1 to 2^32 - 1"),
    "rope_theta x": ("llama", config(rope_theta="x"), "config.json",
                     "rope_theta is 'x', not a finite number above 0"),
    "rope_parameters.rope_theta x": ("qwen2", rope(rope_theta="x"), "config.json",
                                     "rope_parameters.rope_theta is 'x', not a finite number above 0"),
    "rms_norm_eps x": ("llama", config(rms_norm_eps="x"), "config.json",
                       "rms_norm_eps is 'x', not a finite number above 0"),
    "num_hidden_layers '2'": ("llama", config(num_hidden_layers="2"), "config.json",
                              "num_hidden_layers is '2', not an integer from 1 to 512"),
    "llama3 rope_scaling.factor x": ("llama3", llama3_rope_scaling_factor_x, "config.json",
                                     "rope_scaling.factor is 'x', not a finite number above 0"),
    "bos_token_id -5": ("llama", config(bos_token_id=-5), "config.json",
                        "bos_token_id is -5, not a token id"),
    "tokenizer.json not JSON": ("qwen2", write("tokenizer.json", '{"model": {'), "tokenizer.json",
                                "is not valid JSON"),
    "tokenizer.json without model": ("qwen2", tokenizer_json(lambda t: t.pop("model")), "tokenizer.json",
                                     "has no tokenizer model"),
    "tokenizer.json list vocab": ("qwen2", vocab(lambda m: m.update(vocab=list(m["vocab"]))), "tokenizer.json",
                                  "the BPE vocabulary is a list, not an object of token -> id"),
    "tokenizer.json merges of numbers": ("qwen2", vocab(lambda m: m.update(merges=[1, 2, 3])), "tokenizer.json",
                                         "merge 0 is 1, not two tokens split by one space"),
    "tokenizer.json merge of one token": ("qwen2", vocab(lambda m: m["merges"].insert(3, ["a"])), "tokenizer.json",
                                          "merge 3 is ['a'], not a [token, token] pair (the form of merge 0)"),
    "tokenizer.json merge of an unknown token": ("qwen2", vocab(lambda m: m["merges"].insert(0, ["zq", "xw"])),
                                                 "tokenizer.json", "transformers' AutoTokenizer cannot read it"),
    "tokenizer.json id past the vocabulary": ("qwen2", vocab(lambda m: m["vocab"].update(zzz=5000)),
                                              "tokenizer.json", "token 'zzz' has id 5000, beyond the model's "
                                                                "vocab_size 400"),
    "tokenizer.json negative id": ("qwen2", vocab(lambda m: m["vocab"].update(zzz=-3)), "tokenizer.json",
                                   "token 'zzz' has id -3, not a token id"),
    "added_tokens_decoder entry a list": ("llama", tokenizer_config(added_tokens_decoder={"5": ["a"]}),
                                          "tokenizer_config.json",
                                          "added_tokens_decoder['5'] is a list, not an object"),
    "added_tokens_decoder entry without content": ("llama", tokenizer_config(added_tokens_decoder={"5": {}}),
                                                   "tokenizer_config.json",
                                                   "added_tokens_decoder['5'] has no content"),
    "added_tokens_decoder id not an integer": ("llama",
                                               tokenizer_config(added_tokens_decoder={"x": {"content": "a"}}),
                                               "tokenizer_config.json",
                                               "added_tokens_decoder has key 'x', not a token id"),
    "architectures a string": ("llama", config(architectures="LlamaForCausalLM"), "config.json",
                               "architectures is 'LlamaForCausalLM', not a list of model class names"),
    "generation_config.json temperature x": ("llama", lambda f: edit_json(f / "generation_config.json",
                                                                          lambda g: g.update(temperature="x")),
                                             "generation_config.json", "temperature is 'x', not a finite number"),
}
UNLOADABLE = {  # llama.cpp's converter writes a GGUF (exit 0) that llama.cpp refuses or aborts on
    "num_attention_heads 6": ("llama", config(num_attention_heads=6), "config.json",
                              "num_attention_heads x head_dim is 6 x 64 = 384 but model.layers.0.self_attn."),
    "num_key_value_heads 3": ("llama", config(num_key_value_heads=3), "config.json",
                              "num_key_value_heads is 3, which does not divide num_attention_heads (4)"),
    "qwen2 num_key_value_heads 4": ("qwen2", config(num_key_value_heads=4), "config.json",
                                    "num_key_value_heads x head_dim (hidden_size / num_attention_heads) is 4 x 64 = "
                                    "256 but model.layers.0.self_attn.k_proj."),
    "num_hidden_layers 3": ("llama", config(num_hidden_layers=3), "config.json",
                            "num_hidden_layers is 3 but the weights hold 2 blocks (model.layers.0-1)"),
    "vocab_size 100": ("llama", config(vocab_size=100), "config.json", "vocab_size is 100 but "),
    "qwen2 vocab_size 100": ("qwen2", config(vocab_size=100), "config.json", "vocab_size is 100 but "),
    "hidden_size 128": ("llama", config(hidden_size=128), "config.json", "hidden_size is 128 but "),
    "intermediate_size 100": ("llama", config(intermediate_size=100), "config.json",
                              "intermediate_size is 100 but model.layers.0.mlp."),
    "head_dim 32": ("llama", config(head_dim=32), "config.json", "x head_dim is "),
    "qwen2 head_dim 128": ("qwen2", config(head_dim=128), "config.json", "x head_dim is "),
    "rms_norm_eps -1": ("llama", config(rms_norm_eps=-1), "config.json",
                        "rms_norm_eps is -1, not a finite number above 0"),
    "rms_norm_eps NaN": ("llama", config(rms_norm_eps=float("nan")), "config.json",
                         "rms_norm_eps is nan, not a finite number above 0"),
    "chat_template.jinja not Jinja": ("qwen2", write("chat_template.jinja", "{% for m in messages %}{{ m }"),
                                      "chat_template.jinja", "the chat template is not valid Jinja"),
    "tokenizer_config.json chat_template not Jinja": ("llama", tokenizer_config(chat_template="{% if %}x{% endif %}"),
                                                      "tokenizer_config.json", "the chat template is not valid Jinja"),
    "named chat template not Jinja": ("llama", tokenizer_config(chat_template=[
        {"name": "default", "template": "{{ x }}"}, {"name": "tool_use", "template": "{{ x"}]),
        "tokenizer_config.json", "chat template 'tool_use' is not valid Jinja"),
    "num_experts_per_tok without experts": ("llama", config(num_experts_per_tok=2), "config.json",
                                            "num_experts_per_tok is 2, but the model has no experts"),
    "a token twice": ("llama", duplicate_piece, "tokenizer.model", "is in the vocabulary twice (ids 100 and 300)"),
}
HUGE = {  # the converter (or transformers' config class) would build lists this long
    "num_hidden_layers 10^9": ("llama", config(num_hidden_layers=10**9), "config.json",
                               "num_hidden_layers is 1000000000, not an integer from 1 to 512"),
    "vocab_size 10^9": ("llama", config(vocab_size=10**9), "config.json", "vocab_size is 1000000000 but "),
    "qwen2 vocab_size 10^9": ("qwen2", config(vocab_size=10**9), "config.json", "vocab_size is 1000000000 but "),
    "qwen2 num_hidden_layers 10^9": ("qwen2", config(num_hidden_layers=10**9), "config.json",
                                     "num_hidden_layers is 1000000000, not an integer from 1 to 512"),
}


def refused(folders, tmp_path, run_ckpt, base, edit, culprit, problem):
    folder = copy_folder(folders[base], tmp_path / "in" / base)
    edit(folder)
    before = fingerprint(folder)
    out = tmp_path / "out" / "m.gguf"
    out.parent.mkdir()
    assert_refused(run_ckpt, tmp_path, ("convert", folder, "--to", "gguf-q8_0", "-o", out),
                   str(folder / culprit), problem)
    assert fingerprint(folder) == before
    assert not any(out.parent.iterdir())


@pytest.mark.parametrize("case", list(TRACEBACKS))
def test_was_a_traceback(case, folders, tmp_path, run_ckpt):
    refused(folders, tmp_path, run_ckpt, *TRACEBACKS[case])


@pytest.mark.parametrize("case", list(UNLOADABLE))
def test_was_a_gguf_llama_cpp_refuses(case, folders, tmp_path, run_ckpt, intact_loads):
    base = UNLOADABLE[case][0]
    intact_loads(base)
    refused(folders, tmp_path, run_ckpt, *UNLOADABLE[case])


@pytest.mark.parametrize("case", list(HUGE))
def test_was_a_huge_allocation(case, folders, tmp_path, run_ckpt):
    """Refused before anything of that size is built: Python's allocations stay small (tracemalloc)."""
    tracemalloc.start()
    try:
        refused(folders, tmp_path, run_ckpt, *HUGE[case])
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 64 << 20, peak


def test_a_fifo_for_tokenizer_json_is_refused_without_blocking(folders, tmp_path, run_ckpt):
    folder = copy_folder(folders["qwen2"], tmp_path / "in" / "qwen2")
    (folder / "tokenizer.json").unlink()
    os.mkfifo(folder / "tokenizer.json")
    assert_refused(run_ckpt, tmp_path, ("convert", folder, "--to", "gguf-f16", "-o", tmp_path / "m.gguf"),
                   str(folder / "tokenizer.json"), "is a FIFO (named pipe), not a file ckpt can read")


# ---- what GGUF export needs beyond the runtime dependencies: one line saying what to install


def test_without_sentencepiece_says_what_to_install(folders, tmp_path, run_ckpt, monkeypatch):
    from ckpt.targets.planners.gguf_vocab import INSTALL

    monkeypatch.setitem(sys.modules, "sentencepiece", None)  # `import sentencepiece` raises ImportError
    folder = folders["llama"]
    assert_refused(run_ckpt, tmp_path, ("convert", folder, "--to", "gguf-f16", "-o", tmp_path / "m.gguf"),
                   str(folder / "tokenizer.model"), f"sentencepiece package, which is not installed: {INSTALL}")
    assert INSTALL == "pip install sentencepiece transformers jinja2 (the ckpt-toolkit[gguf] extra)"


def test_without_transformers_says_what_to_install(folders, tmp_path, run_ckpt, monkeypatch):
    from ckpt.targets.planners.gguf_vocab import INSTALL

    for name in [m for m in sys.modules if m == "transformers" or m.startswith("transformers.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "transformers", None)
    folder = folders["qwen2"]
    assert_refused(run_ckpt, tmp_path, ("convert", folder, "--to", "gguf-f16", "-o", tmp_path / "m.gguf"),
                   str(folder / "tokenizer.json"), f"transformers is not installed: {INSTALL}")


def test_without_jinja2_the_template_is_not_checked(folders, tmp_path, run_ckpt, monkeypatch):
    """jinja2 comes with the gguf extra; without it the chat template is written as it is (as llama.cpp's
    converter writes it), and the rest of the export works."""
    from helpers.hf_llm import read_gguf

    monkeypatch.setitem(sys.modules, "jinja2", None)
    folder = copy_folder(folders["qwen2"], tmp_path / "in" / "qwen2")
    (folder / "chat_template.jinja").write_text("{% for %}")
    code, _, err = run_ckpt("convert", folder, "--to", "gguf-f16", "-o", tmp_path / "m.gguf", "-q")
    assert code == 0, err
    assert read_gguf(tmp_path / "m.gguf")[0]["tokenizer.chat_template"][0] == "{% for %}"


# ---- what is not refused: said, and the GGUF loads


def test_a_special_token_id_past_the_vocabulary_is_a_warning(folders, tmp_path, run_ckpt, intact_loads):
    """The reference leaves such an id out (llama.cpp would disable it): the file loads, and the user hears it."""
    from helpers import llama_ref

    intact_loads("llama")
    folder = copy_folder(folders["llama"], tmp_path / "in" / "llama")
    config(pad_token_id=5000)(folder)
    code, _, err = run_ckpt("convert", folder, "--to", "gguf-f16", "-o", tmp_path / "m.gguf", "-q")
    assert code == 0, err
    assert f"warning: {folder / 'config.json'}: pad_token_id 5000 is not a token of the 320-token vocabulary" in err
    assert llama_ref.logits(tmp_path / "m.gguf", [1, 2, 3]).shape[0] == 3


def test_the_sentencepiece_folder_without_tokenizer_model_converts_and_loads(folders, tmp_path, run_ckpt,
                                                                          intact_loads):
    """The Llama folder's tokenizer.json alone (llama.cpp's `_set_vocab_llama_hf` route): the token list is
    checked against the embedding rows like every other."""
    from helpers import llama_ref

    intact_loads("llama")
    folder = copy_folder(folders["llama"], tmp_path / "in" / "llama")
    (folder / "tokenizer.model").unlink()
    code, _, err = run_ckpt("convert", folder, "--to", "gguf-f16", "-o", tmp_path / "m.gguf", "-q")
    assert code == 0, err
    assert llama_ref.logits(tmp_path / "m.gguf", [1, 2, 3]).shape[0] == 3
