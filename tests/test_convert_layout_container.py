"""`ckpt convert --layout` as a container change: Qwen-Image and HiDream (one naming: ComfyUI's single file
and diffusers' folder hold the same names) and diffusers-named single files of two-layout families.

- single file (bare or under `model.diffusion_model.`) -> diffusers model folder: diffusers' own
  `from_pretrained` loads it with no missing, unexpected or mismatched key, every tensor bit for bit the
  model's, and the derived config.json's values are the tiny model's; sharded with an index as diffusers
  writes it when --max-shard-size asks.
- a diffusers folder (sharded by `save_pretrained`) -> one bare file with the model's tensors unchanged;
  file -> folder -> file is byte-identical.
- what is already in the requested container, a model whose config the shapes cannot give, and a LoRA
  passed to --layout: one line `error: ...`, exit 2, nothing written, inputs unchanged.
Tiny models use the releases' attention head size (128) where the families' conventions need it.
"""

from __future__ import annotations

import hashlib
import json
import re

import pytest
import torch
from safetensors.torch import load_file, save_file

from families_util import state_dict
from helpers.refusals import assert_refused

diffusers = pytest.importorskip("diffusers")


def _qwen(layered: bool = False):
    return diffusers.QwenImageTransformer2DModel(
        patch_size=2, in_channels=16, out_channels=4, num_layers=2, attention_head_dim=128, num_attention_heads=1,
        joint_attention_dim=16, axes_dims_rope=(16, 56, 56), use_additional_t_cond=layered, use_layer3d_rope=layered)


def _hidream():
    return diffusers.HiDreamImageTransformer2DModel(
        patch_size=2, in_channels=4, out_channels=4, num_layers=1, num_single_layers=1, attention_head_dim=128,
        num_attention_heads=1, caption_channels=[8, 12], text_emb_dim=16, num_routed_experts=2,
        num_activated_experts=2, axes_dims_rope=(64, 32, 32), max_resolution=(128, 128), llama_layers=[0, 1])


MAKERS = {"qwen_image": _qwen, "qwen_image_layered": lambda: _qwen(layered=True), "hidream": _hidream}


@pytest.fixture(scope="module", params=list(MAKERS))
def case(request):
    torch.manual_seed(0)
    model = MAKERS[request.param]()
    return model, state_dict(model)


def _same(got: dict, want: dict) -> bool:
    return set(got) == set(want) and all(got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]) for k in want)


def _config_matches(cfg: dict, model) -> None:
    for k, v in cfg.items():
        if not k.startswith("_"):
            norm = (lambda x: list(x) if isinstance(x, (tuple, list)) else x)
            assert norm(v) == norm(model.config[k]), (k, v, model.config[k])


def _digest(*paths) -> list[str]:
    return [hashlib.sha256(p.read_bytes()).hexdigest() for p in paths]


@pytest.mark.parametrize("prefix", ["", "model.diffusion_model."])
def test_single_file_to_diffusers_folder_loads_in_diffusers(tmp_path, run_ckpt, case, prefix):
    model, sd = case
    src = tmp_path / "comfy.safetensors"
    save_file({prefix + k: v for k, v in sd.items()}, src)
    out = tmp_path / "transformer"
    code, _, err = run_ckpt("convert", src, "--layout", "diffusers", "-o", out)
    assert code == 0, err
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "diffusion_pytorch_model.safetensors"]
    assert _same(load_file(out / "diffusion_pytorch_model.safetensors"), sd)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["_class_name"] == type(model).__name__
    _config_matches(cfg, model)
    loaded, info = type(model).from_pretrained(out, output_loading_info=True)
    assert not any(info.values()), info
    assert _same(state_dict(loaded), sd)
    assert "(the same names)" in err and ("prefix" in err) == bool(prefix), err


def test_sharded_folder_as_diffusers_writes_it(tmp_path, run_ckpt, case):
    model, sd = case
    save_file(sd, tmp_path / "m.safetensors")
    out = tmp_path / "d"
    code, _, err = run_ckpt("convert", tmp_path / "m.safetensors", "--layout", "diffusers", "--max-shard-size",
                            "2MB", "-o", out, "-q")
    assert code == 0, err
    index = json.loads((out / "diffusion_pytorch_model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    named = rf"diffusion_pytorch_model-\d{{5}}-of-{len(shards):05d}\.safetensors"  # diffusers' (hub's) pattern
    assert len(shards) > 1 and all(re.fullmatch(named, s) for s in shards), shards
    assert sorted(p.name for p in out.iterdir()) == sorted(shards + ["config.json",
                                                                     "diffusion_pytorch_model.safetensors.index.json"])
    loaded, info = type(model).from_pretrained(out, output_loading_info=True)
    assert not any(info.values()), info
    assert _same(state_dict(loaded), sd)


def test_diffusers_folder_to_one_bare_file_and_round_trip(tmp_path, run_ckpt, case):
    model, sd = case
    model.save_pretrained(tmp_path / "dif", max_shard_size="2MB")  # sharded, as the releases are
    assert (tmp_path / "dif" / "diffusion_pytorch_model.safetensors.index.json").exists()
    o1 = tmp_path / "o1.safetensors"
    code, _, err = run_ckpt("convert", tmp_path / "dif", "--layout", "original", "-o", o1, "-q")
    assert code == 0, err
    assert _same(load_file(o1), sd)  # bare keys, as ComfyUI's loaders read them
    code, _, err = run_ckpt("convert", o1, "--layout", "diffusers", "-o", tmp_path / "d2", "-q")
    assert code == 0, err
    code, _, err = run_ckpt("convert", tmp_path / "d2", "--layout", "original", "-o", tmp_path / "o2.safetensors", "-q")
    assert code == 0, err
    first, again = _digest(o1, tmp_path / "o2.safetensors")
    assert first == again


def test_diffusers_named_single_file_of_a_two_layout_family_becomes_a_folder(tmp_path, run_ckpt):
    """The same container change for Flux.1: a file already in diffusers' names gets its folder and config."""
    torch.manual_seed(1)
    model = diffusers.FluxTransformer2DModel(in_channels=4, num_layers=1, num_single_layers=1, attention_head_dim=128,
                                             num_attention_heads=1, joint_attention_dim=16, pooled_projection_dim=16,
                                             guidance_embeds=True, axes_dims_rope=(16, 56, 56))
    sd = state_dict(model)
    save_file(sd, tmp_path / "flux-diffusers.safetensors")
    code, _, err = run_ckpt("convert", tmp_path / "flux-diffusers.safetensors", "--layout", "diffusers",
                            "-o", tmp_path / "d", "-q")
    assert code == 0, err
    loaded, info = diffusers.FluxTransformer2DModel.from_pretrained(tmp_path / "d", output_loading_info=True)
    assert not any(info.values()), info
    assert _same(state_dict(loaded), sd)
    # a stray tensor in the file is still refused: the identity covers the family's own names only
    save_file({**sd, "transformer_blocks.0.extra.weight": torch.zeros(2, 2)}, tmp_path / "stray.safetensors")
    assert_refused(run_ckpt, tmp_path, ["convert", tmp_path / "stray.safetensors", "--layout", "diffusers", "-o",
                                        tmp_path / "x"], "1 tensor has no counterpart", "transformer_blocks.0.extra")


def _inputs(tmp_path) -> dict:
    return {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}


@pytest.mark.parametrize("make", [_qwen, _hidream], ids=["qwen_image", "hidream"])
def test_already_in_the_requested_container_is_one_line(tmp_path, run_ckpt, make):
    model = make()
    sd = state_dict(model)
    save_file({"model.diffusion_model." + k: v for k, v in sd.items()}, tmp_path / "m.safetensors")
    model.save_pretrained(tmp_path / "dif")
    before = _inputs(tmp_path)
    assert_refused(run_ckpt, tmp_path, ["convert", tmp_path / "m.safetensors", "--layout", "original", "-o",
                                        tmp_path / "o.safetensors"], f"{tmp_path / 'm.safetensors'}: already in the "
                   "original layout", "one file); nothing to convert")
    assert_refused(run_ckpt, tmp_path, ["convert", tmp_path / "dif", "--layout", "diffusers", "-o", tmp_path / "o"],
                   f"{tmp_path / 'dif'}: already in the diffusers layout",
                   "a diffusers model folder); nothing to convert")
    assert _inputs(tmp_path) == before


@pytest.mark.parametrize("family", ["qwen_image", "hidream"])
def test_a_config_the_shapes_cannot_give_is_refused(tmp_path, run_ckpt, family):
    """Heads no release has: the rope axes (Qwen-Image) or the head count (HiDream) are not guessed."""
    from families_util import tiny_hidream, tiny_qwen_image  # attention heads 8 wide

    model = {"qwen_image": tiny_qwen_image, "hidream": tiny_hidream}[family]()
    sd = state_dict(model)
    save_file(sd, tmp_path / "m.safetensors")
    before = _inputs(tmp_path)
    assert_refused(run_ckpt, tmp_path, ["convert", tmp_path / "m.safetensors", "--layout", "diffusers", "-o",
                                        tmp_path / "d"], f"{tmp_path / 'm.safetensors'}: cannot derive the diffusers "
                   "config.json", "pass --config REF")
    assert _inputs(tmp_path) == before
    model.save_config(tmp_path / "ref")  # --config supplies what the conventions do not
    code, _, err = run_ckpt("convert", tmp_path / "m.safetensors", "--layout", "diffusers", "--config",
                            tmp_path / "ref", "-o", tmp_path / "d", "-q")
    assert code == 0, err
    loaded, info = type(model).from_pretrained(tmp_path / "d", output_loading_info=True)
    assert not any(info.values()), info
    assert _same(state_dict(loaded), sd)


def test_lora_passed_to_layout_is_named_as_a_lora(tmp_path, run_ckpt):
    """A LoRA matches a family by its module names; --layout says it is a LoRA and which command converts it."""
    kohya = {"lora_unet_transformer_blocks_0_attn_to_q.lora_down.weight": torch.zeros(4, 128),
             "lora_unet_transformer_blocks_0_attn_to_q.lora_up.weight": torch.zeros(128, 4),
             "lora_unet_transformer_blocks_0_attn_to_q.alpha": torch.tensor(4.0)}
    peft = {"transformer.transformer_blocks.0.attn.to_q.lora_A.weight": torch.zeros(4, 128),
            "transformer.transformer_blocks.0.attn.to_q.lora_B.weight": torch.zeros(128, 4)}
    save_file(kohya, tmp_path / "kohya.safetensors")
    save_file(peft, tmp_path / "peft.safetensors")
    before = _inputs(tmp_path)
    for name in ("kohya", "peft"):
        src = tmp_path / f"{name}.safetensors"
        for layout, fmt in (("diffusers", "diffusers"), ("original", "comfy")):
            assert_refused(run_ckpt, tmp_path, ["convert", src, "--layout", layout, "-o", tmp_path / "out"],
                           f"{src} is a LoRA, not a model", f"`ckpt lora convert {src} --format {fmt}`")
    assert _inputs(tmp_path) == before


def test_quantizing_into_the_original_container_keeps_the_family_rule(tmp_path, run_ckpt):
    """`--layout original --to int8` on a Qwen-Image folder: the names are the same, so the layers
    ComfyUI-GGUF and ComfyUI keep in high precision (input/output layers) stay unquantized."""
    pytest.importorskip("comfy_kitchen")
    torch.manual_seed(2)
    model = _qwen()
    model.save_pretrained(tmp_path / "dif")
    code, _, err = run_ckpt("convert", tmp_path / "dif", "--layout", "original", "--to", "int8", "-o",
                            tmp_path / "q.safetensors", "-q")
    assert code == 0, err
    q = load_file(tmp_path / "q.safetensors")
    quantized = {k[: -len(".comfy_quant")] for k in q if k.endswith(".comfy_quant")}
    assert quantized == {k[: -len(".weight")] for k, v in state_dict(model).items()
                         if k.startswith("transformer_blocks.") and k.endswith(".weight") and v.dim() == 2}
