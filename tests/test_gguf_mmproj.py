"""`ckpt convert ./my-vlm --to gguf-f16 --mmproj`: a vision-language model folder's vision tower and projector as the
mmproj GGUF llama.cpp's multimodal tools load (`ckpt.targets.planners.gguf_mmproj_out`, `ckpt.families.llm.vision`),
held to llama.cpp's own converter.

Oracles: llama.cpp's `convert_hf_to_gguf.py --mmproj` (llama-cpp-python 0.3.36's vendored tree, run in one subprocess
with its own gguf-py for every folder and outtype), and llama.cpp itself (libmtmd, built into llama-cpp-python)
loading ckpt's projector beside the reference's text GGUF and encoding an image.

The models are tiny random ones built here with transformers 5.24 (every weight random, so no zero-initialized
projection hides a swapped tensor) and saved as the hub checkpoints are: Gemma 3's SigLIP tower under
`vision_tower.vision_model.` (transformers 5 saves it without `vision_model.`, a layout llama.cpp's converter cannot
map), Qwen2-VL / Qwen2.5-VL under `visual.`, Qwen3-VL under `model.visual.`, Mistral 3 and Pixtral-in-Llava under
`vision_tower.` / `multi_modal_projector.`. Layer counts are at least what gguf's MMPROJ name table needs for the
projectors' numbered parts (`visual.merger.mlp.2`, `multi_modal_projector.linear_2`: the table is built for the vision
layer count, so the reference fails on fewer layers, and so does ckpt).
"""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from helpers.hf_llm import bpe_hash, bpe_tokenizer, read_gguf, spm_tokenizer
from helpers.refusals import assert_refused

CKPT_ONLY = {"ckpt.version", "ckpt.operation"}
# The one tensor ckpt writes that the reference drops (ckpt/families/llm/vision/llava.py: its MmprojModel filter leaves
# out the language model's embedding before LlavaVisionModel extracts the row, and llama.cpp requires the tensor)
IMG_BREAK = "v.token_embd.img_break"
PIXTRAL = ("mistral3", "llava")  # the builder kinds of LlavaVisionModel
# name -> (builder kind, source dtype, outtypes compared with the reference, text GGUF for the llama.cpp check)
MODELS = {
    "gemma3": ("gemma3", torch.bfloat16, ("f16", "bf16", "f32", "q8_0"), True),
    "qwen2_5_vl": ("qwen2_5_vl", torch.float32, ("f16", "q8_0", "bf16"), True),
    "qwen2_vl": ("qwen2_vl", torch.float16, ("f16",), False),
    "qwen3_vl": ("qwen3_vl", torch.float32, ("f16", "f32"), True),
    "qwen3_vl_moe": ("qwen3_vl_moe", torch.bfloat16, ("f16",), False),
    "qwen3_5": ("qwen3_5", torch.float32, ("f16",), False),
    "qwen3_5_moe": ("qwen3_5_moe", torch.bfloat16, ("bf16",), False),
    "mistral3": ("mistral3", torch.bfloat16, ("f16", "bf16"), True),
    "llava_pixtral": ("llava", torch.float32, ("q8_0", "f16"), False),
}
TEXT = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
            head_dim=64, max_position_embeddings=512)


def _qwen3_vision():
    import transformers as T

    moe = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64)
    return {"qwen3_vl_moe": (T.Qwen3VLMoeConfig, T.Qwen3VLMoeForConditionalGeneration, moe),
            "qwen3_5": (T.Qwen3_5Config, T.Qwen3_5ForConditionalGeneration, dict(num_hidden_layers=4)),
            "qwen3_5_moe": (T.Qwen3_5MoeConfig, T.Qwen3_5MoeForConditionalGeneration,
                            dict(moe, num_hidden_layers=4, shared_expert_intermediate_size=64))}


def _randomize(model) -> None:
    """Every weight random (transformers zero-initializes some projections), norms around 1."""
    torch.manual_seed(1)
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(torch.randn(p.shape) * 0.05)
            if "norm" in n and n.endswith("weight"):
                p.add_(1.0)


def _hub_layout_gemma3(folder) -> None:
    """Gemma 3's tower saved under `vision_tower.vision_model.` as google's checkpoints are."""
    from safetensors.torch import load_file, save_file

    sd = load_file(folder / "model.safetensors")
    sd = {("vision_tower.vision_model." + k[len("vision_tower."):] if k.startswith("vision_tower.") else k): v
          for k, v in sd.items()}
    save_file(sd, folder / "model.safetensors", metadata={"format": "pt"})


def _pixtral_tokenizer(folder) -> int:
    """A BPE tokenizer with Pixtral's image tokens ([IMG_BREAK] is looked up by the converter)."""
    from transformers import AutoTokenizer

    bpe_tokenizer(folder)
    tok = AutoTokenizer.from_pretrained(folder)
    tok.add_special_tokens({"additional_special_tokens": ["[IMG]", "[IMG_BREAK]", "[IMG_END]"]})
    tok.save_pretrained(folder)
    return len(tok)


def vlm_folder(folder, kind: str, dtype, hub: bool = True) -> None:
    """A tiny random `kind` VLM folder with a tokenizer and an image processor config, as the hub ships them (`hub`
    False: Gemma 3 as transformers 5 saves it)."""
    import transformers as T

    QWEN3_VISION = _qwen3_vision()
    folder.mkdir(parents=True, exist_ok=True)
    pixtral = dict(model_type="pixtral", hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                   num_attention_heads=2, head_dim=32, image_size=64, patch_size=8)
    if kind == "gemma3":
        n = spm_tokenizer(folder)
        cfg = T.Gemma3Config(text_config=dict(TEXT, vocab_size=n, pad_token_id=0, bos_token_id=1, eos_token_id=2),
                             vision_config=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                                num_attention_heads=2, image_size=64, patch_size=8,
                                                vision_use_head=False),
                             mm_tokens_per_image=16)
        model = T.Gemma3ForConditionalGeneration(cfg)
        proc = T.Gemma3ImageProcessorPil(size={"height": 64, "width": 64})
    elif kind in QWEN3_VISION:  # Qwen3-VL's tower (DeepStack where the config says) under a Qwen3 / 3.5 model
        n = bpe_tokenizer(folder)
        cfg_cls, model_cls, text = QWEN3_VISION[kind]
        cfg = cfg_cls(text_config=dict(TEXT, vocab_size=n, bos_token_id=None, eos_token_id=n - 1, **text),
                      vision_config=dict(hidden_size=64, intermediate_size=128, depth=2, num_heads=2,
                                         out_hidden_size=128, num_position_embeddings=16, patch_size=16,
                                         **({"deepstack_visual_indexes": [1]} if "vl" in kind else {})))
        model = model_cls(cfg)
        proc = T.Qwen2VLImageProcessorPil(patch_size=16, min_pixels=64 * 64, max_pixels=128 * 128)
    elif kind in ("qwen2_5_vl", "qwen2_vl", "qwen3_vl"):
        n = bpe_tokenizer(folder)
        text = dict(TEXT, vocab_size=n, bos_token_id=None, eos_token_id=n - 1)
        if kind == "qwen2_5_vl":
            cfg = T.Qwen2_5_VLConfig(text_config=dict(text, rope_scaling={"type": "mrope", "mrope_section": [16, 8, 8]}),
                                     vision_config=dict(hidden_size=64, intermediate_size=128, depth=4, num_heads=2,
                                                        out_hidden_size=128, fullatt_block_indexes=[1, 3],
                                                        window_size=56, patch_size=14, spatial_merge_size=2))
            model = T.Qwen2_5_VLForConditionalGeneration(cfg)
        elif kind == "qwen2_vl":
            cfg = T.Qwen2VLConfig(text_config=dict(text, rope_scaling={"type": "mrope", "mrope_section": [16, 8, 8]}),
                                  vision_config=dict(embed_dim=64, hidden_size=128, depth=3, num_heads=2,
                                                     mlp_ratio=2, patch_size=14, spatial_merge_size=2))
            model = T.Qwen2VLForConditionalGeneration(cfg)
        else:
            cfg = T.Qwen3VLConfig(text_config=dict(text, rope_scaling={"rope_type": "default",
                                                                       "mrope_section": [16, 8, 8]}),
                                  vision_config=dict(hidden_size=64, intermediate_size=128, depth=2, num_heads=2,
                                                     out_hidden_size=128, deepstack_visual_indexes=[0],
                                                     num_position_embeddings=16, patch_size=16))
            model = T.Qwen3VLForConditionalGeneration(cfg)
        proc = T.Qwen2VLImageProcessorPil(patch_size=16 if kind == "qwen3_vl" else 14,
                                          min_pixels=64 * 64, max_pixels=128 * 128)
    elif kind == "mistral3":
        n = _pixtral_tokenizer(folder)
        cfg = T.Mistral3Config(text_config=dict(TEXT, model_type="mistral", vocab_size=n, bos_token_id=None,
                                                eos_token_id=n - 4),
                               vision_config=dict(pixtral, hidden_act="silu"), spatial_merge_size=2)
        model = T.Mistral3ForConditionalGeneration(cfg)
        proc = T.PixtralImageProcessorPil(size={"longest_edge": 64}, patch_size=8)
    else:  # Pixtral-12B's Llava layout, a vision width that is no whole number of Q8_0 blocks
        n = _pixtral_tokenizer(folder)
        cfg = T.LlavaConfig(text_config=dict(TEXT, model_type="mistral", vocab_size=n),
                            vision_config=dict(pixtral, hidden_size=48, intermediate_size=96, head_dim=24,
                                               hidden_act="gelu"))
        model = T.LlavaForConditionalGeneration(cfg)
        proc = T.PixtralImageProcessorPil(size={"longest_edge": 64}, patch_size=8)
    _randomize(model)
    model.to(dtype).save_pretrained(folder)
    proc.save_pretrained(folder)
    if kind == "gemma3":
        if hub:
            _hub_layout_gemma3(folder)
        pre = json.loads((folder / "preprocessor_config.json").read_text())
        pre["image_seq_length"] = 16  # 4x4 tokens from 8x8 patches: llama.cpp's scale factor 2, written
        (folder / "preprocessor_config.json").write_text(json.dumps(pre))


DRIVER = r"""
import runpy, sys
sys.path.insert(0, {tree!r})
sys.path.insert(0, {gguf_py!r})
import conversion.base as base
pres = {pres!r}
orig = base.TextModel.get_vocab_base_pre
def get_vocab_base_pre(self, tokenizer):
    from hashlib import sha256
    chktok = tokenizer.encode({chktxt!r})
    h = sha256(str(chktok).encode()).hexdigest()
    return pres[h] if h in pres else orig(self, tokenizer)
base.TextModel.get_vocab_base_pre = get_vocab_base_pre
import conversion.llava as llava
def let_the_embedding_through(cls, item):  # LlavaVisionModel as its modify_tensors expects to be fed
    if item[0].endswith("embed_tokens.weight"):
        return item
    return super(llava.LlavaVisionModel, cls).filter_tensors(item)
for folder, outtype, outfile, args, fixed in {runs!r}:
    if fixed:
        llava.LlavaVisionModel.filter_tensors = classmethod(let_the_embedding_through)
    elif "filter_tensors" in llava.LlavaVisionModel.__dict__:
        del llava.LlavaVisionModel.filter_tensors
    sys.argv = ["convert_hf_to_gguf.py", folder, "--outtype", outtype, "--outfile", outfile, *args]
    runpy.run_path({script!r}, run_name="__main__")
"""


def reference_runs(runs, pres: dict, scratch) -> None:
    """llama.cpp's convert_hf_to_gguf.py for every (folder, outtype, outfile, extra args, fixed) in one subprocess
    (one import of torch and transformers), the test BPE vocabularies' hashes registered under `pres` names (as
    `helpers.hf_llm.reference` does for one folder). `fixed`: LlavaVisionModel given the language model's
    embedding its modify_tensors extracts the [IMG_BREAK] row from (the reference's MmprojModel.filter_tensors
    drops it first: `ckpt/families/llm/vision/llava.py`), the only change to the reference."""
    from ckpt.targets.planners.gguf_vocab import CHECK_TEXT
    from helpers.ggml_ref import llama_cpp_tree

    tree = llama_cpp_tree()
    driver = scratch / "mmproj-driver.py"
    driver.write_text(DRIVER.format(tree=str(tree), gguf_py=str(tree / "gguf-py"), pres=pres, chktxt=CHECK_TEXT,
                                    script=str(tree / "convert_hf_to_gguf.py"),
                                    runs=[(str(f), t, str(o), list(a), fix) for f, t, o, a, fix in runs]))
    env = {**os.environ, "PYTHONPATH": str(tree / "gguf-py"), "NO_LOCAL_GGUF": "1", "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, str(driver)], capture_output=True, text=True, env=env, cwd=str(tree))
    assert r.returncode == 0, r.stderr[-3000:]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """The folders, and the reference's projector (every outtype compared) and text GGUF (f32) of each."""
    root = tmp_path_factory.mktemp("vlm")
    folders, runs, pres = {}, [], {}
    for name, (kind, dtype, outtypes, text) in MODELS.items():
        f = root / name
        vlm_folder(f, kind, dtype)
        folders[name] = f
        runs += [(f, t, root / f"{name}-ref-mmproj-{t}.gguf", ("--mmproj",), False) for t in outtypes]
        if kind in PIXTRAL:
            runs += [(f, t, root / f"{name}-fixed-mmproj-{t}.gguf", ("--mmproj",), True) for t in outtypes]
        if text:
            runs.append((f, "f32", root / f"{name}-ref-text.gguf", (), False))
            if not (f / "tokenizer.model").exists():
                pres[bpe_hash(f)] = "qwen2"
    reference_runs(runs, pres, root)
    return root, folders


def ckpt_mmproj(run_ckpt, folder, outtype, out):
    code, _, err = run_ckpt("convert", folder, "--to", f"gguf-{outtype}", "--mmproj", "-o", out, "-q")
    assert code == 0, err
    return out


# ---- 1. the reference's file, key for key and byte for byte


def assert_same_file(ours_path, theirs_path, skip_tensor=None, skip_keys=()):
    """Same metadata (keys, value types, values, order) but ckpt's two provenance keys (and `skip_keys`), and the
    same tensors (names, order, types, shapes, bytes) but `skip_tensor`, which is returned (or None)."""
    ours, ours_t = read_gguf(ours_path)
    theirs, theirs_t = read_gguf(theirs_path)
    assert set(ours) - set(theirs) == CKPT_ONLY and set(theirs) <= set(ours), set(ours) ^ set(theirs)
    assert [k for k in ours if k not in CKPT_ONLY] == list(theirs)
    for k in theirs:
        if k not in skip_keys:
            assert ours[k] == theirs[k], (k, str(ours[k])[:200], str(theirs[k])[:200])
    skipped = next((x for x in ours_t if x[0] == skip_tensor), None)
    ours_t = [x for x in ours_t if x[0] != skip_tensor]
    assert [x[:3] for x in ours_t] == [x[:3] for x in theirs_t]
    for a, b in zip(ours_t, theirs_t):
        assert a[3] == b[3], a[0]
    return ours, skipped


@pytest.mark.parametrize("name", list(MODELS))
def test_same_projector_as_convert_hf_to_gguf(name, built, run_ckpt, tmp_path):
    """Every outtype of the reference for this model: the same file but ckpt's two provenance keys. Pixtral
    projectors (Mistral 3, Llava): the reference's file plus `v.token_embd.img_break` (first, the [IMG_BREAK]
    token's embedding row in F32, `general.size_label` counting it), and exactly the file the reference's own
    LlavaVisionModel writes when its embedding is not filtered out before it (`reference_runs`' `fixed`)."""
    root, folders = built
    pixtral = MODELS[name][0] in PIXTRAL
    for t in MODELS[name][2]:
        out = ckpt_mmproj(run_ckpt, folders[name], t, tmp_path / f"ckpt-{t}.gguf")
        meta, row = assert_same_file(out, root / f"{name}-ref-mmproj-{t}.gguf", IMG_BREAK if pixtral else None,
                                     ("general.size_label",) if pixtral else ())
        assert meta["general.architecture"][0] == "clip" and meta["general.type"][0] == "mmproj"
        assert meta["ckpt.operation"][0] == f"convert --to gguf-{t} --mmproj"
        if pixtral:
            _, tensors = read_gguf(out)
            assert tensors[0] == row and row[1] == "F32", row[:3]
            from safetensors.torch import load_file
            from transformers import AutoTokenizer

            embedding = load_file(folders[name] / "model.safetensors")["language_model.model.embed_tokens.weight"]
            token = AutoTokenizer.from_pretrained(folders[name]).convert_tokens_to_ids("[IMG_BREAK]")
            assert row[3] == embedding[token].float().numpy().tobytes()
            assert_same_file(out, root / f"{name}-fixed-mmproj-{t}.gguf")


def test_gemma3_as_transformers_5_saves_it(built, run_ckpt, tmp_path):
    """A Gemma 3 saved by transformers 5 (tower under `vision_tower.`, not Google's `vision_tower.vision_model.`):
    the reference cannot map its names; ckpt writes the reference's projector of the same weights in Google's
    layout."""
    root, _ = built
    folder = tmp_path / "t5" / "gemma3"  # the same folder name: the same general.name
    vlm_folder(folder, "gemma3", MODELS["gemma3"][1], hub=False)
    from safetensors import safe_open

    with safe_open(folder / "model.safetensors", "pt") as f:
        assert any(k.startswith("vision_tower.encoder.") for k in f.keys())
    with pytest.raises(AssertionError, match="Can not map tensor 'vision_tower.embeddings"):
        reference_runs([(folder, "f16", tmp_path / "ref.gguf", ("--mmproj",), False)], {}, tmp_path)
    assert_same_file(ckpt_mmproj(run_ckpt, folder, "f16", tmp_path / "ours.gguf"), root / "gemma3-ref-mmproj-f16.gguf")


def test_q8_0_rows_that_fit_no_block_are_f16_as_the_reference_falls_back(built, run_ckpt, tmp_path):
    """Pixtral-in-Llava with a 48-wide tower: the tower's matrices are F16 in the Q8_0 file (the reference's
    QuantError fallback), the projector's 128-wide output layer Q8_0; the summary says how many fell back."""
    _, folders = built
    code, out, err = run_ckpt("convert", folders["llava_pixtral"], "--to", "gguf-q8_0", "--mmproj", "-o",
                              tmp_path / "p.gguf")
    assert code == 0, err
    _, tensors = read_gguf(tmp_path / "p.gguf")
    types = {n: t for n, t, _, _ in tensors}
    assert types["v.blk.0.attn_q.weight"] == "F16" and types["mm.2.weight"] == "Q8_0"
    assert "written F16 instead of Q8_0" in out + err


def test_default_name_beside_the_folder(built, run_ckpt, tmp_path):
    """Without -o: `<folder>-mmproj-F16.gguf` beside the folder (ckpt's SRC-SUFFIX naming, `mmproj` in it as the
    projector files on the hub are named), never over the text model's `<folder>-F16.gguf`."""
    import shutil

    _, folders = built
    src = tmp_path / "my-vlm"
    shutil.copytree(folders["qwen3_vl"], src)
    code, out, err = run_ckpt("convert", src, "--to", "gguf-bf16", "--mmproj", "-q")
    assert code == 0, err
    assert (tmp_path / "my-vlm-mmproj-BF16.gguf").is_file() and out.strip().endswith("my-vlm-mmproj-BF16.gguf")


# ---- 2. llama.cpp loads it


_QUIET = None


def _image_embeddings(text_gguf, mmproj) -> np.ndarray | None:
    """llama.cpp's (libmtmd's) embeddings of one 64x64 random image through `mmproj`, beside the text model; None
    where libmtmd refuses the projector."""
    from helpers.llama_ref import llama_cpp

    lc = llama_cpp()
    try:
        from llama_cpp import mtmd_cpp as M
    except Exception as e:  # built without libmtmd
        pytest.skip(f"llama-cpp-python has no libmtmd ({type(e).__name__}: {e})")
    lc.llama_backend_init()
    global _QUIET
    if _QUIET is None:  # llama.cpp's and libmtmd's logs (a page per load) kept out of the test output
        _QUIET = lc.llama_log_callback(lambda level, text, user_data: None)
    M.mtmd_log_set(_QUIET, ctypes.c_void_p(0))
    lc.llama_log_set(_QUIET, ctypes.c_void_p(0))
    mp = lc.llama_model_default_params()
    mp.use_extra_bufts, mp.n_gpu_layers = False, 0
    model = lc.llama_model_load_from_file(str(text_gguf).encode(), mp)
    assert model, text_gguf
    cp = M.mtmd_context_params_default()
    cp.use_gpu, cp.n_threads, cp.print_timings, cp.warmup = False, 2, False, False
    ctx = M.mtmd_init_from_file(str(mmproj).encode(), model, cp)
    try:
        if not ctx:
            return None
        img = np.random.default_rng(0).integers(0, 256, size=(64, 64, 3), dtype=np.uint8)
        bitmap = M.mtmd_bitmap_init(64, 64, (ctypes.c_uint8 * img.size).from_buffer_copy(img.tobytes()))
        chunks = M.mtmd_input_chunks_init()
        prompt = b"look " + M.mtmd_default_marker() + b" here"
        text = M.mtmd_input_text(prompt, len(prompt), True, True)
        assert M.mtmd_tokenize(ctx, chunks, ctypes.byref(text), (M.mtmd_bitmap_p_ctypes * 1)(bitmap), 1) == 0
        out = []
        for i in range(M.mtmd_input_chunks_size(chunks)):
            chunk = M.mtmd_input_chunks_get(chunks, i)
            if M.mtmd_input_chunk_get_type(chunk) != 0:  # the image's chunk
                assert M.mtmd_encode_chunk(ctx, chunk) == 0
                n = M.mtmd_input_chunk_get_n_tokens(chunk) * lc.llama_model_n_embd(model)
                out.append(np.ctypeslib.as_array(M.mtmd_get_output_embd(ctx), shape=(n,)).copy())
        M.mtmd_input_chunks_free(chunks)
        M.mtmd_bitmap_free(bitmap)
        assert out
        return np.concatenate(out)
    finally:
        if ctx:
            M.mtmd_free(ctx)
        lc.llama_model_free(model)
        from llama_cpp import _logger

        lc.llama_log_set(_logger.llama_log_callback, ctypes.c_void_p(0))


@pytest.mark.parametrize("name", [n for n, m in MODELS.items() if m[3]])
def test_llama_cpp_encodes_an_image_with_the_projector(name, built, run_ckpt, tmp_path):
    """llama.cpp's libmtmd loads ckpt's projector beside the reference's text GGUF and encodes an image; the
    embeddings are finite, not all zero, and bit for bit those of the reference's own projector. A Pixtral one
    (Mistral 3): the reference's file is refused by libmtmd (no v.token_embd.img_break), ckpt's is not, and its
    embeddings are those of the file LlavaVisionModel writes when it sees the embedding."""
    root, folders = built
    t = MODELS[name][2][0]
    text = root / f"{name}-ref-text.gguf"
    ours = _image_embeddings(text, ckpt_mmproj(run_ckpt, folders[name], t, tmp_path / "ours.gguf"))
    assert ours is not None and np.isfinite(ours).all() and np.abs(ours).max() > 0
    if MODELS[name][0] in PIXTRAL:
        assert _image_embeddings(text, root / f"{name}-ref-mmproj-{t}.gguf") is None
        theirs = _image_embeddings(text, root / f"{name}-fixed-mmproj-{t}.gguf")
    else:
        theirs = _image_embeddings(text, root / f"{name}-ref-mmproj-{t}.gguf")
    assert np.array_equal(ours, theirs)


# ---- 3. bad input: one line, exit 2, nothing written


def test_a_text_model_has_no_projector(run_ckpt, tmp_path, capsys):
    from helpers.hf_llm import model_folder

    folder = model_folder(tmp_path / "llm", "llama", tokenizer=None, num_hidden_layers=1, hidden_size=64,
                          intermediate_size=128)
    capsys.readouterr()  # transformers' save progress
    assert_refused(run_ckpt, tmp_path, ["convert", folder, "--to", "gguf-f16", "--mmproj"], str(folder),
                   "LlamaForCausalLM has no vision projector ckpt writes (supported: ")


@pytest.mark.parametrize("args, problem", [
    (["--to", "gguf-q4_k_m"], "--mmproj with --to gguf-q4_k_m: llama.cpp's converter writes a projector as gguf-f32"),
    (["--to", "fp16"], "--mmproj writes a llama.cpp projector GGUF: give --to gguf-f16"),
    ([], "--mmproj writes a llama.cpp projector GGUF: give --to gguf-f16"),
    (["--to", "gguf-q8_0", "--pure"], "--pure does not apply to --mmproj"),
])
def test_outtypes_the_reference_has_not(args, problem, built, run_ckpt, tmp_path):
    _, folders = built
    assert_refused(run_ckpt, tmp_path, ["convert", folders["gemma3"], "--mmproj", "-o", tmp_path / "x.gguf", *args],
                   "--", problem)


def _copy(folder, dst):
    import shutil

    shutil.copytree(folder, dst)
    return dst


def test_a_vision_layer_count_the_tensors_do_not_have(built, run_ckpt, tmp_path):
    """config.json says 3 vision layers, the tensors have 2: the reference writes a projector llama.cpp cannot
    load (it looks for v.blk.2); ckpt names both."""
    _, folders = built
    src = _copy(folders["gemma3"], tmp_path / "src")
    cfg = json.loads((src / "config.json").read_text())
    cfg["vision_config"]["num_hidden_layers"] = 3
    (src / "config.json").write_text(json.dumps(cfg))
    assert_refused(run_ckpt, tmp_path, ["convert", src, "--to", "gguf-f16", "--mmproj"], str(src / "config.json"),
                   "vision_config says 3 vision layers but the tensors have 2")


def test_no_image_normalization(built, run_ckpt, tmp_path):
    _, folders = built
    src = _copy(folders["qwen2_5_vl"], tmp_path / "src")
    (src / "preprocessor_config.json").unlink()
    assert_refused(run_ckpt, tmp_path, ["convert", src, "--to", "gguf-f16", "--mmproj"], str(src),
                   "no image_mean in preprocessor_config.json")


def test_pixtral_without_its_image_break_token(built, run_ckpt, tmp_path):
    _, folders = built
    src = _copy(folders["mistral3"], tmp_path / "src")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        data = (src / name).read_text().replace("[IMG_BREAK]", "[IMG_BRK]")
        (src / name).write_text(data)
    assert_refused(run_ckpt, tmp_path, ["convert", src, "--to", "gguf-f16", "--mmproj"], str(src),
                   "the tokenizer has no [IMG_BREAK] token")


def test_a_fused_qkv_that_is_not_three_parts(built, run_ckpt, tmp_path):
    from helpers.refusals import edit_saved

    _, folders = built
    src = _copy(folders["qwen2_5_vl"], tmp_path / "src")
    edit_saved(src, {"visual.blocks.0.attn.qkv.bias": torch.zeros(190)})
    assert_refused(run_ckpt, tmp_path, ["convert", src, "--to", "gguf-f16", "--mmproj"], str(src),
                   "'visual.blocks.0.attn.qkv.bias' has 190 rows, not q, k and v of one size")


def test_a_gguf_source(built, run_ckpt, tmp_path):
    """A projector is made from the Hugging Face folder (the text GGUF has no vision tensors)."""
    root, _ = built
    src = root / "gemma3-ref-text.gguf"
    assert_refused(run_ckpt, tmp_path, ["convert", src, "--to", "gguf-f16", "--mmproj", "-o", tmp_path / "x.gguf"],
                   str(src), "--mmproj writes a projector from the Hugging Face folder")
