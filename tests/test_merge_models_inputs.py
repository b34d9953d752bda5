"""`ckpt merge` over inputs in any format and layout: a merge of quantized inputs (fp8 scaled, ComfyUI int8,
GGUF) equals the merge of their decoded versions bit for bit; a diffusers-folder fine-tune merges with an
original single file as its converted version does; `--layout` writes the other layout; `BASE+LORA` equals
mergekit's; `--keep-format` re-encodes into the reference's format as `convert` encodes."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from families_util import original_from_pairs, state_dict, tiny_flux1
from helpers.merge_oracle import max_diff, same_yaml, tensors, variants

LINEAR = "merge_method: linear\nmodels:\n  - model: {a}\n    parameters: {{weight: 0.3}}\n" \
         "  - model: {b}\n    parameters: {{weight: 0.7}}\ndtype: float32\n"


@pytest.fixture(scope="module")
def flux(tmp_path_factory):
    """Two Flux.1 original-layout files, B a fine-tune of A (random values, so every quantizer has work)."""
    from ckpt import families

    root = tmp_path_factory.mktemp("flux")
    torch.manual_seed(0)
    model = tiny_flux1()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.05)
    sd = original_from_pairs(families.get("flux1"), state_dict(model))
    model.save_config(root / "config")  # the diffusers config.json of --layout diffusers (no release has this size)
    save_file(sd, root / "a.safetensors")
    g = torch.Generator().manual_seed(1)
    save_file({k: v + 0.01 * torch.randn(v.shape, generator=g) for k, v in sd.items()}, root / "b.safetensors")
    return root


def _merge(run_ckpt, tmp_path, a, b, out, *extra):
    cfg = tmp_path / f"{out.name}.yaml"
    cfg.write_text(LINEAR.format(a=a, b=b))
    code, o, err = run_ckpt("merge", cfg, "-o", out, "-q", *extra)
    assert code == 0, (o, err)
    return out


@pytest.mark.parametrize("to", [["fp8_e4m3fn", "--scaled"], ["int8"], ["gguf-q8_0"], ["gguf-q4_1"], ["bf16"]])
def test_quantized_input_merges_as_its_decoded_version(run_ckpt, tmp_path, flux, to):
    ext = ".gguf" if to[0].startswith("gguf") else ".safetensors"
    q = tmp_path / f"bq{ext}"
    code, out, err = run_ckpt("convert", flux / "b.safetensors", "--to", *to, "-o", q, "-q")
    assert code == 0, err
    code, out, err = run_ckpt("convert", q, "--to", "fp32", "-o", tmp_path / "bd.safetensors", "-q")
    assert code == 0, err
    got = _merge(run_ckpt, tmp_path, flux / "a.safetensors", q, tmp_path / "m1.safetensors")
    want = _merge(run_ckpt, tmp_path, flux / "a.safetensors", tmp_path / "bd.safetensors", tmp_path / "m2.safetensors")
    assert max_diff(tensors(got), tensors(want)) == 0


def test_a_diffusers_folder_merges_with_an_original_file(run_ckpt, tmp_path, flux):
    code, out, err = run_ckpt("convert", flux / "b.safetensors", "--layout", "diffusers", "-o", tmp_path / "bdiff", "-q",
                              "--config", flux / "config")
    assert code == 0, err
    got = _merge(run_ckpt, tmp_path, flux / "a.safetensors", tmp_path / "bdiff", tmp_path / "m1.safetensors")
    want = _merge(run_ckpt, tmp_path, flux / "a.safetensors", flux / "b.safetensors", tmp_path / "m2.safetensors")
    assert max_diff(tensors(got), tensors(want)) == 0
    # the reference (the base, else the first model) names the output: a diffusers base, a diffusers folder
    rev = tmp_path / "rev.yaml"
    rev.write_text("merge_method: linear\nbase_model: {b}\nmodels:\n  - model: {a}\n    parameters: {{weight: 0.3}}\n"
                   "  - model: {b}\n    parameters: {{weight: 0.7}}\ndtype: float32\n".format(
                       a=flux / "a.safetensors", b=tmp_path / "bdiff"))
    code, out, err = run_ckpt("merge", rev, "-o", tmp_path / "m3", "-q")
    assert code == 0, err
    code, out, err = run_ckpt("convert", want, "--layout", "diffusers", "-o", tmp_path / "m2diff", "-q",
                              "--config", flux / "config")
    assert code == 0, err
    assert max_diff(tensors(tmp_path / "m3"), tensors(tmp_path / "m2diff")) == 0
    # --layout diffusers from two original files: the converted merge
    got = _merge(run_ckpt, tmp_path, flux / "a.safetensors", flux / "b.safetensors", tmp_path / "m4", "--layout", "diffusers",
                 "--config", flux / "config")
    assert max_diff(tensors(got), tensors(tmp_path / "m2diff")) == 0
    assert (tmp_path / "m4" / "config.json").exists()


def test_keep_format_reencodes_as_convert_encodes(run_ckpt, tmp_path, flux):
    aq = tmp_path / "aq.safetensors"
    code, out, err = run_ckpt("convert", flux / "a.safetensors", "--to", "fp8_e4m3fn", "--scaled", "-o", aq, "-q")
    assert code == 0, err
    got = _merge(run_ckpt, tmp_path, aq, flux / "b.safetensors", tmp_path / "kf.safetensors", "--keep-format")
    plain = _merge(run_ckpt, tmp_path, aq, flux / "b.safetensors", tmp_path / "plain.safetensors", "--to", "fp32")
    code, out, err = run_ckpt("convert", plain, "--to", "fp8_e4m3fn", "--scaled", "-o", tmp_path / "enc.safetensors", "-q")
    assert code == 0, err
    a, b = load_file(got), load_file(tmp_path / "enc.safetensors")
    assert set(a) == set(load_file(aq))
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k].reshape(-1).view(torch.uint8), b[k].reshape(-1).view(torch.uint8)), k


def test_base_plus_lora_equals_mergekit(run_ckpt, tmp_path):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    ms = variants(tmp_path, 2)
    torch.manual_seed(5)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(ms[1]),
                           LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"]))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_" in n:
                p.normal_(0, 0.1)
    model.save_pretrained(tmp_path / "lora")
    same_yaml(run_ckpt, tmp_path, f"""merge_method: linear
models:
  - model: {ms[0]}
    parameters: {{weight: 0.5}}
  - model: {ms[1]}+{tmp_path / 'lora'}
    parameters: {{weight: 0.5}}
dtype: float32
""", tol=2e-7)


def test_keep_format_on_a_gguf_reference_writes_gguf(run_ckpt, tmp_path, flux):
    import gguf

    aq = tmp_path / "aq.gguf"
    code, out, err = run_ckpt("convert", flux / "a.safetensors", "--to", "gguf-q8_0", "-o", aq, "-q")
    assert code == 0, err
    got = _merge(run_ckpt, tmp_path, aq, flux / "b.safetensors", tmp_path / "kf.gguf", "--keep-format")
    plain = _merge(run_ckpt, tmp_path, aq, flux / "b.safetensors", tmp_path / "plain.safetensors", "--to", "fp32")
    code, out, err = run_ckpt("convert", plain, "--to", "gguf-q8_0", "-o", tmp_path / "enc.gguf", "-q")
    assert code == 0, err
    a = {t.name: t for t in gguf.GGUFReader(got).tensors}
    b = {t.name: t for t in gguf.GGUFReader(tmp_path / "enc.gguf").tensors}
    assert set(a) == set(b)
    for k in a:
        assert a[k].tensor_type == b[k].tensor_type and bytes(a[k].data) == bytes(b[k].data), k
