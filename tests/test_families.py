"""The family registry against diffusers' own converters and model classes.

For every family with two layouts: a tiny diffusers model's state dict (values unique per element) is
put into the original layout from the family's pairs; diffusers' single-file converter
(`convert_*_to_diffusers`) must turn that back into exactly the model's keys and values, bit for bit.
That proves the correspondence in both directions (pairs read forwards give what the converter gives;
read backwards they give a file the converter accepts whole). Recognition: each layout's keys are told
apart, with and without shapes, and LoRA module names (kohya-flattened) name the same family.
"""

from __future__ import annotations

import pytest
import torch

from families_util import (diffusers_from_pairs, flux1_converter, original_from_pairs, shapes, state_dict, tiny_chroma,
                           tiny_clip, tiny_flux1, tiny_flux2, tiny_hidream, tiny_hunyuan_video, tiny_lumina2, tiny_ltx2,
                           tiny_ltx_video, tiny_qwen_image, tiny_sd3, tiny_unet, tiny_wan, tiny_z_image, unique_values,
                           with_constants, with_width)
from ckpt import families
from ckpt.families import DIFFUSERS, ORIGINAL

pytest.importorskip("diffusers")


def _sfu():
    from diffusers.loaders import single_file_utils

    return single_file_utils


def _wan(kind):
    return lambda: (tiny_wan(kind), _sfu().convert_wan_transformer_to_diffusers)


def _unet(kind):
    config = {"layers_per_block": 2, **({"addition_embed_type": "text_time"} if kind == "sdxl" else {})}

    def convert(sd):
        out = _sfu().convert_ldm_unet_checkpoint({"model.diffusion_model." + k: v for k, v in sd.items()}, config)
        return out

    return lambda: (tiny_unet(kind), convert)


def _clip():
    model = tiny_clip()

    def convert(sd):
        prefix = "conditioner.embedders.1.model."
        return _sfu().convert_open_clip_checkpoint(model, {prefix + k: v for k, v in sd.items()}, prefix=prefix)

    return model, convert


def _vae():
    from diffusers import AutoencoderKL

    model = AutoencoderKL(block_out_channels=(32, 64), down_block_types=("DownEncoderBlock2D",) * 2,
                          up_block_types=("UpDecoderBlock2D",) * 2, latent_channels=4, layers_per_block=1)
    return model, lambda sd: _sfu().convert_ldm_vae_checkpoint(sd, dict(model.config))


def _hunyuan_video(kind):
    return lambda: (tiny_hunyuan_video(kind), with_width(_sfu().convert_hunyuan_video_transformer_to_diffusers, 16))


# family id, variant label, maker of (tiny model, converter original -> diffusers)
CASES = [
    ("autoencoder_kl", "vae", _vae),
    ("wan", "wan-t2v", _wan("t2v")),
    ("wan", "wan-i2v", _wan("i2v")),
    ("wan", "wan-vace", _wan("vace")),
    ("flux2", "flux2", lambda: (tiny_flux2(), _sfu().convert_flux2_transformer_checkpoint_to_diffusers)),
    ("flux1", "flux1", lambda: (tiny_flux1(), flux1_converter(16))),
    ("sd3", "sd3", lambda: (tiny_sd3(), _sfu().convert_sd3_transformer_checkpoint_to_diffusers)),
    ("sd1", "sd1", _unet("sd1")),
    ("sdxl", "sdxl", _unet("sdxl")),
    ("clip", "clip-bigG-like", _clip),
    ("hunyuan_video", "hunyuan-video-t2v", _hunyuan_video("t2v")),
    ("hunyuan_video", "hunyuan-video-i2v", _hunyuan_video("i2v")),
    ("ltx_video", "ltx-video", lambda: (tiny_ltx_video(), _sfu().convert_ltx_transformer_checkpoint_to_diffusers)),
    ("ltx2", "ltx2", lambda: (tiny_ltx2(), _sfu().convert_ltx2_transformer_to_diffusers)),
    ("chroma", "chroma", lambda: (tiny_chroma(), with_constants(
        _sfu().convert_chroma_transformer_checkpoint_to_diffusers, {3072: 16}))),
    ("z_image", "z_image", lambda: (tiny_z_image(), _sfu().convert_z_image_transformer_checkpoint_to_diffusers)),
    ("z_image", "z_image-omni", lambda: (tiny_z_image(siglip=True),
                                         _sfu().convert_z_image_transformer_checkpoint_to_diffusers)),
    ("lumina2", "lumina2", lambda: (tiny_lumina2(), with_constants(_sfu().convert_lumina2_to_diffusers,
                                                                   {2304: 32, 768: 16}))),
]


@pytest.fixture(scope="module", params=CASES, ids=[c[1] for c in CASES])
def case(request):
    family_id, _, make = request.param
    torch.manual_seed(0)
    model, convert = make()
    sd = unique_values(state_dict(model))
    if family_id == "clip":  # a buffer, not a weight: neither the converter nor OpenCLIP has it
        sd.pop("text_model.embeddings.position_ids", None)
    return family_id, model, sd, convert


def test_original_layout_from_pairs_converts_back_bit_for_bit(case):
    family_id, _, sd, convert = case
    fam = families.get(family_id)
    original = original_from_pairs(fam, sd)
    assert set(original) != set(sd), "the layouts must differ"
    back = convert({k: v.clone() for k, v in original.items()})
    assert set(back) == set(sd)
    for k in sd:
        assert torch.equal(back[k], sd[k]), k
    # and the pairs read forwards give what the converter gives
    forward = diffusers_from_pairs(fam, original)
    assert set(forward) == set(sd) and all(torch.equal(forward[k], sd[k]) for k in sd)


def test_both_layouts_are_recognised(case):
    family_id, _, sd, _ = case
    fam = families.get(family_id)
    original = original_from_pairs(fam, sd)
    for layout, keys in ((ORIGINAL, shapes(original)), (DIFFUSERS, shapes(sd))):
        m = families.detect(keys, keys)
        assert m is not None and m.family is fam and m.layout == layout, (layout, m)
        if family_id not in ("sd1",):  # the tiny SD1 UNet says its cross-attention width: 768
            assert m.family_id == family_id, m
        # kohya-flattened LoRA module names (no shapes) name the same family and layout
        flat = [k.rsplit(".", 1)[0].replace(".", "_") for k in keys if k.endswith(".weight")]
        m2 = families.detect(flat)
        assert m2 is not None and m2.family is fam and m2.layout == layout, (layout, m2)


def test_flux1_and_flux2_told_apart_by_shapes_alone():
    """A kohya Flux.2 LoRA on BFL names carries no Flux.2-only name; its factor shapes tell."""
    from families_util import original_from_pairs as ofp

    f2 = ofp(families.get("flux2"), unique_values(state_dict(tiny_flux2())))
    mods = {k.rsplit(".", 1)[0].replace(".", "_"): v.shape for k, v in f2.items()
            if "_blocks" in k and k.endswith(".weight") and "modulation" not in k}
    assert families.detect(mods, mods).family_id == "flux2"
    assert families.detect(list(mods)).family_id == "flux1"  # names alone cannot tell


def test_registry_ids_and_config_classes():
    ids = {i for f in families.all_families() for i in f.all_ids}
    assert {"sd1", "sd2", "sdxl", "sd3", "flux1", "flux2", "wan", "clip", "t5", "hf_causal_lm", "litgpt",
            "autoencoder_kl"} <= ids
    assert families.get("sdxl") is families.get("sd1")
    assert families.from_config({"_class_name": "WanTransformer3DModel"}) is families.get("wan")
    assert families.from_config({"_class_name": "Flux2Transformer2DModel"}) is families.get("flux2")
    assert families.from_config({"architectures": ["Qwen3ForCausalLM"]}) is families.get("hf_causal_lm")
    assert families.from_config({"_class_name": "Nope"}) is None and families.from_config(None) is None


def test_high_precision_rule_is_per_family():
    wan, flux2 = families.get("wan"), families.get("flux2")
    assert wan.keeps_high_precision("patch_embedding.weight", (16, 4, 1, 2, 2), ORIGINAL)
    assert wan.keeps_high_precision("blocks.0.modulation", (1, 6, 16), ORIGINAL)
    assert not wan.keeps_high_precision("blocks.0.self_attn.q.weight", (16, 16), ORIGINAL)
    assert wan.keeps_high_precision("blocks.0.self_attn.q.bias", (16,), ORIGINAL)  # 1-D: always
    assert flux2.keeps_high_precision("img_in.weight", (16, 4), ORIGINAL)
    assert not flux2.keeps_high_precision("single_blocks.0.linear1.weight", (144, 16), ORIGINAL)
    assert flux2.keeps_high_precision("x_embedder.weight", (16, 4), DIFFUSERS)


# Families whose released files already use diffusers' names: one layout, "diffusers".
ONE_NAMING = [
    ("hidream", tiny_hidream, "convert_hidream_transformer_to_diffusers"),
    ("qwen_image", tiny_qwen_image, None),  # diffusers loads Qwen-Image single files unconverted
]


@pytest.mark.parametrize("family_id,make,converter", ONE_NAMING, ids=[c[0] for c in ONE_NAMING])
def test_one_naming_families(family_id, make, converter):
    """diffusers' single-file loading keeps every name (a ComfyUI file loses only its prefix), and the
    names, the ComfyUI-prefixed file's names without the prefix and kohya-flattened LoRA names all read
    as the family in the diffusers layout."""
    fam = families.get(family_id)
    model = make()
    sd = unique_values(state_dict(model))
    if converter:
        back = getattr(_sfu(), converter)({"model.diffusion_model." + k: v for k, v in sd.items()})
        assert set(back) == set(sd) and all(torch.equal(back[k], sd[k]) for k in sd)
    keys = shapes(sd)
    m = families.detect(keys, keys)
    assert m is not None and m.family is fam and m.family_id == family_id and m.layout == DIFFUSERS, m
    flat = [k.rsplit(".", 1)[0].replace(".", "_") for k in keys if k.endswith(".weight")]
    m2 = families.detect(flat)
    assert m2 is not None and m2.family is fam and m2.layout == DIFFUSERS, m2
    assert fam.kohya_layout == DIFFUSERS and fam.pairs is None


def test_new_families_config_classes():
    for family_id, cls in (("chroma", "ChromaTransformer2DModel"), ("z_image", "ZImageTransformer2DModel"),
                           ("lumina2", "Lumina2Transformer2DModel"), ("hidream", "HiDreamImageTransformer2DModel"),
                           ("qwen_image", "QwenImageTransformer2DModel")):
        assert families.from_config({"_class_name": cls}) is families.get(family_id), family_id
    # Qwen-Image 2.1 is another architecture (gated MLP, no img_mod): not read as Qwen-Image
    assert families.from_config({"_class_name": "QwenImage21Transformer2DModel"}) is families.get("qwen_image21")
    q21 = ["transformer_blocks_0_attn_to_q", "transformer_blocks_0_img_mlp_proj", "transformer_blocks_0_img_mlp_out"]
    m = families.detect(q21)
    assert m is None or m.family_id != "qwen_image", m


def test_z_image_and_lumina2_told_apart():
    """The same original names; Z-Image by its block modulation `adaLN_modulation.0`, its pad tokens, or
    (a LoRA's names alone) an ungrouped fused qkv; Lumina 2 when nothing says Z-Image."""
    z = original_from_pairs(families.get("z_image"), unique_values(state_dict(tiny_z_image())))
    lu = original_from_pairs(families.get("lumina2"), unique_values(state_dict(tiny_lumina2())))
    for sd, want in ((z, "z_image"), (lu, "lumina2")):
        qkv = {k.rsplit(".", 1)[0].replace(".", "_"): tuple(v.shape) for k, v in sd.items()
               if k.endswith("attention.qkv.weight")}
        assert families.detect(qkv, qkv).family_id == want  # shapes of a qkv-only LoRA tell
        assert families.detect(shapes(sd), shapes(sd)).family_id == want
    assert families.detect(["layers_0_attention_qkv", "layers_0_attention_out"]).family_id == "lumina2"


def test_high_precision_of_new_families():
    ch, z, lu, hd, qw = (families.get(i) for i in ("chroma", "z_image", "lumina2", "hidream", "qwen_image"))
    assert ch.keeps_high_precision("distilled_guidance_layer.layers.0.in_layer.weight", (32, 32), ORIGINAL)
    assert ch.keeps_high_precision("distilled_guidance_layer.layers.0.linear_1.weight", (32, 32), DIFFUSERS)
    assert not ch.keeps_high_precision("double_blocks.0.img_attn.qkv.weight", (48, 16), ORIGINAL)
    assert z.keeps_high_precision("x_pad_token", (1, 32), ORIGINAL) and z.keeps_high_precision(
        "all_final_layer.2-1.linear.weight", (16, 32), DIFFUSERS)
    assert not z.keeps_high_precision("layers.0.attention.qkv.weight", (96, 32), ORIGINAL)
    assert lu.keeps_high_precision("time_caption_embed.caption_embedder.1.weight", (32, 16), DIFFUSERS)
    assert not lu.keeps_high_precision("layers.0.feed_forward.w1.weight", (96, 32), ORIGINAL)
    assert hd.keeps_high_precision("double_stream_blocks.0.block.ff_i.gate.weight", (2, 16), DIFFUSERS)
    assert not hd.keeps_high_precision("double_stream_blocks.0.block.ff_i.experts.0.w1.weight", (64, 16), DIFFUSERS)
    assert qw.keeps_high_precision("img_in.weight", (16, 64), DIFFUSERS)
    assert not qw.keeps_high_precision("transformer_blocks.0.img_mod.1.weight", (96, 16), DIFFUSERS)
