"""`ckpt merge-lora` end to end on tiny SD1 / SDXL UNets, with diffusers and PEFT as the only oracles.

For each UNet kind a tiny `UNet2DConditionModel` gets its weights from a random LDM state dict
(`model.diffusion_model.input_blocks...`). The LDM key set is written from the LDM UNetModel layout
(`ldm_blocks` below, independent of ckpt's own key map) and proven by diffusers' single-file converter:
`convert_ldm_unet_checkpoint` must turn it into exactly the model's state-dict keys and shapes, placing
every LDM tensor on the diffusers key our name table says. The converted dict is loaded into the model.

A real PEFT LoRA is added with `add_adapter` on every Linear / Conv2d of the UNet (attention q/k/v/out,
proj_in/out, feed-forward, resnet conv1/conv2/conv_shortcut/time_emb_proj, down/upsampler convs with
their stride, conv_in/conv_out, time and SDXL add embeddings), r=4, lora_alpha=8 (scale 2), random
non-zero A and B (`init_lora_weights=False`). It is saved the ways users have it:

- `peft`: `save_lora_adapter` folder (bare diffusers names, alpha only in `lora_adapter_metadata`);
- `diffusers`: `StableDiffusion(XL)LoraLoaderMixin.save_lora_weights` (`unet.` names, `unet.lora_alpha`
  metadata), the file a diffusers pipeline writes;
- `kohya`: diffusers' `convert_state_dict_to_kohya` (`lora_unet_down_blocks_...`, lora_down/lora_up),
  with kohya's own alpha key set to the network alpha (diffusers' converter writes alpha = rank);
- `kohya_ldm`: the same with LDM module names (`lora_unet_input_blocks_4_1_...`), the names kohya's
  SDXL trainer writes.

Oracle: the model's own weights after diffusers' `fuse_lora(lora_scale=RATIO)` (PEFT's merge). Each LoRA
is merged by the CLI with `--ratio RATIO` into the LDM single file (output converted back with
`convert_ldm_unet_checkpoint`), into the `save_pretrained` UNet folder, and into a pipeline folder that
holds it as `unet/`.

Tolerance: fp32 on both sides and the same products W + ratio * alpha / r * (B @ A); only the summation
order differs (PEFT merges conv LoRAs with conv2d, ckpt with one addmm on the flattened weight), so
results agree to a few fp32 ulps: rtol 1e-5, atol 1e-6 (weights and deltas are O(0.1), an ulp there is
~1e-8). Tensors the LoRA does not touch must come out bit-identical.
"""

from __future__ import annotations

import json
import logging
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file

diffusers = pytest.importorskip("diffusers")
peft = pytest.importorskip("peft")

logging.getLogger("diffusers").setLevel(logging.ERROR)

PREFIX = "model.diffusion_model."
RATIO = 0.7
RANK, ALPHA = 4, 8
TOL = {"rtol": 1e-5, "atol": 1e-6}
# Together these name every Linear / Conv2d of both UNets (checked in the fixture).
TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "proj_in", "proj_out", "ff.net.0.proj", "ff.net.2",
           "conv1", "conv2", "conv_shortcut", "time_emb_proj", "conv", "conv_in", "conv_out",
           "linear_1", "linear_2"]
# diffusers ResnetBlock2D submodule -> LDM ResBlock submodule
RESNET_TO_LDM = {"norm1": "in_layers.0", "conv1": "in_layers.2", "time_emb_proj": "emb_layers.1",
                 "norm2": "out_layers.0", "conv2": "out_layers.3", "conv_shortcut": "skip_connection"}


def flat(name: str) -> str:
    return name.replace(".", "_")


def make_unet(kind: str):
    from diffusers import UNet2DConditionModel

    common = {"sample_size": 8, "in_channels": 4, "out_channels": 4, "block_out_channels": (32, 64),
              "layers_per_block": 2, "cross_attention_dim": 32, "attention_head_dim": 8, "norm_num_groups": 32}
    if kind == "sd1":  # cross-attention at the top level and in the middle, conv proj_in/proj_out
        return UNet2DConditionModel(**common, down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
                                    up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"))
    # SDXL: no attention at the top level, several transformer layers per block, linear projections,
    # `add_embedding` (LDM `label_emb`) for the text_time conditioning
    return UNet2DConditionModel(**common, down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
                                up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"), transformer_layers_per_block=(1, 2),
                                use_linear_projection=True, addition_embed_type="text_time", addition_time_embed_dim=8,
                                projection_class_embeddings_input_dim=32 + 6 * 8)


def ldm_blocks(cfg) -> dict[str, tuple[str, bool]]:
    """diffusers module prefix -> (LDM prefix, is a resnet), written from the LDM UNetModel definition
    (input_blocks: conv_in, then per level `layers_per_block` x [ResBlock, SpatialTransformer?] and a
    Downsample `op` except at the last level; middle_block: ResBlock, SpatialTransformer, ResBlock;
    output_blocks: per level `layers_per_block + 1` x [ResBlock, SpatialTransformer?], the last one
    with an Upsample `conv` except at the last level)."""
    n, last = cfg["layers_per_block"], len(cfg["block_out_channels"]) - 1
    out = {"conv_in": ("input_blocks.0.0", False),
           "time_embedding.linear_1": ("time_embed.0", False), "time_embedding.linear_2": ("time_embed.2", False),
           "conv_norm_out": ("out.0", False), "conv_out": ("out.2", False)}
    if cfg.get("addition_embed_type") == "text_time":
        out["add_embedding.linear_1"] = ("label_emb.0.0", False)
        out["add_embedding.linear_2"] = ("label_emb.0.2", False)
    k = 1
    for x, kind in enumerate(cfg["down_block_types"]):
        for i in range(n):
            out[f"down_blocks.{x}.resnets.{i}"] = (f"input_blocks.{k}.0", True)
            if kind.startswith("CrossAttn"):
                out[f"down_blocks.{x}.attentions.{i}"] = (f"input_blocks.{k}.1", False)
            k += 1
        if x < last:
            out[f"down_blocks.{x}.downsamplers.0.conv"] = (f"input_blocks.{k}.0.op", False)
            k += 1
    out.update({"mid_block.resnets.0": ("middle_block.0", True), "mid_block.attentions.0": ("middle_block.1", False),
                "mid_block.resnets.1": ("middle_block.2", True)})
    k = 0
    for x, kind in enumerate(cfg["up_block_types"]):
        attn = kind.startswith("CrossAttn")
        for i in range(n + 1):
            out[f"up_blocks.{x}.resnets.{i}"] = (f"output_blocks.{k}.0", True)
            if attn:
                out[f"up_blocks.{x}.attentions.{i}"] = (f"output_blocks.{k}.1", False)
            if i == n and x < last:
                out[f"up_blocks.{x}.upsamplers.0.conv"] = (f"output_blocks.{k}.{2 if attn else 1}.conv", False)
            k += 1
    return out


def to_ldm(name: str, blocks: dict[str, tuple[str, bool]]) -> str:
    """LDM spelling of a diffusers module or parameter name
    (`down_blocks.1.resnets.0.conv1.weight` -> `input_blocks.4.0.in_layers.2.weight`)."""
    head = max((b for b in blocks if name == b or name.startswith(b + ".")), key=len)
    ldm, resnet = blocks[head]
    rest = name[len(head) + 1:]
    if resnet:
        first, _, tail = rest.partition(".")
        rest = RESNET_TO_LDM[first] + ("." + tail if tail else "")
    return ldm + ("." + rest if rest else "")


@pytest.fixture(scope="module", params=["sd1", "sdxl"])
def case(request, tmp_path_factory):
    from diffusers.loaders import StableDiffusionLoraLoaderMixin, StableDiffusionXLLoraLoaderMixin
    from diffusers.loaders.single_file_utils import convert_ldm_unet_checkpoint
    from diffusers.utils.state_dict_utils import convert_state_dict_to_kohya
    from peft import LoraConfig, get_peft_model_state_dict

    kind = request.param
    d = tmp_path_factory.mktemp(kind)
    torch.manual_seed(0)
    model = make_unet(kind)
    config = dict(model.config)
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    layers = sorted(n for n, m in model.named_modules() if isinstance(m, (torch.nn.Linear, torch.nn.Conv2d)))

    # A random LDM UNet; diffusers' converter says what it is.
    blocks = ldm_blocks(config)
    names = {k: to_ldm(k, blocks) for k in shapes}
    assert len(set(names.values())) == len(names)
    gen = torch.Generator().manual_seed(1)
    ldm = {PREFIX + names[k]: torch.randn(shape, generator=gen) * 0.1 for k, shape in shapes.items()}
    converted = convert_ldm_unet_checkpoint(dict(ldm), config)
    assert {k: tuple(v.shape) for k, v in converted.items()} == shapes, "not this UNet's LDM layout"
    assert all(converted[k] is ldm[PREFIX + names[k]] for k in shapes)  # every LDM tensor used, where we think
    model.load_state_dict(converted, strict=True)
    base_sd = {k: v.detach().clone() for k, v in model.state_dict().items()}

    extras = {"first_stage_model.decoder.conv_in.weight": torch.randn(8, 4, 3, 3, generator=gen),
              "alphas_cumprod": torch.rand(10, generator=gen)}
    save_file({**ldm, **extras}, d / "ldm.safetensors")
    model.save_pretrained(d / "unet")
    pipe = d / "pipe"
    model.save_pretrained(pipe / "unet")
    pipe_class = "StableDiffusionXLPipeline" if kind == "sdxl" else "StableDiffusionPipeline"
    (pipe / "model_index.json").write_text(json.dumps({"_class_name": pipe_class,
                                                      "_diffusers_version": diffusers.__version__,
                                                      "unet": ["diffusers", "UNet2DConditionModel"]}))
    bases = {"ldm": d / "ldm.safetensors", "unet_folder": d / "unet", "pipeline": pipe}

    # A real PEFT LoRA on every Linear / Conv2d, saved the ways users have it.
    model.add_adapter(LoraConfig(r=RANK, lora_alpha=ALPHA, init_lora_weights=False, target_modules=TARGETS))
    lora_sd = {k: v.detach().clone().contiguous() for k, v in get_peft_model_state_dict(model).items()}
    modules = sorted({k.rsplit(".lora_", 1)[0] for k in lora_sd})
    assert modules == layers
    assert all(bool((v != 0).all()) for k, v in lora_sd.items() if ".lora_B." in k)  # random, non-zero B
    assert any(lora_sd[f"{m}.lora_A.weight"].shape[2:] == (3, 3) for m in modules)  # 3x3 conv LoRAs too

    loras = {}
    model.save_lora_adapter(d / "lora_peft")
    loras["peft"] = d / "lora_peft"
    mixin = StableDiffusionXLLoraLoaderMixin if kind == "sdxl" else StableDiffusionLoraLoaderMixin
    mixin.save_lora_weights(d / "lora_diffusers", unet_lora_layers=lora_sd,
                            unet_lora_adapter_metadata=model.peft_config["default"].to_dict())
    loras["diffusers"] = d / "lora_diffusers" / "pytorch_lora_weights.safetensors"
    assert all(k.startswith("unet.") for k in load_file(loras["diffusers"]))

    kohya = convert_state_dict_to_kohya({f"unet.{k}": v for k, v in lora_sd.items()})
    parts = ("lora_down.weight", "lora_up.weight", "alpha")
    assert set(kohya) == {f"lora_unet_{flat(m)}.{s}" for m in modules for s in parts}
    # kohya stores the network alpha (diffusers' converter writes alpha = rank, i.e. lora_alpha == r)
    kohya = {k: torch.tensor(float(ALPHA)) if k.endswith(".alpha") else v.contiguous() for k, v in kohya.items()}
    save_file(kohya, d / "lora_kohya.safetensors")
    loras["kohya"] = d / "lora_kohya.safetensors"
    ldm_flat = {flat(m): flat(to_ldm(m, blocks)) for m in modules}
    kohya_ldm = {}
    for k, v in kohya.items():
        head, _, part = k.partition(".")
        kohya_ldm[f"lora_unet_{ldm_flat[head[len('lora_unet_'):]]}.{part}"] = v
    assert len(kohya_ldm) == len(kohya)
    save_file(kohya_ldm, d / "lora_kohya_ldm.safetensors")
    loras["kohya_ldm"] = d / "lora_kohya_ldm.safetensors"

    # The oracle: PEFT's merge, through diffusers.
    model.fuse_lora(lora_scale=RATIO)
    want = {k.replace(".base_layer.", "."): v.detach().clone()
            for k, v in model.state_dict().items() if "lora_" not in k}
    assert set(want) == set(base_sd)
    changed = {f"{m}.weight" for m in modules}
    for k, v in want.items():
        assert torch.equal(v, base_sd[k]) != (k in changed), k

    return SimpleNamespace(kind=kind, config=config, bases=bases, loras=loras, want=want, changed=changed,
                           modules=modules, ldm_keys=set(ldm) | set(extras), extras=extras)


@pytest.mark.parametrize("lora", ["peft", "diffusers", "kohya", "kohya_ldm"])
@pytest.mark.parametrize("base", ["ldm", "unet_folder", "pipeline"])
def test_peft_unet_lora_matches_fuse_lora(case, base, lora, tmp_path, run_ckpt):
    from diffusers.loaders.single_file_utils import convert_ldm_unet_checkpoint

    out = tmp_path / ("out.safetensors" if base == "ldm" else "out")
    code, stdout, err = run_ckpt("merge-lora", case.bases[base], case.loras[lora], "--ratio", RATIO, "-o", out, "-q")
    assert code == 0, stdout + err
    n = len(case.modules)
    assert f"{n} LoRA modules matched" in stdout and f"base tensors changed: {n}" in stdout, stdout

    if base == "ldm":
        result = load_file(out)
        assert set(result) == case.ldm_keys
        for k, v in case.extras.items():
            assert torch.equal(result[k], v), k
        got = convert_ldm_unet_checkpoint(result, case.config)
    else:
        folder = out / "unet" if base == "pipeline" else out
        assert (folder / "config.json").is_file()
        got = load_file(folder / "diffusion_pytorch_model.safetensors")

    assert set(got) == set(case.want)
    for k, want in case.want.items():
        assert got[k].dtype == torch.float32, k
        if k in case.changed:
            torch.testing.assert_close(got[k], want, **TOL, msg=k)
        else:
            assert torch.equal(got[k], want), k
