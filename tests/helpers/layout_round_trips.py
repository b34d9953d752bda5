"""The two round trips every `--layout` family table runs (tests/test_convert_layout.py for the image
families, tests/test_convert_layout_video.py for the video ones), each on its module's `case` fixture:
(tiny diffusers model, its state dict, the original layout made from the family's pairs, diffusers' own
single-file converter). Oracles: the converter's tensors, `from_pretrained` with no missing or unexpected key,
the model's config, and original -> diffusers -> original giving the same bytes."""

from __future__ import annotations

import hashlib
import json

import torch
from safetensors.torch import load_file, save_file


def config_matches(cfg: dict, model):
    for k, v in cfg.items():
        if k.startswith("_") or (k == "sample_size" and "UNet" in cfg["_class_name"]):
            continue  # a UNet's sample size is the release's (64, 96, 128), not the tiny model's
        want = model.config[k]
        norm = (lambda x: list(x) if isinstance(x, (tuple, list)) else x)
        if k == "out_channels" and v is None:
            continue  # None means "= in_channels", as the model class reads it
        assert norm(v) == norm(want), (k, v, want)


def original_file_to_diffusers_folder(tmp_path, run_ckpt, case, prefix):
    model, sd, original, convert = case
    save_file({prefix + k: v for k, v in original.items()}, tmp_path / "orig.safetensors")
    out = tmp_path / "out"
    code, stdout, err = run_ckpt("convert", tmp_path / "orig.safetensors", "--layout", "diffusers", "-o", out)
    assert code == 0, err
    got = load_file(out / "diffusion_pytorch_model.safetensors")
    want = convert({k: v.clone() for k, v in original.items()})
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["_class_name"] == type(model).__name__
    config_matches(cfg, model)
    loaded, info = type(model).from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    assert all(torch.equal(v, sd[k]) for k, v in loaded.state_dict().items())


def diffusers_folder_to_original_and_round_trip(tmp_path, run_ckpt, case):
    model, sd, original, convert = case
    model.save_pretrained(tmp_path / "dif")
    o1 = tmp_path / "o1.safetensors"
    code, _, err = run_ckpt("convert", tmp_path / "dif", "--layout", "original", "-o", o1, "-q")
    assert code == 0, err
    got = load_file(o1)
    assert set(got) == set(original) and all(torch.equal(got[k], original[k]) for k in original)
    back = convert(dict(got))
    assert set(back) == set(sd) and all(torch.equal(back[k], sd[k]) for k in sd)
    # original -> diffusers -> original: the same bytes
    code, _, err = run_ckpt("convert", o1, "--layout", "diffusers", "-o", tmp_path / "d2", "-q")
    assert code == 0, err
    code, _, err = run_ckpt("convert", tmp_path / "d2", "--layout", "original", "-o", tmp_path / "o2.safetensors", "-q")
    assert code == 0, err
    digest = [hashlib.sha256((tmp_path / n).read_bytes()).hexdigest() for n in ("o1.safetensors", "o2.safetensors")]
    assert digest[0] == digest[1]
