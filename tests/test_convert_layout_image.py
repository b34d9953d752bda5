"""`ckpt convert --layout` facts of the image families beyond tests/test_convert_layout.py's round trips:
the original files' unused `norm_final.weight` (Lumina 2, Z-Image). The families with one naming (HiDream,
Qwen-Image), whose --layout changes only the container: tests/test_convert_layout_container.py."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from families_util import original_from_pairs, state_dict, tiny_lumina2, tiny_z_image, with_constants
from ckpt import families

diffusers = pytest.importorskip("diffusers")


def _sfu():
    from diffusers.loaders import single_file_utils

    return single_file_utils


@pytest.mark.parametrize("family_id", ["z_image", "lumina2"])
def test_unused_norm_final_is_dropped_with_a_note(tmp_path, run_ckpt, family_id):
    """Released Lumina 2 / Z-Image files carry `norm_final.weight`, which the model never uses and diffusers'
    converter drops: the diffusers output is the converter's, and the note says what was not written."""
    make, convert = {"z_image": (tiny_z_image, _sfu().convert_z_image_transformer_checkpoint_to_diffusers),
                     "lumina2": (tiny_lumina2, with_constants(_sfu().convert_lumina2_to_diffusers,
                                                              {2304: 32, 768: 16}))}[family_id]
    sd = state_dict(make())
    original = original_from_pairs(families.get(family_id), sd)
    original["norm_final.weight"] = torch.ones(32)
    save_file({"model.diffusion_model." + k: v for k, v in original.items()}, tmp_path / "o.safetensors")
    want = convert({k: v.clone() for k, v in original.items()})
    code, stdout, err = run_ckpt("convert", tmp_path / "o.safetensors", "--layout", "diffusers", "--config",
                                 _config(tmp_path, make), "-o", tmp_path / "d")
    assert code == 0, err
    got = load_file(tmp_path / "d" / "diffusion_pytorch_model.safetensors")
    assert set(got) == set(want) == set(sd) and all(torch.equal(got[k], want[k]) for k in want)
    assert "note: 1 tensor exists in the original layout only and is not written: norm_final.weight" in err


def _config(tmp_path, make):
    """The tiny model's own config (its head size is not a release's, so no convention applies)."""
    make().save_config(tmp_path / "cfg")
    return tmp_path / "cfg" / "config.json"


def test_config_conventions_refuse_unknown_head_sizes(tmp_path, run_ckpt):
    """A Z-Image whose head size no release has: the rope axes are not guessed; --config supplies them."""
    sd = state_dict(tiny_z_image())  # head size 16
    original = original_from_pairs(families.get("z_image"), sd)
    save_file(original, tmp_path / "z.safetensors")
    code, _, err = run_ckpt("convert", tmp_path / "z.safetensors", "--layout", "diffusers", "-o", tmp_path / "d")
    assert code == 2 and "head size of 128, not 16" in err and "--config" in err, err
    assert not (tmp_path / "d").exists()
    code, _, err = run_ckpt("convert", tmp_path / "z.safetensors", "--layout", "diffusers", "--config",
                            _config(tmp_path, tiny_z_image), "-o", tmp_path / "d", "-q")
    assert code == 0, err
    cfg = json.loads((tmp_path / "d" / "config.json").read_text())
    loaded, info = diffusers.ZImageTransformer2DModel.from_pretrained(tmp_path / "d", output_loading_info=True)
    assert cfg["_class_name"] == "ZImageTransformer2DModel" and not any(info.values()), info
    assert all(torch.equal(v, sd[k]) for k, v in loaded.state_dict().items())
