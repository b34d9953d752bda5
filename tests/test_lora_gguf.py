"""`ckpt lora convert ADAPTER --format gguf --base HF_FOLDER`: PEFT adapters as llama.cpp's LoRA adapter GGUF
(`ckpt.lora.gguf_adapter`), held to llama.cpp's own `convert_lora_to_gguf.py` and to llama.cpp applying it.

Oracles: llama.cpp's `convert_lora_to_gguf.py` (llama-cpp-python 0.3.36's vendored tree, run in a subprocess with
its own gguf-py), every key, value type, value and tensor byte of its file; llama.cpp itself through
llama-cpp-python (`helpers.llama_ref`: `Llama(lora_path=...)`, i.e. `llama_adapter_lora_init`): its logits with
ckpt's adapter equal its logits with the reference's, differ from the base's, and equal (within float32 summation
order) its logits on the model PEFT merges (`merge_and_unload`) and ckpt converts to GGUF.

The bases are tiny random models built here (`helpers.hf_llm`: Llama, Qwen2, Qwen3, Qwen3-MoE, Mixtral, Phi-3,
Gemma 3; Gemma 2 for its lm_head refusal); the adapters are PEFT's (`get_peft_model`,
`save_pretrained`) with lora_B drawn at random (PEFT starts it at zero). transformers 5 holds a MoE layer's experts
as one fused parameter, on which PEFT's LoRA is a `target_parameters` bank that llama.cpp's converter cannot name;
the MoE adapter therefore gets its per-expert modules (`mlp.experts.N.gate_proj`, as PEFT saved them for
transformers 4 models, and as llama.cpp's converter stacks them) added to PEFT's file here.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from helpers.hf_llm import SAMPLES, bpe_hash, model_folder, read_gguf
from helpers.refusals import assert_refused

CKPT_ONLY = {"ckpt.version", "ckpt.operation"}
SMALL = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2)
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ATTN = ["q_proj", "k_proj", "v_proj", "o_proj"]
# name -> (HF kind, tokenizer, base dtype, adapter dtype, config overrides, LoraConfig fields)
MODELS = {
    "llama": ("llama", "spm", torch.float32, torch.float32, {}, dict(target_modules=ALL + ["embed_tokens"])),
    "qwen2": ("qwen2", "bpe", torch.float32, torch.float16, {}, dict(target_modules=ATTN + ["down_proj"], r=8)),
    "qwen3": ("qwen3", "bpe", torch.bfloat16, torch.bfloat16, dict(head_dim=16), dict(target_modules=ALL)),
    "qwen3_moe": ("qwen3_moe", "bpe", torch.float32, torch.float32, dict(head_dim=16, moe_intermediate_size=32),
                  dict(target_modules=ATTN, target_parameters=["mlp.gate.weight"])),
    "mixtral": ("mixtral", "spm", torch.bfloat16, torch.float32, dict(num_local_experts=4), dict(target_modules=ATTN)),
    "phi3": ("phi3", "spm", torch.float32, torch.float32, {},
             dict(target_modules=["qkv_proj", "o_proj", "gate_up_proj", "down_proj"])),
    "gemma3": ("gemma3", "spm", torch.float32, torch.bfloat16, dict(head_dim=16, query_pre_attn_scalar=16),
               dict(target_modules=ALL)),
}
# the per-expert modules added to a MoE adapter (module docstring): name template, projection -> (rows, cols) in
# config keys
EXPERTS = {
    "qwen3_moe": ("model.layers.{layer}.mlp.experts.{x}.{proj}",
                  {"gate_proj": ("moe_intermediate_size", "hidden_size"),
                   "up_proj": ("moe_intermediate_size", "hidden_size"),
                   "down_proj": ("hidden_size", "moe_intermediate_size")}),
    "mixtral": ("model.layers.{layer}.block_sparse_moe.experts.{x}.{proj}",
                {"w1": ("intermediate_size", "hidden_size"), "w2": ("hidden_size", "intermediate_size"),
                 "w3": ("intermediate_size", "hidden_size")}),
}
OUTTYPES = {"fp32": "f32", "fp16": "f16", "bf16": "bf16"}
RANK = 4

DRIVER = r"""
import runpy, sys
sys.path.insert(0, {tree!r})
for outtype, outfile in {runs!r}:
    sys.argv = ["convert_lora_to_gguf.py", {adapter!r}, "--base", {base!r}, "--outtype", outtype, "--outfile", outfile]
    runpy.run_path({script!r}, run_name="__main__")
"""


def reference(adapter: Path, base: Path, outs: dict[str, Path]) -> None:
    """llama.cpp's convert_lora_to_gguf.py once per `{outtype: outfile}`, in one subprocess with its own gguf-py."""
    from helpers.ggml_ref import llama_cpp_tree

    tree = llama_cpp_tree()
    first = next(iter(outs.values()))
    driver = first.parent / f".{first.name}.driver.py"
    driver.write_text(DRIVER.format(tree=str(tree), adapter=str(adapter), base=str(base),
                                    script=str(tree / "convert_lora_to_gguf.py"),
                                    runs=[(t, str(p)) for t, p in outs.items()]))
    env = {**os.environ, "PYTHONPATH": str(tree / "gguf-py"), "NO_LOCAL_GGUF": "1", "OMP_NUM_THREADS": "1"}
    try:
        r = subprocess.run([sys.executable, str(driver)], capture_output=True, text=True, env=env, cwd=str(tree))
    finally:
        driver.unlink()
    assert r.returncode == 0, r.stderr[-3000:]


def peft_adapter(base: Path, out: Path, dtype=torch.float32, seed: int = 1, **fields):
    """A PEFT LoRA of `base` saved to `out`, lora_B drawn at random; returns the PeftModel (float32)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    fields = {"r": RANK, "lora_alpha": 8, **fields}
    pm = get_peft_model(model, LoraConfig(**fields))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    if dtype == torch.float32:
        pm.save_pretrained(out)
    else:  # the adapter's own dtype (a bf16 / fp16 training run saves its factors so)
        from safetensors.torch import load_file, save_file

        pm.save_pretrained(out)
        sd = load_file(out / "adapter_model.safetensors")
        save_file({k: v.to(dtype) for k, v in sd.items()}, out / "adapter_model.safetensors", metadata={"format": "pt"})
    return pm


def add_expert_modules(adapter: Path, kind: str, base: Path, dtype=torch.float32, drop: str | None = None) -> None:
    """Per-expert LoRA modules of every MoE layer added to a PEFT adapter file (transformers 4's module names)."""
    from safetensors.torch import load_file, save_file

    cfg = json.loads((base / "config.json").read_text())
    template, projections = EXPERTS[kind]
    path = adapter / "adapter_model.safetensors"
    sd = load_file(path)
    g = torch.Generator().manual_seed(2)
    for layer in range(cfg["num_hidden_layers"]):
        for x in range(cfg.get("num_experts") or cfg["num_local_experts"]):
            for proj, (rows, cols) in projections.items():
                rows, cols = cfg[rows], cfg[cols]
                name = "base_model.model." + template.format(layer=layer, x=x, proj=proj)
                if name == drop:
                    continue
                sd[f"{name}.lora_A.weight"] = (torch.randn(RANK, cols, generator=g) * 0.1).to(dtype)
                sd[f"{name}.lora_B.weight"] = (torch.randn(rows, RANK, generator=g) * 0.05).to(dtype)
    save_file(sd, path, metadata={"format": "pt"})


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """name -> (base folder, adapter folder, BPE pre-tokenizer registration or None)."""
    root = tmp_path_factory.mktemp("lora-gguf")
    out = {}
    for name, (kind, tok, dtype, ad_dtype, cfg, fields) in MODELS.items():
        base = model_folder(root / name, kind, tokenizer=tok, dtype=dtype, **{**SMALL, **cfg})
        adapter = root / f"{name}-adapter"
        peft_adapter(base, adapter, ad_dtype, **fields)
        if name in EXPERTS:
            add_expert_modules(adapter, name, base, ad_dtype)
        out[name] = (base, adapter, (bpe_hash(base), "qwen2") if tok == "bpe" else None)
    return out


def ckpt_adapter(run_ckpt, adapter, base, out, save_dtype="fp32", *extra):
    code, stdout, err = run_ckpt("lora", "convert", adapter, "--format", "gguf", "--base", base, "--save-dtype",
                                 save_dtype, "-o", out, "-q", *extra)
    assert code == 0, err
    return out


def same_file(ours: Path, theirs: Path, what) -> None:
    """Every key (order, type, value) of the reference's but ckpt's two provenance keys; every tensor's name,
    type, shape and bytes."""
    m1, t1 = read_gguf(ours)
    m2, t2 = read_gguf(theirs)
    assert [k for k in m1 if k not in CKPT_ONLY] == list(m2) and set(m1) - set(m2) == CKPT_ONLY, (what, m1, m2)
    for k in m2:
        assert m1[k] == m2[k], (what, k, m1[k], m2[k])
    assert [x[:3] for x in t1] == [x[:3] for x in t2], what
    for a, b in zip(t1, t2):
        assert a[3] == b[3], (what, a[0])


# ---- 1. the reference's file, key for key and byte for byte


@pytest.mark.parametrize("name", list(MODELS))
def test_same_file_as_convert_lora_to_gguf(name, made, run_ckpt, tmp_path):
    """Each --save-dtype against the reference's --outtype: general.type adapter, adapter.type lora,
    adapter.lora.alpha, the general.* model-card keys; the factors named by the base's architecture, q/k lora_b
    rows permuted for llama's RoPE, a MoE layer's expert factors stacked, the router's pair; types and bytes."""
    base, adapter, _ = made[name]
    reference(adapter, base, {t: tmp_path / f"ref-{t}.gguf" for t in OUTTYPES.values()})
    for dt, t in OUTTYPES.items():
        ours = ckpt_adapter(run_ckpt, adapter, base, tmp_path / f"ckpt-{t}.gguf", dt)
        same_file(ours, tmp_path / f"ref-{t}.gguf", (name, t))
    meta, tensors = read_gguf(tmp_path / "ckpt-f16.gguf")
    assert meta["general.type"][0] == "adapter" and meta["adapter.type"][0] == "lora"
    assert meta["adapter.lora.alpha"][0] == 8.0
    names = {n for n, *_ in tensors}
    assert "blk.1.attn_output.weight.lora_b" in names and {t for _, t, _, _ in tensors} == {"F16"}
    if name in EXPERTS:
        shapes = {n: s for n, _, s, _ in tensors}
        assert shapes["blk.0.ffn_gate_exps.weight.lora_a"] == (64, RANK, 4)  # gguf's order: [in, r, experts]
    if name == "qwen3_moe":
        assert "blk.1.ffn_gate_inp.weight.lora_b" in names


def test_alora_invocation_tokens_as_the_reference_writes_them(made, run_ckpt, tmp_path):
    """An aLoRA's `alora_invocation_tokens` become `adapter.alora.invocation_tokens` (UINT32 array), as there."""
    base, adapter, _ = made["qwen2"]
    alora = tmp_path / "alora"
    shutil.copytree(adapter, alora)
    cfg = json.loads((alora / "adapter_config.json").read_text())
    cfg["alora_invocation_tokens"] = [5, 17, 3]
    (alora / "adapter_config.json").write_text(json.dumps(cfg))
    reference(alora, base, {"f16": tmp_path / "ref.gguf"})
    same_file(ckpt_adapter(run_ckpt, alora, base, tmp_path / "ckpt.gguf", "fp16"), tmp_path / "ref.gguf", "alora")
    meta, _ = read_gguf(tmp_path / "ckpt.gguf")
    assert list(meta["adapter.alora.invocation_tokens"][0]) == [5, 17, 3]


# ---- 2. llama.cpp applies it


def _logits(model: Path, tokens: list[int], lora: Path | None = None) -> np.ndarray:
    from helpers import llama_ref

    kw = {"lora_path": str(lora)} if lora is not None else {}
    llm = llama_ref.load(model, logits_all=True, n_ctx=64, n_batch=64, n_threads=2, **kw)
    try:
        llm.eval(list(tokens))
        return np.array(llm.scores[: len(tokens)], dtype=np.float32)
    finally:
        llm.close()


def _tokens(folder: Path) -> list[int]:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)(SAMPLES[1])["input_ids"][:24]


@pytest.fixture
def registered(made, monkeypatch):
    from ckpt.targets.planners import gguf_vocab

    for _, _, pre in made.values():
        if pre:
            monkeypatch.setitem(gguf_vocab.PRE_TOKENIZERS, *pre)


@pytest.mark.parametrize("name", ["llama", "qwen3_moe"])
def test_llama_cpp_logits_equal_the_references_adapter(name, made, registered, run_ckpt, tmp_path):
    """llama.cpp's logits on the F32 base with ckpt's adapter are its logits with the reference's adapter, bit for
    bit (f32 and f16 adapters), and not the base's own."""
    from helpers.llama_ref import llama_cpp

    llama_cpp()
    base, adapter, _ = made[name]
    code, _, err = run_ckpt("convert", base, "--to", "gguf-f32", "-o", tmp_path / "base.gguf", "-q")
    assert code == 0, err
    reference(adapter, base, {"f32": tmp_path / "ref-f32.gguf", "f16": tmp_path / "ref-f16.gguf"})
    tokens = _tokens(base)
    plain = _logits(tmp_path / "base.gguf", tokens)
    for dt, t in (("fp32", "f32"), ("fp16", "f16")):
        mine = ckpt_adapter(run_ckpt, adapter, base, tmp_path / f"a-{t}.gguf", dt)
        ours = _logits(tmp_path / "base.gguf", tokens, mine)
        theirs = _logits(tmp_path / "base.gguf", tokens, tmp_path / f"ref-{t}.gguf")
        assert np.array_equal(ours, theirs), (name, t)
        assert np.abs(ours - plain).max() > 1e-3, (name, t)


def _merged_gguf(run_ckpt, pm, base: Path, folder: Path) -> Path:
    """The model PEFT merges (float32) saved beside the base's tokenizer, and converted by ckpt to an F32 GGUF."""
    pm.merge_and_unload().save_pretrained(folder)
    for f in base.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors") and not (folder / f.name).exists():
            shutil.copy(f, folder / f.name)
    code, _, err = run_ckpt("convert", folder, "--to", "gguf-f32", "-o", folder.with_suffix(".gguf"), "-q")
    assert code == 0, err
    return folder.with_suffix(".gguf")


@pytest.mark.parametrize("config", [dict(), dict(use_rslora=True, alpha_pattern={"q_proj": 32, "down_proj": 2})])
def test_llama_cpp_with_the_adapter_computes_the_merged_model(config, made, run_ckpt, tmp_path):
    """llama.cpp's logits on base + ckpt's F32 adapter equal its logits on the model PEFT merges (within float32
    summation order: 2e-4 of the logits' range), the adapter's scale as PEFT applies it. With use_rslora and
    alpha_pattern (scales GGUF's one alpha / rank cannot say) ckpt folds each module's scale into its lora_b and
    still computes the merged model; the reference's file, which drops them, does not."""
    from helpers.llama_ref import llama_cpp

    llama_cpp()
    base, _, _ = made["llama"]
    adapter = tmp_path / "adapter"
    pm = peft_adapter(base, adapter, seed=3, target_modules=ALL + ["embed_tokens"], **config)
    merged = _merged_gguf(run_ckpt, pm, base, tmp_path / "merged")
    code, _, err = run_ckpt("convert", base, "--to", "gguf-f32", "-o", tmp_path / "base.gguf", "-q")
    assert code == 0, err
    code, out, err = run_ckpt("lora", "convert", adapter, "--format", "gguf", "--base", base, "-o",
                              tmp_path / "a.gguf")
    assert code == 0, err
    tokens = _tokens(base)
    want = _logits(merged, tokens)
    got = _logits(tmp_path / "base.gguf", tokens, tmp_path / "a.gguf")
    tol = 2e-4 * float(np.ptp(want))
    assert np.abs(got - want).max() < tol, (np.abs(got - want).max(), tol)
    assert np.abs(want - _logits(tmp_path / "base.gguf", tokens)).max() > 10 * tol  # the adapter changes them
    if config:
        assert "the scale folded into lora_b" in out + err
        reference(adapter, base, {"f32": tmp_path / "ref.gguf"})
        theirs = _logits(tmp_path / "base.gguf", tokens, tmp_path / "ref.gguf")
        assert np.abs(theirs - want).max() > 10 * tol


# ---- 3. refusals: one line, exit 2, nothing written


def test_refusals(made, run_ckpt, tmp_path):
    base, adapter, _ = made["llama"]
    qbase, qadapter, _ = made["qwen2"]
    out = tmp_path / "x.gguf"
    args = ("lora", "convert", adapter, "--format", "gguf")
    assert_refused(run_ckpt, tmp_path, (*args, "-o", out), "--format gguf", "give --base HF_FOLDER")
    assert_refused(run_ckpt, tmp_path, (*args, "--base", base, "-o", tmp_path / "x.safetensors"),
                   f"-o {tmp_path / 'x.safetensors'}", "name it .gguf")
    assert_refused(run_ckpt, tmp_path, (*args, "--base", base, "--to-lora", "4", "-o", out), "--to-lora",
                   "not with --format gguf")
    # a base that is not an HF LLM folder ckpt writes: an unknown class, a LoRA, a GGUF
    other = tmp_path / "other"
    shutil.copytree(base, other)
    cfg = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**cfg, "architectures": ["FooForCausalLM"]}))
    assert_refused(run_ckpt, tmp_path, (*args, "--base", other, "-o", out), str(other),
                   "architecture 'FooForCausalLM' cannot be written as a llama.cpp GGUF")
    assert_refused(run_ckpt, tmp_path, (*args, "--base", qadapter, "-o", out), str(qadapter), "no config.json")
    # the adapter of another model: a shape differs; modules the base does not have
    wider = tmp_path / "wider"
    shutil.copytree(adapter, wider)
    from safetensors.torch import load_file, save_file

    sd = load_file(wider / "adapter_model.safetensors")
    sd["base_model.model.model.layers.1.self_attn.k_proj.lora_B.weight"] = torch.zeros(48, RANK)
    save_file(sd, wider / "adapter_model.safetensors")
    assert_refused(run_ckpt, tmp_path, ("lora", "convert", wider, "--format", "gguf", "--base", base, "-o", out),
                   str(wider), "changes a 48x64 weight, but the base's model.layers.1.self_attn.k_proj.weight is 32x64")
    moe_base, moe_adapter, _ = made["qwen3_moe"]
    assert_refused(run_ckpt, tmp_path, ("lora", "convert", moe_adapter, "--format", "gguf", "--base", qbase, "-o",
                                        out), str(moe_adapter), "target a weight the base")
    code, stdout, err = run_ckpt(*args, "--base", base, "-o", out, "--dry-run")
    assert code == 0 and "would write" in stdout and not out.exists(), err


def test_refused_modules(made, run_ckpt, tmp_path, capsys):
    """DoRA (no form in a llama.cpp adapter), an incomplete set of expert modules (llama.cpp stacks a layer's
    experts into one tensor), a PEFT LoRA on a fused expert bank (no pair in llama.cpp), Gemma 2's lm_head
    (llama.cpp ties it to the embedding; the reference refuses it)."""
    base, _, _ = made["llama"]
    dora = tmp_path / "dora"
    peft_adapter(base, dora, target_modules=["q_proj"], use_dora=True)
    out = tmp_path / "x.gguf"
    capsys.readouterr()  # PEFT's and transformers' own warnings
    assert_refused(run_ckpt, tmp_path, ("lora", "convert", dora, "--format", "gguf", "--base", base, "-o", out),
                   str(dora), "is a DoRA module")
    moe_base, _, _ = made["qwen3_moe"]
    part = tmp_path / "part"
    peft_adapter(moe_base, part, target_modules=["q_proj"])
    add_expert_modules(part, "qwen3_moe", moe_base, drop="base_model.model.model.layers.1.mlp.experts.2.up_proj")
    gemma2 = model_folder(tmp_path / "gemma2", "gemma2", tokenizer="spm", **SMALL, head_dim=16,
                          query_pre_attn_scalar=16)
    head = tmp_path / "head"
    peft_adapter(gemma2, head, target_modules=["q_proj", "lm_head"])
    bank = tmp_path / "bank"  # PEFT's LoRA on transformers 5's fused expert parameter
    peft_adapter(moe_base, bank, target_modules=["q_proj"], target_parameters=["mlp.experts.gate_up_proj"])
    capsys.readouterr()
    assert_refused(run_ckpt, tmp_path, ("lora", "convert", bank, "--format", "gguf", "--base", moe_base, "-o", out),
                   str(bank), "is a PEFT target_parameters LoRA on a parameter that is no 2-D weight")
    assert_refused(run_ckpt, tmp_path, ("lora", "convert", part, "--format", "gguf", "--base", moe_base, "-o", out),
                   "", "incomplete set")
    assert_refused(run_ckpt, tmp_path, ("lora", "convert", head, "--format", "gguf", "--base", gemma2, "-o", out),
                   str(head), "changes 'lm_head.weight', which llama.cpp's gemma2 model does not have")


def test_a_transform_without_a_form_on_the_factors_is_refused_by_name():
    """An architecture transform a LoRA's factors cannot take (here Gemma's norm shift) names itself."""
    from ckpt.errors import CkptError
    from ckpt.families.llm.architectures import ALL as ARCHS
    from ckpt.families.llm.tensors import Shifted
    from ckpt.io.tensors import ComputedTensor
    from ckpt.lora.gguf_adapter import LoraWeight, factors

    a = ComputedTensor("a", lambda: torch.zeros(2, 8), torch.float32, (2, 8))
    b = ComputedTensor("b", lambda: torch.zeros(8, 2), torch.float32, (8, 2))
    with pytest.raises(CkptError, match="transform \\(Shifted\\)"):
        factors(ARCHS["gemma2"], "blk.0.x.weight", Shifted(LoraWeight("x.weight", (8, 8), a, b, "x"), 1.0))


def test_a_kohya_named_file_gives_the_same_adapter(made, run_ckpt, tmp_path):
    """What ckpt's LoRA loading reads beyond PEFT folders, where it maps: the same LoRA as a kohya-named file
    (`lora convert --format kohya`, alpha per module, the embedding's factors in row view) gives the same tensors,
    byte for byte (the model-card keys aside: a single file has no README)."""
    from safetensors.torch import load_file, save_file

    base, adapter, _ = made["llama"]
    plain = tmp_path / "plain"  # without PEFT's saved copy of the embedding (kohya has no form for it)
    shutil.copytree(adapter, plain)
    sd = load_file(plain / "adapter_model.safetensors")
    save_file({k: v for k, v in sd.items() if ".base_layer." not in k}, plain / "adapter_model.safetensors")
    code, _, err = run_ckpt("lora", "convert", plain, "--format", "kohya", "--base", base, "-o",
                            tmp_path / "kohya.safetensors", "-q")
    assert code == 0, err
    peft = ckpt_adapter(run_ckpt, adapter, base, tmp_path / "peft.gguf", "fp16")
    kohya = ckpt_adapter(run_ckpt, tmp_path / "kohya.safetensors", base, tmp_path / "kohya.gguf", "fp16")
    m1, t1 = read_gguf(peft)
    m2, t2 = read_gguf(kohya)
    assert sorted(t1) == sorted(t2)
    assert "token_embd.weight.lora_a" in {n for n, *_ in t1}
    assert m2["adapter.lora.alpha"] == m1["adapter.lora.alpha"] and m2["general.type"] == m1["general.type"]
