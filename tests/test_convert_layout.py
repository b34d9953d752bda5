"""`ckpt convert --layout diffusers|original` against diffusers' converters and model classes.

- original -> diffusers: the output tensors equal, bit for bit, what diffusers' own single-file converter
  (`convert_*_to_diffusers`) makes of the same file; the derived config.json makes the model class's
  `from_pretrained` load with no missing or unexpected key, and its values are the tiny model's own.
- diffusers -> original: diffusers' converter maps the output back to the model's state dict exactly;
  original -> diffusers -> original is byte-identical.
- Bad inputs: one line, exit 2, nothing written.
Tiny models use realistic attention head sizes (128) where a family's conventions need them.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from families_util import flux1_converter, original_from_pairs, state_dict, with_constants
from helpers.layout_round_trips import diffusers_folder_to_original_and_round_trip, original_file_to_diffusers_folder
from ckpt import families

diffusers = pytest.importorskip("diffusers")


def _sfu():
    from diffusers.loaders import single_file_utils

    return single_file_utils


def _wan(kind):
    def make():
        cls = diffusers.WanVACETransformer3DModel if kind == "vace" else diffusers.WanTransformer3DModel
        kw = dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=128, in_channels=4,
                  out_channels=4, text_dim=16, freq_dim=8, ffn_dim=32, num_layers=2)
        if kind == "i2v":
            kw.update(image_dim=12, added_kv_proj_dim=12)
        if kind == "vace":
            kw.update(vace_layers=[0], vace_in_channels=6)
        return cls(**kw)

    return make, lambda: _sfu().convert_wan_transformer_to_diffusers


def _flux2():
    return (lambda: diffusers.Flux2Transformer2DModel(
        in_channels=4, num_layers=1, num_single_layers=2, attention_head_dim=128, num_attention_heads=1,
        joint_attention_dim=16, timestep_guidance_channels=8, axes_dims_rope=(32, 32, 32, 32)),
        lambda: _sfu().convert_flux2_transformer_checkpoint_to_diffusers)


def _flux1():
    return (lambda: diffusers.FluxTransformer2DModel(
        in_channels=4, num_layers=1, num_single_layers=1, attention_head_dim=128, num_attention_heads=1,
        joint_attention_dim=16, pooled_projection_dim=16, guidance_embeds=True, axes_dims_rope=(16, 56, 56)),
        lambda: flux1_converter(128))


def _sd3():
    return (lambda: diffusers.SD3Transformer2DModel(
        sample_size=128, patch_size=2, in_channels=4, num_layers=2, attention_head_dim=16, num_attention_heads=2,
        joint_attention_dim=32, caption_projection_dim=32, pooled_projection_dim=32, out_channels=4,
        pos_embed_max_size=8, dual_attention_layers=(0,), qk_norm="rms_norm"),
        lambda: _sfu().convert_sd3_transformer_checkpoint_to_diffusers)


def _unet(kind):
    from diffusers import UNet2DConditionModel

    config = {"layers_per_block": 2, **({"addition_embed_type": "text_time"} if kind == "sdxl" else {})}
    if kind == "sdxl":
        make = lambda: UNet2DConditionModel(  # noqa: E731
            sample_size=8, in_channels=4, out_channels=4, block_out_channels=(64, 128), layers_per_block=2,
            down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"), up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
            transformer_layers_per_block=(1, 2), cross_attention_dim=2048, attention_head_dim=(1, 2),
            use_linear_projection=True, addition_embed_type="text_time", addition_time_embed_dim=256,
            projection_class_embeddings_input_dim=32 + 6 * 256)
    else:
        make = lambda: UNet2DConditionModel(  # noqa: E731
            sample_size=8, in_channels=4, out_channels=4, block_out_channels=(32, 64), layers_per_block=2,
            down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
            cross_attention_dim=768, attention_head_dim=8)

    def converter():
        return lambda sd: _sfu().convert_ldm_unet_checkpoint({"model.diffusion_model." + k: v for k, v in sd.items()},
                                                             config)

    return make, converter


def _chroma():
    return (lambda: diffusers.ChromaTransformer2DModel(
        in_channels=4, num_layers=1, num_single_layers=1, attention_head_dim=128, num_attention_heads=1,
        joint_attention_dim=16, axes_dims_rope=(16, 56, 56), approximator_num_channels=8, approximator_hidden_dim=32,
        approximator_layers=2),
        lambda: with_constants(_sfu().convert_chroma_transformer_checkpoint_to_diffusers, {3072: 128}))


def _z_image():
    return (lambda: diffusers.ZImageTransformer2DModel(
        all_patch_size=(2,), all_f_patch_size=(1,), in_channels=4, dim=128, n_layers=1, n_refiner_layers=1, n_heads=1,
        n_kv_heads=1, cap_feat_dim=16, axes_dims=[32, 48, 48], axes_lens=[1536, 512, 512]),
        lambda: _sfu().convert_z_image_transformer_checkpoint_to_diffusers)


def _lumina2():
    return (lambda: diffusers.Lumina2Transformer2DModel(
        sample_size=128, patch_size=2, in_channels=4, hidden_size=192, num_layers=1, num_refiner_layers=1,
        num_attention_heads=2, num_kv_heads=1, multiple_of=256, cap_feat_dim=16, axes_dim_rope=(32, 32, 32),
        axes_lens=(300, 512, 512)),
        lambda: with_constants(_sfu().convert_lumina2_to_diffusers, {2304: 192, 768: 96}))


CASES = {"sd1-unet": ("sd1", *_unet("sd1")), "sdxl-unet": ("sdxl", *_unet("sdxl")),
         "wan-t2v": ("wan", *_wan("t2v")), "wan-i2v": ("wan", *_wan("i2v")), "wan-vace": ("wan", *_wan("vace")),
         "flux2": ("flux2", *_flux2()), "flux1": ("flux1", *_flux1()), "sd3": ("sd3", *_sd3()),
         "chroma": ("chroma", *_chroma()), "z_image": ("z_image", *_z_image()), "lumina2": ("lumina2", *_lumina2())}


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


def _wan_file(tmp_path, head=128, extra=None, drop=None):
    make, _ = _wan("t2v")
    torch.manual_seed(1)
    model = make() if head == 128 else diffusers.WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=head, in_channels=4, out_channels=4,
        text_dim=16, freq_dim=8, ffn_dim=32, num_layers=1)
    sd = state_dict(model)
    orig = original_from_pairs(families.get("wan"), sd)
    orig.update(extra or {})
    for k in drop or ():
        orig.pop(k)
    save_file(orig, tmp_path / "wan.safetensors")
    return model, sd, tmp_path / "wan.safetensors"


def test_sharded_output_and_dtype(tmp_path, run_ckpt):
    model, sd, path = _wan_file(tmp_path)
    out = tmp_path / "out"
    code, _, err = run_ckpt("convert", path, "--layout", "diffusers", "--to", "bf16", "--max-shard-size", "300kB",
                            "-o", out, "-q")
    assert code == 0, err
    index = json.loads((out / "diffusion_pytorch_model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    loaded, info = diffusers.WanTransformer3DModel.from_pretrained(out, output_loading_info=True,
                                                                   torch_dtype=torch.bfloat16)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert all(torch.equal(v, sd[k].bfloat16()) for k, v in loaded.state_dict().items())


def test_config_ref_overrides_the_conventions(tmp_path, run_ckpt):
    """Wan's heads are 128 wide in every release; a model that is not needs --config."""
    model, sd, path = _wan_file(tmp_path, head=8)
    code, _, err = run_ckpt("convert", path, "--layout", "diffusers", "-o", tmp_path / "x")
    assert code == 2 and "--config" in err and "128" in err and not (tmp_path / "x").exists()
    model.save_pretrained(tmp_path / "ref")
    for ref in (tmp_path / "ref", tmp_path / "ref" / "config.json"):
        out = tmp_path / f"out-{ref.name}"
        code, _, err = run_ckpt("convert", path, "--layout", "diffusers", "--config", ref, "-o", out, "-q")
        assert code == 0, err
        loaded, info = diffusers.WanTransformer3DModel.from_pretrained(out, output_loading_info=True)
        assert not info["missing_keys"] and not info["unexpected_keys"]
        assert loaded.config.attention_head_dim == 8


@pytest.mark.parametrize("what", ["extra", "missing_piece", "unknown", "bundle", "no_config", "config_json",
                                  "config_original", "fused_short", "fused_long"])
def test_bad_inputs_are_refused_before_writing(tmp_path, run_ckpt, what):
    out = tmp_path / "out"
    args = ["--layout", "diffusers"]
    if what == "extra":
        _, _, path = _wan_file(tmp_path, extra={"blocks.0.lora_thing.weight": torch.zeros(2, 2)})
        expect = "blocks.0.lora_thing.weight"
    elif what == "missing_piece":  # a diffusers Flux.2 folder without one of q/k/v
        make, _ = _flux2()
        make().save_pretrained(tmp_path / "f2")
        sd = load_file(tmp_path / "f2" / "diffusion_pytorch_model.safetensors")
        sd.pop("transformer_blocks.0.attn.to_k.weight")
        save_file(sd, tmp_path / "f2" / "diffusion_pytorch_model.safetensors")
        path, args, expect = tmp_path / "f2", ["--layout", "original"], "double_blocks.0.img_attn.qkv.weight"
    elif what == "unknown":
        save_file({"foo.bar.weight": torch.zeros(2, 2)}, tmp_path / "x.safetensors")
        path, expect = tmp_path / "x.safetensors", "no known model family"
    elif what == "bundle":
        _, _, path = _wan_file(tmp_path)
        sd = {"model.diffusion_model." + k: v for k, v in load_file(path).items()}
        sd["vae.decoder.conv_in.weight"] = torch.zeros(2, 2)
        save_file(sd, path)
        expect = "vae.decoder.conv_in.weight"
    elif what == "no_config":
        _, _, path = _wan_file(tmp_path)
        args, expect = ["--layout", "diffusers", "--config", tmp_path / "nowhere"], "no such file"
    elif what == "config_json":
        _, _, path = _wan_file(tmp_path)
        (tmp_path / "c.json").write_text("[1, 2")
        args, expect = ["--layout", "diffusers", "--config", tmp_path / "c.json"], "not a JSON object"
    elif what.startswith("fused_"):  # a BFL Flux.1 file whose fused q/k/v has a row too few / too many
        make, _ = _flux1()
        original = original_from_pairs(families.get("flux1"), state_dict(make()))
        qkv = original["double_blocks.0.img_attn.qkv.weight"]
        original["double_blocks.0.img_attn.qkv.weight"] = qkv[:-1] if what == "fused_short" else \
            torch.cat([qkv, qkv[:1]])
        path = tmp_path / "f1.safetensors"
        save_file(original, path)
        expect = f"double_blocks.0.img_attn.qkv.weight: {qkv.shape[0] + (-1 if what == 'fused_short' else 1)} rows"
    else:
        _, _, path = _wan_file(tmp_path)
        args, expect = ["--layout", "original", "--config", tmp_path], "--config applies to --layout diffusers"
    code, stdout, err = run_ckpt("convert", path, *args, "-o", out)
    assert code == 2, (stdout, err)
    assert err.startswith("error: ") and expect in err and "Traceback" not in err, err
    assert not out.exists()


def test_vae_needs_config_and_round_trips(tmp_path, run_ckpt):
    """An LDM VAE: the latent scaling is not in its weights, so --config names it; 1x1-conv attention
    becomes linear and back."""
    from diffusers.models import AutoencoderKL

    torch.manual_seed(3)
    model = AutoencoderKL(block_out_channels=(32, 64), down_block_types=("DownEncoderBlock2D",) * 2,
                          up_block_types=("UpDecoderBlock2D",) * 2, latent_channels=4, layers_per_block=1)
    sd = state_dict(model)
    original = original_from_pairs(families.get("autoencoder_kl"), sd)
    assert original["encoder.mid.attn_1.q.weight"].shape[2:] == (1, 1)
    want = _sfu().convert_ldm_vae_checkpoint(dict(original), dict(model.config))
    assert set(want) == set(sd) and all(torch.equal(want[k], sd[k]) for k in sd)
    save_file(original, tmp_path / "vae.safetensors")
    code, _, err = run_ckpt("convert", tmp_path / "vae.safetensors", "--layout", "diffusers", "-o", tmp_path / "x")
    assert code == 2 and "scaling factor" in err and "--config" in err
    model.save_pretrained(tmp_path / "ref")
    code, _, err = run_ckpt("convert", tmp_path / "vae.safetensors", "--layout", "diffusers", "--config",
                            tmp_path / "ref", "-o", tmp_path / "dif", "-q")
    assert code == 0, err
    got = load_file(tmp_path / "dif" / "diffusion_pytorch_model.safetensors")
    assert set(got) == set(sd) and all(torch.equal(got[k], sd[k]) for k in sd)
    loaded, info = AutoencoderKL.from_pretrained(tmp_path / "dif", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    code, _, err = run_ckpt("convert", tmp_path / "dif", "--layout", "original", "-o", tmp_path / "o.safetensors", "-q")
    assert code == 0, err
    back = load_file(tmp_path / "o.safetensors")
    assert set(back) == set(original) and all(torch.equal(back[k], original[k]) for k in original)
