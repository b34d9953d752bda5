"""Fuzzing of `ckpt merge CONFIG` (issue #31): seeded mutants of valid mergekit configs of several methods (values
replaced by wrong types, huge, negative, NaN or infinite numbers, bools, deep nesting, alias bombs and
self-referencing aliases, paths to FIFOs, devices, folders and missing files; keys removed or added; the YAML text
truncated or overwritten with random bytes), each run in-process through the CLI on tiny models. Every mutant
either merges (exit 0, every output tensor finite: the inputs are) or is refused (exit 2, exactly one `error:`
line, nothing written); never a traceback, never a hang (each case has SECONDS), and the inputs stay as they were.
The one exit 0 with NaN/Inf allowed is an output dtype too narrow for the merged values, which the run says
(the Caster's overflow warning) and which writes infinities, never NaN.

The run's working folder and HOME are a sandbox and every path in the configs is relative to it: a truncated path
("models/", "~") names a folder of the sandbox, never / or the real home folder.

CI runs CASES mutants; CKPT_FUZZ_CASES=N runs N (CKPT_FUZZ_SEED picks another seed).
"""

from __future__ import annotations

import copy
import hashlib
import os
import random
import shutil
import signal

import pytest
import torch
import yaml
from safetensors.torch import load_file

from helpers.merge_oracle import variants

CASES = int(os.environ.get("CKPT_FUZZ_CASES", "40"))
SEED = int(os.environ.get("CKPT_FUZZ_SEED", "31"))
SECONDS = 60  # per mutant; the models are a few kB, a merge takes well under a second


def bases(m, s) -> list[dict]:
    """Valid configs (m: the models m0..m2; s: the special paths)."""
    return [
        {"merge_method": "linear", "models": [
            {"model": m[0], "parameters": {"weight": 0.5}}, {"model": m[1], "parameters": {"weight": [0.2, 1.0]}},
            {"model": m[2], "parameters": {"weight": [{"filter": "mlp", "value": 0.7}, {"value": 0.3}]}}],
         "dtype": "float32"},
        {"merge_method": "ties", "base_model": m[0], "models": [
            {"model": m[1], "parameters": {"weight": 0.6, "density": 0.5}},
            {"model": m[2], "parameters": {"weight": 0.4, "density": [0.3, 0.9]}}],
         "parameters": {"normalize": True, "lambda": 1.2}},
        {"merge_method": "dare_linear", "base_model": m[0], "models": [
            {"model": m[1], "parameters": {"weight": 1.0, "density": 0.7}}, {"model": m[2], "parameters": {"weight": 0.5}}]},
        {"merge_method": "slerp", "base_model": m[0], "models": [{"model": m[0]}, {"model": m[1]}],
         "parameters": {"t": [0.0, 0.5, 1.0]}},
        {"merge_method": "nuslerp", "models": [
            {"model": m[1], "parameters": {"weight": 0.3}}, {"model": m[2], "parameters": {"weight": 0.7}}],
         "parameters": {"nuslerp_flatten": False}},
        {"merge_method": "multislerp", "base_model": m[0], "models": [
            {"model": m[1], "parameters": {"weight": 0.5}}, {"model": m[2], "parameters": {"weight": 0.5}}]},
        {"merge_method": "karcher", "models": [{"model": m[0]}, {"model": m[1]}, {"model": m[2]}],
         "parameters": {"max_iter": 5, "tol": 1.0e-6}},
        {"merge_method": "weighted_sum", "models": [m[0], m[1]], "parameters": {"alpha": 0.3}},
        {"merge_method": "add_difference", "models": [m[0], m[1], m[2]], "parameters": {"alpha": 1.0}},
        {"merge_method": "passthrough", "slices": [
            {"sources": [{"model": m[0], "layer_range": [0, 2]}]},
            {"sources": [{"model": m[1], "layer_range": [2, 4], "parameters": {"scale": 0.5}}]}]},
        {"merge_method": "model_stock", "base_model": m[0], "models": [{"model": m[1]}, {"model": m[2]}],
         "out_dtype": "bfloat16"},
        {"merge_method": "della", "base_model": m[0], "models": [
            {"model": m[1], "parameters": {"weight": 1.0, "density": 0.5, "epsilon": 0.1}},
            {"model": m[2], "parameters": {"weight": 1.0, "density": 0.6}}]},
        {"merge_method": "ramplus_tl", "base_model": m[0], "models": [{"model": m[1]}, {"model": m[2]}],
         "parameters": {"r": 0.1, "alpha": 0.2}},
    ]


class Raw(str):
    """YAML text put into the dumped config as it is (what yaml.dump cannot write: aliases, 1,000 levels)."""


def bomb() -> Raw:
    levels = ["&b0 [1, 1, 1, 1, 1, 1, 1, 1, 1, 1]"] + [
        f"&b{i} [" + ", ".join([f"*b{i - 1}"] * 10) + "]" for i in range(1, 9)]
    return Raw("[" + ", ".join(levels) + "]")


def values(rng: random.Random, s) -> list:
    d = rng.choice([3, 40, 1000])
    return [
        "abc", "", None, [], {}, [1, "x"], {"x": 1}, [{"filter": 1, "value": 1}], {"filter": "mlp"}, [[0.5]],
        0, -1, 1, 0.5, 2, 3, 1e6, 1.0e7, -1e39, 1e39, 1e-300, 2 ** 70, Raw("1" + "0" * 400), Raw("9" * 5000),
        float("nan"), float("inf"), float("-inf"), "1e-3", "nan", True, False, Raw("2001-02-30"),
        Raw("[" * d + "0.5" + "]" * d), Raw("{a: " * d + "1" + "}" * d), bomb(), Raw("&s [*s]"), Raw("*undefined"),
        "x" * 5000, rng.choice(["merge_method", "models", "weight", "mlp"]),
    ] + paths(s)


def paths(s) -> list:
    return [s["fifo"], s["zero_link"], s["missing"], s["empty_dir"], s["text_file"], "~nosuchuser/m",
            Raw('"m\\0x"'), Raw('"m\\nx"'), "org/not-cached-model", f"{s['models'][0]}+{s['fifo']}"]


KEYS = ["foo", "modules", "tokenizer", "residual_weight", "layer_range", "density", "weight", "t", "alpha",
        "normalize", "dtype", "out_dtype", "tokenizer_source", "base_model", "slices", "models", "parameters",
        "max_iter", "epsilon", "lambda", "scale", "filter", "value", "sources"]
PATH_KEYS = ("model", "base_model", "tokenizer_source")


def slots(node, out=None, seen=None):
    """Every (container, key) of the config tree (which an alias mutation may have made a graph with cycles)."""
    out, seen = ([] if out is None else out), (set() if seen is None else seen)
    if id(node) in seen:
        return out
    seen.add(id(node))
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else []
    for k, v in list(items):
        out.append((node, k))
        slots(v, out, seen)
    return out


def dump(data) -> str:
    """YAML of `data` (shared containers become anchors and aliases, a cycle an alias inside its anchor), with
    the Raw values put in as they are."""
    raws: dict[str, str] = {}
    done: dict[int, object] = {}

    def swap(v):
        if isinstance(v, Raw):
            key = f"RAW{len(raws)}X"
            raws[key] = str(v)
            return key
        if id(v) in done:
            return done[id(v)]
        if isinstance(v, dict):
            new = done[id(v)] = {}
            new.update({swap(k) if isinstance(k, Raw) else k: swap(x) for k, x in v.items()})
            return new
        if isinstance(v, list):
            new = done[id(v)] = []
            new.extend(swap(x) for x in v)
            return new
        return v

    text = yaml.safe_dump(swap(data), sort_keys=False, width=1 << 30)
    for key, raw in raws.items():
        text = text.replace(key, raw)
    return text


def mutants(n: int, seed: int, m, s):
    """`n` (description, config bytes) pairs, the same for the same seed."""
    rng = random.Random(seed)
    configs = bases(m, s)
    for i in range(n):
        b = rng.randrange(len(configs))
        data = copy.deepcopy(configs[b])
        what = rng.random()
        desc = f"base {b} ({data['merge_method']})"
        for _ in range(rng.choice([1, 1, 1, 2, 3])):  # a few changes at once, sometimes
            sl = slots(data)
            if not sl:  # every key removed
                break
            if what < 0.15:  # a change a valid config can have: another number, another of the models
                node, k = rng.choice(sl)
                v = node[k]
                if isinstance(v, str) and v in m:
                    node[k] = rng.choice(m)
                elif isinstance(v, (int, float)) and not isinstance(v, bool):
                    node[k] = round(rng.uniform(0.05, 0.95), 3) if isinstance(v, float) else v
                desc += f"; {k!r} -> {str(node[k])[:40]!r}"
            elif what < 0.55:  # one value replaced
                node, k = rng.choice(sl)
                pool = paths(s) if k in PATH_KEYS or (isinstance(node, list) and isinstance(node[k], str)
                                                       and rng.random() < 0.7) else values(rng, s)
                v = rng.choice(pool)
                node[k] = v
                desc += f"; {k!r} -> {str(v)[:40]!r}"
            elif what < 0.65:  # a key removed
                maps = [(node, k) for node, k in sl if isinstance(node, dict)] + [(data, k) for k in list(data)]
                node, k = rng.choice(maps)
                node.pop(k, None)
                desc += f"; {k!r} removed"
            elif what < 0.75:  # a key added
                maps = [node for node, _ in sl if isinstance(node, dict)] + [data]
                node, k, v = rng.choice(maps), rng.choice(KEYS), rng.choice(values(rng, s))
                node[k] = v
                desc += f"; {k!r}: {str(v)[:40]!r} added"
            elif what < 0.8:  # one subtree in two places: YAML anchors and aliases
                node, k = rng.choice(sl)
                other, k2 = rng.choice(sl)
                other[k2] = node[k]
                desc += f"; {k2!r} aliases {k!r}"
        text = dump(data).encode()
        if 0.8 <= what < 0.9:  # truncated
            cut = rng.randrange(len(text))
            text = text[:cut]
            desc += f"; truncated to {cut} bytes"
        elif what >= 0.9:  # random bytes
            data_ = bytearray(text)
            spots = [rng.randrange(len(data_)) for _ in range(rng.randint(1, 6))]
            for p in spots:
                data_[p] = rng.randrange(256)
            text = bytes(data_)
            desc += f"; bytes {spots} changed"
        yield i, desc, text


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("fuzz")
    (root / "models").mkdir()
    m = [str(p.relative_to(root)) for p in variants(root / "models", 3)]
    s = {"models": m, "fifo": "fifo", "zero_link": "zero", "missing": "missing", "empty_dir": "empty",
         "text_file": "notes.txt"}
    os.mkfifo(root / "fifo")
    (root / "zero").symlink_to("/dev/zero")
    (root / "empty").mkdir()
    (root / "notes.txt").write_text("not a model\n")
    return root, m, s


def _digest(root) -> str:
    h = hashlib.sha256()
    for p in sorted(root.rglob("*")):
        if p.is_file() and not p.is_symlink():
            h.update(str(p).encode() + p.read_bytes())
    return h.hexdigest()


class _Slow(Exception):
    pass


def _alarm(signum, frame):
    raise _Slow()


def _outputs_finite(out, said: str) -> None:
    files = [out] if out.is_file() else sorted(out.rglob("*.safetensors"))
    assert files, list(out.rglob("*"))
    for f in files:
        for k, t in load_file(f).items():
            if not t.is_floating_point() or bool(torch.isfinite(t).all()):
                continue
            assert not bool(torch.isnan(t).any()), f"{f.name}: {k} holds NaN"
            assert "overflowed to inf in the target dtype" in said, f"{f.name}: {k} holds Inf, unsaid"


def test_mutated_configs_merge_or_are_refused_in_one_line(setup, run_ckpt, tmp_path, monkeypatch):
    root, m, s = setup
    monkeypatch.chdir(root)
    monkeypatch.setenv("HOME", str(root))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # a hub-id-like mutant is looked up in an empty cache, offline
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub-cache"))
    before = _digest(root / "models")
    outcomes = {"merged": 0, "refused": 0}
    for i, desc, text in mutants(CASES, SEED, m, s):
        case = tmp_path / f"case{i}"
        case.mkdir()
        cfg = case / "config.yaml"
        cfg.write_bytes(text)
        out = case / "out"
        old = signal.signal(signal.SIGALRM, _alarm)
        signal.setitimer(signal.ITIMER_REAL, SECONDS)
        try:
            code, o, err = run_ckpt("merge", cfg, "-o", out, "-q")
        except _Slow:
            pytest.fail(f"case {i} ({desc}): no answer within {SECONDS} s")
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, old)
        assert code in (0, 2), f"case {i} ({desc}): exit {code}: {err[-3000:]}"
        if code == 0:
            _outputs_finite(out, o + err)
            outcomes["merged"] += 1
        else:
            assert err.count("\n") == 1 and err.startswith("error: ") and len(err) < 1000, \
                f"case {i} ({desc}): {err[:3000]!r}"
            assert sorted(p.name for p in case.iterdir()) == ["config.yaml"], f"case {i} ({desc}): left {err}"
            outcomes["refused"] += 1
        assert cfg.read_bytes() == text
        shutil.rmtree(case)
    assert _digest(root / "models") == before
    print(outcomes)
    assert outcomes["refused"] and outcomes["merged"], outcomes  # the mutants reach both sides
