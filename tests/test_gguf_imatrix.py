"""`--imatrix FILE` on GGUF outputs against llama.cpp itself: `convert_hf_to_gguf.py --outtype bf16` then
`llama-quantize --imatrix FILE <MIX>` (llama-cpp-python 0.3.36's `llama_model_quantize`, handed the importances
and the `quantize.imatrix.*` key-values exactly as llama-quantize's main() hands them, `tests/helpers/llama_ref.py`;
the importances are what llama.cpp's own loader reads from the file, `tests/test_imatrix_read.py` proves that) is
the oracle: same tensors, types, bytes and key-values, ckpt's provenance keys aside. The same statistics as a
GGUF imatrix and as a legacy `.dat` give the same file; a 3-D expert tensor takes one importance row per expert;
an imatrix that misses tensors quantizes those without one (and says so); bad input is refused in one line."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from helpers import imatrix_files
from helpers.hf_llm import model_folder, read_gguf, reference
from helpers.refusals import assert_refused

CKPT_ONLY = {"ckpt.version", "ckpt.operation"}


def _stats_for(ref_gguf, seed: int = 0, drop=()) -> imatrix_files.Stats:
    """Random llama-imatrix statistics for every matrix of a GGUF (n_mat = experts of a 3-D tensor)."""
    shapes = {}
    for t in gguf.GGUFReader(str(ref_gguf)).tensors:
        ne = [int(d) for d in t.shape]  # ggml order: ne0 first
        if len(ne) >= 2 and t.name.endswith(".weight") and not any(d in t.name for d in drop):
            shapes[t.name] = (ne[2] if len(ne) >= 3 else 1, ne[0])
    return imatrix_files.random_stats(shapes, seed=seed, zero_experts=True)


def _llama_quantize(src, dst, ftype, stats, imatrix_path, **kw):
    from helpers import llama_ref

    imatrix = {n: imatrix_files.expected_importance(stats, n).reshape(-1) for n in stats.entries}
    kv = {"quantize.imatrix.file": str(imatrix_path)[:127]}
    if stats.datasets:
        kv["quantize.imatrix.dataset"] = stats.datasets[0]
    kv["quantize.imatrix.entries_count"] = len(imatrix)
    if stats.chunk_count > 0:
        kv["quantize.imatrix.chunks_count"] = stats.chunk_count
    return llama_ref.quantize_gguf(src, dst, ftype, imatrix=imatrix, kv_overrides=kv, **kw)


def _same_file(ours_path, theirs_path, skip_keys=()):
    ours, ours_t = read_gguf(ours_path)
    theirs, theirs_t = read_gguf(theirs_path)
    assert [x[:3] for x in ours_t] == [x[:3] for x in theirs_t]
    for a, b in zip(ours_t, theirs_t):
        assert a[3] == b[3], (a[0], a[1])
    assert [k for k in ours if k not in CKPT_ONLY] == list(theirs)
    for k in theirs:
        if k not in skip_keys:
            assert ours[k] == theirs[k], (k, str(ours[k])[:200], str(theirs[k])[:200])


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """bf16 HF folders (the two-step route rounds nothing then) and their bf16 reference GGUFs."""
    pytest.importorskip("transformers")
    root = tmp_path_factory.mktemp("imatrix")
    out = {}
    for name, kind in (("llama", "llama"), ("mixtral", "mixtral")):
        folder = model_folder(root / name, kind, tokenizer="spm", dtype=torch.bfloat16)
        reference(folder, {"bf16": root / f"{name}-BF16.gguf"})
        out[name] = (folder, root / f"{name}-BF16.gguf")
    return out


@pytest.mark.slow
@pytest.mark.parametrize("name,mix", [("llama", "q4_k_m"), ("llama", "q2_k"), ("llama", "q3_k_s"), ("llama", "q5_k_m"),
                                      ("llama", "q6_k"), ("llama", "iq4_xs"), ("llama", "q4_0"), ("llama", "q5_1"),
                                      ("mixtral", "q4_k_m"), ("mixtral", "q4_1"),
                                      # the types that exist only with an imatrix, and the rest of llama-quantize's
                                      ("llama", "iq2_xxs"), ("llama", "iq2_xs"), ("llama", "iq2_s"), ("llama", "iq2_m"),
                                      ("llama", "iq1_s"), ("llama", "iq1_m"), ("llama", "iq3_xxs"), ("llama", "iq3_xs"),
                                      ("llama", "iq3_s"), ("llama", "iq3_m"), ("llama", "q2_k_s"), ("llama", "tq1_0"),
                                      ("llama", "tq2_0"), ("llama", "q1_0"), ("llama", "q2_0"), ("llama", "iq4_nl"),
                                      ("mixtral", "mxfp4_moe"), ("mixtral", "iq2_xxs")])
def test_imatrix_mix_is_llama_quantize(name, mix, models, run_ckpt, tmp_path):
    from helpers import llama_ref

    from ckpt.targets.planners.gguf_mixes import mix as mix_of

    llama_ref.llama_cpp()
    folder, ref_bf16 = models[name]
    stats = _stats_for(ref_bf16)
    im = imatrix_files.write_gguf(tmp_path / "imatrix.gguf", stats)
    _llama_quantize(ref_bf16, tmp_path / "ref.gguf", mix_of(mix).ftype, stats, im)
    code, _, err = run_ckpt("convert", folder, "--to", f"gguf-{mix}", "--imatrix", im, "-o", tmp_path / "ckpt.gguf",
                            "-q")
    assert code == 0, err
    _same_file(tmp_path / "ckpt.gguf", tmp_path / "ref.gguf")


@pytest.mark.slow
def test_dat_and_gguf_imatrix_give_the_same_file(models, run_ckpt, tmp_path):
    """The same statistics in both formats: the same tensors and bytes (only quantize.imatrix.file differs), and the
    .dat's key-values as llama-quantize writes them from a .dat."""
    folder, ref_bf16 = models["mixtral"]
    stats = _stats_for(ref_bf16, seed=3)
    outs = {}
    for fmt, write in (("gguf", imatrix_files.write_gguf), ("dat", imatrix_files.write_dat)):
        im = write(tmp_path / f"imatrix.{fmt}", stats)
        code, _, err = run_ckpt("convert", folder, "--to", "gguf-q3_k_m", "--imatrix", im,
                                "-o", tmp_path / f"{fmt}.gguf", "-q")
        assert code == 0, err
        outs[fmt] = read_gguf(tmp_path / f"{fmt}.gguf")
    assert outs["gguf"][1] == outs["dat"][1]
    assert outs["dat"][0]["quantize.imatrix.file"][0] == str(tmp_path / "imatrix.dat")
    assert outs["dat"][0]["quantize.imatrix.entries_count"] == outs["gguf"][0]["quantize.imatrix.entries_count"]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["llama", "mixtral"])
def test_imatrix_missing_tensors_and_gguf_source(name, models, run_ckpt, tmp_path):
    """An imatrix without the second block's tensors: those are quantized without one, as llama-quantize does, and
    the summary says how many; from a llama.cpp BF16 GGUF source (3-D expert tensors stored as such) the same file
    comes out."""
    from helpers import llama_ref

    llama_ref.llama_cpp()
    folder, ref_bf16 = models[name]
    stats = _stats_for(ref_bf16, seed=5, drop=("blk.1.",))
    im = imatrix_files.write_gguf(tmp_path / "partial.gguf", stats)
    _llama_quantize(ref_bf16, tmp_path / "ref.gguf", "MOSTLY_Q4_K_S", stats, im)
    for src in (folder, ref_bf16):
        out = tmp_path / f"ckpt-{src.name}.gguf"
        code, text, err = run_ckpt("convert", src, "--to", "gguf-q4_k_s", "--imatrix", im, "-o", out)
        assert code == 0, err
        assert "have no entry in it and were quantized without one (e.g. 'blk.1." in text + err
        _same_file(out, tmp_path / "ref.gguf", skip_keys=CKPT_ONLY)


def test_bad_imatrix_refused(models, run_ckpt, tmp_path):
    """A damaged file, an imatrix of another model (no entry names a tensor), an entry of the wrong size: one line
    naming the file, nothing written."""
    folder, ref_bf16 = models["llama"]
    bad = tmp_path / "bad.gguf"
    problem = imatrix_files.write_bad(bad, "gguf_counts_missing")
    assert_refused(run_ckpt, tmp_path, ("convert", folder, "--to", "gguf-q4_k_m", "--imatrix", bad,
                                        "-o", tmp_path / "o.gguf"), str(bad), problem)
    dat = tmp_path / "bad.dat"
    problem = imatrix_files.write_bad(dat, "dat_truncated")
    assert_refused(run_ckpt, tmp_path, ("convert", folder, "--to", "gguf-q4_k_m", "--imatrix", dat,
                                        "-o", tmp_path / "o.gguf"), str(dat), problem)
    other = imatrix_files.write_gguf(tmp_path / "other.gguf", imatrix_files.random_stats(
        {"model.diffusion.w": (1, 256)}))
    assert_refused(run_ckpt, tmp_path, ("convert", folder, "--to", "gguf-q4_k_m", "--imatrix", other,
                                        "-o", tmp_path / "o.gguf"), str(other), "an imatrix of another model?")
    wrong = imatrix_files.write_gguf(tmp_path / "wrong.gguf", imatrix_files.random_stats(
        {"blk.0.attn_q.weight": (1, 128)}))
    assert_refused(run_ckpt, tmp_path, ("convert", folder, "--to", "gguf-q4_k_m", "--imatrix", wrong,
                                        "-o", tmp_path / "o.gguf"), str(wrong),
                   "imatrix size 128 is different from tensor size 256 for blk.0.attn_q.weight")
    assert_refused(run_ckpt, tmp_path, ("convert", folder, "--to", "gguf-q4_k_m", "--imatrix", tmp_path / "nope.gguf",
                                        "-o", tmp_path / "o.gguf"), str(tmp_path / "nope.gguf"), "")


def test_image_model_imatrix_is_ggml_with_the_importance(run_ckpt, tmp_path):
    """A diffusion model (ComfyUI-GGUF's mix) with an imatrix for its block matrices: every quantized tensor's bytes
    are ggml's quantize_<type>(rows, importance) of the source's values; the metadata carries the imatrix keys."""
    from helpers import ggml_ref
    from safetensors.torch import save_file

    from families_util import wan_original_layout

    diffusers = pytest.importorskip("diffusers")
    try:
        ggml_ref.library()
    except ggml_ref.Unavailable as e:
        pytest.skip(str(e))
    torch.manual_seed(0)
    m = diffusers.WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=128,
                                        in_channels=4, out_channels=4, text_dim=16, freq_dim=8, ffn_dim=512,
                                        num_layers=2)
    sd = {k: v.to(torch.bfloat16) for k, v in wan_original_layout(m).items()}
    save_file(sd, tmp_path / "wan.safetensors")
    shapes = {k: (1, v.shape[-1]) for k, v in sd.items() if k.startswith("blocks.0.") and v.dim() == 2}
    stats = imatrix_files.random_stats(shapes, seed=9)
    im = imatrix_files.write_gguf(tmp_path / "imatrix.gguf", stats)
    out = tmp_path / "wan-Q4_K_M.gguf"
    code, _, err = run_ckpt("convert", tmp_path / "wan.safetensors", "--to", "gguf-q4_k_m", "--imatrix", im,
                            "-o", out, "-q")
    assert code == 0, err
    r = gguf.GGUFReader(str(out))
    checked = 0
    for t in r.tensors:
        if t.tensor_type in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16,
                             gguf.GGMLQuantizationType.BF16):
            continue
        rows = sd[t.name].float().reshape(-1, int(t.shape[0])).numpy()
        qw = imatrix_files.expected_importance(stats, t.name)[0] if t.name in stats.entries else None
        want = ggml_ref.quantize(ggml_ref.ref_name(t.tensor_type.name), rows, imatrix=qw)
        assert bytes(t.data.tobytes()) == want, t.name
        checked += qw is not None
    assert checked >= 4
    meta = read_gguf(out)[0]
    assert meta["quantize.imatrix.file"][0] == str(im)
    assert meta["quantize.imatrix.entries_count"][0] == len(shapes)


@pytest.mark.slow
@pytest.mark.parametrize("name,mix", [("llama", "iq3_s"), ("llama", "iq3_m"), ("llama", "tq1_0"),
                                      ("llama", "tq2_0"), ("llama", "q1_0"), ("llama", "q2_0"),
                                      ("mixtral", "mxfp4_moe")])
def test_new_mixes_without_imatrix_are_llama_quantize(name, mix, models, run_ckpt, tmp_path):
    """The file types added with the imatrix work, where llama-quantize makes them without one: the same file."""
    from helpers import llama_ref

    from ckpt.targets.planners.gguf_mixes import mix as mix_of

    llama_ref.llama_cpp()
    folder, ref_bf16 = models[name]
    llama_ref.quantize_gguf(ref_bf16, tmp_path / "ref.gguf", mix_of(mix).ftype)
    code, _, err = run_ckpt("convert", folder, "--to", f"gguf-{mix}", "-o", tmp_path / "ckpt.gguf", "-q")
    assert code == 0, err
    _same_file(tmp_path / "ckpt.gguf", tmp_path / "ref.gguf")


@pytest.mark.parametrize("mix", ["iq2_xxs", "iq2_xs", "iq2_s", "iq2_m", "iq1_s", "iq1_m", "iq3_xxs", "iq3_xs", "q2_k_s"])
def test_imatrix_only_types_refused_without_one(mix, models, run_ckpt, tmp_path):
    """What llama-quantize refuses without an imatrix ("this quantization requires an imatrix!": a type of the mix
    that needs one, IQ1/IQ2, reached by some tensor), in one line, nothing written."""
    from helpers import llama_ref

    from ckpt.targets.planners.gguf_mixes import mix as mix_of

    folder, ref_bf16 = models["llama"]
    llama_ref.llama_cpp()
    rc, log = llama_ref.quantize_gguf_result(ref_bf16, tmp_path / "ref.gguf", mix_of(mix).ftype)
    assert rc != 0 and "requires an imatrix" in log
    (tmp_path / "ref.gguf").unlink(missing_ok=True)
    assert_refused(run_ckpt, tmp_path, ("convert", folder, "--to", f"gguf-{mix}", "-o", tmp_path / "o.gguf"),
                   "", "--imatrix")


@pytest.mark.slow
def test_merge_lora_and_merge_take_the_imatrix(models, run_ckpt, tmp_path):
    """`merge-lora --to gguf-<mix> --imatrix` is the merged model (PEFT LoRA, fp32) converted with the same imatrix
    (the one output side); `merge --to gguf-<mix> --imatrix` likewise."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    folder = model_folder(tmp_path / "f32", "llama", tokenizer="spm", dtype=torch.float32)
    ref_bf16 = models["llama"][1]
    stats = _stats_for(ref_bf16, seed=11)
    im = imatrix_files.write_gguf(tmp_path / "imatrix.gguf", stats)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    torch.manual_seed(2)
    peft = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "down_proj"],
                                            init_lora_weights=False))
    peft.save_pretrained(tmp_path / "lora")
    code, _, err = run_ckpt("merge-lora", folder, tmp_path / "lora", "--to", "fp32", "-o", tmp_path / "m-lora", "-q")
    assert code == 0, err
    for i, args in enumerate((("merge-lora", folder, tmp_path / "lora"),
                              ("merge", folder, tmp_path / "m-lora", "--alpha", "0.5"))):
        code, _, err = run_ckpt(*args, "--to", "fp32", "-o", tmp_path / f"merged{i}", "-q")
        assert code == 0, err
        code, _, err = run_ckpt("convert", tmp_path / f"merged{i}", "--to", "gguf-q4_k_m", "--imatrix", im,
                                "-o", tmp_path / f"two{i}.gguf", "-q")
        assert code == 0, err
        code, _, err = run_ckpt(*args, "--to", "gguf-q4_k_m", "--imatrix", im, "-o", tmp_path / f"one{i}.gguf", "-q")
        assert code == 0, err
        assert read_gguf(tmp_path / f"one{i}.gguf")[1] == read_gguf(tmp_path / f"two{i}.gguf")[1]


def test_the_imatrix_is_read_once_per_run(models, run_ckpt, tmp_path, monkeypatch):
    """The target checks the flags before the input is read and plans with them after: the file (whose every kept
    entry is read and checked on load) is loaded once."""
    import ckpt.io.imatrix as imatrix_io

    folder, ref_bf16 = models["llama"]
    im = imatrix_files.write_gguf(tmp_path / "imatrix.gguf", _stats_for(ref_bf16, seed=13))
    calls = []
    real = imatrix_io.load_imatrix
    monkeypatch.setattr(imatrix_io, "load_imatrix", lambda *a, **k: calls.append(a) or real(*a, **k))
    code, _, err = run_ckpt("convert", folder, "--to", "gguf-q4_k_m", "--imatrix", im, "-o", tmp_path / "o.gguf", "-q")
    assert code == 0, err
    assert len(calls) == 1
