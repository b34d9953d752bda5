"""`convert LLM --to ct-*` against llm-compressor 0.14.0.1 itself (run in .venv-serve: it pins compressed-tensors 0.19
and transformers 5.17): its data-free `model_free_ptq` with the preset of the same name and `ignore=["lm_head"]`
writes the same tensors, byte for byte, and an equivalent `quantization_config`; `oneshot` with a preset
`QuantizationModifier(targets="Linear", ignore=["lm_head"])` and no dataset agrees on every Linear (NVFP4: its global
scales shared across q/k/v and gate/up). Tiny models built here: bf16, fp16 and fp32 weights, a zero row, -0.0,
k_proj far larger than q/v (so a fused global scale differs from a per-tensor one), widths that are not whole
128-blocks (FP8_BLOCK's edge blocks).

The one intended difference: model_free_ptq quantizes `model.embed_tokens` too (it matches every `*.weight` but
norms by name); it is an Embedding, which `oneshot` and the loaders leave plain, and so does ckpt. The oracle is
told to ignore it (its FP8_BLOCK crashes on an embedding that is no whole number of blocks wide, saving a
non-contiguous crop), and its config compared without that entry. For the same crash, FP8_BLOCK on widths that are
no whole number of blocks is held to `oneshot`. The two paths differ on one input: a -0.0 weight becomes FP8 code
0x80 (-0) in model_free_ptq and 0x00 in oneshot (its zero point, added as +0.0, clears the sign); ckpt writes
model_free_ptq's (both decode to zero), so the model compared with oneshot has no -0.0.
"""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("llmcompressor", reason="llm-compressor is not installed (the oracle: make setup-serve)")

from safetensors.torch import load_file  # noqa: E402

SCHEMES = {"ct-fp8-dynamic": "FP8_DYNAMIC", "ct-fp8-block": "FP8_BLOCK", "ct-w4a16": "W4A16", "ct-w8a16": "W8A16",
           "ct-nvfp4a16": "NVFP4A16"}
MODELS = {  # name: (architecture, hidden, intermediate, dtype)
    "llama-bf16": ("llama", 256, 384, torch.bfloat16),
    "llama-fp16": ("llama", 256, 384, torch.float16),
    "qwen3-fp32-odd": ("qwen3", 160, 200, torch.float32),  # FP8 only: widths no group divides
}
EMBED = "model.embed_tokens"
CASES = [(m, t) for m in ("llama-bf16", "llama-fp16") for t in SCHEMES] + [("qwen3-fp32-odd", "ct-fp8-dynamic")]


def build(folder, name):
    import transformers

    arch, hidden, inter, dtype = MODELS[name]
    cfg_cls, model_cls = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
                          "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM)}[arch]
    cfg = cfg_cls(vocab_size=128, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = model_cls(cfg).eval()
    with torch.no_grad():
        layer = model.model.layers[0]
        layer.self_attn.k_proj.weight.mul_(4)  # the fused set's amax is k_proj's
        layer.self_attn.o_proj.weight[3].zero_()  # a zero row: the scales' eps
        if arch == "llama":  # -0.0: model_free_ptq keeps its sign in FP8 codes, oneshot does not (module docstring)
            layer.mlp.up_proj.weight[1, :40] = -0.0
    model.to(dtype).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("ct_models")
    return {name: build(root / name, name) for name in MODELS}


def _tensors(folder):
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def _bits(t):
    return t.contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def _without_embed(config):
    """llm-compressor's config less the embedding the oracle is told to ignore (module docstring)."""
    config["quantization_config"]["ignore"].remove(EMBED)
    return config


def assert_same_tensors(ours, theirs):
    """Every tensor llm-compressor writes, byte for byte."""
    assert set(ours) == set(theirs)
    for k in theirs:
        a, b = ours[k], theirs[k]
        assert a.dtype == b.dtype and a.shape == b.shape, (k, a.dtype, b.dtype, a.shape, b.shape)
        assert torch.equal(_bits(a), _bits(b)), (k, int((_bits(a) != _bits(b)).sum()))


def _ckpt(run_ckpt, src, out, target, *extra):
    code, _, err = run_ckpt("convert", src, "--to", target, "-o", out, "-q", *extra)
    assert code == 0, err
    return out


@pytest.mark.parametrize("model,target", CASES)
def test_convert_equals_model_free_ptq(tmp_path, run_ckpt, models, model, target):
    from llmcompressor import model_free_ptq

    src = models[model]
    model_free_ptq(src, tmp_path / "ref", scheme=SCHEMES[target], ignore=["lm_head", EMBED], device="cpu")
    ours = _ckpt(run_ckpt, src, tmp_path / "ours", target)
    assert_same_tensors(_tensors(ours), _tensors(tmp_path / "ref"))
    qa = json.loads((ours / "config.json").read_text())
    qb = _without_embed(json.loads((tmp_path / "ref" / "config.json").read_text()))
    assert qa["quantization_config"] == qb["quantization_config"]  # version included: the 0.19.0 layout
    assert {k: v for k, v in qa.items() if k != "quantization_config"} == \
        {k: v for k, v in qb.items() if k != "quantization_config"}


def test_group_size_equals_a_custom_int_scheme(tmp_path, run_ckpt, models):
    """--group-size 32: llm-compressor's W4A16 args with group_size 32 (a scheme of its own: the group's name
    differs, "config_group_0", its contents do not)."""
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from llmcompressor import model_free_ptq

    src = models["llama-bf16"]
    scheme = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(
        num_bits=4, type="int", strategy="group", group_size=32, symmetric=True, dynamic=False))
    model_free_ptq(src, tmp_path / "ref", scheme=scheme, ignore=["lm_head", EMBED], device="cpu")
    ours = _ckpt(run_ckpt, src, tmp_path / "ours", "ct-w4a16", "--group-size", "32")
    assert_same_tensors(_tensors(ours), _tensors(tmp_path / "ref"))
    qa = json.loads((ours / "config.json").read_text())["quantization_config"]
    qb = _without_embed(json.loads((tmp_path / "ref" / "config.json").read_text()))["quantization_config"]
    assert list(qa.pop("config_groups").values()) == list(qb.pop("config_groups").values())
    assert qa == qb


def test_keep_is_llm_compressors_ignore(tmp_path, run_ckpt, models):
    from llmcompressor import model_free_ptq

    src = models["llama-bf16"]
    ignore = ["lm_head", "model.layers.0.mlp.down_proj", "model.layers.1.mlp.down_proj", EMBED]
    model_free_ptq(src, tmp_path / "ref", scheme="NVFP4A16", ignore=ignore, device="cpu")
    ours = _ckpt(run_ckpt, src, tmp_path / "ours", "ct-nvfp4a16", "--keep", "*.down_proj.weight")
    assert_same_tensors(_tensors(ours), _tensors(tmp_path / "ref"))
    assert json.loads((ours / "config.json").read_text())["quantization_config"] == \
        _without_embed(json.loads((tmp_path / "ref" / "config.json").read_text()))["quantization_config"]


@pytest.mark.parametrize("model,target", [("llama-bf16", "ct-nvfp4a16"), ("llama-bf16", "ct-w4a16"),
                                          ("qwen3-fp32-odd", "ct-fp8-block")])
def test_convert_equals_oneshot_on_every_linear(tmp_path, run_ckpt, models, model, target):
    import transformers
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier

    src = models[model]
    model = transformers.AutoModelForCausalLM.from_pretrained(src, dtype="auto")
    oneshot(model=model, recipe=QuantizationModifier(targets="Linear", scheme=SCHEMES[target], ignore=["lm_head"]))
    model.save_pretrained(tmp_path / "ref")
    ours, theirs = _tensors(_ckpt(run_ckpt, src, tmp_path / "ours", target)), _tensors(tmp_path / "ref")
    assert set(ours) == set(theirs)
    assert all(torch.equal(_bits(ours[k]), _bits(theirs[k])) for k in ours)
