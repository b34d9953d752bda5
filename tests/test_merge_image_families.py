"""merge-lora on Chroma, Z-Image, Lumina 2, HiDream and Qwen-Image, both layouts, against diffusers' own
LoRA loading (the helpers of tests/helpers/merge_compare.py; diffusers-format LoRAs onto the original
layout are the table of tests/test_merge_diffusers_loras.py).

Bases: a tiny diffusers model saved with `save_pretrained` (diffusers layout), or its original layout made
from the family's pairs and checked by diffusers' converter. LoRAs: PEFT adapters saved by the pipeline's
`save_lora_weights`, or original-named files (kohya `lora_unet_`, ComfyUI `diffusion_model.`) written here.
Oracle: the pipeline's `lora_state_dict` (which converts non-diffusers namings itself), `load_lora_adapter`,
`fuse_lora`. Where diffusers' LoRA converter hard-codes a release's width (Chroma's 3072 for kohya
`linear1`, Lumina 2's 2304/768 qkv split), it runs with the tiny model's width (`with_constants`).
fp32: rtol 1e-5, atol 1e-6.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from families_util import original_from_pairs, state_dict, tiny_chroma, with_constants
from helpers.merge_compare import compare, diffusers_fused, peft_lora_file
from ckpt import families

diffusers = pytest.importorskip("diffusers")
PREFIX = "model.diffusion_model."


def _sfu():
    from diffusers.loaders import single_file_utils

    return single_file_utils


def _original_base(family_id, base_sd, convert, path, prefix=PREFIX):
    """The original layout of a diffusers state dict from the family's pairs, checked by diffusers'
    converter, saved at `path` (ComfyUI's prefix by default)."""
    original = original_from_pairs(families.get(family_id), base_sd)
    back = convert({k: v.clone() for k, v in original.items()})
    assert set(back) == set(base_sd) and all(torch.equal(back[k], base_sd[k]) for k in base_sd)
    save_file({prefix + k: v for k, v in original.items()}, path)
    return original


def _merged_original(out, convert, original, stdout, prefix=PREFIX):
    """The merged original-layout file through diffusers' converter; checks the count merge-lora reports
    (original tensors changed)."""
    merged = {k[len(prefix):]: v for k, v in load_file(out).items()}
    assert set(merged) == set(original)
    changed = sum(not torch.equal(merged[k], original[k]) for k in original)
    assert f"base tensors changed: {changed}" in stdout, stdout
    return convert(merged)


def _lora_pair(name, w, r=4, kohya=True, alpha=None):
    """Random LoRA factors for base weight `w` under module name `name` (kohya down/up or A/B)."""
    down, up = (".lora_down.weight", ".lora_up.weight") if kohya else (".lora_A.weight", ".lora_B.weight")
    out = {name + down: torch.randn(r, w.shape[1]) * 0.1, name + up: torch.randn(w.shape[0], r) * 0.1}
    if alpha is not None:
        out[name + ".alpha"] = torch.tensor(float(alpha))
    return out


# ------------------------------------------------------------------------------------------ Chroma

def _chroma_convert():
    return with_constants(_sfu().convert_chroma_transformer_checkpoint_to_diffusers, {3072: 16})


def test_kohya_chroma_lora_onto_diffusers_folder(tmp_path, run_ckpt, monkeypatch):
    """A kohya/ai-toolkit Chroma LoRA (original names: fused qkv and linear1) on a diffusers folder; oracle:
    diffusers' kohya Flux converter, which ChromaPipeline uses (its linear1 split set to the tiny width).
    Not `img_in`/`txt_in`: that converter names them without `transformer.`, so diffusers drops them."""
    from diffusers.loaders import lora_conversion_utils, lora_pipeline

    monkeypatch.setattr(lora_pipeline, "_convert_kohya_flux_lora_to_diffusers", with_constants(
        lora_conversion_utils._convert_kohya_flux_lora_to_diffusers, {3072: 16, 12288: 64}))
    torch.manual_seed(1)
    model = tiny_chroma()
    base_sd = state_dict(model)
    model.save_pretrained(tmp_path / "chroma")
    original = original_from_pairs(families.get("chroma"), base_sd)
    lora = {}
    for mod in ("double_blocks.0.img_attn.qkv", "double_blocks.0.txt_attn.qkv", "double_blocks.0.img_mlp.0",
                "double_blocks.0.txt_attn.proj", "single_blocks.0.linear1", "single_blocks.1.linear2"):
        lora.update(_lora_pair("lora_unet_" + mod.replace(".", "_"), original[f"{mod}.weight"], alpha=2))
    save_file(lora, tmp_path / "kohya.safetensors")
    want = diffusers_fused(tiny_chroma, base_sd, tmp_path / "kohya.safetensors", diffusers.ChromaPipeline, 1.0)

    code, stdout, err = run_ckpt("merge-lora", tmp_path / "chroma", tmp_path / "kohya.safetensors", "-o",
                                 tmp_path / "out", "-q")
    assert code == 0, err
    got = load_file(tmp_path / "out" / "diffusion_pytorch_model.safetensors")
    assert compare(got, want, base_sd) == 3 + 3 + 1 + 1 + 4 + 1
    assert "6 LoRA modules matched" in stdout


# ----------------------------------------------------------------------------------------- inspect

@pytest.mark.parametrize("family_id", ["chroma", "z_image", "lumina2", "hidream", "qwen_image"])
def test_inspect_reports_family_id_and_layout(tmp_path, run_ckpt, family_id):
    """A diffusers folder is the diffusers layout; a ComfyUI single file is the original layout where the
    family has one, else the diffusers layout (HiDream, Qwen-Image files use diffusers' names)."""
    import families_util

    model = getattr(families_util, f"tiny_{family_id}")()
    model.save_pretrained(tmp_path / "folder")
    sd = state_dict(model)
    fam = families.get(family_id)
    single = original_from_pairs(fam, sd) if fam.pairs else sd
    save_file({PREFIX + k: v for k, v in single.items()}, tmp_path / "single.safetensors")
    seen = {}
    for name in ("folder", "single.safetensors"):
        code, out, err = run_ckpt("inspect", "--json", tmp_path / name)
        assert code == 0, err
        (c,) = json.loads(out)["components"]
        seen[name] = (c["family_id"], c["layout"])
    assert seen["folder"] == (family_id, "diffusers")
    assert seen["single.safetensors"] == (family_id, "original" if fam.pairs else "diffusers")


# ----------------------------------------------------------------------------------------- Z-Image

def _z_convert():
    return _sfu().convert_z_image_transformer_checkpoint_to_diffusers


def test_musubi_z_image_lora_onto_original_base(tmp_path, run_ckpt):
    """The common case: a musubi-tuner/ai-toolkit Z-Image LoRA (kohya names of the diffusers modules,
    `lora_unet_layers_0_attention_to_q`) on ComfyUI's original-layout file (fused `attention.qkv`);
    oracle: the pipeline's kohya converter, fused into the diffusers model."""
    from families_util import tiny_z_image

    torch.manual_seed(3)
    model = tiny_z_image()
    base_sd = state_dict(model)
    original = _original_base("z_image", base_sd, _z_convert(), tmp_path / "z.safetensors")
    lora = {}
    for head, n in (("layers", 2), ("noise_refiner", 1), ("context_refiner", 1)):
        for i in range(n):
            for mod in ("attention.to_q", "attention.to_k", "attention.to_v", "attention.to_out.0",
                        "feed_forward.w2") + (("adaLN_modulation.0",) if head != "context_refiner" else ()):
                key = f"{head}.{i}.{mod}"
                lora.update(_lora_pair("lora_unet_" + key.replace(".", "_"), base_sd[key + ".weight"], alpha=3))
    save_file(lora, tmp_path / "musubi.safetensors")
    want = diffusers_fused(tiny_z_image, base_sd, tmp_path / "musubi.safetensors", diffusers.ZImagePipeline, 1.0)

    out = tmp_path / "out.safetensors"
    code, stdout, err = run_ckpt("merge-lora", tmp_path / "z.safetensors", tmp_path / "musubi.safetensors", "-o", out)
    assert code == 0, err
    got = _merged_original(out, _z_convert(), original, stdout)
    assert compare(got, want, base_sd) == 4 * 5 + 3
    assert "23 LoRA modules matched" in stdout


def test_comfyui_z_image_lora_onto_diffusers_folder(tmp_path, run_ckpt):
    """A ComfyUI-named LoRA (original names, `diffusion_model.`, kohya down/up) on a diffusers folder:
    `attention.out` lands on `to_out.0`; oracle: diffusers. Its fused `attention.qkv` and `final_layer`
    (diffusers' LoRA converter maps neither: it drops them) land on to_q/k/v and `all_final_layer.2-1`
    exactly as merging the LoRA into the original file and converting that with diffusers' converter."""
    from families_util import tiny_z_image

    torch.manual_seed(4)
    model = tiny_z_image()
    base_sd = state_dict(model)
    model.save_pretrained(tmp_path / "z")
    original = _original_base("z_image", base_sd, _z_convert(), tmp_path / "z.safetensors")
    lora = {}
    for mod in ("layers.0.attention.out", "layers.1.feed_forward.w1", "noise_refiner.0.adaLN_modulation.0",
                "context_refiner.0.attention.out"):
        lora.update(_lora_pair("diffusion_model." + mod, original[mod + ".weight"], alpha=2))
    save_file(lora, tmp_path / "comfy.safetensors")
    want = diffusers_fused(tiny_z_image, base_sd, tmp_path / "comfy.safetensors", diffusers.ZImagePipeline, 1.0)
    code, stdout, err = run_ckpt("merge-lora", tmp_path / "z", tmp_path / "comfy.safetensors", "-o",
                                 tmp_path / "out", "-q")
    assert code == 0, err
    assert compare(load_file(tmp_path / "out" / "diffusion_pytorch_model.safetensors"), want, base_sd) == 4

    qkv = {}
    for mod in ("layers.0.attention.qkv", "noise_refiner.0.attention.qkv", "final_layer.linear"):
        qkv.update(_lora_pair("diffusion_model." + mod, original[mod + ".weight"], alpha=2))
    save_file(qkv, tmp_path / "qkv.safetensors")
    for base, out in (("z", "out2"), ("z.safetensors", "out2.safetensors")):
        code, stdout, err = run_ckpt("merge-lora", tmp_path / base, tmp_path / "qkv.safetensors", "-o",
                                     tmp_path / out, "-q")
        assert code == 0, err
    via_original = _z_convert()({k[len(PREFIX):]: v for k, v in load_file(tmp_path / "out2.safetensors").items()})
    got = load_file(tmp_path / "out2" / "diffusion_pytorch_model.safetensors")
    assert compare(got, via_original, base_sd) == 3 + 3 + 1


# --------------------------------------------------------------------------------------- Lumina 2

def _lumina_convert():
    return with_constants(_sfu().convert_lumina2_to_diffusers, {2304: 32, 768: 16})


def test_comfyui_lumina2_lora_onto_diffusers_folder(tmp_path, run_ckpt, monkeypatch):
    """A ComfyUI / sd-scripts Lumina 2 LoRA (original names: fused GQA `attention.qkv`, `w1..w3`,
    `adaLN_modulation.1`) on a diffusers folder; oracle: diffusers' Lumina 2 LoRA converter (its
    2304/768 qkv split set to the tiny model's 32/16), which needs every one of those modules."""
    from diffusers.loaders import lora_conversion_utils, lora_pipeline

    from families_util import tiny_lumina2

    monkeypatch.setattr(lora_pipeline, "_convert_non_diffusers_lumina2_lora_to_diffusers", with_constants(
        lora_conversion_utils._convert_non_diffusers_lumina2_lora_to_diffusers, {2304: 32, 768: 16}))
    torch.manual_seed(6)
    model = tiny_lumina2()
    base_sd = state_dict(model)
    model.save_pretrained(tmp_path / "lu")
    original = original_from_pairs(families.get("lumina2"), base_sd)
    lora = {}
    for head, n in (("layers", 2), ("noise_refiner", 2), ("context_refiner", 2)):
        for i in range(n):
            mods = ["attention.qkv", "attention.out", "feed_forward.w1", "feed_forward.w2", "feed_forward.w3"]
            for mod in mods + (["adaLN_modulation.1"] if head != "context_refiner" else []):
                key = f"{head}.{i}.{mod}"
                lora.update(_lora_pair("diffusion_model." + key, original[key + ".weight"], kohya=False))
    save_file(lora, tmp_path / "comfy.safetensors")
    want = diffusers_fused(tiny_lumina2, base_sd, tmp_path / "comfy.safetensors", diffusers.Lumina2Pipeline, 1.0)

    code, stdout, err = run_ckpt("merge-lora", tmp_path / "lu", tmp_path / "comfy.safetensors", "-o",
                                 tmp_path / "out", "-q")
    assert code == 0, err
    got = load_file(tmp_path / "out" / "diffusion_pytorch_model.safetensors")
    assert compare(got, want, base_sd) == 6 * (3 + 1 + 3) + 4
    assert "34 LoRA modules matched" in stdout


# ------------------------------------------------------------------------- HiDream, Qwen-Image (one naming)

def test_diffusers_hidream_lora_onto_comfyui_file(tmp_path, run_ckpt):
    """A PEFT LoRA on attention, the mixture-of-experts feed-forwards (shared and routed experts) and
    the embedders, onto a ComfyUI single file (diffusers names under `model.diffusion_model.`)."""
    from families_util import tiny_hidream

    torch.manual_seed(7)
    model = tiny_hidream()
    base_sd = state_dict(model)
    save_file({PREFIX + k: v for k, v in base_sd.items()}, tmp_path / "hd.safetensors")
    targets = (r".*(attn1\.(to_q|to_k|to_v|to_out|to_q_t|to_out_t)|ff_i\.(shared_experts|experts\.\d+)\.w[12]"
               r"|ff_t\.w3|adaLN_modulation\.1|caption_projection\.\d+\.linear|x_embedder\.proj)")
    lora = peft_lora_file(model, targets, tmp_path / "lora", diffusers.HiDreamImagePipeline)
    want = diffusers_fused(tiny_hidream, base_sd, lora, diffusers.HiDreamImagePipeline, 0.6)

    out = tmp_path / "out.safetensors"
    code, stdout, err = run_ckpt("merge-lora", tmp_path / "hd.safetensors", lora, "--ratio", "0.6", "-o", out)
    assert code == 0, err
    got = {k[len(PREFIX):]: v for k, v in load_file(out).items()}
    n = compare(got, want, base_sd)
    # double block 6 attn + 6 ff_i + ff_t + adaLN, single 4 + 6 + adaLN, 3 caption projections, x_embedder,
    # final_layer's adaLN
    assert n == 14 + 11 + 3 + 1 + 1 and f"base tensors changed: {n}" in stdout


def test_comfyui_and_kohya_hidream_loras_onto_diffusers_folder(tmp_path, run_ckpt):
    """ComfyUI/ai-toolkit `diffusion_model.` names (oracle: diffusers' HiDream converter) and the same
    factors under kohya-flattened names (`lora_unet_double_stream_blocks_0_block_attn1_to_q`, which
    diffusers does not read) give the same merge."""
    from families_util import tiny_hidream

    torch.manual_seed(8)
    model = tiny_hidream()
    base_sd = state_dict(model)
    model.save_pretrained(tmp_path / "hd")
    comfy, kohya = {}, {}
    for mod in ("double_stream_blocks.0.block.attn1.to_q", "double_stream_blocks.0.block.attn1.to_v_t",
                "double_stream_blocks.0.block.ff_i.experts.1.w3",
                "single_stream_blocks.0.block.ff_i.shared_experts.w2",
                "single_stream_blocks.0.block.adaLN_modulation.1", "final_layer.linear",
                "t_embedder.timestep_embedder.linear_1"):
        pair = _lora_pair(mod, base_sd[mod + ".weight"], kohya=False)
        comfy.update({"diffusion_model." + k: v for k, v in pair.items()})
        kohya.update({"lora_unet_" + mod.replace(".", "_") + k[len(mod):].replace("lora_A", "lora_down").replace(
            "lora_B", "lora_up"): v for k, v in pair.items()})
    save_file(comfy, tmp_path / "comfy.safetensors")
    save_file(kohya, tmp_path / "kohya.safetensors")
    want = diffusers_fused(tiny_hidream, base_sd, tmp_path / "comfy.safetensors", diffusers.HiDreamImagePipeline, 1.0)
    for name in ("comfy", "kohya"):
        code, stdout, err = run_ckpt("merge-lora", tmp_path / "hd", tmp_path / f"{name}.safetensors", "-o",
                                     tmp_path / f"out_{name}", "-q")
        assert code == 0, err
        assert "7 LoRA modules matched" in stdout
        assert compare(load_file(tmp_path / f"out_{name}" / "diffusion_pytorch_model.safetensors"), want, base_sd) == 7


def test_diffsynth_qwen_image_lora_onto_comfyui_file(tmp_path, run_ckpt):
    """A DiffSynth-Studio Qwen-Image LoRA (no prefix, `.lora_A.default.weight`) onto a ComfyUI single file;
    oracle: the pipeline's Qwen LoRA converter."""
    from families_util import tiny_qwen_image

    torch.manual_seed(9)
    model = tiny_qwen_image()
    base_sd = state_dict(model)
    save_file({PREFIX + k: v for k, v in base_sd.items()}, tmp_path / "q.safetensors")
    lora = {}
    for i in range(2):
        for mod in ("attn.to_q", "attn.add_k_proj", "attn.to_add_out", "img_mlp.net.0.proj", "txt_mlp.net.2",
                    "img_mod.1"):
            key = f"transformer_blocks.{i}.{mod}"
            pair = _lora_pair(key, base_sd[key + ".weight"], kohya=False)
            lora.update({k.replace(".lora_A.", ".lora_A.default.").replace(".lora_B.", ".lora_B.default."): v
                         for k, v in pair.items()})
    save_file(lora, tmp_path / "diffsynth.safetensors")
    want = diffusers_fused(tiny_qwen_image, base_sd, tmp_path / "diffsynth.safetensors", diffusers.QwenImagePipeline, 0.9)

    out = tmp_path / "out.safetensors"
    code, stdout, err = run_ckpt("merge-lora", tmp_path / "q.safetensors", tmp_path / "diffsynth.safetensors",
                                 "--ratio", "0.9", "-o", out, "-q")
    assert code == 0, err
    assert compare({k[len(PREFIX):]: v for k, v in load_file(out).items()}, want, base_sd) == 12


def test_musubi_qwen_image_lora_onto_diffusers_folder(tmp_path, run_ckpt):
    """musubi-tuner/kohya Qwen-Image names: the diffusers names flattened, underscores of `add_q_proj`,
    `to_add_out`, `img_mlp`, `img_mod` and of the top-level modules included; alpha scaling; oracle: the
    pipeline's Qwen converter (which un-flattens them by its own rules)."""
    from families_util import tiny_qwen_image

    torch.manual_seed(10)
    model = tiny_qwen_image()
    base_sd = state_dict(model)
    model.save_pretrained(tmp_path / "q")
    mods = [f"transformer_blocks.{i}.{m}" for i in range(2) for m in
            ("attn.add_q_proj", "attn.to_add_out", "attn.to_out.0", "img_mlp.net.2", "txt_mod.1", "txt_mlp.net.0.proj")]
    mods += ["img_in", "txt_in", "proj_out", "norm_out.linear", "time_text_embed.timestep_embedder.linear_1"]
    lora = {}
    for mod in mods:
        lora.update(_lora_pair("lora_unet_" + mod.replace(".", "_"), base_sd[mod + ".weight"], alpha=8))
    save_file(lora, tmp_path / "musubi.safetensors")
    want = diffusers_fused(tiny_qwen_image, base_sd, tmp_path / "musubi.safetensors", diffusers.QwenImagePipeline, 1.0)

    code, stdout, err = run_ckpt("merge-lora", tmp_path / "q", tmp_path / "musubi.safetensors", "-o",
                                 tmp_path / "out", "-q")
    assert code == 0, err
    assert f"{len(mods)} LoRA modules matched" in stdout
    assert compare(load_file(tmp_path / "out" / "diffusion_pytorch_model.safetensors"), want, base_sd) == len(mods)


# ------------------------------------------------------------------------- namings, unmatched message

def test_every_naming_of_one_z_image_lora_merges_the_same(tmp_path, run_ckpt):
    """The same factors under each trainer's naming of the diffusers modules (PEFT `transformer.`,
    DiffSynth `.default.`, `base_model.model.`, OneTrainer `lora_transformer_`, SimpleTuner `lycoris_`,
    musubi `lora_unet_`) and ComfyUI's `diffusion_model.` (original `attention.out`; `to_k`, a row third of
    `attention.qkv`, by the diffusers name ComfyUI's Z-Image key map also takes) give the same tensors on an
    original-layout base."""
    from families_util import tiny_z_image

    torch.manual_seed(11)
    base_sd = state_dict(tiny_z_image())
    _original_base("z_image", base_sd, _z_convert(), tmp_path / "z.safetensors")
    factors = {m: _lora_pair("", base_sd[m + ".weight"], kohya=False) for m in
               ("layers.0.attention.to_k", "layers.1.attention.to_out.0", "noise_refiner.0.feed_forward.w2")}
    original_name = {"layers.0.attention.to_k": None, "layers.1.attention.to_out.0": "layers.1.attention.out",
                     "noise_refiner.0.feed_forward.w2": "noise_refiner.0.feed_forward.w2"}
    namings = {
        "peft": lambda m, part: f"transformer.{m}.lora_{part}.weight",
        "diffsynth": lambda m, part: f"{m}.lora_{part}.default.weight",
        "base_model": lambda m, part: f"base_model.model.{m}.lora_{part}.weight",
        "onetrainer": lambda m, part: f"lora_transformer_{m.replace('.', '_')}.lora_{part}.weight",
        "lycoris": lambda m, part: f"lycoris_{m.replace('.', '_')}.lora_{'down' if part == 'A' else 'up'}.weight",
        "musubi": lambda m, part: f"lora_unet_{m.replace('.', '_')}.lora_{'down' if part == 'A' else 'up'}.weight",
        "comfyui": lambda m, part: f"diffusion_model.{original_name[m] or m}.lora_{part}.weight",
    }
    merged = {}
    for naming, spell in namings.items():
        lora = {spell(m, k.split("_")[-1][0]): v for m, pair in factors.items() for k, v in
                ((k.replace(".weight", ""), v) for k, v in pair.items())}
        save_file(lora, tmp_path / f"{naming}.safetensors")
        out = tmp_path / f"{naming}_out.safetensors"
        code, stdout, err = run_ckpt("merge-lora", tmp_path / "z.safetensors", tmp_path / f"{naming}.safetensors",
                                     "-o", out)
        assert code == 0, (naming, err)
        assert "3 LoRA modules matched" in stdout and "base tensors changed: 3" in stdout, (naming, stdout)
        merged[naming] = load_file(out)
    first = merged.pop("peft")
    for naming, got in merged.items():
        assert set(got) == set(first) and all(torch.equal(got[k], first[k]) for k in first), naming


def test_z_image_lora_on_lumina2_base_is_refused_naming_both(tmp_path, run_ckpt):
    from families_util import tiny_lumina2

    tiny_lumina2().save_pretrained(tmp_path / "lu")
    lora = {}
    for mod in ("layers.0.attention.to_q", "layers.0.attention.to_k", "layers.0.adaLN_modulation.0"):
        lora.update(_lora_pair("lora_unet_" + mod.replace(".", "_"), torch.zeros(32, 32)))
    save_file(lora, tmp_path / "z_lora.safetensors")
    code, _, err = run_ckpt("merge-lora", tmp_path / "lu", tmp_path / "z_lora.safetensors", "-o", tmp_path / "o")
    assert code == 2 and "Traceback" not in err
    assert "kohya LoRA for z_image (diffusers layout); base is lumina2 (diffusers layout)" in err, err
    assert not (tmp_path / "o").exists()
