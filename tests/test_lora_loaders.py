"""What `ckpt lora extract|convert|resize|merge` write in PEFT's key spelling, loaded by the libraries that read it.

- rank_pattern / alpha_pattern: PEFT reads each key K as the regex `(.*\\.)?(K)$` against a module's full name,
  so a bare `proj_out` also selects `single_transformer_blocks.0.proj_out`, which then gets the top-level
  module's rank ("size mismatch" when the file is loaded). Oracle: diffusers' `load_lora_adapter` (what
  `load_lora_weights` calls for the transformer) on a tiny Flux.1 whose top-level `proj_out` and `x_embedder`
  have another rank than the blocks' `proj_out`: the file loads, PEFT wraps exactly the LoRA's modules (also
  where an unadapted block's `proj_out` ends with a listed name), and the fused weights equal the tuned model's
  (extract) and `ckpt merge-lora` of the same file.
- embeddings: PEFT stores an `nn.Embedding`'s LoRA as `lora_embedding_A` [r, num_embeddings] /
  `lora_embedding_B` [dim, r] and drops `lora_A/lora_B` keys on one with only a warning. Oracle: PEFT's
  `PeftModel.from_pretrained` + `merge_and_unload` on a tiny Llama with an `embed_tokens` LoRA, against the
  tuned model (extract), PEFT's own merge of its own adapter (convert round trips) and `ckpt merge-lora` of the
  same adapter (resize, merge). Which module names are embeddings is checked against the module types of
  tiny transformers and diffusers models.
- no loader says anything about missing or unexpected keys (Python warnings and the diffusers / PEFT /
  transformers loggers are recorded around each load).

Tolerance atol 2e-5 on O(1) weights (fp32 SVDs and products; only summation order differs).
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
import warnings

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from lora_helpers import low_rank

diffusers = pytest.importorskip("diffusers")
peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

from families_util import state_dict, tiny_flux1  # noqa: E402

TOL = dict(rtol=0, atol=2e-5)
KEY_WARNING = re.compile(r"missing|unexpected|size mismatch|inconsisten", re.I)
# Flux.1 modules changed, with their delta's rank: the top-level proj_out / x_embedder differ from the blocks'.
# single_transformer_blocks.1.proj_out stays unchanged: its name ends with the listed `proj_out`.
FLUX_RANKS = {"proj_out": 2, "x_embedder": 2, "single_transformer_blocks.0.proj_out": 4,
              "single_transformer_blocks.0.attn.to_q": 4, "transformer_blocks.0.attn.to_q": 4,
              "transformer_blocks.0.ff.net.2": 4}


@contextlib.contextmanager
def loader_warnings():
    """Every warning said while loading: Python warnings and the diffusers / PEFT / transformers loggers'."""
    said: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            said.append(record.getMessage())

    keep = Keep(logging.WARNING)
    loggers = [logging.getLogger(n) for n in ("diffusers", "peft", "transformers")]
    for lg in loggers:
        lg.addHandler(keep)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield said
    finally:
        for lg in loggers:
            lg.removeHandler(keep)
        said.extend(str(w.message) for w in caught)


def key_warnings(said: list[str]) -> list[str]:
    return [m[:300] for m in said if KEY_WARNING.search(m)]


def wrapped(model) -> set[str]:
    """The modules PEFT put a LoRA layer on."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    return {n.removeprefix("base_model.model.") for n, m in model.named_modules() if isinstance(m, BaseTunerLayer)}


def lora_config(path) -> dict:
    with safe_open(str(path), "pt") as f:
        return json.loads(f.metadata()["lora_adapter_metadata"])


def merged_by_ckpt(run_ckpt, base, *loras, out):
    code, _, err = run_ckpt("merge-lora", base, *loras, "-o", out, "-q")
    assert code == 0, err
    return load_file(out)


# -- diffusers ------------------------------------------------------------------------------------------------

@pytest.fixture
def flux(tmp_path):
    """A tiny Flux.1 diffusers folder `base`, its fine-tune `tuned` (FLUX_RANKS), and base.safetensors (the same
    weights in one file, for merge-lora); returns (base state dict, tuned state dict)."""
    torch.manual_seed(0)
    model = tiny_flux1()
    base = state_dict(model)
    model.save_pretrained(tmp_path / "base")
    save_file(base, tmp_path / "base.safetensors")
    with torch.no_grad():
        for name, r in FLUX_RANKS.items():
            w = model.get_submodule(name).weight
            w.add_(low_rank(w.shape, r))
    model.save_pretrained(tmp_path / "tuned")
    return base, state_dict(model)


def fused_by_diffusers(base_sd, lora_file):
    """The file as diffusers' pipeline loader reads it (weights and lora_adapter_metadata), loaded into a fresh
    model and fused: (fused weights, the modules PEFT wrapped, what the loaders said)."""
    model = tiny_flux1()
    model.load_state_dict(base_sd)
    sd, metadata = diffusers.FluxPipeline.lora_state_dict(str(lora_file), return_lora_metadata=True)
    assert metadata
    with loader_warnings() as said:
        model.load_lora_adapter(sd, prefix="transformer", metadata=metadata)
    targets = wrapped(model)
    model.fuse_lora()
    fused = {k.replace(".base_layer.", "."): v for k, v in model.state_dict().items() if "lora_" not in k}
    return fused, targets, said


def assert_same(got: dict, want: dict):
    for k, v in want.items():
        torch.testing.assert_close(got[k], v, **TOL, msg=k)


def test_extract_diffusers_anchors_rank_patterns_and_loads(tmp_path, run_ckpt, flux):
    base, tuned = flux
    out = tmp_path / "lora.safetensors"
    code, _, err = run_ckpt("lora", "extract", tmp_path / "base", tmp_path / "tuned", "--rank", 8, "--dynamic",
                            "sv_ratio", "--threshold", 1e4, "--format", "diffusers", "-o", out, "-q")
    assert code == 0, err
    meta = lora_config(out)
    assert meta["transformer.r"] == 4
    assert meta["transformer.rank_pattern"] == {"^proj_out": 2, "^x_embedder": 2}
    assert meta["transformer.alpha_pattern"] == {"^proj_out": 2, "^x_embedder": 2}
    # `proj_out` listed would also wrap the unchanged single_transformer_blocks.1.proj_out: one exact regex
    assert isinstance(meta["transformer.target_modules"], str)
    fused, targets, said = fused_by_diffusers(base, out)
    assert not key_warnings(said), key_warnings(said)
    assert targets == set(FLUX_RANKS)
    assert_same(fused, tuned)
    assert_same(fused, merged_by_ckpt(run_ckpt, tmp_path / "base.safetensors", out, out=tmp_path / "m.safetensors"))


def test_convert_resize_merge_to_diffusers_load(tmp_path, run_ckpt, flux):
    base, tuned = flux
    kohya = tmp_path / "kohya.safetensors"
    code, _, err = run_ckpt("lora", "extract", tmp_path / "base", tmp_path / "tuned", "--rank", 8, "--dynamic",
                            "sv_ratio", "--threshold", 1e4, "--format", "kohya", "-o", kohya, "-q")
    assert code == 0, err
    want = merged_by_ckpt(run_ckpt, tmp_path / "base.safetensors", kohya, out=tmp_path / "mk.safetensors")
    assert_same(want, tuned)
    # the kohya names read back on their own (no --base), and against the base (which knows every module)
    for extra in ([], ["--base", tmp_path / "base"]):
        out = tmp_path / f"conv{len(extra)}.safetensors"
        code, _, err = run_ckpt("lora", "convert", kohya, "--format", "diffusers", *extra, "-o", out, "-q")
        assert code == 0, err
        meta = lora_config(out)
        pattern = meta["transformer.rank_pattern"]
        assert pattern["^proj_out"] == 2 and pattern["^x_embedder"] == 2
        assert all(k.startswith("^") for k in meta["transformer.rank_pattern"] | meta["transformer.alpha_pattern"])
        fused, targets, said = fused_by_diffusers(base, out)
        assert not key_warnings([m for m in said if extra or "inconsisten" not in m]), said
        assert set(FLUX_RANKS) <= targets
        assert_same(fused, want)
    # resize keeps the file's LoraConfig (its exact regex too): rank 4 -> 3 (the zero to_k/to_v pieces of the split
    # kohya modules -> 1), the rank-2 modules as they are
    resized = tmp_path / "resized.safetensors"
    code, _, err = run_ckpt("lora", "resize", out, "--rank", 3, "-o", resized, "-q")
    assert code == 0, err
    meta = lora_config(resized)
    pattern = meta["transformer.rank_pattern"]
    assert pattern["^proj_out"] == 2 and pattern["^x_embedder"] == 2 and pattern["^transformer_blocks.0.attn.to_q"] == 3
    assert all(k.startswith("^") for k in pattern) and isinstance(meta["transformer.target_modules"], str)
    fused, targets, said = fused_by_diffusers(base, resized)
    assert not key_warnings(said), said
    assert_same(fused, merged_by_ckpt(run_ckpt, tmp_path / "base.safetensors", resized,
                                      out=tmp_path / "mr.safetensors"))
    # merge: the file with itself at 0.5 each, stacked (ranks 4 and 8): the tuned model again
    both = tmp_path / "both.safetensors"
    code, _, err = run_ckpt("lora", "merge", out, out, "--ratio", 0.5, "--ratio", 0.5, "-o", both, "-q")
    assert code == 0, err
    assert lora_config(both)["transformer.rank_pattern"] == {"^proj_out": 4, "^x_embedder": 4}
    fused, targets, said = fused_by_diffusers(base, both)
    assert not key_warnings(said), said
    assert_same(fused, tuned)
    assert_same(fused, merged_by_ckpt(run_ckpt, tmp_path / "base.safetensors", both, out=tmp_path / "mb.safetensors"))


def test_pattern_keys_select_their_own_module_by_peft_rule():
    """Each written key selects its own module and no other, by PEFT's own matcher; a name whose dots would
    match another module's characters, or that holds other regex characters, is escaped."""
    from peft.utils.other import get_pattern_key

    from ckpt.lora.formats import pattern_key

    names = ["proj_out", "single_transformer_blocks.0.proj_out", "x_embedder", "blocks.1.attn", "blocks_1_attn",
             "norm_out.linear", "a+b", "ab"]
    by_length: dict[int, list[str]] = {}
    for n in names:
        by_length.setdefault(len(n), []).append(n)
    keys = {pattern_key(n, by_length): n for n in names}
    assert len(keys) == len(names) and all(k.startswith("^") for k in keys)
    for n in names:
        assert keys[get_pattern_key(list(keys), n)] == n, n
        assert keys[get_pattern_key(list(reversed(keys)), n)] == n, n


# -- PEFT -------------------------------------------------------------------------------------------------------

LLAMA = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, tie_word_embeddings=False)


def fresh_llama():
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA))


def merged_by_peft(adapter):
    """PEFT's answer: the adapter folder loaded onto a fresh base and merged; (weights, wrapped modules, said)."""
    with loader_warnings() as said:
        model = peft.PeftModel.from_pretrained(fresh_llama(), adapter)
    targets = wrapped(model)
    return model.merge_and_unload().state_dict(), targets, said


def peft_tensors(adapter) -> dict[str, tuple[int, ...]]:
    return {k: tuple(v.shape) for k, v in load_file(adapter / "adapter_model.safetensors").items()}


def test_extract_peft_embedding_loads_in_peft(tmp_path, run_ckpt):
    model = fresh_llama()
    model.save_pretrained(tmp_path / "base")
    ranks = {"model.embed_tokens": 3, "model.layers.0.self_attn.q_proj": 5, "model.layers.1.self_attn.q_proj": 5,
             "lm_head": 5}
    with torch.no_grad():
        for name, r in ranks.items():
            w = model.get_submodule(name).weight
            w.add_(low_rank(w.shape, r))
    model.save_pretrained(tmp_path / "tuned")
    tuned = state_dict(model)
    out = tmp_path / "adapter"
    code, _, err = run_ckpt("lora", "extract", tmp_path / "base", tmp_path / "tuned", "--rank", 8, "--dynamic",
                            "sv_fro", "--threshold", 0.999999, "-o", out, "-q")
    assert code == 0, err
    cfg = json.loads((out / "adapter_config.json").read_text())
    assert cfg["r"] == 5 and cfg["rank_pattern"] == {"^model.embed_tokens": 3}
    shapes = peft_tensors(out)
    assert shapes["base_model.model.model.embed_tokens.lora_embedding_A"] == (3, 64)  # [r, num_embeddings]
    assert shapes["base_model.model.model.embed_tokens.lora_embedding_B"] == (32, 3)  # [embedding_dim, r]
    assert not any("embed_tokens.lora_A" in k or "embed_tokens.lora_B" in k for k in shapes)
    got, targets, said = merged_by_peft(out)
    assert not key_warnings(said), key_warnings(said)
    assert targets == set(ranks)
    assert_same(got, tuned)
    base_file = tmp_path / "base" / "model.safetensors"
    assert_same(got, merged_by_ckpt(run_ckpt, base_file, out, out=tmp_path / "m.safetensors"))


@pytest.fixture
def peft_adapter(tmp_path):
    """PEFT's own adapter on a tiny Llama: embed_tokens at rank 6, q/v_proj at rank 4 (alpha 8), random factors;
    returns PEFT's own merged weights."""
    fresh_llama().save_pretrained(tmp_path / "base")
    conf = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["embed_tokens", "q_proj", "v_proj"],
                           rank_pattern={"embed_tokens": 6}, init_lora_weights=False)
    pm = peft.get_peft_model(fresh_llama(), conf)
    pm.save_pretrained(tmp_path / "adapter", save_embedding_layers=False)
    return pm.merge_and_unload().state_dict()


def test_convert_peft_embedding_round_trips(tmp_path, run_ckpt, peft_adapter):
    want = peft_adapter
    base = tmp_path / "base"
    kohya = tmp_path / "kohya.safetensors"
    code, _, err = run_ckpt("lora", "convert", tmp_path / "adapter", "--format", "kohya", "--base", base, "-o", kohya,
                            "-q")
    assert code == 0, err
    emb = load_file(kohya)["lora_unet_model_embed_tokens.lora_up.weight"]
    assert tuple(emb.shape) == (64, 6)  # the embedding weight's rows: [num_embeddings, r]
    # the adapter as ckpt wrote embeddings before: lora_B = A^T [num_embeddings, r], lora_A = B^T [r, dim], which
    # PEFT drops; convert re-spells it
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "adapter_config.json").write_bytes((tmp_path / "adapter" / "adapter_config.json").read_bytes())
    sd = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    head = "base_model.model.model.embed_tokens."
    sd[head + "lora_B.weight"] = sd.pop(head + "lora_embedding_A").T.contiguous()
    sd[head + "lora_A.weight"] = sd.pop(head + "lora_embedding_B").T.contiguous()
    save_file(sd, plain / "adapter_model.safetensors")
    for name, src, extra in (("back", kohya, ["--base", base]), ("renamed", tmp_path / "adapter", []),
                             ("respelled", plain, [])):
        out = tmp_path / name
        code, _, err = run_ckpt("lora", "convert", src, "--format", "peft", *extra, "-o", out, "-q")
        assert code == 0, err
        cfg = json.loads((out / "adapter_config.json").read_text())
        assert cfg["r"] == 4 and cfg["rank_pattern"] == {"^model.embed_tokens": 6}
        shapes = peft_tensors(out)
        assert shapes["base_model.model.model.embed_tokens.lora_embedding_A"] == (6, 64)
        got, targets, said = merged_by_peft(out)
        assert not key_warnings(said), key_warnings(said)
        assert "model.embed_tokens" in targets and len(targets) == 5
        assert_same(got, want)


def test_resize_and_merge_peft_embedding_load_in_peft(tmp_path, run_ckpt, peft_adapter):
    base_file = tmp_path / "base" / "model.safetensors"
    adapter = tmp_path / "adapter"
    resized = tmp_path / "resized"
    code, _, err = run_ckpt("lora", "resize", adapter, "--rank", 5, "-o", resized, "-q")
    assert code == 0, err
    cfg = json.loads((resized / "adapter_config.json").read_text())
    assert cfg["r"] == 4 and cfg["rank_pattern"] == {"^model.embed_tokens": 5}  # 6 -> 5; rank 4 kept
    assert peft_tensors(resized)["base_model.model.model.embed_tokens.lora_embedding_B"] == (32, 5)
    got, _, said = merged_by_peft(resized)
    assert not key_warnings(said), key_warnings(said)
    assert_same(got, merged_by_ckpt(run_ckpt, base_file, resized, out=tmp_path / "mr.safetensors"))
    # stacked with a kohya copy of itself: through --format peft (converted first) and from the PEFT folders alone
    kohya = tmp_path / "kohya.safetensors"
    assert run_ckpt("lora", "convert", adapter, "--format", "kohya", "--base", tmp_path / "base", "-o", kohya,
                    "-q")[0] == 0
    want = merged_by_ckpt(run_ckpt, base_file, adapter, resized, out=tmp_path / "mm.safetensors")
    for name, inputs, extra in (("merged", [adapter, resized], []),
                                ("reformatted", [kohya, resized], ["--format", "peft", "--base", tmp_path / "base"])):
        out = tmp_path / name
        code, _, err = run_ckpt("lora", "merge", *inputs, *extra, "-o", out, "-q")
        assert code == 0, err
        cfg = json.loads((out / "adapter_config.json").read_text())
        assert cfg["r"] == 8 and cfg["rank_pattern"] == {"^model.embed_tokens": 11}
        assert peft_tensors(out)["base_model.model.model.embed_tokens.lora_embedding_A"] == (11, 64)
        got, _, said = merged_by_peft(out)
        assert not key_warnings(said), key_warnings(said)
        assert_same(got, want)


# -- which modules are embeddings ---------------------------------------------------------------------------------

def _models():
    T = transformers
    yield "llama", fresh_llama()
    yield "gpt2", T.GPT2LMHeadModel(T.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=1, n_head=4))
    yield "bert", T.BertModel(T.BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                           intermediate_size=48, max_position_embeddings=16))
    yield "t5", T.T5ForConditionalGeneration(T.T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=48, num_layers=1,
                                                        num_heads=4))
    yield "clip", T.CLIPTextModel(T.CLIPTextConfig(vocab_size=64, hidden_size=32, intermediate_size=48,
                                                   num_hidden_layers=1, num_attention_heads=4,
                                                   max_position_embeddings=16))
    yield "opt", T.OPTForCausalLM(T.OPTConfig(vocab_size=64, hidden_size=32, ffn_dim=48, num_hidden_layers=1,
                                              num_attention_heads=4, max_position_embeddings=16,
                                              word_embed_proj_dim=16))
    yield "gpt_neox", T.GPTNeoXForCausalLM(T.GPTNeoXConfig(vocab_size=64, hidden_size=32, intermediate_size=48,
                                                           num_hidden_layers=1, num_attention_heads=4))
    yield "bloom", T.BloomForCausalLM(T.BloomConfig(vocab_size=64, hidden_size=32, n_layer=1, n_head=4))
    yield "flux", tiny_flux1()
    yield "dit", diffusers.DiTTransformer2DModel(num_attention_heads=2, attention_head_dim=8, in_channels=4,
                                                 num_layers=1, sample_size=8, patch_size=2, num_embeds_ada_norm=10)


def test_embedding_names_are_the_libraries_embeddings():
    from ckpt.lora.embeddings import is_embedding

    for kind, model in _models():
        seen = 0
        for name, module in model.named_modules():
            weight = getattr(module, "weight", None)
            if isinstance(weight, torch.Tensor) and weight.dim() >= 2:
                assert is_embedding(name) == isinstance(module, torch.nn.Embedding), (kind, name, type(module))
                seen += isinstance(module, torch.nn.Embedding)
        assert seen or kind == "flux", kind
