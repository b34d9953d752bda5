"""Fuzzing the inputs of the HF LLM -> GGUF export (issue 31, items 8 and 9): a tiny SentencePiece Llama, a
byte-level BPE Qwen2 (with a chat template) and a Llama 3 style folder (`helpers.gguf_llm_inputs.BASES`),
mutated with a seeded RNG: config.json values of the wrong type, zero, negative, huge, NaN, infinite or off by
one; keys dropped; RoPE parameters likewise; tokenizer and config files truncated, replaced by random bytes,
flipped in place, removed; their JSON values swapped for other shapes; chat templates broken.

Each mutant goes through the CLI (`ckpt convert FOLDER --to gguf-<type>`) within a time bound, and must either
be refused (exit 2, one `error: ` line, nothing written) or be written (exit 0) as a GGUF llama.cpp loads, in a
child process (`helpers.gguf_llm_inputs.LlamaLoader`: weights and vocabulary, a text tokenized, and for an F16
file a few tokens evaluated with `helpers.llama_ref.logits`); either way the input files are unchanged.

CI runs a fixed seeded sample (`CASES`, well under a minute); CKPT_FUZZ_CASES=N runs N cases
(CKPT_FUZZ_SEED picks another seed).
"""

from __future__ import annotations

import json
import math
import os
import random
import shutil
import signal

import pytest

from helpers.gguf_llm_inputs import LlamaLoader, build, copy_folder, fingerprint, pre_tokenizers

CASES = int(os.environ.get("CKPT_FUZZ_CASES", "200"))
SEED = int(os.environ.get("CKPT_FUZZ_SEED", "31"))
SECONDS = 60  # per case: a conversion of a few MB, whatever the mutant
MIXES = ("f16", "q8_0", "q4_k_m")

# config.json keys the mutants also add where the base lacks them (they are read when present)
EXTRA_KEYS = ("head_dim", "sliding_window", "num_local_experts", "num_experts_per_tok", "rope_theta", "rope_scaling",
              "partial_rotary_factor", "original_max_position_embeddings", "pad_token_id", "n_head", "n_embd",
              "text_config", "is_causal", "layer_norm_eps", "architectures")
ROPE_KEYS = ("rope_type", "rope_theta", "factor", "low_freq_factor", "high_freq_factor",
             "original_max_position_embeddings", "beta_fast", "attention_factor")
TEMPLATE_BITS = ("{%", "%}", "{{", "}}", "{% endfor %}", "{% if x %}", "{% endif %}", "{#", "|", "(", "'",
                 "{% generation %}", "{% endgeneration %}", "{% break %}", "\u00ff", "\n")


def odd_value(rng: random.Random, v):
    """A value of the wrong type, zero, negative, huge, non-finite, or near the original."""
    choices = ["x", "", "2", [], {}, [1, 2], {"a": 1}, True, False, None, 0, -1, -5, 1.5, 0.0, float("nan"),
               float("inf"), -float("inf"), 1e-45, 1e39, 10**9, 2**31, 2**32, 2**40, 2**64, 10**30]
    if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
        choices += [v + 1, v - 1, v * 2, v // 2 if isinstance(v, int) else v / 2, -v, v * 3]
    return rng.choice(choices)


def json_nodes(value, path=()):
    """Every (path, value) inside a JSON value, the root's children first; big lists and objects sampled by
    their first entries (a vocabulary has hundreds)."""
    out = []
    items = list(value.items())[:12] if isinstance(value, dict) else \
        list(enumerate(value))[:6] if isinstance(value, list) else []
    for k, v in items:
        out.append((path + (k,), v))
        out += json_nodes(v, path + (k,))
    return out


def _json(path):
    """The JSON object in `path`, None where an earlier mutation of the case left none to edit."""
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def at(value, path):
    for k in path:
        value = value[k]
    return value


def mutate_config(rng, folder):
    cfg = _json(folder / "config.json")
    if cfg is None:
        return "config.json left as it is"
    what = rng.random()
    if what < 0.55:
        key = rng.choice(sorted(cfg) + list(EXTRA_KEYS))
        cfg[key] = odd_value(rng, cfg.get(key))
        desc = f"config.json {key} = {cfg[key]!r}"
    elif what < 0.75:
        rope = cfg.setdefault("rope_parameters", {"rope_type": "default", "rope_theta": 10000.0})
        if not isinstance(rope, dict):
            rope = cfg["rope_parameters"] = {}
        key = rng.choice(ROPE_KEYS)
        rope[key] = rng.choice(["llama3", "yarn", "linear", "dynamic", "longrope"]) if key == "rope_type" and \
            rng.random() < 0.5 else odd_value(rng, rope.get(key))
        desc = f"config.json rope_parameters.{key} = {rope[key]!r}"
    else:
        key = rng.choice(sorted(cfg))
        del cfg[key]
        desc = f"config.json without {key}"
    (folder / "config.json").write_text(json.dumps(cfg))
    return desc


def present(folder, names):
    return [n for n in names if (folder / n).is_file()]


def mutate_bytes(rng, folder):
    names = present(folder, ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "chat_template.jinja",
                             "special_tokens_map.json", "generation_config.json", "config.json"))
    if not names:
        return "no file left"
    name = rng.choice(names)
    path = folder / name
    data = bytearray(path.read_bytes())
    what = rng.random()
    if what < 0.35:
        cut = rng.randrange(len(data) + 1)
        del data[cut:]
        desc = f"{name} truncated to {cut} bytes"
    elif what < 0.55:
        data = bytearray(rng.randbytes(rng.choice([0, 1, 16, 300, 4000])))
        desc = f"{name} replaced by {len(data)} random bytes"
    elif what < 0.85 and data:
        spots = [rng.randrange(len(data)) for _ in range(rng.randint(1, 6))]
        for s in spots:
            data[s] = rng.randrange(256)
        desc = f"{name} bytes {spots[:6]} changed"
    else:
        path.unlink()
        return f"{name} removed"
    path.write_bytes(bytes(data))
    return desc


def mutate_json_shape(rng, folder):
    names = present(folder, ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"))
    if not names:
        return "no JSON tokenizer file left"
    name = rng.choice(names)
    path = folder / name
    value = _json(path)
    if value is None:
        return f"{name} left as it is"
    nodes = json_nodes(value)
    if not nodes:
        return f"{name} unchanged (no nodes)"
    where, old = rng.choice(nodes)
    parent = at(value, where[:-1])
    if rng.random() < 0.25 and isinstance(parent, dict):
        del parent[where[-1]]
        desc = f"{name} without {'.'.join(map(str, where))}"
    else:
        new = odd_value(rng, old) if rng.random() < 0.6 else \
            rng.choice([[old], {"x": old}, str(old)[:20], -1, 2**40, None, [], {}])
        parent[where[-1]] = new
        desc = f"{name} {'.'.join(map(str, where))} = {str(new)[:40]}"
    path.write_text(json.dumps(value))
    return desc


def mutate_template(rng, folder):
    jinja = folder / "chat_template.jinja"
    config = folder / "tokenizer_config.json"
    if jinja.is_file():
        text = jinja.read_text(errors="replace")
    else:
        from helpers.hf_llm import CHATML
        text = CHATML
    if rng.random() < 0.5:
        text = text[:rng.randrange(len(text) + 1)]
    else:
        for _ in range(rng.randint(1, 3)):
            i = rng.randrange(len(text) + 1)
            text = text[:i] + rng.choice(TEMPLATE_BITS) + text[i:]
    if jinja.is_file():
        jinja.write_text(text)
        return f"chat_template.jinja = {text[:60]!r}"
    cfg = _json(config)
    if cfg is None:
        return "tokenizer_config.json left as it is"
    cfg["chat_template"] = text if rng.random() < 0.8 else odd_value(rng, text)
    config.write_text(json.dumps(cfg))
    return f"tokenizer_config.json chat_template = {str(cfg['chat_template'])[:60]!r}"


MUTATIONS = ((mutate_config, 0.45), (mutate_bytes, 0.2), (mutate_json_shape, 0.2), (mutate_template, 0.15))


def mutants(bases: dict, n: int, seed: int):
    """`n` cases (index, base, mix, edits as a function of the folder), the same for the same seed."""
    rng = random.Random(seed)
    for i in range(n):
        base = rng.choice(sorted(bases))
        mix = rng.choice(MIXES)
        picks = rng.choices([m for m, _ in MUTATIONS], weights=[w for _, w in MUTATIONS], k=rng.choice([1, 1, 2, 3]))
        case_seed = rng.randrange(2**32)

        def edit(folder, picks=picks, case_seed=case_seed):
            r = random.Random(case_seed)
            return "; ".join(m(r, folder) for m in picks)

        yield i, base, mix, edit


class _Slow(BaseException):  # not an Exception: nothing in the CLI may catch it
    pass


def _alarm(signum, frame):
    raise _Slow()


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    return build(tmp_path_factory.mktemp("bases"))


def test_mutants_are_refused_in_one_line_or_written_as_a_gguf_llama_cpp_loads(bases, tmp_path, run_ckpt,
                                                                            monkeypatch):
    from helpers import llama_ref

    from ckpt.targets.planners import gguf_vocab

    llama_ref.llama_cpp()  # skips, saying why, where llama-cpp-python does not import
    for h, name in pre_tokenizers(bases).items():
        monkeypatch.setitem(gguf_vocab.PRE_TOKENIZERS, h, name)
    loader = LlamaLoader(tmp_path / "llama.log")
    outcomes = {"refused": 0, "written": 0}
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    old = signal.signal(signal.SIGALRM, _alarm)
    try:
        for i, base, mix, edit in mutants(bases, CASES, SEED):
            folder = copy_folder(bases[base], tmp_path / f"case{i}" / base)
            desc = f"case {i} ({base}, gguf-{mix}): {edit(folder)}"
            before = fingerprint(folder)
            out = out_dir / f"m{i}.gguf"
            signal.setitimer(signal.ITIMER_REAL, SECONDS)
            try:
                code, _, err = run_ckpt("convert", folder, "--to", f"gguf-{mix}", "-o", out, "-q")
            except _Slow:
                pytest.fail(f"{desc}: no answer within {SECONDS} s")
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
            assert fingerprint(folder) == before, desc
            if code == 2:
                assert err.count("\n") == 1 and err.startswith("error: "), f"{desc}: {err}"
                assert not any(out_dir.iterdir()), f"{desc}: {sorted(p.name for p in out_dir.iterdir())}"
                outcomes["refused"] += 1
            else:
                assert code == 0, f"{desc}: exit {code}: {err[-3000:]}"
                assert out.is_file(), desc
                why = loader.load(out)
                assert why is None, f"{desc}: written, but llama.cpp does not load it: {why}"
                outcomes["written"] += 1
                out.unlink()
            shutil.rmtree(folder.parent)
    finally:
        signal.signal(signal.SIGALRM, old)
        loader.close()
    print(outcomes)
    assert outcomes["refused"] and outcomes["written"], outcomes  # the mutants reach both sides
