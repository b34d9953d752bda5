"""Where a tensor sits in a diffusion model's depth (`Family.blocks`, `ckpt.merge.blocks`): the `t` a gradient
setting of `ckpt merge` is evaluated at.

Every diffusion family module declares its blocks; on its tiny model's original-layout keys (diffusers' tiny
model through the family's pairs; AuraFlow and Cosmos, which have no diffusers correspondence, from their
reference names) exactly the tensors of the expected blocks are matched, numbered in depth order (what the
family's forward runs first comes first: Flux double then single blocks, SD input, middle, output blocks), and
every other tensor (embedders, token refiners, final layers) sits at t = 0. The expected blocks are written
here from each tiny model's configuration, independently of the patterns. Then a gradient `alpha: [0, 1]` of
weighted_sum on Flux.1 files is checked on the merged values, in the original and in the diffusers layout.
"""

from __future__ import annotations

import re

import pytest
import torch
from safetensors.torch import load_file, save_file

from families_util import (comfy_hunyuan_video, original_from_pairs, state_dict, tiny_chroma, tiny_flux1, tiny_flux2,
                           tiny_hidream, tiny_hunyuan_video, tiny_hunyuan_video15, tiny_ltx2, tiny_ltx_video,
                           tiny_lumina2, tiny_qwen_image, tiny_sd3, tiny_unet, tiny_wan, tiny_z_image)
from helpers.tiny_anima import tiny_conditioner, tiny_cosmos
from helpers.tiny_ernie_image import tiny_ernie_image
from helpers.tiny_ideogram4 import tiny_ideogram4
from helpers.tiny_kandinsky6 import tiny_kandinsky6
from helpers.tiny_krea2 import tiny_krea2
from helpers.tiny_minimax_h3 import tiny_minimax_h3
from helpers.tiny_qwen_image21 import tiny_qwen_image21
from ckpt import families
from ckpt.merge import blocks

pytest.importorskip("diffusers")


def _aura_keys():
    """AuraFlow's reference names (fal's single files, ComfyUI): 4 double (joint) layers, then 3 single."""
    keys = ["init_x_linear.weight", "positional_encoding", "register_tokens", "cond_seq_linear.weight",
            "t_embedder.mlp.0.weight", "t_embedder.mlp.2.weight", "modF.1.weight", "final_linear.weight"]
    for b in range(4):
        keys += [f"double_layers.{b}.{m}.weight" for m in ("modC.1", "modX.1", "attn.w1q", "attn.w2q", "mlpX.c_fc1",
                                                           "mlpC.c_proj")]
    for b in range(3):
        keys += [f"single_layers.{b}.{m}.weight" for m in ("modCX.1", "attn.w1q", "attn.w1o", "mlp.c_fc1")]
    return keys


def _cosmos_keys():
    """Cosmos-Predict2's MiniTrainDIT names: 3 blocks between the embedders and the final layer."""
    keys = ["x_embedder.proj.1.weight", "t_embedder.1.linear_1.weight", "t_embedding_norm.weight", "pos_embedder.seq",
            "final_layer.linear.weight", "final_layer.adaln_modulation.1.weight"]
    for b in range(3):
        keys += [f"blocks.{b}.{m}" for m in ("self_attn.q_proj.weight", "self_attn.output_proj.weight",
                                              "cross_attn.k_proj.weight", "mlp.layer1.weight", "mlp.layer2.weight",
                                              "adaln_modulation_self_attn.1.weight",
                                              "adaln_modulation_cross_attn.1.weight", "adaln_modulation_mlp.1.weight")]
    return keys


def _original(family_id, make):
    def keys():
        torch.manual_seed(0)
        return list(original_from_pairs(families.get(family_id), state_dict(make())))
    return keys


def _diffusers(make):
    def keys():
        return list(state_dict(make()))
    return keys


def _anima_keys():
    """Anima's single file: the Cosmos DiT's original names and the LLM adapter under `llm_adapter.` (ComfyUI's
    LLMAdapter names are the conditioner's own), whose `llm_adapter.blocks.N` are no DiT blocks."""
    return _original("anima", tiny_cosmos)() + ["llm_adapter." + k for k in state_dict(tiny_conditioner())]


_hyvid = _original("hunyuan_video", tiny_hunyuan_video)

# case: (family id, the tiny model's keys, its blocks in depth order as (head, count); count None: one block)
CASES = {
    "sd1": ("sd1", _original("sd1", lambda: tiny_unet("sd1")),
            (("input_blocks", 6), ("middle_block", None), ("output_blocks", 6))),
    "sdxl": ("sd1", _original("sdxl", lambda: tiny_unet("sdxl")),
             (("input_blocks", 6), ("middle_block", None), ("output_blocks", 6))),
    "sd3": ("sd3", _original("sd3", tiny_sd3), (("joint_blocks", 2),)),
    "flux1": ("flux1", _original("flux1", tiny_flux1), (("double_blocks", 1), ("single_blocks", 2))),
    "flux2": ("flux2", _original("flux2", tiny_flux2), (("double_blocks", 1), ("single_blocks", 2))),
    "chroma": ("chroma", _original("chroma", tiny_chroma), (("double_blocks", 1), ("single_blocks", 2))),
    "wan": ("wan", _original("wan", tiny_wan), (("blocks", 2),)),
    "wan-vace": ("wan", _original("wan", lambda: tiny_wan("vace")), (("blocks", 2),)),  # vace_blocks: beside
    "hunyuan_video": ("hunyuan_video", _hyvid, (("double_blocks", 2), ("single_blocks", 2))),
    "hunyuan_video-comfy": ("hunyuan_video", lambda: list(comfy_hunyuan_video(dict.fromkeys(_hyvid()))),
                            (("double_blocks", 2), ("single_blocks", 2))),  # ComfyUI's own spelling
    "hunyuan_video15": ("hunyuan_video15", _original("hunyuan_video15", tiny_hunyuan_video15),
                        (("double_blocks", 2),)),
    "ltx_video": ("ltx_video", _original("ltx_video", tiny_ltx_video), (("transformer_blocks", 2),)),
    "ltx2": ("ltx2", _original("ltx2", tiny_ltx2), (("transformer_blocks", 2),)),
    "qwen_image": ("qwen_image", _diffusers(tiny_qwen_image), (("transformer_blocks", 2),)),
    "qwen_image21": ("qwen_image21", _original("qwen_image21", tiny_qwen_image21), (("transformer_blocks", 2),)),
    "hidream": ("hidream", _diffusers(tiny_hidream), (("double_stream_blocks", 1), ("single_stream_blocks", 1))),
    "lumina2": ("lumina2", _original("lumina2", tiny_lumina2), (("layers", 2),)),
    "z_image": ("z_image", _original("z_image", tiny_z_image), (("layers", 2),)),
    "ernie_image": ("ernie_image", _diffusers(tiny_ernie_image), (("layers", 2),)),  # one naming: diffusers'
    "krea2": ("krea2", _original("krea2", tiny_krea2), (("blocks", 2),)),  # txtfusion blocks: beside
    "ideogram4": ("ideogram4", _original("ideogram4", tiny_ideogram4), (("layers", 2),)),
    "minimax_h3": ("minimax_h3", _original("minimax_h3", tiny_minimax_h3), (("blocks", 2),)),  # token_refiner: beside
    "kandinsky6": ("kandinsky6", _original("kandinsky6", tiny_kandinsky6),
                   (("visual_blocks", 2),)),  # video_/audio_text_transformer_blocks: beside
    "auraflow": ("auraflow", _aura_keys, (("double_layers", 4), ("single_layers", 3))),
    "cosmos": ("cosmos", _cosmos_keys, (("blocks", 3),)),
    "anima": ("anima", _anima_keys, (("blocks", 2),)),  # llm_adapter.blocks: beside
}


def test_every_diffusion_family_declares_blocks_and_has_a_case():
    diffusion = {f.family_id for f in families.all_families() if f.kind == "diffusion"}
    assert diffusion == {fid for fid, _, _ in CASES.values()}
    for fid in diffusion:
        fam = families.get(fid)
        assert fam.blocks, fid
        for p in fam.blocks:
            assert p.startswith("^") and re.compile(p).groups <= 1, (fid, p)


def _expected(keys, order):
    prefixes = [f"{h}." if n is None else f"{h}.{i}." for h, n in order for i in range(n or 1)]
    n = len(prefixes)
    where = {k: next((i for i, p in enumerate(prefixes) if k.startswith(p)), None) for k in keys}
    assert set(where.values()) - {None} == set(range(n))  # every expected block is in the tiny model
    t = {k: (0.0 if i is None else i / (n - 1)) for k, i in where.items()}
    return t, {k for k, i in where.items() if i is not None}


@pytest.mark.parametrize("case", list(CASES))
def test_blocks_match_the_tiny_model_in_depth_order(case):
    fid, make, order = CASES[case]
    keys = make()
    m = families.detect(keys, {})
    assert m is not None and m.family is families.get(fid), (case, m)
    want_t, want_in = _expected(keys, order)
    rx = [re.compile(p) for p in m.family.blocks]
    assert {k for k in keys if blocks.block_of(k, rx) is not None} == want_in
    assert blocks.positions({k: k for k in keys}, m.family) == want_t


# ------------------------------------------------------------------------------ a gradient on Flux.1 values

def _flux_pair(tmp_path):
    """A (zeros) and B (ones) in the original layout: weighted_sum(A, B, alpha) is alpha, element by element."""
    torch.manual_seed(0)
    sd = original_from_pairs(families.get("flux1"), state_dict(tiny_flux1()))
    a = {k: torch.zeros_like(v) for k, v in sd.items()}
    b = {k: torch.ones_like(v) for k, v in sd.items()}
    save_file(a, tmp_path / "a.safetensors")
    save_file(b, tmp_path / "b.safetensors")
    return a


FLUX_T = {"double_blocks.0.": 0.0, "single_blocks.0.": 0.5, "single_blocks.1.": 1.0}  # 1 double, 2 single blocks


def _flux_t(original_name):
    return next((t for p, t in FLUX_T.items() if original_name.startswith(p)), 0.0)


def _gradient_config(tmp_path, a, b):
    cfg = tmp_path / "ramp.yaml"
    cfg.write_text(f"merge_method: weighted_sum\nmodels: [{a}, {b}]\nparameters:\n  alpha: [0, 1]\n")
    return cfg


def test_gradient_ramps_over_double_then_single_blocks(run_ckpt, tmp_path):
    a = _flux_pair(tmp_path)
    cfg = _gradient_config(tmp_path, tmp_path / "a.safetensors", tmp_path / "b.safetensors")
    code, out, err = run_ckpt("merge", cfg, "-o", tmp_path / "out.safetensors", "-q")
    assert code == 0, err
    got = load_file(tmp_path / "out.safetensors")
    assert set(got) == set(a)
    seen = set()
    for k, v in got.items():
        t = _flux_t(k)
        seen.add(t)
        torch.testing.assert_close(v, torch.full_like(v, t), rtol=0, atol=1e-7, msg=k)
    assert seen == {0.0, 0.5, 1.0}
    assert torch.equal(got["img_in.weight"], torch.zeros_like(a["img_in.weight"]))  # outside the blocks: t = 0


def test_gradient_follows_the_original_blocks_in_a_diffusers_reference(run_ckpt, tmp_path):
    """A is a diffusers folder, B an original-layout file: the output keeps A's diffusers names, and each
    tensor's t is that of the original block it comes from (`transformer_blocks.0` = `double_blocks.0`)."""
    _flux_pair(tmp_path)
    torch.manual_seed(0)
    model = tiny_flux1()
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    model.save_pretrained(tmp_path / "a")
    cfg = _gradient_config(tmp_path, tmp_path / "a", tmp_path / "b.safetensors")
    code, out, err = run_ckpt("merge", cfg, "-o", tmp_path / "out", "-q")
    assert code == 0, err
    got = load_file(tmp_path / "out" / "diffusion_pytorch_model.safetensors")
    shapes = {k: tuple(v.shape) for k, v in got.items()}
    original = {p.diffusers: p.original for p in families.get("flux1").pairs(shapes, families.DIFFUSERS)
                if p.diffusers in got and p.original}
    assert set(original) == set(got)
    for k, v in got.items():
        torch.testing.assert_close(v, torch.full_like(v, _flux_t(original[k])), rtol=0, atol=1e-7, msg=k)
    assert any(k.startswith("single_transformer_blocks.1.") for k in got)


def test_gradient_on_an_all_in_one_sd_file_follows_the_unet_only(run_ckpt, tmp_path):
    """An A1111-style bundle (UNet under model.diffusion_model., CLIP, VAE): the UNet's blocks carry t, the text
    encoder's `encoder.layers.N` (a language model's layer pattern) and the VAE get t = 0."""
    keys = ["model.diffusion_model.input_blocks.0.0.weight", "model.diffusion_model.input_blocks.1.1.proj_in.weight",
            "model.diffusion_model.middle_block.1.proj_in.weight", "model.diffusion_model.output_blocks.0.0.in_layers.2.weight",
            "model.diffusion_model.output_blocks.1.1.proj_out.weight", "model.diffusion_model.out.2.weight",
            "cond_stage_model.transformer.text_model.encoder.layers.0.mlp.fc1.weight",
            "cond_stage_model.transformer.text_model.encoder.layers.1.mlp.fc1.weight",
            "first_stage_model.decoder.conv_out.weight"]
    save_file({k: torch.zeros(4, 4) for k in keys}, tmp_path / "a.safetensors")
    save_file({k: torch.ones(4, 4) for k in keys}, tmp_path / "b.safetensors")
    code, out, err = run_ckpt("merge", tmp_path / "a.safetensors", tmp_path / "b.safetensors", "--param", "alpha=0,1",
                              "-o", tmp_path / "o.safetensors", "-q")
    assert code == 0, err
    got = {k: v[0, 0].item() for k, v in load_file(tmp_path / "o.safetensors").items()}
    assert [round(got[k], 6) for k in keys] == [0, 0.25, 0.5, 0.75, 1, 0, 0, 0, 0]
