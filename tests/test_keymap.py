"""The LoRA key map against real oracles.

- Layout conversions come from diffusers' own single-file converters
  (`convert_flux_transformer_checkpoint_to_diffusers`, `convert_sd3_transformer_checkpoint_to_diffusers`,
  `convert_ldm_unet_checkpoint`, `convert_open_clip_checkpoint`): a tiny native state dict with unique
  values is converted, and every Placement (key, rows, transform) must reproduce the converted tensor.
  The tiny native dicts are checked first: the converter must consume all of them and produce exactly
  the state-dict keys of a tiny diffusers/transformers model, so they are real layouts.
- Module names come from the models themselves (`named_modules()` of tiny diffusers / transformers
  models) spelled the way each trainer does, and from PEFT's `get_peft_model_state_dict`.
"""

from __future__ import annotations

import logging

import pytest
import torch

from ckpt.families import get
from ckpt.adapters.keymap import build_keymap
from ckpt.adapters.placement import Placement

logging.getLogger("transformers").setLevel(logging.ERROR)
logging.getLogger("diffusers").setLevel(logging.ERROR)


def shapes(sd):
    return {k: tuple(v.shape) for k, v in sd.items()}


def flat(name):
    return name.replace(".", "_")


class Unique:
    """Tensors with values no other tensor shares, so equality proves where data came from."""

    def __init__(self):
        self.next = 0.0

    def __call__(self, *shape):
        n = 1
        for s in shape:
            n *= s
        t = torch.arange(self.next, self.next + n, dtype=torch.float64).reshape(shape)
        self.next += n
        return t


def apply(target: Placement, native: torch.Tensor) -> torch.Tensor:
    """What the diffusers-side tensor is, read through a Placement of the native base."""
    t = native
    if target.rows is not None:
        t = t[target.rows[0]: target.rows[1]]
    if target.transform == "swap_halves":
        a, b = t.chunk(2, dim=0)
        t = torch.cat([b, a])
    elif target.transform == "transpose":
        t = t.T
    return t


def assemble(targets: list[Placement], sd: dict, rows: int) -> torch.Tensor:
    """Rebuild a fused native tensor from the pieces a split Placement list points at."""
    parts = sorted(targets, key=lambda t: t.part[0] if t.part else 0)
    out = []
    for t in parts:
        piece = apply(Placement(t.key, transform=t.transform), sd[t.key])
        out.append(piece)
        if t.part:
            assert piece.shape[0] == t.part[1] - t.part[0]
    whole = torch.cat(out)
    assert whole.shape[0] == rows
    return whole


# --------------------------------------------------------------------------------------- Flux

FLUX_H = 3072  # diffusers' BFL converter hard-codes Flux's width; only dim 0 matters, so columns are 1


def flux_bfl(u: Unique, doubles=1, singles=1, h=FLUX_H, head_dim=4):
    sd = {}

    def lin(name, rows, bias=True):
        sd[f"{name}.weight"] = u(rows, 1)
        if bias:
            sd[f"{name}.bias"] = u(rows)

    for name in ("img_in", "txt_in", "time_in.in_layer", "time_in.out_layer", "vector_in.in_layer",
                 "vector_in.out_layer", "guidance_in.in_layer", "guidance_in.out_layer"):
        lin(name, h)
    for i in range(doubles):
        b = f"double_blocks.{i}"
        for s in ("img", "txt"):
            lin(f"{b}.{s}_mod.lin", 6 * h)
            lin(f"{b}.{s}_attn.qkv", 3 * h)
            lin(f"{b}.{s}_attn.proj", h)
            lin(f"{b}.{s}_mlp.0", 4 * h)
            lin(f"{b}.{s}_mlp.2", h)
            sd[f"{b}.{s}_attn.norm.query_norm.scale"] = u(head_dim)
            sd[f"{b}.{s}_attn.norm.key_norm.scale"] = u(head_dim)
    for j in range(singles):
        b = f"single_blocks.{j}"
        lin(f"{b}.modulation.lin", 3 * h)
        lin(f"{b}.linear1", 3 * h + 4 * h)
        lin(f"{b}.linear2", h)
        sd[f"{b}.norm.query_norm.scale"] = u(head_dim)
        sd[f"{b}.norm.key_norm.scale"] = u(head_dim)
    lin("final_layer.linear", 4)
    lin("final_layer.adaLN_modulation.1", 2 * h)
    return sd


@pytest.fixture(scope="module")
def flux_pair():
    from diffusers import FluxTransformer2DModel
    from diffusers.loaders.single_file_utils import convert_flux_transformer_checkpoint_to_diffusers

    bfl = flux_bfl(Unique())
    work = dict(bfl)
    converted = convert_flux_transformer_checkpoint_to_diffusers(work)
    assert work == {}, f"converter left {sorted(work)}"
    model = FluxTransformer2DModel(
        in_channels=4, num_layers=1, num_single_layers=1, attention_head_dim=8, num_attention_heads=2,
        joint_attention_dim=16, pooled_projection_dim=16, guidance_embeds=True, axes_dims_rope=(2, 2, 4),
    )
    assert set(converted) == set(model.state_dict()), "tiny BFL dict is not a Flux layout"
    modules = [n for n, m in model.named_modules() if isinstance(getattr(m, "weight", None), torch.Tensor)]
    return bfl, converted, modules


@pytest.mark.parametrize("prefix", ["", "model.diffusion_model.", "model.model."])
def test_flux_bfl_base_answers_diffusers_names(flux_pair, prefix):
    bfl, converted, modules = flux_pair
    km = build_keymap({prefix + k: v for k, v in shapes(bfl).items()})
    base = {prefix + k: v for k, v in bfl.items()}
    assert modules
    for mod in modules:
        spellings = [f"transformer.{mod}", f"lora_transformer_{flat(mod)}", f"lycoris_{flat(mod)}", mod]
        for name in spellings:
            t = km.lookup(name)
            assert t is not None, name
            assert torch.equal(apply(t, base[t.key]), converted[f"{mod}.weight"]), name
            if f"{mod}.bias" in converted:
                bias = Placement(t.bias_key, t.rows, t.transform)
                assert torch.equal(apply(bias, base[t.bias_key]), converted[f"{mod}.bias"]), name


def test_flux_bfl_base_answers_kohya_and_comfy_names(flux_pair):
    bfl, _, _ = flux_pair
    km = build_keymap({"model.diffusion_model." + k: v for k, v in shapes(bfl).items()})
    for key in bfl:
        if key.endswith(".bias"):
            continue
        mod = key.rsplit(".", 1)[0]
        full = Placement("model.diffusion_model." + key)
        assert km.lookup(f"lora_unet_{flat(mod)}") == full
        assert km.lookup(f"diffusion_model.{mod}") == full
        assert km.lookup(f"model.diffusion_model.{mod}") == full
    xl = km.lookup("double_blocks.0.processor.qkv_lora2")
    assert xl == Placement("model.diffusion_model.double_blocks.0.txt_attn.qkv.weight")
    qkv_only = km.lookup("single_blocks.0.linear1_qkv")
    assert qkv_only.rows == (0, 3 * FLUX_H)


def test_flux_diffusers_base_splits_bfl_names(flux_pair):
    """kohya (BFL-named) LoRA on a diffusers `transformer/` folder: one module, several Targets."""
    bfl, converted, _ = flux_pair
    for component, prefix in ((None, ""), ("transformer", ""), (None, "transformer/")):
        km = build_keymap({prefix + k: v for k, v in shapes(converted).items()}, component=component)
        sd = {prefix + k: v for k, v in converted.items()}
        for key, native in bfl.items():
            if key.endswith(".bias"):
                continue
            mod = key.rsplit(".", 1)[0]
            for name in (f"lora_unet_{flat(mod)}", f"diffusion_model.{mod}"):
                targets = km.targets(name)
                assert targets, name
                assert torch.equal(assemble(targets, sd, native.shape[0]), native), name
                if len(targets) > 1:
                    assert km.lookup(name) is None  # a split needs `targets()`
        # diffusers/PEFT names land on the same-named weight
        t = km.lookup("transformer.single_transformer_blocks.0.attn.to_q")
        assert t == Placement(prefix + "single_transformer_blocks.0.attn.to_q.weight")
        assert km.lookup("transformer.norm_out.linear").transform is None


def flux2_bfl(u: Unique, h=16, head_dim=8, mlp=48):
    """Flux.2 BFL layout: no biases, shared modulations, gated MLPs (2 * mlp rows in)."""
    sd = {}
    for name, rows in (("img_in", h), ("txt_in", h), ("time_in.in_layer", h), ("time_in.out_layer", h),
                       ("guidance_in.in_layer", h), ("guidance_in.out_layer", h),
                       ("double_stream_modulation_img.lin", 6 * h), ("double_stream_modulation_txt.lin", 6 * h),
                       ("single_stream_modulation.lin", 3 * h), ("final_layer.linear", 4),
                       ("final_layer.adaLN_modulation.1", 2 * h)):
        sd[f"{name}.weight"] = u(rows, 1)
    for s in ("img", "txt"):
        b = f"double_blocks.0.{s}"
        sd.update({f"{b}_attn.qkv.weight": u(3 * h, 1), f"{b}_attn.proj.weight": u(h, 1),
                   f"{b}_attn.norm.query_norm.scale": u(head_dim), f"{b}_attn.norm.key_norm.scale": u(head_dim),
                   f"{b}_mlp.0.weight": u(2 * mlp, 1), f"{b}_mlp.2.weight": u(h, 1)})
    b = "single_blocks.0"
    sd.update({f"{b}.linear1.weight": u(3 * h + 2 * mlp, 1), f"{b}.linear2.weight": u(h, 1),
               f"{b}.norm.query_norm.scale": u(head_dim), f"{b}.norm.key_norm.scale": u(head_dim)})
    return sd


def test_flux2_both_directions():
    from diffusers import Flux2Transformer2DModel
    from diffusers.loaders.single_file_utils import convert_flux2_transformer_checkpoint_to_diffusers

    bfl = flux2_bfl(Unique())
    converted = convert_flux2_transformer_checkpoint_to_diffusers(dict(bfl))
    model = Flux2Transformer2DModel(in_channels=4, num_layers=1, num_single_layers=1, attention_head_dim=8,
                                    num_attention_heads=2, joint_attention_dim=16, timestep_guidance_channels=8,
                                    axes_dims_rope=(2, 2, 2, 2))
    assert set(converted) == set(model.state_dict()), "tiny dict is not a Flux.2 layout"
    km = build_keymap({"model.diffusion_model." + k: v for k, v in shapes(bfl).items()})
    for key, value in converted.items():
        mod = key.rsplit(".", 1)[0]
        for name in (f"transformer.{mod}", f"lora_transformer_{flat(mod)}"):
            t = km.lookup(name)
            assert t is not None, name
            assert torch.equal(apply(t, bfl[t.key[len("model.diffusion_model."):]]), value), name
    km = build_keymap(shapes(converted), component="transformer")
    for key, native in bfl.items():
        targets = km.targets("lora_unet_" + flat(key.rsplit(".", 1)[0]))
        assert targets, key
        assert torch.equal(assemble(targets, converted, native.shape[0]), native), key


# ---------------------------------------------------------------------------------------- SD3

SD3_H = 32


def sd3_sai(u: Unique, layers=2, dual=(0,)):
    h = SD3_H
    sd = {"pos_embed": u(1, 64, h)}

    def lin(name, rows):
        sd[f"{name}.weight"] = u(rows, 1)
        sd[f"{name}.bias"] = u(rows)

    lin("x_embedder.proj", h)
    for name in ("t_embedder.mlp.0", "t_embedder.mlp.2", "y_embedder.mlp.0", "y_embedder.mlp.2", "context_embedder"):
        lin(name, h)
    for i in range(layers):
        b = f"joint_blocks.{i}"
        last = i == layers - 1
        lin(f"{b}.x_block.attn.qkv", 3 * h)
        lin(f"{b}.context_block.attn.qkv", 3 * h)
        lin(f"{b}.x_block.attn.proj", h)
        for s in ("x_block.attn", "context_block.attn"):
            sd[f"{b}.{s}.ln_q.weight"] = u(16)
            sd[f"{b}.{s}.ln_k.weight"] = u(16)
        if i in dual:
            lin(f"{b}.x_block.attn2.qkv", 3 * h)
            lin(f"{b}.x_block.attn2.proj", h)
            sd[f"{b}.x_block.attn2.ln_q.weight"] = u(16)
            sd[f"{b}.x_block.attn2.ln_k.weight"] = u(16)
        lin(f"{b}.x_block.adaLN_modulation.1", (9 if i in dual else 6) * h)
        lin(f"{b}.context_block.adaLN_modulation.1", 2 * h if last else 6 * h)
        lin(f"{b}.x_block.mlp.fc1", 4 * h)
        lin(f"{b}.x_block.mlp.fc2", h)
        if not last:
            lin(f"{b}.context_block.attn.proj", h)
            lin(f"{b}.context_block.mlp.fc1", 4 * h)
            lin(f"{b}.context_block.mlp.fc2", h)
    lin("final_layer.linear", 16)
    lin("final_layer.adaLN_modulation.1", 2 * h)
    return sd


@pytest.fixture(scope="module")
def sd3_pair():
    from diffusers import SD3Transformer2DModel
    from diffusers.loaders.single_file_utils import convert_sd3_transformer_checkpoint_to_diffusers

    sai = sd3_sai(Unique())
    work = dict(sai)
    converted = convert_sd3_transformer_checkpoint_to_diffusers(work)
    assert work == {}, f"converter left {sorted(work)}"
    model = SD3Transformer2DModel(
        sample_size=8, patch_size=2, in_channels=4, num_layers=2, attention_head_dim=16, num_attention_heads=2,
        joint_attention_dim=32, caption_projection_dim=SD3_H, pooled_projection_dim=32, out_channels=4,
        pos_embed_max_size=8, dual_attention_layers=(0,), qk_norm="rms_norm",
    )
    assert set(converted) == set(model.state_dict()), "tiny SAI dict is not an SD3 layout"
    modules = [n for n, m in model.named_modules() if isinstance(getattr(m, "weight", None), torch.Tensor)]
    return sai, converted, modules


def test_sd3_sai_base_answers_diffusers_names(sd3_pair):
    sai, converted, modules = sd3_pair
    prefix = "model.diffusion_model."
    km = build_keymap({prefix + k: v for k, v in shapes(sai).items()})
    base = {prefix + k: v for k, v in sai.items()}
    swapped = []
    for mod in modules:
        for name in (f"transformer.{mod}", f"base_model.model.{mod}", f"lora_transformer_{flat(mod)}",
                     f"lycoris_{flat(mod)}"):
            t = km.lookup(name)
            assert t is not None, name
            assert torch.equal(apply(t, base[t.key]), converted[f"{mod}.weight"]), name
            if f"{mod}.bias" in converted:
                bias = Placement(t.bias_key, t.rows, t.transform)
                assert torch.equal(apply(bias, base[t.bias_key]), converted[f"{mod}.bias"]), name
            if t.transform == "swap_halves":
                swapped.append(mod)
    assert sorted(set(swapped)) == ["norm_out.linear", "transformer_blocks.1.norm1_context.linear"]
    qkv = Placement(prefix + "joint_blocks.0.x_block.attn.qkv.weight")
    assert km.lookup("lora_unet_joint_blocks_0_x_block_attn_qkv") == qkv


def test_sd3_diffusers_base_splits_sai_names(sd3_pair):
    sai, converted, _ = sd3_pair
    km = build_keymap(shapes(converted))
    for key, native in sai.items():
        if key.endswith(".bias") or key == "pos_embed":
            continue
        mod = key.rsplit(".", 1)[0]
        targets = km.targets(f"lora_unet_{flat(mod)}")
        assert targets, mod
        assert torch.equal(assemble(targets, converted, native.shape[0]), native), mod


# ------------------------------------------------------------------------------------ SD UNets

def _unet_sd1():
    from diffusers import UNet2DConditionModel

    model = UNet2DConditionModel(
        sample_size=8, in_channels=4, out_channels=4, block_out_channels=(32, 64), layers_per_block=2,
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=32, attention_head_dim=8, norm_num_groups=32,
    )
    # The LDM layout of this config, written from the LDM definition (checked by the converter below).
    blocks = {
        "conv_in": "input_blocks.0.0",
        "down_blocks.0.resnets.0": "input_blocks.1.0", "down_blocks.0.attentions.0": "input_blocks.1.1",
        "down_blocks.0.resnets.1": "input_blocks.2.0", "down_blocks.0.attentions.1": "input_blocks.2.1",
        "down_blocks.0.downsamplers.0.conv": "input_blocks.3.0.op",
        "down_blocks.1.resnets.0": "input_blocks.4.0", "down_blocks.1.resnets.1": "input_blocks.5.0",
        "mid_block.resnets.0": "middle_block.0", "mid_block.attentions.0": "middle_block.1",
        "mid_block.resnets.1": "middle_block.2",
        "up_blocks.0.resnets.0": "output_blocks.0.0", "up_blocks.0.resnets.1": "output_blocks.1.0",
        "up_blocks.0.resnets.2": "output_blocks.2.0", "up_blocks.0.upsamplers.0.conv": "output_blocks.2.1.conv",
        "up_blocks.1.resnets.0": "output_blocks.3.0", "up_blocks.1.attentions.0": "output_blocks.3.1",
        "up_blocks.1.resnets.1": "output_blocks.4.0", "up_blocks.1.attentions.1": "output_blocks.4.1",
        "up_blocks.1.resnets.2": "output_blocks.5.0", "up_blocks.1.attentions.2": "output_blocks.5.1",
        "time_embedding.linear_1": "time_embed.0", "time_embedding.linear_2": "time_embed.2",
        "conv_norm_out": "out.0", "conv_out": "out.2",
    }
    return model, blocks, {"layers_per_block": 2}


def _unet_sdxl():
    from diffusers import UNet2DConditionModel

    model = UNet2DConditionModel(
        sample_size=8, in_channels=4, out_channels=4, block_out_channels=(32, 64), layers_per_block=2,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"), up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        transformer_layers_per_block=(1, 2), cross_attention_dim=32, attention_head_dim=8, norm_num_groups=32,
        use_linear_projection=True, addition_embed_type="text_time", addition_time_embed_dim=8,
        projection_class_embeddings_input_dim=32 + 6 * 8,
    )
    blocks = {
        "conv_in": "input_blocks.0.0",
        "down_blocks.0.resnets.0": "input_blocks.1.0", "down_blocks.0.resnets.1": "input_blocks.2.0",
        "down_blocks.0.downsamplers.0.conv": "input_blocks.3.0.op",
        "down_blocks.1.resnets.0": "input_blocks.4.0", "down_blocks.1.attentions.0": "input_blocks.4.1",
        "down_blocks.1.resnets.1": "input_blocks.5.0", "down_blocks.1.attentions.1": "input_blocks.5.1",
        "mid_block.resnets.0": "middle_block.0", "mid_block.attentions.0": "middle_block.1",
        "mid_block.resnets.1": "middle_block.2",
        "up_blocks.0.resnets.0": "output_blocks.0.0", "up_blocks.0.attentions.0": "output_blocks.0.1",
        "up_blocks.0.resnets.1": "output_blocks.1.0", "up_blocks.0.attentions.1": "output_blocks.1.1",
        "up_blocks.0.resnets.2": "output_blocks.2.0", "up_blocks.0.attentions.2": "output_blocks.2.1",
        "up_blocks.0.upsamplers.0.conv": "output_blocks.2.2.conv",
        "up_blocks.1.resnets.0": "output_blocks.3.0", "up_blocks.1.resnets.1": "output_blocks.4.0",
        "up_blocks.1.resnets.2": "output_blocks.5.0",
        "time_embedding.linear_1": "time_embed.0", "time_embedding.linear_2": "time_embed.2",
        "add_embedding.linear_1": "label_emb.0.0", "add_embedding.linear_2": "label_emb.0.2",
        "conv_norm_out": "out.0", "conv_out": "out.2",
    }
    return model, blocks, {"layers_per_block": 2, "addition_embed_type": "text_time"}


LDM_RESNET = {"norm1": "in_layers.0", "conv1": "in_layers.2", "time_emb_proj": "emb_layers.1",
              "norm2": "out_layers.0", "conv2": "out_layers.3", "conv_shortcut": "skip_connection"}


def _ldm_dict(model, blocks, u):
    out = {}
    for key, value in model.state_dict().items():
        head = max((b for b in blocks if key == b or key.startswith(b + ".")), key=len)
        rest = key[len(head) + 1:]
        if ".resnets." in head:
            first, _, tail = rest.partition(".")
            rest = LDM_RESNET[first] + "." + tail
        out["model.diffusion_model." + blocks[head] + "." + rest] = u(*value.shape)
    return out


@pytest.fixture(scope="module", params=["sd1", "sdxl"])
def unet_pair(request):
    from diffusers.loaders.single_file_utils import convert_ldm_unet_checkpoint

    model, blocks, config = (_unet_sd1 if request.param == "sd1" else _unet_sdxl)()
    ldm = _ldm_dict(model, blocks, Unique())
    converted = convert_ldm_unet_checkpoint(dict(ldm), config)
    assert set(converted) == set(model.state_dict()), "tiny LDM dict is not this UNet's layout"
    modules = [n for n, m in model.named_modules() if isinstance(m, (torch.nn.Linear, torch.nn.Conv2d))]
    return request.param, ldm, converted, modules


def test_ldm_unet_base_answers_diffusers_and_kohya_names(unet_pair):
    kind, ldm, converted, modules = unet_pair
    km = build_keymap(shapes(ldm))
    assert any(m.family is get("sd1") and m.layout == "original" for _, m in km.matches)
    assert modules
    for mod in modules:
        names = [f"lora_unet_{flat(mod)}", f"unet.{mod}", f"lycoris_{flat(mod)}", mod]
        for name in names:
            t = km.lookup(name)
            assert t is not None, name
            assert ldm[t.key] is converted[f"{mod}.weight"], name
            if f"{mod}.bias" in converted:
                assert ldm[t.bias_key] is converted[f"{mod}.bias"]
    # LDM (kohya SDXL) names of every weight
    for key in ldm:
        if key.endswith(".weight"):
            mod = key[len("model.diffusion_model."): -len(".weight")]
            assert km.lookup(f"lora_unet_{flat(mod)}") == Placement(key)
    # old diffusers attention-processor names
    attn = next(m for m in modules if m.endswith("attn1.to_out.0"))
    proc = attn.replace("attn1.to_out.0", "attn1.processor.to_out")
    assert ldm[km.lookup(proc).key] is converted[f"{attn}.weight"]
    # the same UNet saved without the `model.diffusion_model.` prefix
    prefix = "model.diffusion_model."
    bare = build_keymap({k[len(prefix):]: v for k, v in shapes(ldm).items()})
    for mod in modules:
        for name in (f"lora_unet_{flat(mod)}", f"unet.{mod}"):
            assert prefix + bare.lookup(name).key == km.lookup(name).key, name


def test_diffusers_unet_base_answers_ldm_names(unet_pair):
    kind, ldm, converted, modules = unet_pair
    km = build_keymap(shapes(converted), component="unet")
    for key, value in ldm.items():
        if not key.endswith(".weight"):
            continue
        mod = key[len("model.diffusion_model."): -len(".weight")]
        t = km.lookup(f"lora_unet_{flat(mod)}")
        assert t is not None, mod
        assert converted[t.key] is value, mod
    for mod in modules:
        assert km.lookup(f"lora_unet_{flat(mod)}") == Placement(f"{mod}.weight")
        assert km.lookup(f"unet.{mod}") == Placement(f"{mod}.weight")


# ------------------------------------------------------------------------------ text encoders

def _clip(width, layers=2, proj=None):
    """A tiny HF CLIP text encoder; WithProjection keeps the `text_model.` wrapper that checkpoints and
    trainers name (transformers 5's plain CLIPTextModel dropped it; see the unwrapped test below)."""
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection

    cfg = CLIPTextConfig(hidden_size=width, intermediate_size=2 * width, num_hidden_layers=layers,
                         num_attention_heads=2, vocab_size=64, max_position_embeddings=8,
                         projection_dim=proj or width, bos_token_id=0, eos_token_id=1, pad_token_id=1)
    return CLIPTextModelWithProjection(cfg)


def _t5():
    from transformers import T5Config, T5EncoderModel

    return T5EncoderModel(T5Config(vocab_size=64, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_heads=2))


def _linear_modules(model):
    return [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]


def _openclip_dict(model, prefix, u):
    """An OpenCLIP text tower of the same shapes, built from the OpenCLIP layout definition."""
    cfg = model.config
    w, n = cfg.hidden_size, cfg.num_hidden_layers
    sd = {f"{prefix}token_embedding.weight": u(cfg.vocab_size, w),
          f"{prefix}positional_embedding": u(cfg.max_position_embeddings, w),
          f"{prefix}ln_final.weight": u(w), f"{prefix}ln_final.bias": u(w),
          f"{prefix}text_projection": u(w, cfg.projection_dim)}
    for i in range(n):
        b = f"{prefix}transformer.resblocks.{i}"
        sd.update({f"{b}.attn.in_proj_weight": u(3 * w, w), f"{b}.attn.in_proj_bias": u(3 * w),
                   f"{b}.attn.out_proj.weight": u(w, w), f"{b}.attn.out_proj.bias": u(w),
                   f"{b}.ln_1.weight": u(w), f"{b}.ln_1.bias": u(w), f"{b}.ln_2.weight": u(w), f"{b}.ln_2.bias": u(w),
                   f"{b}.mlp.c_fc.weight": u(cfg.intermediate_size, w), f"{b}.mlp.c_fc.bias": u(cfg.intermediate_size),
                   f"{b}.mlp.c_proj.weight": u(w, cfg.intermediate_size), f"{b}.mlp.c_proj.bias": u(w)})
    return sd


def test_sdxl_text_encoders_openclip_slices_and_kohya_numbers():
    from diffusers.loaders.single_file_utils import convert_open_clip_checkpoint

    u = Unique()
    clip_l, big_g = _clip(16), _clip(32, proj=24)
    te1 = {f"conditioner.embedders.0.transformer.{k}": u(*v.shape) for k, v in clip_l.state_dict().items()}
    te2 = _openclip_dict(big_g, "conditioner.embedders.1.model.", u)
    converted = convert_open_clip_checkpoint(big_g, dict(te2), prefix="conditioner.embedders.1.model.")
    missing, unexpected = big_g.load_state_dict({k: v.float() for k, v in converted.items()}, strict=False)
    assert not unexpected and all("position_ids" in k for k in missing), (missing, unexpected)
    base = {**te1, **te2, "model.diffusion_model.input_blocks.0.0.weight": u(1)}
    km = build_keymap(shapes(base))

    for mod in _linear_modules(big_g):
        for name in (f"lora_te2_{flat(mod)}", f"text_encoder_2.{mod}"):
            t = km.lookup(name)
            assert t is not None, name
            assert torch.equal(apply(t, base[t.key]), converted[f"{mod}.weight"]), name
            if f"{mod}.bias" in converted:
                bias = Placement(t.bias_key, t.rows)
                assert torch.equal(apply(bias, base[t.bias_key]), converted[f"{mod}.bias"]), name
    assert km.lookup("lora_te2_text_projection").transform == "transpose"
    for mod in _linear_modules(clip_l):
        want = Placement(f"conditioner.embedders.0.transformer.{mod}.weight")
        for name in (f"lora_te1_{flat(mod)}", f"text_encoder.{mod}", f"lora_te_{flat(mod)}"):
            assert km.lookup(name) == want, name
    # te1 and te2 share HF module names: bare names are claimed twice and resolve to nothing
    bare = "text_model.encoder.layers.0.self_attn.q_proj"
    assert km.lookup(bare) is None
    assert {t.key for t in km.ambiguous(bare)} == {
        f"conditioner.embedders.0.transformer.{bare}.weight",
        "conditioner.embedders.1.model.transformer.resblocks.0.attn.in_proj_weight",
    }
    assert km.ambiguous(f"lora_te1_{flat(bare)}") == []


def test_sd2_openclip_is_the_only_text_encoder():
    u = Unique()
    te = _openclip_dict(_clip(16), "cond_stage_model.model.", u)
    km = build_keymap(shapes(te))
    t = km.lookup("lora_te_text_model_encoder_layers_1_self_attn_v_proj")
    assert t == Placement("cond_stage_model.model.transformer.resblocks.1.attn.in_proj_weight", (32, 48))
    assert t.bias_key == "cond_stage_model.model.transformer.resblocks.1.attn.in_proj_bias"
    assert km.lookup("text_encoder.text_model.encoder.layers.0.mlp.fc1") == Placement(
        "cond_stage_model.model.transformer.resblocks.0.mlp.c_fc.weight")


def test_sd1_checkpoint_te_and_unet_prefixes():
    clip = _clip(16)
    base = {f"cond_stage_model.transformer.{k}": tuple(v.shape) for k, v in clip.state_dict().items()}
    base.update({"model.diffusion_model.input_blocks.1.1.proj_in.weight": (8, 8, 1, 1),
                 "model.diffusion_model.middle_block.1.proj_in.weight": (8, 8, 1, 1),
                 "first_stage_model.decoder.conv_in.weight": (4, 4, 3, 3), "alphas_cumprod": (1000,)})
    km = build_keymap(base)
    for mod in _linear_modules(clip):
        assert km.lookup(f"lora_te_{flat(mod)}") == Placement(f"cond_stage_model.transformer.{mod}.weight")
    assert km.lookup("lora_unet_down_blocks_0_attentions_0_proj_in") == Placement(
        "model.diffusion_model.input_blocks.1.1.proj_in.weight")
    assert km.lookup("lora_unet_mid_block_attentions_0_proj_in") == Placement(
        "model.diffusion_model.middle_block.1.proj_in.weight")
    assert km.lookup("lora_unet_decoder_conv_in") is None  # VAE keys get no LoRA spellings
    assert km.lookup("first_stage_model.decoder.conv_in") == Placement("first_stage_model.decoder.conv_in.weight")
    assert km.lookup("lora_unet_alphas_cumprod") is None


@pytest.mark.parametrize("encoders, numbers", [
    (("clip_l", "clip_g", "t5xxl"), {"clip_l": {1}, "clip_g": {2}, "t5xxl": {3}}),  # SD3
    (("clip_l", "t5xxl"), {"clip_l": {1}, "t5xxl": {2, 3}}),  # Flux: kohya te3, OneTrainer te2
])
def test_comfy_text_encoders_numbering(encoders, numbers):
    models = {"clip_l": _clip(16), "clip_g": _clip(24, proj=24), "t5xxl": _t5()}
    base = {"model.diffusion_model.double_blocks.0.img_attn.qkv.weight": (24, 8)}
    for name in encoders:
        for k, v in models[name].state_dict().items():
            base[f"text_encoders.{name}.transformer.{k}"] = tuple(v.shape)
    base["text_encoders.clip_l.logit_scale"] = ()
    km = build_keymap(base)
    for name in encoders:
        for mod in _linear_modules(models[name]):
            want = Placement(f"text_encoders.{name}.transformer.{mod}.weight")
            for n in range(1, 4):
                got = km.lookup(f"lora_te{n}_{flat(mod)}")
                if n in numbers[name]:
                    assert got == want, (name, n, mod)
                else:
                    assert got != want, (name, n, mod)
            assert km.lookup(f"text_encoders.{name}.transformer.{mod}") == want
    t5_mod = _linear_modules(models["t5xxl"])[0]
    assert km.lookup(f"lora_te3_{flat(t5_mod)}") == Placement(f"text_encoders.t5xxl.transformer.{t5_mod}.weight")


def test_standalone_text_encoder_files():
    t5 = _t5()
    km = build_keymap(shapes(t5.state_dict()))
    mod = _linear_modules(t5)[0]
    for name in (f"lora_te3_{flat(mod)}", f"lora_te2_{flat(mod)}", f"text_encoder_2.{mod}", mod):
        assert km.lookup(name) == Placement(f"{mod}.weight"), name
    clip_l = _clip(16)
    km = build_keymap(shapes(clip_l.state_dict()))
    mod = _linear_modules(clip_l)[0]
    assert km.lookup(f"lora_te1_{flat(mod)}") == Placement(f"{mod}.weight")
    assert km.lookup(f"lora_te2_{flat(mod)}") is None


# ------------------------------------------------------------------------------------- LLMs

def test_peft_names_on_hf_llm_shards():
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=16))
    base = shapes(model.state_dict())
    peft = get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj", "k_proj", "v_proj", "o_proj",
                                                                 "gate_proj", "up_proj", "down_proj"]))
    names = {k.rsplit(".lora_", 1)[0] for k in get_peft_model_state_dict(peft)}
    assert len(names) == 2 * 7
    km = build_keymap(base)
    for name in names:
        t = km.lookup(name)
        assert t is not None, name
        assert t.key == name[len("base_model.model."):] + ".weight" and t.key in base
        assert t.rows is None and t.transform is None


# ------------------------------------------------------------------------- ambiguity, unknowns

def test_underscore_collisions_are_ambiguous_not_guessed():
    km = build_keymap({"a.b_c.weight": (2, 2), "a_b.c.weight": (2, 2), "x.y.weight": (2, 2)})
    assert km.lookup("lora_unet_a_b_c") is None
    assert {t.key for t in km.ambiguous("lora_unet_a_b_c")} == {"a.b_c.weight", "a_b.c.weight"}
    assert km.lookup("a.b_c") == Placement("a.b_c.weight")  # the dotted spelling is unique
    assert km.ambiguous("a.b_c") == []
    assert km.lookup("lora_unet_x_y") == Placement("x.y.weight")


def test_unknown_names():
    km = build_keymap({"double_blocks.0.img_attn.qkv.weight": (6, 2), "double_blocks.0.img_attn.proj.weight": (2, 2)})
    for name in ("lora_unet_double_blocks_7_img_attn_qkv", "transformer.transformer_blocks.3.attn.to_q",
                 "lora_te1_text_model_encoder_layers_0_self_attn_q_proj", "", "double_blocks"):
        assert km.lookup(name) is None and km.ambiguous(name) == [] and km.targets(name) == []
    assert km.lookup("transformer.transformer_blocks.0.attn.to_k") == Placement(
        "double_blocks.0.img_attn.qkv.weight", (2, 4))


def test_clip_saved_without_text_model_wrapper():
    """transformers 5's CLIPTextModel saves `encoder.layers...` without the `text_model.` wrapper."""
    wrapped = shapes(_clip(16).state_dict())
    keys = {k[len("text_model."):]: v for k, v in wrapped.items() if k.startswith("text_model.")}
    assert "encoder.layers.0.self_attn.q_proj.weight" in keys
    km = build_keymap(keys, component="text_encoder")
    for name in ("lora_te1_text_model_encoder_layers_0_self_attn_q_proj",
                 "lora_te_text_model_encoder_layers_0_self_attn_q_proj",
                 "text_encoder.text_model.encoder.layers.0.self_attn.q_proj",
                 "text_encoder.encoder.layers.0.self_attn.q_proj"):
        assert km.lookup(name) == Placement("encoder.layers.0.self_attn.q_proj.weight"), name


# --------------------------------------------------------------------------- end to end (CLI)

def _native_like(template: dict, convert, model_sd: dict) -> dict:
    """A native state dict holding exactly `model_sd`, found with the converter as the only authority.

    Every native tensor of `template` gets one id per row; the converter moves the ids; wherever a
    diffusers tensor's rows came from is then known without any mapping of ours, and the model's
    values are scattered back into native tensors of the real shapes.
    """
    ids, offset = {}, {}
    n = 0
    for k, v in template.items():
        rows = v.shape[0] if v.ndim else 1
        ids[k] = torch.arange(n, n + rows, dtype=torch.float64).reshape((rows,) + (1,) * max(v.ndim - 1, 0))
        offset[k] = (n, n + rows)
        n += rows
    moved = convert(dict(ids))
    native = {}
    for d, idt in moved.items():
        row_ids = idt.reshape(idt.shape[0], -1)[:, 0].long()
        k = next(k for k, (a, b) in offset.items() if a <= row_ids[0] < b)
        a, b = offset[k]
        if k not in native:
            native[k] = torch.zeros((b - a,) + tuple(model_sd[d].shape[1:]), dtype=model_sd[d].dtype)
        native[k][row_ids - a] = model_sd[d]
    return native


def test_merge_lora_cli_peft_sd3_into_sai_base(tmp_path, run_ckpt):
    """PEFT LoRA trained on a diffusers SD3 transformer (q/k/v, norm_out, last context norm), merged by
    the CLI into an SAI-layout single file, equals PEFT's merge_and_unload after converting back."""
    from diffusers import SD3Transformer2DModel
    from diffusers.loaders.single_file_utils import convert_sd3_transformer_checkpoint_to_diffusers as to_diffusers
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
    from safetensors.torch import load_file, save_file

    torch.manual_seed(0)
    model = SD3Transformer2DModel(
        sample_size=8, patch_size=2, in_channels=4, num_layers=2, attention_head_dim=16, num_attention_heads=2,
        joint_attention_dim=32, caption_projection_dim=SD3_H, pooled_projection_dim=32, out_channels=4,
        pos_embed_max_size=8, dual_attention_layers=(0,), qk_norm="rms_norm",
    )
    model_sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    sai = _native_like(sd3_sai(Unique()), to_diffusers, model_sd)
    back = to_diffusers(dict(sai))
    assert set(back) == set(model_sd) and all(torch.equal(back[k], model_sd[k]) for k in back)

    targets = ["to_q", "to_k", "to_v", "add_q_proj", "add_v_proj", "to_out.0", "norm_out.linear",
               "norm1_context.linear", "ff.net.2"]
    peft = get_peft_model(model, LoraConfig(r=4, lora_alpha=4, target_modules=targets, lora_dropout=0.0))
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    lora = {("transformer." + k[len("base_model.model."):]): v.contiguous()
            for k, v in get_peft_model_state_dict(peft).items()}
    assert any("norm_out.linear" in k for k in lora) and any("transformer_blocks.1.norm1_context" in k for k in lora)
    merged = {k: v.detach() for k, v in peft.merge_and_unload().state_dict().items()}

    base_path, lora_path = tmp_path / "sd3.safetensors", tmp_path / "lora.safetensors"
    out_path = tmp_path / "out.safetensors"
    save_file({"model.diffusion_model." + k: v.contiguous() for k, v in sai.items()}, str(base_path))
    save_file(lora, str(lora_path))
    code, out, err = run_ckpt("merge-lora", base_path, lora_path, "-o", out_path)
    assert code == 0, out + err
    result = load_file(str(out_path))
    got = to_diffusers({k[len("model.diffusion_model."):]: v for k, v in result.items()})
    assert set(got) == set(merged)
    changed = 0
    for k in merged:
        assert torch.allclose(got[k], merged[k], atol=1e-5, rtol=1e-4), k
        changed += not torch.equal(merged[k], model_sd[k])
    assert changed >= 2 * 6  # the LoRA really moved the weights it targets


def test_merge_lora_cli_kohya_sai_names_into_diffusers_folder(tmp_path, run_ckpt):
    """kohya LoRA on SAI modules (fused qkv, swapped modulations) merged into a diffusers pipeline's
    `transformer/`: equals W + alpha/r * up @ down applied to the SAI weights, converted by diffusers."""
    from diffusers import SD3Transformer2DModel
    from diffusers.loaders.single_file_utils import convert_sd3_transformer_checkpoint_to_diffusers as to_diffusers
    from safetensors.torch import load_file, save_file

    torch.manual_seed(1)
    model = SD3Transformer2DModel(
        sample_size=8, patch_size=2, in_channels=4, num_layers=2, attention_head_dim=16, num_attention_heads=2,
        joint_attention_dim=32, caption_projection_dim=SD3_H, pooled_projection_dim=32, out_channels=4,
        pos_embed_max_size=8, dual_attention_layers=(0,), qk_norm="rms_norm",
    )
    model_sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    sai = _native_like(sd3_sai(Unique()), to_diffusers, model_sd)
    model.save_pretrained(tmp_path / "pipe" / "transformer")

    r, alpha = 4, 2.0
    lora, expected_sai = {}, dict(sai)
    for mod in ("joint_blocks.0.x_block.attn.qkv", "joint_blocks.0.context_block.attn.qkv",
                "joint_blocks.0.x_block.attn2.qkv", "joint_blocks.1.context_block.adaLN_modulation.1",
                "final_layer.adaLN_modulation.1", "joint_blocks.1.x_block.mlp.fc2"):
        w = sai[f"{mod}.weight"]
        down, up = torch.randn(r, w.shape[1]) * 0.1, torch.randn(w.shape[0], r) * 0.1
        name = "lora_unet_" + mod.replace(".", "_")
        lora.update({f"{name}.lora_down.weight": down, f"{name}.lora_up.weight": up,
                     f"{name}.alpha": torch.tensor(alpha)})
        expected_sai[f"{mod}.weight"] = w + (alpha / r) * (up @ down)
    expected = to_diffusers(dict(expected_sai))
    save_file(lora, str(tmp_path / "lora.safetensors"))

    code, out, err = run_ckpt("merge-lora", tmp_path / "pipe", tmp_path / "lora.safetensors", "-o", tmp_path / "out")
    assert code == 0, out + err
    got = load_file(str(tmp_path / "out" / "transformer" / "diffusion_pytorch_model.safetensors"))
    assert set(got) == set(expected)
    for k in expected:
        assert torch.allclose(got[k], expected[k], atol=1e-5, rtol=1e-4), k
    assert not torch.equal(got["norm_out.linear.weight"], model_sd["norm_out.linear.weight"])


def _flux_converter(width: int):
    """diffusers' BFL -> diffusers Flux converter with its one hard-coded constant, Flux's width 3072,
    set to `width` (it is only used to split `linear1`); everything else is diffusers' own code."""
    import types

    from diffusers.loaders.single_file_utils import convert_flux_transformer_checkpoint_to_diffusers as fn

    code = fn.__code__
    assert code.co_consts.count(3072) == 1
    consts = tuple(width if c == 3072 and type(c) is int else c for c in code.co_consts)
    return types.FunctionType(code.replace(co_consts=consts), fn.__globals__, fn.__name__, fn.__defaults__,
                              fn.__closure__)


@pytest.mark.parametrize("prefix", ["", "model.diffusion_model."])
def test_merge_lora_cli_peft_flux_into_bfl_base(tmp_path, run_ckpt, prefix):
    """PEFT LoRA on a tiny diffusers Flux transformer (to_q/k/v, single-block proj_mlp, norm_out...)
    merged by the CLI into a BFL file equals PEFT's merge_and_unload after converting back."""
    from diffusers import FluxTransformer2DModel
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
    from safetensors.torch import load_file, save_file

    torch.manual_seed(2)
    model = FluxTransformer2DModel(
        in_channels=4, num_layers=1, num_single_layers=2, attention_head_dim=8, num_attention_heads=2,
        joint_attention_dim=16, pooled_projection_dim=16, guidance_embeds=True, axes_dims_rope=(2, 2, 4),
    )
    h = 16
    to_diffusers = _flux_converter(h)
    model_sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    bfl = _native_like(flux_bfl(Unique(), singles=2, h=h, head_dim=8), to_diffusers, model_sd)
    back = to_diffusers(dict(bfl))
    assert set(back) == set(model_sd) and all(torch.equal(back[k], model_sd[k]) for k in back)

    targets = ["to_q", "to_k", "to_v", "add_k_proj", "proj_mlp", "to_out.0", "norm_out.linear", "proj_out",
               "ff_context.net.0.proj", "norm1.linear"]
    peft = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=targets, lora_dropout=0.0))
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    # PEFT's own layout: base_model.model.<module>.lora_A.weight, alpha in adapter_config.json
    peft.save_pretrained(tmp_path / "lora")
    assert any("single_transformer_blocks.1.proj_mlp" in k for k in get_peft_model_state_dict(peft))
    merged = {k: v.detach() for k, v in peft.merge_and_unload().state_dict().items()}

    base_path, out_path = tmp_path / "flux.safetensors", tmp_path / "out.safetensors"
    save_file({prefix + k: v.contiguous() for k, v in bfl.items()}, str(base_path))
    code, out, err = run_ckpt("merge-lora", base_path, tmp_path / "lora", "-o", out_path)
    assert code == 0, out + err
    got = to_diffusers({k[len(prefix):]: v for k, v in load_file(str(out_path)).items()})
    assert set(got) == set(merged)
    changed = 0
    for k in merged:
        assert torch.allclose(got[k], merged[k], atol=1e-5, rtol=1e-4), k
        changed += not torch.equal(merged[k], model_sd[k])
    assert changed >= 10


@pytest.mark.parametrize("kind", ["sd1", "sdxl"])
def test_full_size_unet_layouts_round_trip_through_diffusers_converter(kind):
    """Real SD1/SDXL UNet structures (meta tensors, no memory): the LDM names the key map derives for a
    diffusers UNet, fed to diffusers' LDM converter, land every tensor back on its own diffusers key."""
    from diffusers import UNet2DConditionModel
    from diffusers.loaders.single_file_utils import convert_ldm_unet_checkpoint

    from ckpt.families import DIFFUSERS, get

    config = {"layers_per_block": 2}
    with torch.device("meta"):
        if kind == "sd1":
            model = UNet2DConditionModel(cross_attention_dim=768)
        else:
            model = UNet2DConditionModel(
                sample_size=128, cross_attention_dim=2048, block_out_channels=(320, 640, 1280),
                down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
                up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
                transformer_layers_per_block=(1, 2, 10), use_linear_projection=True, addition_embed_type="text_time",
                addition_time_embed_dim=256, projection_class_embeddings_input_dim=2816, attention_head_dim=(5, 10, 20),
            )
            config["addition_embed_type"] = "text_time"
    sd = model.state_dict()
    ldm = {}
    for pair in get(kind).pairs(shapes(sd), DIFFUSERS):
        ldm[f"model.diffusion_model.{pair.original}"] = sd[pair.diffusers]
    back = convert_ldm_unet_checkpoint(ldm, config)
    assert set(back) == set(sd)
    assert all(back[k] is sd[k] for k in sd)
    # and the LDM layout maps forward onto the same diffusers names
    km = build_keymap(shapes(ldm))
    for name, module in model.named_modules():
        if isinstance(module, (torch.nn.Linear, torch.nn.Conv2d)):
            t = km.lookup(f"lora_unet_{flat(name)}")
            assert t is not None and back[f"{name}.weight"] is ldm[t.key], name
