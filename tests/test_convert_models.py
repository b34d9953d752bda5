"""Converted model folders load in the libraries they came from: transformers and diffusers are the
oracles (their `from_pretrained` must accept the folder and give the weights of `model.to(dtype)`)."""

from __future__ import annotations

import json

import torch
from safetensors.torch import load_file


def test_transformers_folder_fp16_loads_in_transformers(tmp_path, run_ckpt):
    from transformers import GPT2Config, GPT2Model

    torch.manual_seed(0)
    model = GPT2Model(GPT2Config(n_layer=2, n_embd=16, n_head=2, n_positions=32, vocab_size=64))
    src = tmp_path / "gpt2"
    model.save_pretrained(src, max_shard_size="20KB")  # sharded, with an index
    assert (src / "model.safetensors.index.json").exists()
    code, out, err = run_ckpt("convert", src, "--to", "fp16", "-q")
    assert code == 0, err
    dst = tmp_path / "gpt2-fp16"
    assert json.loads((dst / "config.json").read_text())["dtype" if "dtype" in json.loads(
        (src / "config.json").read_text()) else "torch_dtype"] == "float16"
    loaded = GPT2Model.from_pretrained(dst)
    assert loaded.config.dtype == torch.float16 or str(loaded.config.dtype).endswith("float16")
    want = model.half().state_dict()
    got = loaded.state_dict()
    for k, v in want.items():
        assert torch.equal(got[k].to(v.dtype), v), k


def test_transformers_folder_resharded(tmp_path, run_ckpt):
    from transformers import GPT2Config, GPT2Model

    torch.manual_seed(1)
    model = GPT2Model(GPT2Config(n_layer=2, n_embd=16, n_head=2, n_positions=32, vocab_size=64))
    model.save_pretrained(tmp_path / "src")
    code, out, err = run_ckpt("convert", tmp_path / "src", "--to", "bf16", "--max-shard-size", "10KB", "-q",
                              "-o", tmp_path / "out")
    assert code == 0, err
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    loaded = GPT2Model.from_pretrained(tmp_path / "out", dtype=torch.bfloat16)
    for k, v in model.to(torch.bfloat16).state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v), k


def test_diffusers_pipeline_folder_fp16(tmp_path, run_ckpt):
    from diffusers import AutoencoderKL, UNet2DModel

    torch.manual_seed(0)
    unet = UNet2DModel(sample_size=8, in_channels=3, out_channels=3, layers_per_block=1,
                       block_out_channels=(8, 16), down_block_types=("DownBlock2D", "DownBlock2D"),
                       up_block_types=("UpBlock2D", "UpBlock2D"), norm_num_groups=4)
    vae = AutoencoderKL(in_channels=3, out_channels=3, block_out_channels=(8,), latent_channels=2,
                        norm_num_groups=4, layers_per_block=1)
    src = tmp_path / "pipe"
    unet.save_pretrained(src / "unet")
    vae.save_pretrained(src / "vae")
    (src / "model_index.json").write_text(json.dumps({"_class_name": "DDPMPipeline", "unet": ["diffusers", "UNet2DModel"]}))
    (src / "scheduler").mkdir()
    (src / "scheduler" / "scheduler_config.json").write_text(json.dumps({"_class_name": "DDPMScheduler"}))
    code, out, err = run_ckpt("convert", src, "--to", "fp16", "-q")
    assert code == 0, err
    dst = tmp_path / "pipe-fp16"
    assert (dst / "model_index.json").read_text() == (src / "model_index.json").read_text()
    assert (dst / "scheduler" / "scheduler_config.json").exists()
    for sub, cls, model in (("unet", UNet2DModel, unet), ("vae", AutoencoderKL, vae)):
        stored = load_file(dst / sub / "diffusion_pytorch_model.safetensors")
        assert {v.dtype for v in stored.values()} == {torch.float16}
        loaded = cls.from_pretrained(dst / sub, torch_dtype=torch.float16)
        for k, v in model.to(torch.float16).state_dict().items():
            assert torch.equal(loaded.state_dict()[k], v), (sub, k)


def _gpt2(seed):
    from transformers import GPT2Config, GPT2Model

    torch.manual_seed(seed)
    return GPT2Model(GPT2Config(n_layer=2, n_embd=16, n_head=2, n_positions=32, vocab_size=64))


def test_transformers_folder_in_torch_format_loads_in_transformers(tmp_path, run_ckpt):
    """--format torch on a model folder writes the names transformers loads: pytorch_model.bin, or
    pytorch_model-0000x-of-0000y.bin + pytorch_model.bin.index.json (one torch zip per shard)."""
    from transformers import GPT2Model

    model = _gpt2(2)
    model.save_pretrained(tmp_path / "src")
    cases = {"one": ["-o", tmp_path / "one"], "resharded": ["--max-shard-size", "10KB", "-o", tmp_path / "resharded"]}
    model.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")  # a sharded input keeps its shards
    for name, extra in cases.items():
        code, out, err = run_ckpt("convert", tmp_path / "src", "--to", "bf16", "--format", "torch", "-q", *extra)
        assert code == 0, err
    code, out, err = run_ckpt("convert", tmp_path / "sharded", "--to", "bf16", "--format", "torch", "-q",
                              "-o", tmp_path / "kept")
    assert code == 0, err
    assert sorted(p.name for p in (tmp_path / "one").iterdir()) == ["config.json", "pytorch_model.bin"]
    for name in ("resharded", "kept"):
        index = json.loads((tmp_path / name / "pytorch_model.bin.index.json").read_text())
        shards = sorted(set(index["weight_map"].values()))
        assert len(shards) > 1 and all(s.startswith("pytorch_model-0000") and s.endswith(".bin") for s in shards)
        assert not list((tmp_path / name).glob("*.safetensors*"))
    want = model.to(torch.bfloat16).state_dict()
    for name in ("one", "resharded", "kept"):
        loaded = GPT2Model.from_pretrained(tmp_path / name, dtype=torch.bfloat16, use_safetensors=False)
        for k, v in want.items():
            assert torch.equal(loaded.state_dict()[k], v), (name, k)


def test_diffusers_pipeline_in_torch_format_loads_in_diffusers(tmp_path, run_ckpt):
    from diffusers import UNet2DModel

    torch.manual_seed(3)
    unet = UNet2DModel(sample_size=8, in_channels=3, out_channels=3, layers_per_block=1,
                       block_out_channels=(8, 16), down_block_types=("DownBlock2D", "DownBlock2D"),
                       up_block_types=("UpBlock2D", "UpBlock2D"), norm_num_groups=4)
    unet.save_pretrained(tmp_path / "pipe" / "unet")
    (tmp_path / "pipe" / "model_index.json").write_text(json.dumps({"_class_name": "DDPMPipeline",
                                                                   "unet": ["diffusers", "UNet2DModel"]}))
    for name, extra in (("one", []), ("sharded", ["--max-shard-size", "20KB"])):
        code, out, err = run_ckpt("convert", tmp_path / "pipe", "--to", "fp16", "--format", "torch", "-q",
                                  "-o", tmp_path / name, *extra)
        assert code == 0, err
        files = sorted(p.name for p in (tmp_path / name / "unet").iterdir())
        if name == "one":
            assert files == ["config.json", "diffusion_pytorch_model.bin"]
        else:
            assert "diffusion_pytorch_model.bin.index.json" in files
            assert any(f.startswith("diffusion_pytorch_model-00001-of-") and f.endswith(".bin") for f in files)
        loaded = UNet2DModel.from_pretrained(tmp_path / name / "unet", torch_dtype=torch.float16, use_safetensors=False)
        for k, v in unet.to(torch.float16).state_dict().items():
            assert torch.equal(loaded.state_dict()[k], v), (name, k)
