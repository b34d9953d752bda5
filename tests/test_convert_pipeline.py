"""`convert --layout` on whole pipelines: a diffusers SDXL / SD3 pipeline folder <-> the all-in-one
single file, against diffusers' own single-file converters part by part (`convert_ldm_unet_checkpoint`,
`convert_ldm_vae_checkpoint`, `convert_ldm_clip_checkpoint`, `convert_open_clip_checkpoint`,
`convert_sd3_transformer_checkpoint_to_diffusers`), the model classes' `from_pretrained`, and a byte
comparison of the round trip."""

from __future__ import annotations

import hashlib
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from families_util import state_dict

diffusers = pytest.importorskip("diffusers")
transformers = pytest.importorskip("transformers")


def _sfu():
    from diffusers.loaders import single_file_utils

    return single_file_utils


def _clip(width, with_projection=False, proj=None):
    cfg = transformers.CLIPTextConfig(hidden_size=width, intermediate_size=2 * width, num_hidden_layers=2,
                                      num_attention_heads=2, vocab_size=64, max_position_embeddings=8,
                                      projection_dim=proj or width, bos_token_id=0, eos_token_id=1, pad_token_id=1)
    cls = transformers.CLIPTextModelWithProjection if with_projection else transformers.CLIPTextModel
    return cls(cfg)


def _vae(latents):
    return diffusers.AutoencoderKL(block_out_channels=(32, 64), down_block_types=("DownEncoderBlock2D",) * 2,
                                   up_block_types=("UpDecoderBlock2D",) * 2, latent_channels=latents,
                                   layers_per_block=1, use_quant_conv=latents == 4, use_post_quant_conv=latents == 4)


def _pipeline(tmp_path, kind):
    torch.manual_seed(0)
    if kind == "sdxl":
        models = {
            "unet": diffusers.UNet2DConditionModel(
                sample_size=8, in_channels=4, out_channels=4, block_out_channels=(64, 128), layers_per_block=1,
                down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
                up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"), transformer_layers_per_block=(1, 2),
                cross_attention_dim=2048, attention_head_dim=(1, 2), use_linear_projection=True,
                addition_embed_type="text_time", addition_time_embed_dim=256,
                projection_class_embeddings_input_dim=32 + 6 * 256),
            "vae": _vae(4), "text_encoder": _clip(16), "text_encoder_2": _clip(32, True, 32)}
        cls = "StableDiffusionXLPipeline"
    elif kind == "sd1":
        models = {
            "unet": diffusers.UNet2DConditionModel(
                sample_size=8, in_channels=4, out_channels=4, block_out_channels=(32, 64), layers_per_block=1,
                down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
                cross_attention_dim=768, attention_head_dim=8),
            "vae": _vae(4), "text_encoder": _clip(16)}
        cls = "StableDiffusionPipeline"
    else:
        models = {
            "transformer": diffusers.SD3Transformer2DModel(
                sample_size=8, patch_size=2, in_channels=16, num_layers=2, attention_head_dim=16,
                num_attention_heads=2, joint_attention_dim=32, caption_projection_dim=32, pooled_projection_dim=48,
                out_channels=16, pos_embed_max_size=8, qk_norm="rms_norm"),
            "vae": _vae(16), "text_encoder": _clip(16, True), "text_encoder_2": _clip(32, True),
            "text_encoder_3": transformers.T5EncoderModel(transformers.T5Config(
                vocab_size=64, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_heads=2))}
        cls = "StableDiffusion3Pipeline"
    pipe = tmp_path / "pipe"
    index = {"_class_name": cls, "_diffusers_version": "0.42.0", "scheduler": ["diffusers", "EulerDiscreteScheduler"],
             "tokenizer": ["transformers", "CLIPTokenizer"]}
    for name, m in models.items():
        m.save_pretrained(pipe / name)
        index[name] = ["diffusers" if name in ("unet", "vae", "transformer") else "transformers", type(m).__name__]
    diffusers.EulerDiscreteScheduler().save_pretrained(pipe / "scheduler")
    (pipe / "tokenizer").mkdir()
    (pipe / "tokenizer" / "vocab.json").write_text('{"a": 0}')
    (pipe / "model_index.json").write_text(json.dumps(index))
    return pipe, {k: state_dict(m) for k, m in models.items()}, models


@pytest.mark.parametrize("kind", ["sd1", "sdxl", "sd3"])
def test_pipeline_folder_to_single_file_and_back(tmp_path, run_ckpt, kind):
    pipe, sds, models = _pipeline(tmp_path, kind)
    single = tmp_path / "all.safetensors"
    code, _, err = run_ckpt("convert", pipe, "--layout", "original", "-o", single, "-q")
    assert code == 0, err
    f = load_file(single)
    sfu = _sfu()
    if kind in ("sd1", "sdxl"):
        cfg = {"layers_per_block": 1, **({"addition_embed_type": "text_time"} if kind == "sdxl" else {})}
        parts = {"unet": sfu.convert_ldm_unet_checkpoint(dict(f), cfg),
                 "vae": sfu.convert_ldm_vae_checkpoint({k: v for k, v in f.items() if k.startswith("first_stage_model.")},
                                                       dict(models["vae"].config)),
                 "text_encoder": sfu.convert_ldm_clip_checkpoint(dict(f))}
    if kind == "sdxl":
        parts["text_encoder_2"] = sfu.convert_open_clip_checkpoint(models["text_encoder_2"], dict(f),
                                                                   prefix="conditioner.embedders.1.model.")
        assert f["conditioner.embedders.1.model.transformer.resblocks.0.attn.in_proj_weight"].shape[0] == 3 * 32
    elif kind == "sd1":
        assert "cond_stage_model.transformer.text_model.encoder.layers.0.self_attn.q_proj.weight" in f
    if kind == "sd3":
        dm = {k[len("model.diffusion_model."):]: v for k, v in f.items() if k.startswith("model.diffusion_model.")}
        parts = {"transformer": sfu.convert_sd3_transformer_checkpoint_to_diffusers(dm),
                 "vae": sfu.convert_ldm_vae_checkpoint({k: v for k, v in f.items() if k.startswith("first_stage_model.")},
                                                       dict(models["vae"].config))}
        for folder, prefix in (("text_encoder", "text_encoders.clip_l.transformer."),
                               ("text_encoder_2", "text_encoders.clip_g.transformer."),
                               ("text_encoder_3", "text_encoders.t5xxl.transformer.")):
            parts[folder] = {k[len(prefix):]: v for k, v in f.items() if k.startswith(prefix)}
    for folder, got in parts.items():
        stored = {k: v for fn in (pipe / folder).glob("*.safetensors") for k, v in load_file(fn).items()}
        want = {k: v for k, v in stored.items() if not k.endswith("position_ids")}  # tied weights saved once
        got = {(k[len("text_model."):] if folder == "text_encoder" and kind != "sd3" and k[len("text_model."):] in want
                else k): v for k, v in got.items()}
        missing = set(want) - set(got)
        assert not missing, (folder, sorted(missing)[:5])
        for k in want:
            assert torch.equal(got[k], want[k]), (folder, k)

    # back to a pipeline, with the tokenizers, scheduler and configs of a reference pipeline
    out = tmp_path / "pipe2"
    code, _, err = run_ckpt("convert", single, "--layout", "diffusers", "-o", out, "-q")
    assert code == 2 and "--config" in err and not out.exists()
    code, _, err = run_ckpt("convert", single, "--layout", "diffusers", "--config", pipe, "-o", out, "-q")
    assert code == 0, err
    assert (out / "tokenizer" / "vocab.json").exists() and (out / "scheduler" / "scheduler_config.json").exists()
    assert json.loads((out / "model_index.json").read_text())["_class_name"] == json.loads(
        (pipe / "model_index.json").read_text())["_class_name"]
    for folder, m in models.items():
        loaded, info = type(m).from_pretrained(out / folder, output_loading_info=True)
        assert not info["missing_keys"] and not info["unexpected_keys"], (folder, info)
        for k, v in loaded.state_dict().items():
            assert torch.equal(v, sds[folder][k]), (folder, k)
    # pipeline -> file -> pipeline -> file: the same bytes
    code, _, err = run_ckpt("convert", out, "--layout", "original", "-o", tmp_path / "again.safetensors", "-q")
    assert code == 0, err
    assert hashlib.sha256(single.read_bytes()).digest() == hashlib.sha256(
        (tmp_path / "again.safetensors").read_bytes()).digest()


def test_single_file_with_unknown_keys_is_refused(tmp_path, run_ckpt):
    pipe, _, _ = _pipeline(tmp_path, "sdxl")
    single = tmp_path / "all.safetensors"
    assert run_ckpt("convert", pipe, "--layout", "original", "-o", single, "-q")[0] == 0
    f = load_file(single)
    f["alphas_cumprod"] = torch.ones(10)  # bookkeeping: dropped with a note
    f["mystery.weight"] = torch.ones(2)
    save_file(f, single)
    code, _, err = run_ckpt("convert", single, "--layout", "diffusers", "--config", pipe, "-o", tmp_path / "o")
    assert code == 2 and "mystery.weight" in err and not (tmp_path / "o").exists()
    code, _, err = run_ckpt("convert", single, "--layout", "diffusers", "--config", pipe / "unet", "-o", tmp_path / "o")
    assert code == 2 and "model_index.json" in err


def _shards(folder, stem):
    """{tensor: tensor} of a component folder and its number of weight files: one `stem.safetensors`, or
    shards and their index (checked against each other)."""
    if (folder / f"{stem}.safetensors").exists():
        assert not list(folder.glob("*.index.json"))
        return load_file(folder / f"{stem}.safetensors"), 1
    index = json.loads((folder / f"{stem}.safetensors.index.json").read_text())
    files = sorted(folder.glob(f"{stem}-*-of-*.safetensors"))
    assert sorted(set(index["weight_map"].values())) == [f.name for f in files]
    return {k: v for f in files for k, v in load_file(f).items()}, len(files)


def test_pipeline_layout_honours_max_shard_size_per_component(tmp_path, run_ckpt):
    """--max-shard-size shards each component of a pipeline folder as `save_pretrained` would (huggingface_hub's
    planner is the oracle of the shard count), and shards the all-in-one file the other way as one model's
    original layout is sharded; the model classes load every sharded component."""
    from huggingface_hub import split_torch_state_dict_into_shards

    pipe, sds, models = _pipeline(tmp_path, "sd1")
    single = tmp_path / "all.safetensors"
    assert run_ckpt("convert", pipe, "--layout", "original", "-o", single, "-q")[0] == 0
    whole = load_file(single)

    # pipeline -> all-in-one, sharded: transformers-named shards holding exactly the one file's tensors
    sharded = tmp_path / "all-sharded"
    code, _, err = run_ckpt("convert", pipe, "--layout", "original", "--max-shard-size", "1MB", "-o", sharded, "-q")
    assert code == 0, err
    got, n = _shards(sharded, "model")
    assert n == len(split_torch_state_dict_into_shards(whole, max_shard_size=10**6).filename_to_tensors) > 1
    assert got.keys() == whole.keys() and all(torch.equal(got[k], whole[k]) for k in whole)

    # all-in-one -> pipeline: every component sharded past the size, each loaded by its own class
    out = tmp_path / "pipe2"
    code, _, err = run_ckpt("convert", single, "--layout", "diffusers", "--config", pipe, "--max-shard-size", "1MB",
                            "-o", out, "-q")
    assert code == 0, err
    for folder, m in models.items():
        stem = "model" if folder.startswith("text_encoder") else "diffusion_pytorch_model"
        got, n = _shards(out / folder, stem)
        assert n == len(split_torch_state_dict_into_shards(got, max_shard_size=10**6).filename_to_tensors), folder
        assert n > 1 or folder == "text_encoder", folder  # its 16-wide CLIP fits one shard
        loaded, info = type(m).from_pretrained(out / folder, output_loading_info=True)
        assert not info["missing_keys"] and not info["unexpected_keys"], (folder, info)
        for k, v in loaded.state_dict().items():
            assert torch.equal(v, sds[folder][k]), (folder, k)
