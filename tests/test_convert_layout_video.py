"""`ckpt convert --layout` for HunyuanVideo 1.x/1.5 and LTX-Video/LTX-2: tests/test_convert_layout.py's two
oracle tests (original -> diffusers equal to diffusers' converter bit for bit, `from_pretrained` strict and
config values the tiny model's own; diffusers -> original mapped back exactly by the converter; original ->
diffusers -> original byte-identical) run here over these families' tiny models.

Tiny models use the head sizes the families' conventions know (128: the rope axes). Where diffusers'
converter hard-codes a width (HunyuanVideo's 3072), it runs with the tiny width (`with_width`).
"""

from __future__ import annotations

import pytest
import torch

from families_util import (comfy_hunyuan_video, diffusers_from_pairs, original_from_pairs, state_dict, tiny_flux1,
                           tiny_hunyuan_video15, with_width)
from helpers.layout_round_trips import diffusers_folder_to_original_and_round_trip, original_file_to_diffusers_folder
from ckpt import families

diffusers = pytest.importorskip("diffusers")


def _sfu():
    from diffusers.loaders import single_file_utils

    return single_file_utils


def _hunyuan_video(in_channels=16, guidance=True):
    return (lambda: diffusers.HunyuanVideoTransformer3DModel(
        in_channels=in_channels, out_channels=16, num_attention_heads=1, attention_head_dim=128, num_layers=1,
        num_single_layers=2, num_refiner_layers=1, text_embed_dim=12, pooled_projection_dim=8,
        guidance_embeds=guidance, image_condition_type="latent_concat" if in_channels == 33 else None),
        lambda: with_width(_sfu().convert_hunyuan_video_transformer_to_diffusers, 128))


def _hunyuan_video15(meanflow):
    """No diffusers converter for 1.5: the family's own pairs stand in for it (tests/test_families_hunyuan15.py
    checks them); what is tested here is the conversion itself, the config and from_pretrained."""
    fam = families.get("hunyuan_video15")
    return (lambda: tiny_hunyuan_video15(meanflow, head=128), lambda: (lambda sd: diffusers_from_pairs(fam, sd)))


def _ltx_video():
    return (lambda: diffusers.LTXVideoTransformer3DModel(
        in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=64, cross_attention_dim=16,
        num_layers=2, caption_channels=12), lambda: _sfu().convert_ltx_transformer_checkpoint_to_diffusers)


def _ltx2():
    return (lambda: diffusers.LTX2VideoTransformer3DModel(
        in_channels=4, out_channels=4, num_attention_heads=1, attention_head_dim=128, cross_attention_dim=16,
        num_layers=2, caption_channels=12, audio_in_channels=4, audio_out_channels=4, audio_num_attention_heads=1,
        audio_attention_head_dim=64, audio_cross_attention_dim=8), lambda: _sfu().convert_ltx2_transformer_to_diffusers)


CASES = {"hunyuan-video-t2v": ("hunyuan_video", *_hunyuan_video()),
         "hunyuan-video-i2v": ("hunyuan_video", *_hunyuan_video(33, guidance=False)),
         "hunyuan-video15": ("hunyuan_video15", *_hunyuan_video15(False)),
         "hunyuan-video15-meanflow": ("hunyuan_video15", *_hunyuan_video15(True)),
         "ltx-video": ("ltx_video", *_ltx_video()),
         "ltx2": ("ltx2", *_ltx2())}


@pytest.fixture(scope="module", params=list(CASES))
def case(request):
    family_id, make, converter = CASES[request.param]
    torch.manual_seed(0)
    model = make()
    sd = state_dict(model)
    original = original_from_pairs(families.get(family_id), sd)
    convert = converter()
    back = convert({k: v.clone() for k, v in original.items()})
    assert set(back) == set(sd) and all(torch.equal(back[k], sd[k]) for k in sd)
    return model, sd, original, convert


@pytest.mark.parametrize("prefix", ["", "model.diffusion_model."])
def test_original_file_to_diffusers_folder(tmp_path, run_ckpt, case, prefix):
    original_file_to_diffusers_folder(tmp_path, run_ckpt, case, prefix)


def test_diffusers_folder_to_original_and_round_trip(tmp_path, run_ckpt, case):
    diffusers_folder_to_original_and_round_trip(tmp_path, run_ckpt, case)


def test_ltx2_text_connectors_are_dropped_with_a_note(tmp_path, run_ckpt):
    """The release keeps the text connectors inside the transformer; diffusers makes them a model of their
    own (LTX2TextConnectors), and its converter drops them from the transformer: so does --layout diffusers,
    saying so."""
    from safetensors.torch import load_file, save_file

    make, converter = _ltx2()
    torch.manual_seed(2)
    model = make()
    sd = state_dict(model)
    original = original_from_pairs(families.get("ltx2"), sd)
    connectors = {"video_embeddings_connector.transformer_1d_blocks.0.attn1.to_q.weight": torch.ones(4, 4),
                  "audio_embeddings_connector.learnable_registers": torch.ones(2, 4)}
    save_file({"model.diffusion_model." + k: v for k, v in {**original, **connectors}.items()},
              tmp_path / "o.safetensors")
    code, stdout, err = run_ckpt("convert", tmp_path / "o.safetensors", "--layout", "diffusers", "-o", tmp_path / "d")
    assert code == 0, err
    assert "2 tensors exist in the original layout only" in stdout + err, stdout + err
    got = load_file(tmp_path / "d" / "diffusion_pytorch_model.safetensors")
    want = converter()({**original, **connectors})
    assert set(got) == set(want) == set(sd) and all(torch.equal(got[k], want[k]) for k in want)


@pytest.mark.parametrize("norm,prefix", [("weight", ""), ("scale", ""), ("scale", "model.model.")])
def test_comfy_named_hunyuan_video_is_hunyuan_video_and_converts(tmp_path, run_ckpt, norm, prefix):
    """A HunyuanVideo 1.x file in ComfyUI's internal Flux-style names (q/k norms `.weight`, `.scale` before
    ComfyUI's RMSNorm change), bare or under `model.model.` as ComfyUI's ModelSave/CheckpointSave write it
    (`HunyuanVideo.process_unet_state_dict_for_saving`): inspect names the family, the spelling and the
    prefix, --layout diffusers gives what diffusers' converter makes of the Tencent file, bit for bit,
    loading strictly; --layout original writes Tencent's bare names. A Flux.1 BFL file stays Flux.1."""
    import json

    from safetensors.torch import load_file, save_file

    make, converter = _hunyuan_video()
    torch.manual_seed(5)
    model = make()
    sd = state_dict(model)
    original = original_from_pairs(families.get("hunyuan_video"), sd)
    convert = converter()
    comfy = comfy_hunyuan_video(original, norm)
    assert "double_blocks.0.img_attn.qkv.weight" in comfy and "time_in.in_layer.weight" in comfy
    assert f"single_blocks.0.norm.query_norm.{norm}" in comfy
    save_file({prefix + k: v for k, v in comfy.items()}, tmp_path / "comfy.safetensors")

    shapes = {k: tuple(v.shape) for k, v in comfy.items()}
    m = families.detect(list(shapes), shapes)
    assert (m.family_id, m.layout) == ("hunyuan_video", "original")
    code, stdout, err = run_ckpt("inspect", tmp_path / "comfy.safetensors", "--json")
    assert code == 0, err
    assert "hunyuan_video" in stdout and "ComfyUI's Flux-style names" in stdout
    (c,) = json.loads(stdout)["components"]
    assert [(p["prefix"], p["family_id"], p["layout"], p["tensors"]) for p in c["parts"]] == \
        [(prefix, "hunyuan_video", "original", len(comfy))]

    code, _, err = run_ckpt("convert", tmp_path / "comfy.safetensors", "--layout", "diffusers", "-o", tmp_path / "d",
                            "-q")
    assert code == 0, err
    got = load_file(tmp_path / "d" / "diffusion_pytorch_model.safetensors")
    want = convert({k: v.clone() for k, v in original.items()})
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)
    assert json.loads((tmp_path / "d" / "config.json").read_text())["_class_name"] == type(model).__name__
    loaded, info = type(model).from_pretrained(tmp_path / "d", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    assert all(torch.equal(v, sd[k]) for k, v in loaded.state_dict().items())

    code, _, err = run_ckpt("convert", tmp_path / "d", "--layout", "original", "-o", tmp_path / "o.safetensors", "-q")
    assert code == 0, err
    back = load_file(tmp_path / "o.safetensors")
    assert set(back) == set(original) and all(torch.equal(back[k], original[k]) for k in original)

    flux = original_from_pairs(families.get("flux1"), state_dict(tiny_flux1()))
    fshapes = {k: tuple(v.shape) for k, v in flux.items()}
    f = families.detect(list(fshapes), fshapes)
    assert (f.family_id, f.layout) == ("flux1", "original")


@pytest.mark.parametrize("prefix", ["", "model.model."])
def test_comfy_named_hunyuan_video_with_an_unknown_tensor_is_refused(tmp_path, run_ckpt, prefix):
    """A ComfyUI-named file (bare or as ModelSave writes it) with a tensor in neither spelling, or with a
    second model beside `model.model.`: one error line, exit 2, nothing written."""
    from safetensors.torch import save_file

    make, _ = _hunyuan_video()
    torch.manual_seed(6)
    comfy = comfy_hunyuan_video(original_from_pairs(families.get("hunyuan_video"), state_dict(make())))
    good = {prefix + k: v for k, v in comfy.items()}
    bad = {**good, prefix + "double_blocks.0.img_attn.extra.weight": torch.ones(2, 2)}
    save_file(bad, tmp_path / "bad.safetensors")
    code, stdout, err = run_ckpt("convert", tmp_path / "bad.safetensors", "--layout", "diffusers", "-o",
                                 tmp_path / "d")
    assert code == 2 and err.startswith("error: ") and err.count("\n") == 1, err
    assert "double_blocks.0.img_attn.extra.weight" in err
    assert not (tmp_path / "d").exists()
    if prefix:
        save_file({**good, "vae.decoder.conv_in.weight": torch.ones(2, 2)}, tmp_path / "two.safetensors")
        code, stdout, err = run_ckpt("convert", tmp_path / "two.safetensors", "--layout", "diffusers", "-o",
                                     tmp_path / "d")
        assert code == 2 and err.startswith("error: ") and err.count("\n") == 1, err
        assert "more than one model (model.model.* and e.g. vae.decoder.conv_in.weight)" in err
        assert not (tmp_path / "d").exists()


def test_kandinsky5_is_not_taken_for_ltx_video(tmp_path, run_ckpt):
    """Kandinsky 5's diffusers transformer (diffusers' own class) has `time_embeddings.*`, which began like LTX-Video's
    `time_embed.*`: it was detected as LTX-Video and `--layout` failed blaming 80 tensors with no LTX counterpart.
    ckpt has no Kandinsky 5 module: no family is named, `--layout` is refused as an unknown family, nothing written."""
    from diffusers import Kandinsky5Transformer3DModel

    from helpers.refusals import assert_refused

    model = Kandinsky5Transformer3DModel(in_visual_dim=4, in_text_dim=16, in_text_dim2=8, time_dim=16,
                                         out_visual_dim=4, model_dim=32, ff_dim=64, num_text_blocks=1,
                                         num_visual_blocks=2, axes_dims=(4, 6, 6))
    model.save_pretrained(tmp_path / "k5")
    assert any(k.startswith("time_embeddings.") for k in model.state_dict())
    code, out, err = run_ckpt("inspect", tmp_path / "k5")
    assert code == 0, err
    assert "LTX" not in out
    assert_refused(run_ckpt, tmp_path, ["convert", tmp_path / "k5", "--layout", "original", "-o", tmp_path / "out"],
                   str(tmp_path / "k5" / "diffusion_pytorch_model.safetensors"), "no known model family")
