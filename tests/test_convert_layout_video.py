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

from families_util import diffusers_from_pairs, original_from_pairs, state_dict, tiny_hunyuan_video15, with_width
from test_convert_layout import (test_diffusers_folder_to_original_and_round_trip,  # noqa: F401 (run here too)
                                 test_original_file_to_diffusers_folder)
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
