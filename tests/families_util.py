"""Test helpers shared by the family tests: tiny diffusers models of each family, values no other tensor
shares, and the original layout of a diffusers state dict made from a family's pairs (checked, in every
test that uses it, by diffusers' own converter in the forward direction).

Adding a family's tests: add a `tiny_<family>()` maker here and a case to the lists in
tests/test_families.py and tests/test_merge_families.py.
"""

from __future__ import annotations

import json
import logging
import types
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ckpt import families
from ckpt.families import DIFFUSERS, ORIGINAL, Family, Transform

PREFIX = "model.diffusion_model."  # ComfyUI's prefix of a single-file diffusion model, as releases ship it

logging.getLogger("diffusers").setLevel(logging.ERROR)
logging.getLogger("transformers").setLevel(logging.ERROR)


def shapes(sd: dict) -> dict:
    return {k: tuple(v.shape) for k, v in sd.items()}


def unique_values(sd: dict, dtype=torch.float32) -> dict:
    """The same keys and shapes, every element a value no other element has (small ints, exact in fp32)."""
    out, n = {}, 0
    for k, v in sd.items():
        out[k] = torch.arange(n, n + v.numel(), dtype=dtype).reshape(v.shape)
        n += v.numel()
    return out


def state_dict(model) -> dict:
    return {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}


def _transform(t: torch.Tensor, transform: Transform | None, to_original: bool = False) -> torch.Tensor:
    """A pair's transform (`ckpt.families.Transform`; its inverse towards the original layout) on a tensor.
    tests/test_transform.py checks the type itself against plain torch."""
    if transform is None:
        return t
    return (transform.inverse if to_original else transform).apply(t).contiguous()


def original_from_pairs(family: Family, diffusers_sd: dict) -> dict:
    """The original-layout state dict of a diffusers one, put together from the family's pairs."""
    pieces: dict[str, list] = {}
    for p in family.pairs(shapes(diffusers_sd), DIFFUSERS):
        if p.original is None:
            continue
        pieces.setdefault(p.original, []).append(p)
    out = {}
    for key, ps in pieces.items():
        ps.sort(key=lambda p: p.rows[0] if p.rows else 0)
        out[key] = torch.cat([_transform(diffusers_sd[p.diffusers], p.transform, True) for p in ps]).contiguous()
    return out


def diffusers_from_pairs(family: Family, original_sd: dict) -> dict:
    out = {}
    for p in family.pairs(shapes(original_sd), ORIGINAL):
        if p.diffusers is None:
            continue
        t = original_sd[p.original]
        if p.rows:
            t = t[p.rows[0]:p.rows[1]]
        out[p.diffusers] = _transform(t, p.transform).contiguous()
    return out


# --------------------------------------------------------------------- what every family test runs

def assert_detected_both_layouts(family_id: str, original: dict, diffusers: dict, matrices_only: bool = False):
    """Both layouts' shapes (`shapes(...)`) are told to be `family_id` in that layout, and so are their module
    names flattened as kohya/musubi LoRAs flatten them (`matrices_only`: only the 2-D weights' modules, for a
    family whose 1-D `.weight`s would read as another family's)."""
    for layout, keys in ((ORIGINAL, original), (DIFFUSERS, diffusers)):
        m = families.detect(keys, keys)
        assert (m.family_id, m.layout) == (family_id, layout), m
        flat = [k.rsplit(".", 1)[0].replace(".", "_") for k in keys
                if k.endswith(".weight") and (not matrices_only or len(keys[k]) == 2)]
        m = families.detect(flat)
        assert (m.family_id, m.layout) == (family_id, layout), m


def convert_both_ways(run_ckpt, tmp_path, model_cls, sd: dict, original: dict) -> dict:
    """`convert --layout diffusers` of `original` saved as a single file under PREFIX: loaded strictly by
    `model_cls.from_pretrained`, equal to `sd`; then `--layout original` of that folder: `original` again,
    tensor for tensor. Returns the folder's config.json for the family's own checks of it."""
    save_file({PREFIX + k: v for k, v in original.items()}, tmp_path / "single.safetensors")
    code, _, err = run_ckpt("convert", tmp_path / "single.safetensors", "--layout", "diffusers", "-o",
                            tmp_path / "d", "-q")
    assert code == 0, err
    loads_and_converts_back(run_ckpt, tmp_path, model_cls, tmp_path / "d", sd, original)
    return json.loads((tmp_path / "d" / "config.json").read_text())


def loads_and_converts_back(run_ckpt, tmp_path, model_cls, folder, sd: dict, original: dict) -> None:
    """A `--layout diffusers` output `folder`: loaded strictly by `model_cls.from_pretrained`, equal to `sd`; its
    `--layout original` (tmp_path / back.safetensors) is `original`, tensor for tensor."""
    loaded, info = model_cls.from_pretrained(folder, output_loading_info=True)
    assert not any(info.values()), info
    assert all(torch.equal(v, sd[k]) for k, v in loaded.state_dict().items())
    code, _, err = run_ckpt("convert", folder, "--layout", "original", "-o", tmp_path / "back.safetensors", "-q")
    assert code == 0, err
    back = load_file(tmp_path / "back.safetensors")
    assert set(back) == set(original) and all(torch.equal(back[k], original[k]) for k in original)


def merge_onto(run_ckpt, tmp_path, model, original_sd: dict | None, base_layout: str, lora_file, to_diffusers,
               *options, prefix: str = PREFIX, keys_kept: bool = False) -> dict:
    """`ckpt merge-lora BASE lora_file -o OUT -q *options` (`"--ratio", 0.7`), the base `model` saved in
    `base_layout`: a diffusers folder (`save_pretrained`), or the original single file `original_sd` with its
    keys under `prefix`. Returns the merged weights in the diffusers layout, the original file's through
    `to_diffusers` (the family's converter, on the keys with `prefix` stripped): what each family test
    compares with diffusers' own fused weights. `keys_kept`: the original output holds exactly the input's
    keys. Files are named by layout and LoRA, so several merges can share one tmp_path."""
    tag = f"{base_layout}-{Path(lora_file).stem}"
    if base_layout == DIFFUSERS:
        base, out = tmp_path / f"base-{base_layout}", tmp_path / f"merged-{tag}"
        model.save_pretrained(base)
    else:
        base, out = tmp_path / f"base-{base_layout}.safetensors", tmp_path / f"merged-{tag}.safetensors"
        save_file({prefix + k: v for k, v in original_sd.items()}, base)
    code, _, err = run_ckpt("merge-lora", base, lora_file, *options, "-o", out, "-q")
    assert code == 0, err
    if base_layout == DIFFUSERS:
        return load_file(out / "diffusion_pytorch_model.safetensors")
    got = load_file(out)
    if keys_kept:
        assert set(got) == {prefix + k for k in original_sd}
    return to_diffusers({k.removeprefix(prefix): v for k, v in got.items()})


def assert_needs_config(run_ckpt, tmp_path, model, single_file, problem: str):
    """A single file whose config.json the weights cannot say (a head size no release's rope has) is refused
    with `problem`, and converts with `--config` pointing at the model's own config: strict `from_pretrained`."""
    from helpers.refusals import assert_refused

    assert_refused(run_ckpt, tmp_path, ["convert", single_file, "--layout", "diffusers", "-o", tmp_path / "d"],
                   str(single_file), problem)
    model.save_config(tmp_path / "ref")
    code, _, err = run_ckpt("convert", single_file, "--layout", "diffusers", "--config", tmp_path / "ref", "-o",
                            tmp_path / "d", "-q")
    assert code == 0, err
    _, info = type(model).from_pretrained(tmp_path / "d", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info


# ------------------------------------------------------------------------------------- tiny models

def tiny_wan(kind: str = "t2v"):
    from diffusers import WanTransformer3DModel, WanVACETransformer3DModel

    kw = dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=4,
              text_dim=16, freq_dim=8, ffn_dim=32, num_layers=2)
    if kind == "i2v":
        return WanTransformer3DModel(**kw, image_dim=12, added_kv_proj_dim=12)
    if kind == "vace":
        return WanVACETransformer3DModel(**kw, vace_layers=[0], vace_in_channels=6)
    return WanTransformer3DModel(**kw)


def tiny_flux2():
    from diffusers import Flux2Transformer2DModel

    return Flux2Transformer2DModel(in_channels=4, num_layers=1, num_single_layers=2, attention_head_dim=8,
                                   num_attention_heads=2, joint_attention_dim=16, timestep_guidance_channels=8,
                                   axes_dims_rope=(2, 2, 2, 2))


def flux2_bf16_original(path=None, prefix: str = ""):
    """A tiny bf16 Flux.2 with heads of 128 (the size its diffusers config.json is derived for): (diffusers
    state dict, original-layout state dict), the latter saved to `path` with keys under `prefix` if given."""
    from diffusers import Flux2Transformer2DModel
    from safetensors.torch import save_file

    from ckpt.families import get

    torch.manual_seed(0)
    model = Flux2Transformer2DModel(in_channels=4, num_layers=1, num_single_layers=2, attention_head_dim=128,
                                    num_attention_heads=1, joint_attention_dim=16, timestep_guidance_channels=8,
                                    axes_dims_rope=(32, 32, 32, 32))
    sd = state_dict(model.to(torch.bfloat16))
    original = original_from_pairs(get("flux2"), sd)
    if path is not None:
        save_file({prefix + k: v for k, v in original.items()}, path)
    return sd, original


def tiny_flux1():
    from diffusers import FluxTransformer2DModel

    return FluxTransformer2DModel(in_channels=4, num_layers=1, num_single_layers=2, attention_head_dim=8,
                                  num_attention_heads=2, joint_attention_dim=16, pooled_projection_dim=16,
                                  guidance_embeds=True, axes_dims_rope=(2, 2, 4))


def tiny_sd3():
    from diffusers import SD3Transformer2DModel

    return SD3Transformer2DModel(sample_size=8, patch_size=2, in_channels=4, num_layers=2, attention_head_dim=16,
                                 num_attention_heads=2, joint_attention_dim=32, caption_projection_dim=32,
                                 pooled_projection_dim=32, out_channels=4, pos_embed_max_size=8,
                                 dual_attention_layers=(0,), qk_norm="rms_norm")


def tiny_unet(kind: str = "sd1"):
    from diffusers import UNet2DConditionModel

    if kind == "sdxl":
        return UNet2DConditionModel(
            sample_size=8, in_channels=4, out_channels=4, block_out_channels=(32, 64), layers_per_block=2,
            down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"), up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
            transformer_layers_per_block=(1, 2), cross_attention_dim=2048, attention_head_dim=8, norm_num_groups=32,
            use_linear_projection=True, addition_embed_type="text_time", addition_time_embed_dim=8,
            projection_class_embeddings_input_dim=2048 + 6 * 8)
    return UNet2DConditionModel(
        sample_size=8, in_channels=4, out_channels=4, block_out_channels=(32, 64), layers_per_block=2,
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=768, attention_head_dim=8, norm_num_groups=32)


def tiny_clip(width: int = 32, proj: int = 24):
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection

    cfg = CLIPTextConfig(hidden_size=width, intermediate_size=2 * width, num_hidden_layers=2, num_attention_heads=2,
                         vocab_size=64, max_position_embeddings=8, projection_dim=proj, bos_token_id=0,
                         eos_token_id=1, pad_token_id=1)
    return CLIPTextModelWithProjection(cfg)


def flux1_converter(width: int):
    """diffusers' BFL -> diffusers Flux converter with its one hard-coded constant, Flux's width 3072,
    set to `width` (it is only used to split `linear1`); everything else is diffusers' own code."""
    from diffusers.loaders.single_file_utils import convert_flux_transformer_checkpoint_to_diffusers as fn

    return with_constants(fn, {3072: width})


def with_constants(fn, values: dict[int, int]):
    """`fn` (a diffusers converter) with the integer constants of its code, nested functions included,
    replaced by `values` ({3072: 16}: a release's width hard-coded to split fused rows, set to a tiny
    model's; read the converter first: the constant must mean nothing else there); each must occur.
    Everything else is diffusers' own code."""
    seen: dict[int, int] = {}

    def const(c):
        if type(c) is int and c in values:
            seen[c] = seen.get(c, 0) + 1
            return values[c]
        if type(c) is tuple:  # a literal list of ints is compiled to a tuple constant
            return tuple(const(x) for x in c)
        if isinstance(c, types.CodeType):
            return patch(c)
        return c

    def patch(code):
        return code.replace(co_consts=tuple(const(c) for c in code.co_consts))

    code = patch(fn.__code__)
    assert set(seen) == set(values), (fn.__name__, seen)
    return types.FunctionType(code, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)


def with_width(fn, width: int, constant: int = 3072):
    """`fn` (a diffusers converter) with its hard-coded model width `constant` set to `width`."""
    return with_constants(fn, {constant: width})


def tiny_hunyuan_video(kind: str = "t2v"):
    from diffusers import HunyuanVideoTransformer3DModel

    in_ch = {"t2v": 4, "i2v": 9}[kind]
    return HunyuanVideoTransformer3DModel(
        in_channels=in_ch, out_channels=4, num_attention_heads=2, attention_head_dim=8, num_layers=2,
        num_single_layers=2, num_refiner_layers=1, text_embed_dim=12, pooled_projection_dim=8,
        rope_axes_dim=(2, 2, 4), image_condition_type="latent_concat" if kind == "i2v" else None)


def tiny_hunyuan_video15(meanflow: bool = False, head: int = 8):
    from diffusers import HunyuanVideo15Transformer3DModel

    return HunyuanVideo15Transformer3DModel(
        in_channels=5, out_channels=4, num_attention_heads=2, attention_head_dim=head, num_layers=2,
        num_refiner_layers=1, text_embed_dim=12, text_embed_2_dim=10, image_embed_dim=6,
        rope_axes_dim=(2, 2, 4) if head == 8 else (16, 56, 56), use_meanflow=meanflow)


def tiny_ltx_video(head: int = 8):
    from diffusers import LTXVideoTransformer3DModel

    return LTXVideoTransformer3DModel(in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=head,
                                      cross_attention_dim=16, num_layers=2, caption_channels=12)


def tiny_ltx2(head: int = 8, audio_head: int = 4):
    from diffusers import LTX2VideoTransformer3DModel

    return LTX2VideoTransformer3DModel(
        in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=head, cross_attention_dim=16,
        num_layers=2, caption_channels=12, audio_in_channels=4, audio_out_channels=4, audio_num_attention_heads=2,
        audio_attention_head_dim=audio_head, audio_cross_attention_dim=8)


def tiny_chroma():
    from diffusers import ChromaTransformer2DModel

    return ChromaTransformer2DModel(in_channels=4, num_layers=1, num_single_layers=2, attention_head_dim=8,
                                    num_attention_heads=2, joint_attention_dim=16, axes_dims_rope=(2, 2, 4),
                                    approximator_num_channels=8, approximator_hidden_dim=32, approximator_layers=2)


def tiny_z_image(siglip: bool = False):
    from diffusers import ZImageTransformer2DModel

    return ZImageTransformer2DModel(all_patch_size=(2,), all_f_patch_size=(1,), in_channels=4, dim=32, n_layers=2,
                                    n_refiner_layers=1, n_heads=2, n_kv_heads=2, cap_feat_dim=16,
                                    siglip_feat_dim=12 if siglip else None, axes_dims=[4, 6, 6],
                                    axes_lens=[32, 32, 32])


def tiny_lumina2():
    """Grouped-query attention (4 heads, 2 kv heads) as in the release; 2 refiner layers, the number
    diffusers' converter spells out."""
    from diffusers import Lumina2Transformer2DModel

    return Lumina2Transformer2DModel(sample_size=8, patch_size=2, in_channels=4, hidden_size=32, num_layers=2,
                                     num_refiner_layers=2, num_attention_heads=4, num_kv_heads=2, multiple_of=16,
                                     cap_feat_dim=16, axes_dim_rope=(4, 2, 2), axes_lens=(32, 32, 32))


def tiny_hidream():
    from diffusers import HiDreamImageTransformer2DModel

    return HiDreamImageTransformer2DModel(patch_size=2, in_channels=4, num_layers=1, num_single_layers=1,
                                          attention_head_dim=8, num_attention_heads=2, caption_channels=[8, 12],
                                          text_emb_dim=16, num_routed_experts=2, num_activated_experts=1,
                                          axes_dims_rope=(4, 4), max_resolution=(16, 16), llama_layers=[0, 1])


def tiny_qwen_image():
    from diffusers import QwenImageTransformer2DModel

    return QwenImageTransformer2DModel(patch_size=2, in_channels=16, out_channels=4, num_layers=2,
                                       attention_head_dim=8, num_attention_heads=2, joint_attention_dim=16,
                                       axes_dims_rope=(2, 2, 4))


# ComfyUI's own rename of a HunyuanVideo 1.x checkpoint's Tencent keys to the names its model class holds,
# in ComfyUI's order: comfy/supported_models.py `HunyuanVideo.process_unet_state_dict` (Comfy-Org/ComfyUI
# master). Its q/k norms end in `.weight`; ComfyUI before its RMSNorm change named them `.scale` (the same
# function then renamed `_attn_q_norm.weight` to `_attn.norm.query_norm.scale`, as diffusion-pipe's copy
# of it in models/hunyuan_video.py `_convert_state_dict_keys` shows); today's still renames `.scale` to
# `.weight` on load. ModelSave/CheckpointSave write these names back unchanged
# (`process_unet_state_dict_for_saving` only puts `model.model.` before them).
def comfy_hunyuan_video_key(k: str, norm: str = "weight") -> str:
    k = k.replace("txt_in.t_embedder.mlp.0.", "txt_in.t_embedder.in_layer.").replace(
        "txt_in.t_embedder.mlp.2.", "txt_in.t_embedder.out_layer.")
    k = k.replace("txt_in.c_embedder.linear_1.", "txt_in.c_embedder.in_layer.").replace(
        "txt_in.c_embedder.linear_2.", "txt_in.c_embedder.out_layer.")
    k = k.replace("_mod.linear.", "_mod.lin.").replace("_attn_qkv.", "_attn.qkv.")
    k = k.replace("mlp.fc1.", "mlp.0.").replace("mlp.fc2.", "mlp.2.")
    k = k.replace("_attn_q_norm.weight", f"_attn.norm.query_norm.{norm}").replace(
        "_attn_k_norm.weight", f"_attn.norm.key_norm.{norm}")
    k = k.replace(".q_norm.weight", f".norm.query_norm.{norm}").replace(".k_norm.weight", f".norm.key_norm.{norm}")
    k = k.replace("_attn_proj.", "_attn.proj.")
    k = k.replace(".modulation.linear.", ".modulation.lin.")
    k = k.replace("_in.mlp.2.", "_in.out_layer.").replace("_in.mlp.0.", "_in.in_layer.")
    return k


def comfy_hunyuan_video(original: dict, norm: str = "weight") -> dict:
    """A Tencent-named HunyuanVideo 1.x state dict under ComfyUI's names (`comfy_hunyuan_video_key`)."""
    out = {comfy_hunyuan_video_key(k, norm): v for k, v in original.items()}
    assert len(out) == len(original)
    return out


# ------------------------------------------------------------------------------ Wan original names

WAN_INVERSE = [("condition_embedder.time_embedder.linear_1", "time_embedding.0"),
               ("condition_embedder.time_embedder.linear_2", "time_embedding.2"),
               ("condition_embedder.text_embedder.linear_1", "text_embedding.0"),
               ("condition_embedder.text_embedder.linear_2", "text_embedding.2"),
               ("condition_embedder.time_proj", "time_projection.1"), ("attn2", "cross_attn"), ("attn1", "self_attn"),
               (".to_out.0.", ".o."), (".to_q.", ".q."), (".to_k.", ".k."), (".to_v.", ".v."),
               ("ffn.net.0.proj", "ffn.0"), ("ffn.net.2", "ffn.2"),
               ("norm2", "norm_swap"), ("norm3", "norm2"), ("norm_swap", "norm3")]


def wan_original_layout(model) -> dict:
    """Wan's original (Wan-AI / ComfyUI) names for a diffusers WanTransformer3DModel, bf16, non-trivial values;
    checked against diffusers' own convert_wan_transformer_to_diffusers by the caller."""
    g = torch.Generator().manual_seed(3)
    out = {}
    for k, v in model.state_dict().items():
        n = k
        for a, b in WAN_INVERSE:
            n = n.replace(a, b)
        if n == "scale_shift_table":
            n = "head.modulation"
        elif n.endswith(".scale_shift_table"):
            n = n[: -len("scale_shift_table")] + "modulation"
        elif n.startswith("proj_out."):
            n = "head.head." + n[len("proj_out."):]
        out[n] = (v.detach() + torch.randn(v.shape, generator=g) * 0.05).to(torch.bfloat16)
    return out
