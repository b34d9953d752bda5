"""`ckpt.families.llm.quant_mix.llm_types` for every llama-quantize file type, with and without an importance
matrix, and with llama-quantize's per-tensor flags, against llama.cpp's own quantizer (`llama_model_quantize` of
llama-cpp-python 0.3.36, tests/helpers/llama_ref.py): each tensor's type in llama.cpp's output (or, for the bulk of
the cases, in its --dry-run log, which reports the same types without quantizing: `test_dry_run_logs_the_types_
of_the_file` checks that on real files of every new type) must be the one `llm_types` predicts, its row-length
fallbacks the tensors llama.cpp warns about, and where llama.cpp refuses the run, `llm_types` refuses it naming the
same tensor. Types, not bytes: the encoders are tested against ggml's C elsewhere.

The models (tests/test_gguf_llm_mix.py's, and three more here) reach the new rules: GQA 1, 2, 4 and 8 (the IQ
file types' attn_v), 4 and 8 experts (`n_expert >= 4`, `== 8`, MXFP4_MOE's expert tensors), a shared expert in a
16-layer MoE (the IQ1/IQ2 rule counts ffn_down tensors, not layers), tied embeddings (the output rule on
token_embd), rows of 288 / 320 / 336 (fallbacks to IQ4_NL, Q4_0, F16, and Q1_0's missing fallback), and a
per_layer_token_embd table. The importance matrices are random (types do not depend on values), one entry per
weight llama-imatrix would collect (all but the token embeddings)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from helpers import llama_ref
from helpers.llm_mix_models import FALLBACK_WARNING, MODELS, N_VOCAB, Model, tensors, write_model

from ckpt.errors import CkptError
from ckpt.families.llm.quant_mix import DEFAULT_TYPE, FILE_TYPE, llm_types, parse_tensor_type, unused_tensor_types
from ckpt.targets.planners.gguf_mixes import ALIASES, MIXES, ImageMix, mix

STATIC = ("ALL_F32", "MOSTLY_F16", "MOSTLY_BF16", "MOSTLY_Q4_0", "MOSTLY_Q4_1", "MOSTLY_Q5_0", "MOSTLY_Q5_1",
          "MOSTLY_Q8_0", "MOSTLY_Q2_K", "MOSTLY_Q3_K_S", "MOSTLY_Q3_K_M", "MOSTLY_Q3_K_L", "MOSTLY_Q4_K_S",
          "MOSTLY_Q4_K_M", "MOSTLY_Q5_K_S", "MOSTLY_Q5_K_M", "MOSTLY_Q6_K", "MOSTLY_IQ4_NL", "MOSTLY_IQ4_XS")
NEW = tuple(f for f in DEFAULT_TYPE if f not in STATIC)  # the file types of issue 34
SHEXP = {f"blk.{i}.ffn_down_shexp.weight": ((256, 256), T.F16) for i in range(16)}
MORE = {
    "moe4_gqa1": Model("llama", 4, 256, 8, 8, 256, n_expert=4),
    "moe16_shexp": Model("llama", 16, 256, 8, 4, 256, n_expert=2, extra=SHEXP),
    "llama16_ple": Model("llama", 16, 256, 4, 4, 256,
                         extra={"per_layer_token_embd.weight": ((N_VOCAB, 256), T.F16)}),
}
ALL = {**MODELS, **MORE}
SMALL = Model("llama", 1, 256, 4, 1, 256)  # real quantization of every new type in seconds


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """name -> the model's F16/F32 GGUF, written once per module on first use."""
    folder = tmp_path_factory.mktemp("mix_imatrix")
    built = {}

    def get(name: str):
        if name not in built:
            built[name] = folder / f"{name}.gguf"
            write_model(built[name], SMALL if name == "small" else ALL[name])
        return built[name]

    return get


def imatrix_of(m: Model, drop=(), seed: int = 0) -> dict[str, np.ndarray]:
    """A random importance matrix with llama-imatrix's entries (every weight of 2+ dims a matrix product reads:
    all but the token embeddings), of llama-quantize's size ne[0] * ne[2]; `drop`: names left out."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape, _ in tensors(m):
        if len(shape) >= 2 and name not in ("token_embd.weight", "per_layer_token_embd.weight") and name not in drop:
            out[name] = rng.random(shape[-1] * (shape[-3] if len(shape) >= 3 else 1)).astype(np.float32) + 0.01
    return out


def predicted(m: Model, ftype: str, imatrix=None, **flags):
    ts = tensors(m)
    got = llm_types(ftype, [(n, s, t.name) for n, s, t in ts], arch=m.arch, n_layer=m.n_layer, n_head=m.n_head,
                    n_head_kv=m.n_head_kv, n_expert=m.n_expert, has_imatrix=imatrix is not None,
                    imatrix_names=None if imatrix is None else set(imatrix), **flags)
    return {n: g for (n, _, _), g in zip(ts, got)}


def refused_tensor(log: str) -> str:
    """The tensor llama.cpp's refusal names (or, for a type without a fallback, the last one it warned about)."""
    for rx in (r"offending tensor: (\S+)", r"Missing importance matrix for tensor (\S+)"):
        if m := re.search(rx, log):
            return m.group(1)
    assert "no tensor type fallback is defined" in log, log[-1500:]
    return FALLBACK_WARNING.findall(log)[-1]


# ckpt's refusals of what makes llama.cpp abort (a GGML_ASSERT) rather than refuse
ABORTS = ("which ggml quantizes only with an importance matrix", "applies this flag without a fallback type")


def check(source, tmp_path, name: str, ftype: str, imatrix=None, real: bool = False, **flags):
    """llama.cpp's types (its --dry-run log; its file where `real`) against llm_types', or both refusing on the same
    tensor. Returns the prediction (None where refused)."""
    m = SMALL if name == "small" else ALL[name]
    llama_ref.llama_cpp()  # skip here, with the reason, when llama.cpp is not there
    src, dst = source(name), tmp_path / "out.gguf"
    try:
        want = predicted(m, ftype, imatrix, **flags)
    except CkptError as e:
        if any(a in str(e) for a in ABORTS):  # llama.cpp would abort this process: test_where_llama_cpp_aborts
            return None
        rc, log = llama_ref.quantize_gguf_result(src, dst, ftype, imatrix=imatrix, **flags)
        assert rc != 0, f"{ftype}: llama.cpp quantized what ckpt refuses ({e})"
        assert refused_tensor(log) in str(e), (str(e), log[-800:])
        return None
    log = llama_ref.quantize_gguf(src, dst, ftype, imatrix=imatrix, dry_run=not real, **flags)
    got = llama_ref.logged_types(log)
    if real:
        in_file = {t.name: t.tensor_type.name for t in gguf.GGUFReader(dst).tensors}
        assert in_file == got  # the log says what the file holds
    assert set(got) == set(want)
    wrong = {n: (got[n], want[n][0], want[n][1]) for n in want if got[n] != want[n][0]}
    assert not wrong, f"{ftype} {flags}: llama.cpp type, predicted type, rule: {wrong}"
    assert set(FALLBACK_WARNING.findall(log)) == {n for n, (_, _, fb) in want.items() if fb}
    return want


@pytest.fixture(scope="module", autouse=True)
def _types_gguf_lacks():
    from ckpt.io.ggml_types import gguf_package

    gguf_package()  # Q2_0 (type 42) for gguf's reader of llama.cpp's Q2_0 files


CASES = [(n, f, im) for n in ALL for f in DEFAULT_TYPE for im in (False, True) if f in NEW or im]


@pytest.mark.parametrize("name, ftype, with_imatrix", CASES,
                         ids=[f"{n}-{f.replace('MOSTLY_', '')}-{'imatrix' if i else 'static'}" for n, f, i in CASES])
def test_every_file_type_with_and_without_imatrix(source, tmp_path, name, ftype, with_imatrix):
    m = ALL[name]
    check(source, tmp_path, name, ftype, imatrix_of(m) if with_imatrix else None)


PURE = [(n, f) for n in ("llama8", "qwen2_odd_rows", "moe8") for f in NEW]


@pytest.mark.parametrize("name, ftype", PURE, ids=[f"{n}-{f.replace('MOSTLY_', '')}" for n, f in PURE])
def test_pure_with_every_new_file_type(source, tmp_path, name, ftype):
    check(source, tmp_path, name, ftype, imatrix_of(ALL[name]), pure=True)


@pytest.mark.parametrize("ftype", NEW)
def test_dry_run_logs_the_types_of_the_file(source, tmp_path, ftype):
    """A real quantization of every new file type (with an importance matrix): the file's types are the predicted
    ones, and what the --dry-run runs above read from the log."""
    check(source, tmp_path, "small", ftype, imatrix_of(SMALL), real=True)


FLAGS = {
    "tensor_type": dict(tensor_types=[("attn_v", "Q8_0"), ("blk\\.[0-3]\\.ffn_down", "IQ4_XS"),
                                      ("ffn_down", "Q5_0"), ("ffn_(up|gate)", "Q4_K")]),
    "tensor_type_output_and_embd": dict(tensor_types=[("output", "Q8_0"), ("token_embd", "Q6_K")]),
    "tensor_type_low_bit": dict(tensor_types=[("attn_[qk]", "IQ2_XXS"), ("attn_output", "IQ1_S")]),
    "output_tensor_type": dict(output_tensor_type="IQ4_NL"),
    "token_embedding_type": dict(token_embedding_type="Q4_K"),
    "both_types": dict(output_tensor_type="Q8_0", token_embedding_type="Q2_K"),
    "leave_output": dict(quantize_output_tensor=False),
    "all": dict(tensor_types=[("ffn", "Q6_K")], output_tensor_type="Q5_0", token_embedding_type="Q8_0",
                quantize_output_tensor=False),
    "per_layer_named": dict(token_embedding_type="Q4_K", tensor_types=[("per_layer", "Q8_0")]),
}
FLAG_CASES = [(n, f, flag) for n in ("llama8", "qwen3_lex_bf16", "llama16_ple", "qwen2_odd_rows", "moe8")
              for f in ("MOSTLY_Q4_K_M", "MOSTLY_IQ3_XXS", "MOSTLY_F16", "MOSTLY_MXFP4_MOE", "MOSTLY_IQ2_M")
              for flag in FLAGS]


@pytest.mark.parametrize("name, ftype, flag", FLAG_CASES,
                         ids=[f"{n}-{f.replace('MOSTLY_', '')}-{g}" for n, f, g in FLAG_CASES])
def test_per_tensor_flags(source, tmp_path, name, ftype, flag):
    flags = {k: [(p.lower(), t) for p, t in v] if k == "tensor_types" else v for k, v in FLAGS[flag].items()}
    check(source, tmp_path, name, ftype, imatrix_of(ALL[name]), **flags)
    if not FLAGS[flag].get("tensor_types"):
        check(source, tmp_path, name, ftype, imatrix_of(ALL[name]), pure=True, **flags)


def test_the_flags_reach_their_rules():
    """What the oracle tests above cover, spelled out on predictions they checked."""
    m = ALL["llama8"]
    tt = predicted(m, "MOSTLY_Q4_K_M", **FLAGS["tensor_type"])
    assert tt["blk.0.attn_v.weight"] == ("Q8_0", "--tensor-type attn_v=Q8_0", False)
    assert tt["blk.2.ffn_down.weight"][0] == "IQ4_XS" and tt["blk.5.ffn_down.weight"][0] == "Q5_0"  # first wins
    assert tt["output.weight"] == ("Q6_K", "output", False)  # no pattern: the mix's rule
    tied = predicted(ALL["qwen3_lex_bf16"], "MOSTLY_Q4_K_M", output_tensor_type="IQ4_NL")
    assert tied["token_embd.weight"][:2] == ("IQ4_NL", "tied token_embd (output rule): --output-tensor-type")
    left = predicted(m, "MOSTLY_Q4_K_M", quantize_output_tensor=False)
    assert left["output.weight"] == ("F16", "--leave-output-tensor", False)
    ple = predicted(ALL["llama16_ple"], "MOSTLY_Q4_K_M", **FLAGS["per_layer_named"])
    assert ple["per_layer_token_embd.weight"][0] == "Q8_0" and ple["token_embd.weight"][0] == "Q4_K"
    f16 = predicted(m, "MOSTLY_F16", tensor_types=[("attn", "Q8_0")], output_tensor_type="Q8_0")
    assert f16["blk.0.attn_q.weight"][0] == "F16" and f16["output.weight"][0] == "Q8_0"  # patterns: quantized only
    assert unused_tensor_types([("attn", "Q8_0"), ("nothing", "Q4_0")],
                               llm_types("MOSTLY_Q4_K_M", [("blk.0.attn_q.weight", (256, 256), "F16")],
                                         arch="llama", n_layer=1, n_head=8, n_head_kv=8,
                                         tensor_types=[("attn", "Q8_0"), ("nothing", "Q4_0")])) == \
        ["--tensor-type nothing=Q4_0"]


def test_the_imatrix_rules_are_reached():
    m = ALL["llama10_tied_f32"]
    assert predicted(m, "MOSTLY_IQ3_XXS", imatrix_of(m))["blk.0.attn_v.weight"][0] == "IQ3_XXS"
    q4 = predicted(ALL["llama16_ple"], "MOSTLY_Q4_0", imatrix_of(ALL["llama16_ple"]))
    assert [q4[f"blk.{i}.ffn_down.weight"][0] for i in range(3)] == ["Q4_1", "Q4_1", "Q4_0"]
    low = predicted(ALL["moe16_shexp"], "MOSTLY_IQ2_XXS", imatrix_of(ALL["moe16_shexp"]))
    down = [low[f"blk.{i}.{n}.weight"][0] for i in range(2) for n in ("ffn_down_exps", "ffn_down_shexp")]
    assert down == ["Q2_K", "Q2_K", "IQ2_XXS", "IQ2_XXS"]  # the first n_layer/8 = 2 ffn_down *tensors*
    assert predicted(ALL["moe4_gqa1"], "MOSTLY_IQ1_S", imatrix_of(ALL["moe4_gqa1"]))["blk.0.attn_v.weight"][0] == \
        "Q4_K"  # n_expert >= 4
    mx = predicted(ALL["moe8"], "MOSTLY_MXFP4_MOE")
    assert mx["blk.0.ffn_up_exps.weight"][0] == "MXFP4" and mx["blk.0.attn_q.weight"][0] == "Q8_0"


def test_iq3_xxs_rules_without_an_imatrix(source, tmp_path):
    """IQ3_XXS has rules for a run without an importance matrix (attn_v IQ3_S, ffn_down Q4_K/Q3_K); they are
    reached where --tensor-type takes every tensor IQ3_XXS would need one for."""
    want = check(source, tmp_path, "llama16_ple", "MOSTLY_IQ3_XXS",
                 tensor_types=[("attn_[qk]|attn_output|ffn_(up|gate)", "Q4_K")])
    assert want["blk.0.attn_v.weight"][0] == "IQ3_S"
    assert [want[f"blk.{i}.ffn_down.weight"][0] for i in (0, 1, 2)] == ["Q4_K", "Q4_K", "Q3_K"]


@pytest.mark.parametrize("ftype", ["MOSTLY_IQ2_XXS", "MOSTLY_IQ1_M", "MOSTLY_Q2_K_S", "MOSTLY_IQ3_XS"])
def test_an_imatrix_missing_tensors(source, tmp_path, ftype):
    """Entries left out: quantized without an importance where the type allows it, refused (naming the tensor, as
    llama.cpp does) where it requires one."""
    m = ALL["llama8"]
    im = imatrix_of(m, drop=("blk.0.attn_output.weight", "blk.5.ffn_up.weight", "output.weight"))
    check(source, tmp_path, "llama8", ftype, im, real=True)


def test_an_imatrix_missing_tensors_is_refused_where_the_type_needs_it():
    m = ALL["llama8"]
    with pytest.raises(CkptError, match=r"no entry for tensor blk\.5\.ffn_up\.weight, which would be IQ2_XXS"):
        predicted(m, "MOSTLY_IQ2_XXS", imatrix_of(m, drop=("blk.5.ffn_up.weight",)))
    assert predicted(m, "MOSTLY_Q4_K_M", imatrix_of(m, drop=("blk.5.ffn_up.weight",))) == \
        predicted(m, "MOSTLY_Q4_K_M", imatrix_of(m))
    # no entry left (after --include/--exclude-weights): llama-quantize passes no imatrix at all
    assert predicted(m, "MOSTLY_IQ4_XS", {}) == predicted(m, "MOSTLY_IQ4_XS")


@pytest.mark.parametrize("ftype, culprit", [("MOSTLY_IQ2_XXS", "blk.0.attn_k.weight"),
                                            ("MOSTLY_IQ1_S", "blk.0.attn_k.weight"),
                                            ("MOSTLY_Q2_K_S", "blk.0.attn_k.weight"),
                                            ("MOSTLY_IQ3_XS", "blk.0.attn_k.weight")])
def test_file_types_that_need_an_imatrix_are_refused_without_one(ftype, culprit):
    """llama-quantize's "this quantization requires an imatrix", naming the first tensor in its order (checked
    against llama.cpp in the matrix above), as one line that says --imatrix."""
    with pytest.raises(CkptError) as e:
        predicted(ALL["llama8"], ftype)
    msg = str(e.value)
    assert "\n" not in msg and culprit in msg and "--imatrix" in msg and ftype.replace("MOSTLY_", "") in msg


def test_q1_0_without_a_fallback_is_refused():
    with pytest.raises(CkptError, match=r"rows of 320 values, not whole Q1_0 blocks of 128.*no fallback"):
        predicted(ALL["llama10_tied_f32"], "MOSTLY_Q1_0")


@pytest.mark.parametrize("name, flags, problem, assertion", [
    ("llama8", dict(token_embedding_type="IQ2_XXS"), r"tensor token_embd\.weight would be IQ2_XXS.*--imatrix",
     "GGML_ASSERT(imatrix != NULL) failed"),
    ("llama8", dict(output_tensor_type="IQ1_S"), r"tensor output\.weight would be IQ1_S.*--imatrix",
     "GGML_ASSERT(imatrix != NULL) failed"),
    ("qwen2_odd_rows", dict(token_embedding_type="Q4_K"), r"--token-embedding-type Q4_K: tensor token_embd\.weight "
     r"has rows of 288 values, not whole Q4_K blocks of 256", "tensor row size not divisible by block size"),
])
def test_where_llama_cpp_aborts(source, tmp_path, name, flags, problem, assertion):
    """token_embd and output are exempt from llama-quantize's imatrix check, but ggml's IQ2_XXS/IQ2_XS/IQ1_S
    quantizers assert an importance; and the two type flags skip the row-length fallback: llama.cpp aborts (the
    process dies; run here in a subprocess), ckpt refuses in one line."""
    m = ALL[name]
    with pytest.raises(CkptError, match=problem) as e:
        predicted(m, "MOSTLY_Q4_K_M", **flags)
    assert "\n" not in str(e.value)
    llama_ref.llama_cpp()
    code = (f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r})\n"
            "from helpers import llama_ref\n"
            f"llama_ref.quantize_gguf_result({str(source(name))!r}, {str(tmp_path / 'x.gguf')!r}, "
            f"'MOSTLY_Q4_K_M', nthread=1, **{flags!r})\n")  # one thread: two asserting threads deadlock ggml_abort
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode != 0 and assertion in r.stderr, r.stderr[-1000:]


# --tensor-type patterns: llama.cpp's std::regex (ECMAScript, libstdc++) against ckpt's translation
PATTERNS = ["attn_v", "attn_(q|k)", r"attn_q\b", r"^blk\.1\.", "ffn_(up|gate)$", r"\d+\.attn", "[.]", "x|", "()",
            r"(a)\1", r"\_", r"\-", "[a-]", r"\x41", r"\x61", r"\u0061", r"\ca", r"\cb", r"\c1", r"\c", r"\0",
            "a}", "a]", "[]a]", "[^]", r"\a",
            r"\z", r"\k", r"\e", r"\q", "[[:digit:]]", r"blk\.[[:digit:]]\.attn_q", "[^[:alpha:].]", "(?:attn)_q",
            "(?=blk)b", "(?!blk)", "ffn_.*?_w", "t{2}", "l{1,}k", "b?l+k*", "per_layer", "^output", "embd",
            "blk{", "a{,2}", "a{2,1}", "(?i)attn", "(?<=blk)", "\\", "(", r"\1", "*a", "+", "?", r"[\d-z]", "[z-a]",
            "[[:nope:]]"]
STRICTER = {"attn_q*+", "a**", "a{1}{2}"}  # stacked repeats: llama.cpp's libstdc++ takes them, ckpt refuses


@pytest.mark.parametrize("pattern", PATTERNS + sorted(STRICTER))
def test_tensor_type_patterns_match_what_llama_cpp_matches(source, tmp_path, pattern):
    """The library takes the pattern as llama-quantize hands it over (patterns with '=' cannot come from its command
    line: the first '=' ends them; lookaheads are tested here all the same)."""
    llama_ref.llama_cpp()
    m = ALL["llama16_ple"]
    rc, log = llama_ref.quantize_gguf_result(source("llama16_ple"), tmp_path / "x.gguf", "MOSTLY_Q4_K_M",
                                             tensor_types=[(pattern, "Q8_0")], dry_run=True)
    try:
        types = predicted(m, "MOSTLY_Q4_K_M", tensor_types=[(pattern, "Q8_0")])
    except CkptError as e:
        assert rc != 0 or pattern in STRICTER, f"llama.cpp takes {pattern!r}, ckpt refuses it: {e}"
        assert "\n" not in str(e) and "--tensor-type" in str(e)
        return
    assert rc == 0, f"llama.cpp refuses {pattern!r}: {log.strip().splitlines()[-1]}"
    got = {n for n, ty in llama_ref.logged_types(log).items() if ty == "Q8_0"}
    assert got == {n for n, (ty, why, _) in types.items() if why.startswith("--tensor-type")}
    if "=" not in pattern:
        assert parse_tensor_type(f"{pattern}=q8_0") == (pattern, "Q8_0")


@pytest.mark.parametrize("text, problem", [
    ("attn_v", "malformed, expected PATTERN=TYPE"), ("=q8_0", "missing tensor name pattern"),
    ("attn_v=", "missing quantization type"), ("attn_v=q9_9", "unknown GGML type"),
    ("attn_v= q8_0", "unknown GGML type"), ("attn_v=i32", "cannot quantize a tensor to I32"),
    ("attn_v=q8_K", "cannot quantize a tensor to Q8_K"), ("blk{=q8_0", "not a regular expression"),
    ("(?i)attn=q8_0", "not a regular expression"), ("x" * 300 + "=nope", "unknown GGML type"),
])
def test_tensor_type_refusals(text, problem):
    """tools/quantize/quantize.cpp's parse_tensor_type / parse_ggml_type refusals (and the types ggml_quantize_chunk
    has no case for, where llama-quantize would abort), one short line each."""
    with pytest.raises(CkptError, match=re.escape(problem)) as e:
        parse_tensor_type(text)
    assert "\n" not in str(e.value) and len(str(e.value)) < 400


def test_tensor_type_lowercases_the_pattern_and_takes_any_case_of_the_type():
    assert parse_tensor_type("BLK\\.0\\.ATTN_V=Q8_0") == ("blk\\.0\\.attn_v", "Q8_0")
    assert parse_tensor_type("Attn_K=iQ4_xS") == ("attn_k", "IQ4_XS")
    with pytest.raises(CkptError, match="unknown GGML type"):
        parse_tensor_type("a=b=q8_0")  # the first '=' splits, as strchr does


# --- the mix registry against llama-quantize's own list ---------------------------------------------------------


def quant_options() -> dict[str, str]:
    """tools/quantize/quantize.cpp's QUANT_OPTIONS: name -> llama_ftype (COPY left out)."""
    from helpers import ggml_ref

    try:
        text = (ggml_ref.llama_cpp_tree() / "tools" / "quantize" / "quantize.cpp").read_text()
    except ggml_ref.Unavailable as e:
        pytest.skip(str(e))
    opts = dict(re.findall(r'\{\s*"(\w+)",\s*LLAMA_FTYPE_(\w+),', text))
    opts.pop("COPY")
    return opts


def test_every_llama_quantize_type_is_a_gguf_target():
    import llama_cpp

    opts = quant_options()
    names = {m.name.upper(): m.ftype for m in MIXES} | {a.upper(): mix(a).ftype for a in ALIASES}
    assert names == opts
    for m in MIXES:
        assert m.file_type == FILE_TYPE[m.ftype] == getattr(llama_cpp, f"LLAMA_FTYPE_{m.ftype}")


@pytest.mark.parametrize("m", [m for m in MIXES if m.quantized], ids=lambda m: m.name)
def test_each_mix_starts_from_llama_cpps_default_type(source, tmp_path, m):
    """llama_ftype_get_default_type: --pure gives every 256-wide quantizable matrix the mix's default type."""
    llama_ref.llama_cpp()
    log = llama_ref.quantize_gguf(source("small"), tmp_path / "x.gguf", m.ftype, pure=True, dry_run=True)
    assert llama_ref.logged_types(log)["blk.0.attn_q.weight"] == m.default


def test_image_models_take_no_iq_mix_nor_the_newer_types():
    """ComfyUI-GGUF's lcpp.patch refuses every IQ file type for image models; ckpt also refuses MXFP4_MOE, Q1_0 and
    Q2_0, which its patched llama.cpp does not have."""
    assert {m.name for m in MIXES if not m.image} == \
        {m.name for m in MIXES if m.name.startswith("iq")} | {"mxfp4_moe", "q1_0", "q2_0"}


def test_image_mix_takes_the_flags_as_llama_quantize_does():
    """The same first-pattern-wins override as llm_types (checked against llama.cpp above), --pure, the fallback,
    the imatrix rule, and the flags that apply to no image tensor listed."""
    names = ["double_blocks.0.img_attn.qkv.weight", "double_blocks.0.img_mlp.0.weight",
             "double_blocks.0.img_mlp.2.weight", "single_blocks.0.linear1.weight", "single_blocks.0.linear2.weight"]
    tt = [("img_mlp\\.[02]", "Q8_0"), ("mlp", "Q5_0"), ("single", "Q4_K"), ("nothing", "Q6_K")]
    img = ImageMix(mix("q4_k_m"), names=names, tensor_types=tt, output_tensor_type="Q8_0")
    llm = llm_types("MOSTLY_Q4_K_M", [(n, (256, 256), "F16") for n in names], arch="llama", n_layer=1, n_head=8,
                    n_head_kv=8, tensor_types=tt)
    for n, (t, why, _) in zip(names, llm):
        got = img.type_of(n, 256)
        if why.startswith("--tensor-type"):
            assert got == (t, why, None)
        else:
            assert not got[1].startswith("--tensor-type")  # the image bumps instead
    assert img.type_of("single_blocks.0.linear2.weight", 300) == \
        ("F16", "Q4_K fallback: rows of 300 are not a multiple of 256", "Q4_K")
    assert img.unused() == ["--tensor-type mlp=Q5_0", "--tensor-type nothing=Q6_K", "--output-tensor-type"]
    assert ImageMix(mix("q4_k_m"), pure=True, names=names).type_of(names[0], 256)[0] == "Q4_K"
    assert not img.leaves("output.weight") and ImageMix(mix("q8_0"), quantize_output_tensor=False).leaves(
        "output.weight")
    with pytest.raises(CkptError, match="Q2_K_S needs an importance matrix.*--imatrix"):
        ImageMix(mix("q2_k_s"), names=names).type_of(names[1], 256)
    assert ImageMix(mix("q2_k_s"), names=names, has_imatrix=True).type_of(names[1], 256)[0] == "Q2_K"
    with pytest.raises(CkptError, match="IQ2_XXS"):
        ImageMix(mix("q8_0"), tensor_types=[("mlp", "IQ2_XXS")]).type_of(names[1], 256)
