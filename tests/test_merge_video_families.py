"""merge-lora on HunyuanVideo 1.x/1.5 and LTX-Video/LTX-2, both layouts, against diffusers' own LoRA loading.

Same oracle as tests/test_merge_families.py (its helpers are reused): a diffusers/PEFT LoRA saved by the
pipeline's `save_lora_weights` merged onto an original-layout base, and an original-named LoRA
(diffusion-pipe/ComfyUI `diffusion_model.` + original names) merged onto a diffusers `save_pretrained`
folder; diffusers' answer is the pipeline's `lora_state_dict` + `load_lora_adapter` + `fuse_lora`. fp32:
rtol 1e-5, atol 1e-6.

Where diffusers' LoRA converters hard-code a model width (HunyuanVideo's `linear1` split at 3072), the
converter runs with the tiny model's width (`families_util.with_width`), nothing else changed. Known
diffusers LoRA-converter defects are kept out of the oracle comparisons and said where they apply.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from families_util import (comfy_hunyuan_video, comfy_hunyuan_video_key, original_from_pairs,
                           state_dict, tiny_hunyuan_video,
                           tiny_hunyuan_video15, tiny_ltx2, tiny_ltx_video, with_width)
from helpers.merge_compare import compare, diffusers_fused, peft_lora_file
from ckpt import families

diffusers = pytest.importorskip("diffusers")
pytest.importorskip("peft")


def _sfu():
    from diffusers.loaders import single_file_utils

    return single_file_utils


def _checked_original(family_id, base_sd, convert):
    """The original layout of `base_sd` from the family's pairs, checked by diffusers' converter."""
    original = original_from_pairs(families.get(family_id), base_sd)
    back = convert({k: v.clone() for k, v in original.items()})
    assert set(back) == set(base_sd) and all(torch.equal(back[k], base_sd[k]) for k in base_sd)
    return original


def _lora_pair(original, modules, r=4, seed=0, prefix="diffusion_model.", down="lora_A", up="lora_B"):
    torch.manual_seed(seed)
    lora = {}
    for mod in modules:
        w = original[f"{mod}.weight"]
        lora[f"{prefix}{mod}.{down}.weight"] = torch.randn(r, w.shape[1]) * 0.1
        lora[f"{prefix}{mod}.{up}.weight"] = torch.randn(w.shape[0], r) * 0.1
    return lora


# --------------------------------------------------------------------------------------- HunyuanVideo

def _hv_convert():
    return with_width(_sfu().convert_hunyuan_video_transformer_to_diffusers, 16)


@pytest.fixture
def hv_lora_converter(monkeypatch):
    """diffusers' HunyuanVideo LoRA converter, its 3072 (linear1 split) set to the tiny width."""
    from diffusers.loaders import lora_conversion_utils, lora_pipeline

    fn = with_width(lora_conversion_utils._convert_hunyuan_video_lora_to_diffusers, 16)
    monkeypatch.setattr(lora_pipeline, "_convert_hunyuan_video_lora_to_diffusers", fn)


def test_diffusers_hunyuan_video_lora_onto_tencent_base(tmp_path, run_ckpt):
    """PEFT LoRA on to_q/k/v (rows of img_attn_qkv, linear1, the refiner's self_attn_qkv), add_*_proj,
    proj_mlp (the MLP rows of linear1), norm_out.linear (swapped halves of final_layer.adaLN_modulation.1)."""
    torch.manual_seed(0)
    model = tiny_hunyuan_video()
    base_sd = state_dict(model)
    original = _checked_original("hunyuan_video", base_sd, _hv_convert())
    save_file({"model.diffusion_model." + k: v for k, v in original.items()}, tmp_path / "hv.safetensors")

    targets = ["to_q", "to_k", "to_v", "add_q_proj", "add_v_proj", "proj_mlp", "norm_out.linear", "ff.net.0.proj",
               "to_out.0", "norm1.linear", "proj_in", "x_embedder.proj"]
    lora = peft_lora_file(model, targets, tmp_path / "lora", diffusers.HunyuanVideoPipeline)
    want = diffusers_fused(tiny_hunyuan_video, base_sd, lora, diffusers.HunyuanVideoPipeline, 0.6)

    out = tmp_path / "out.safetensors"
    code, stdout, err = run_ckpt("merge-lora", tmp_path / "hv.safetensors", lora, "--ratio", "0.6", "-o", out)
    assert code == 0, err
    merged = {k[len("model.diffusion_model."):]: v for k, v in load_file(out).items()}
    got = _hv_convert()(merged)
    assert compare(got, want, base_sd) >= 30


def test_tencent_named_hunyuan_video_lora_onto_diffusers_folder(tmp_path, run_ckpt, hv_lora_converter):
    """A diffusion-pipe/ComfyUI LoRA (`diffusion_model.double_blocks.0.img_attn_qkv.lora_A`) on a diffusers
    folder: fused qkv and linear1 deltas land on the diffusers pieces row by row.
    (diffusers' converter splits lora_A of the refiner's `self_attn_qkv` and of `final_layer.adaLN_modulation.1`
    as if they were output rows; those modules are kept out of the comparison.)"""
    torch.manual_seed(1)
    model = tiny_hunyuan_video()
    base_sd = state_dict(model)
    model.save_pretrained(tmp_path / "hv")
    original = _checked_original("hunyuan_video", base_sd, _hv_convert())
    modules = ["double_blocks.0.img_attn_qkv", "double_blocks.1.txt_attn_qkv", "double_blocks.0.img_mlp.fc1",
               "double_blocks.1.txt_attn_proj", "double_blocks.0.img_mod.linear", "single_blocks.1.linear1",
               "single_blocks.0.linear2", "single_blocks.0.modulation.linear", "img_in.proj", "final_layer.linear",
               "txt_in.individual_token_refiner.blocks.0.mlp.fc1"]
    lora = _lora_pair(original, [m for m in modules if m != "img_in.proj"], seed=2)
    save_file(lora, tmp_path / "l.safetensors")
    want = diffusers_fused(tiny_hunyuan_video, base_sd, tmp_path / "l.safetensors", diffusers.HunyuanVideoPipeline, 1.0)

    code, stdout, err = run_ckpt("merge-lora", tmp_path / "hv", tmp_path / "l.safetensors", "-o", tmp_path / "out",
                                 "-q")
    assert code == 0, err
    got = load_file(tmp_path / "out" / "diffusion_pytorch_model.safetensors")
    assert compare(got, want, base_sd) == 3 + 3 + 1 + 1 + 1 + 4 + 1 + 1 + 1 + 1
    assert "10 LoRA modules matched" in stdout


def test_musubi_and_comfy_named_hunyuan_video_loras_onto_tencent_base(tmp_path, run_ckpt):
    """musubi-tuner's kohya names (`lora_unet_double_blocks_0_img_mod_linear`) and ComfyUI's Flux-style names
    (`diffusion_model.double_blocks.0.img_mod.lin`) land where the same LoRA in diffusion-pipe names does."""
    torch.manual_seed(3)
    original = original_from_pairs(families.get("hunyuan_video"), state_dict(tiny_hunyuan_video()))
    save_file(original, tmp_path / "hv.safetensors")
    modules = ["double_blocks.0.img_mod.linear", "double_blocks.1.img_mlp.fc2", "double_blocks.0.txt_attn_qkv",
               "single_blocks.0.modulation.linear", "single_blocks.1.linear1", "time_in.mlp.0"]
    plain = _lora_pair(original, modules, seed=4)
    from ckpt.families.hunyuan_video import comfy_name

    kohya = {k.replace("diffusion_model.", "lora_unet_").rsplit(".lora_", 1)[0].replace(".", "_")
             + (".lora_down.weight" if ".lora_A." in k else ".lora_up.weight"): v for k, v in plain.items()}
    comfy_named = {"diffusion_model." + comfy_name(k[len("diffusion_model."):].rsplit(".lora_", 1)[0])
                   + k[k.rindex(".lora_"):]: v for k, v in plain.items()}
    assert "diffusion_model.double_blocks.0.img_mod.lin.lora_A.weight" in comfy_named
    results = []
    for name, lora in (("plain", plain), ("kohya", kohya), ("comfy", comfy_named)):
        save_file(lora, tmp_path / f"{name}.safetensors")
        code, _, err = run_ckpt("merge-lora", tmp_path / "hv.safetensors", tmp_path / f"{name}.safetensors", "-o",
                                tmp_path / f"{name}_out.safetensors", "-q")
        assert code == 0, err
        results.append(load_file(tmp_path / f"{name}_out.safetensors"))
    changed = [k for k in original if not torch.equal(results[0][k], original[k])]
    assert len(changed) == len(modules)
    for other in results[1:]:
        assert all(torch.equal(results[0][k], other[k]) for k in original)


@pytest.mark.parametrize("norm,prefix", [("weight", "model.diffusion_model."), ("scale", "model.diffusion_model."),
                                         ("scale", "model.model.")])
def test_loras_onto_comfy_named_hunyuan_video_base(tmp_path, run_ckpt, norm, prefix):
    """A base in ComfyUI's Flux-style names, under `model.diffusion_model.` or under `model.model.` (what
    ComfyUI's ModelSave/CheckpointSave write for HunyuanVideo): diffusion-pipe, musubi/kohya, ComfyUI-named
    and diffusers/PEFT LoRAs land where they land on the Tencent-named base (merged output in the base's own
    names, prefix included, equal bit for bit once renamed)."""
    torch.manual_seed(7)
    model = tiny_hunyuan_video()
    original = _checked_original("hunyuan_video", state_dict(model), _hv_convert())
    comfy = comfy_hunyuan_video(original, norm)
    to_comfy = {k: comfy_hunyuan_video_key(k, norm) for k in original}
    save_file(original, tmp_path / "base_tencent.safetensors")
    save_file({prefix + k: v for k, v in comfy.items()}, tmp_path / "base_comfy.safetensors")

    modules = ["double_blocks.0.img_mod.linear", "double_blocks.1.img_mlp.fc2", "double_blocks.0.txt_attn_qkv",
               "double_blocks.1.img_attn_proj", "single_blocks.0.modulation.linear", "single_blocks.1.linear1",
               "time_in.mlp.0", "txt_in.t_embedder.mlp.2", "txt_in.individual_token_refiner.blocks.0.self_attn_qkv",
               "final_layer.adaLN_modulation.1"]
    plain = _lora_pair(original, modules, seed=8)
    kohya = {k.replace("diffusion_model.", "lora_unet_").rsplit(".lora_", 1)[0].replace(".", "_")
             + (".lora_down.weight" if ".lora_A." in k else ".lora_up.weight"): v for k, v in plain.items()}
    comfy_named = {"diffusion_model." + comfy_hunyuan_video_key(k[len("diffusion_model."):]): v
                   for k, v in plain.items()}
    assert "diffusion_model.double_blocks.0.img_mod.lin.lora_A.weight" in comfy_named
    loras = {"plain": plain, "kohya": kohya, "comfy": comfy_named}
    for name, lora in loras.items():
        save_file(lora, tmp_path / f"{name}.safetensors")
    loras["peft"] = peft_lora_file(model, ["to_q", "add_k_proj", "proj_mlp", "norm_out.linear", "ff.net.0.proj",
                                       "norm1.linear", "proj_in"], tmp_path / "peft", diffusers.HunyuanVideoPipeline)

    def merged(base, lora, out):
        code, _, err = run_ckpt("merge-lora", base, lora, "-o", out, "-q")
        assert code == 0, err
        return load_file(out)

    for name in loras:
        lora = loras[name] if name == "peft" else tmp_path / f"{name}.safetensors"
        want = merged(tmp_path / "base_tencent.safetensors", lora, tmp_path / f"{name}_t.safetensors")
        got = merged(tmp_path / "base_comfy.safetensors", lora, tmp_path / f"{name}_c.safetensors")
        assert set(got) == {prefix + to_comfy[k] for k in original}
        changed = [k for k in original if not torch.equal(want[k], original[k])]
        assert len(changed) >= (len(modules) if name != "peft" else 7), (name, changed)
        assert all(torch.equal(got[prefix + to_comfy[k]], want[k]) for k in original), name


# ------------------------------------------------------------------------------------ HunyuanVideo 1.5
# diffusers has neither a single-file nor a LoRA converter for 1.5: merged original-layout outputs are read
# back with the family's pairs (their 1.x-shared part verified by diffusers' 1.x converter, the rest by the
# model class: tests/test_families_hunyuan15.py); Tencent-named LoRAs are given to diffusers under the
# diffusers names those pairs give.

def test_musubi_hunyuan_video15_lora_onto_diffusers_folder(tmp_path, run_ckpt):
    torch.manual_seed(6)
    model = tiny_hunyuan_video15()
    base_sd = state_dict(model)
    model.save_pretrained(tmp_path / "hv15")
    fam = families.get("hunyuan_video15")
    original = original_from_pairs(fam, base_sd)
    modules = ["double_blocks.0.img_attn_q", "double_blocks.1.txt_attn_v", "double_blocks.0.img_mlp.fc2",
               "double_blocks.1.txt_mod.linear", "byt5_in.fc2", "vision_in.proj.1", "final_layer.linear"]
    plain = _lora_pair(original, modules, seed=7)
    to_diffusers = {p.original[: -len(".weight")]: p.diffusers[: -len(".weight")]
                    for p in fam.pairs({k: tuple(v.shape) for k, v in original.items()}, "original")
                    if p.original.endswith(".weight")}
    named = {"transformer." + to_diffusers[k[len("diffusion_model."):].rsplit(".lora_", 1)[0]] + k[k.rindex(".lora_"):]:
             v for k, v in plain.items()}
    save_file(named, tmp_path / "d.safetensors")
    want = diffusers_fused(tiny_hunyuan_video15, base_sd, tmp_path / "d.safetensors", diffusers.HunyuanVideoPipeline, 1.0)
    kohya = {k.replace("diffusion_model.", "lora_unet_").rsplit(".lora_", 1)[0].replace(".", "_")
             + (".lora_down.weight" if ".lora_A." in k else ".lora_up.weight"): v for k, v in plain.items()}
    save_file(kohya, tmp_path / "musubi.safetensors")
    code, stdout, err = run_ckpt("merge-lora", tmp_path / "hv15", tmp_path / "musubi.safetensors", "-o",
                                 tmp_path / "out", "-q")
    assert code == 0, err
    got = load_file(tmp_path / "out" / "diffusion_pytorch_model.safetensors")
    assert compare(got, want, base_sd) == len(modules)


# ------------------------------------------------------------------------------------ LTX-Video, LTX-2

LTX = {  # (tiny model, pipeline, diffusers converter, modules of an original-named LoRA)
    "ltx_video": (tiny_ltx_video, "LTXPipeline", "convert_ltx_transformer_checkpoint_to_diffusers",
                  # diffusers' LTX-Video LoRA reader renames nothing: only names both layouts share
                  ["transformer_blocks.0.attn1.to_q", "transformer_blocks.1.attn2.to_k",
                   "transformer_blocks.0.ff.net.2",
                   "caption_projection.linear_2", "proj_out"]),
    "ltx2": (tiny_ltx2, "LTX2Pipeline", "convert_ltx2_transformer_to_diffusers",
             ["transformer_blocks.0.attn1.to_q", "transformer_blocks.1.audio_to_video_attn.to_k",
              "transformer_blocks.0.video_to_audio_attn.to_v", "transformer_blocks.1.audio_ff.net.0.proj",
              "patchify_proj", "audio_patchify_proj", "adaln_single.linear", "av_ca_a2v_gate_adaln_single.linear",
              "audio_adaln_single.emb.timestep_embedder.linear_1"]),
}


@pytest.mark.parametrize("family_id", list(LTX))
def test_original_named_ltx_lora_onto_diffusers_folder(tmp_path, run_ckpt, family_id):
    """A LTX trainer / ComfyUI LoRA (`diffusion_model.` + Lightricks names, renamed modules included for
    LTX-2, whose diffusers reader renames them too) on a diffusers folder."""
    make, pipeline, converter, modules = LTX[family_id]
    torch.manual_seed(9)
    model = make()
    base_sd = state_dict(model)
    model.save_pretrained(tmp_path / "dif")
    original = _checked_original(family_id, base_sd, getattr(_sfu(), converter))
    save_file(_lora_pair(original, modules, seed=10), tmp_path / "l.safetensors")
    want = diffusers_fused(make, base_sd, tmp_path / "l.safetensors", getattr(diffusers, pipeline), 1.0)
    code, stdout, err = run_ckpt("merge-lora", tmp_path / "dif", tmp_path / "l.safetensors", "-o", tmp_path / "out",
                                 "-q")
    assert code == 0, err
    got = load_file(tmp_path / "out" / "diffusion_pytorch_model.safetensors")
    assert compare(got, want, base_sd) == len(modules)
    assert f"{len(modules)} LoRA modules matched" in stdout


def test_inspect_reports_video_family_ids_and_layouts(tmp_path, run_ckpt):
    cases = [("hunyuan_video", tiny_hunyuan_video, "HunyuanVideoTransformer3DModel"),
             ("hunyuan_video15", tiny_hunyuan_video15, "HunyuanVideo15Transformer3DModel"),
             ("ltx_video", tiny_ltx_video, "LTXVideoTransformer3DModel"),
             ("ltx2", tiny_ltx2, "LTX2VideoTransformer3DModel")]
    for family_id, make, cls in cases:
        model = make()
        model.save_pretrained(tmp_path / family_id)
        original = original_from_pairs(families.get(family_id), state_dict(model))
        save_file({"model.diffusion_model." + k: v for k, v in original.items()},
                  tmp_path / f"{family_id}.safetensors")
        for name, layout in ((family_id, "diffusers"), (f"{family_id}.safetensors", "original")):
            code, out, err = run_ckpt("inspect", "--json", tmp_path / name)
            assert code == 0, err
            (c,) = json.loads(out)["components"]
            assert (c["family_id"], c["layout"]) == (family_id, layout), (name, c)
        assert families.from_config(json.loads((tmp_path / family_id / "config.json").read_text())) is \
            families.get(family_id)
        assert cls in json.loads((tmp_path / family_id / "config.json").read_text())["_class_name"]


def test_high_precision_rules():
    hv = families.get("hunyuan_video")
    assert hv.keeps_high_precision("img_in.proj.weight", (3072, 16, 1, 2, 2), "original")
    assert hv.keeps_high_precision("txt_in.individual_token_refiner.blocks.0.self_attn_qkv.weight", (9, 3), "original")
    assert hv.keeps_high_precision("final_layer.adaLN_modulation.1.weight", (6, 3), "original")
    assert not hv.keeps_high_precision("double_blocks.0.img_attn_qkv.weight", (9, 3), "original")
    assert not hv.keeps_high_precision("single_blocks.0.linear1.weight", (21, 3), "original")
    assert hv.keeps_high_precision("context_embedder.proj_in.weight", (3, 3), "diffusers")
    assert not hv.keeps_high_precision("transformer_blocks.0.attn.to_q.weight", (3, 3), "diffusers")
    v15, ltx, ltx2 = families.get("hunyuan_video15"), families.get("ltx_video"), families.get("ltx2")
    assert v15.keeps_high_precision("byt5_in.fc1.weight", (2048, 1472), "original")
    assert v15.keeps_high_precision("cond_type_embedding.weight", (3, 16), "original")
    assert not v15.keeps_high_precision("double_blocks.0.img_attn_q.weight", (16, 16), "original")
    assert v15.keeps_high_precision("image_embedder.linear_1.weight", (16, 16), "diffusers")
    assert ltx.keeps_high_precision("transformer_blocks.0.scale_shift_table", (6, 16), "original")  # ComfyUI-GGUF
    assert ltx.keeps_high_precision("patchify_proj.weight", (16, 4), "original")
    assert not ltx.keeps_high_precision("transformer_blocks.0.attn1.to_q.weight", (16, 16), "diffusers")
    assert ltx2.keeps_high_precision("av_ca_a2v_gate_adaln_single.linear.weight", (16, 16), "original")
    assert ltx2.keeps_high_precision("transformer_blocks.0.scale_shift_table_a2v_ca_video", (5, 16), "original")
    assert ltx2.keeps_high_precision("av_cross_attn_video_a2v_gate.linear.weight", (16, 16), "diffusers")
    assert not ltx2.keeps_high_precision("transformer_blocks.0.audio_attn1.to_q.weight", (8, 8), "original")


def test_trainer_spellings_of_diffusers_names_onto_ltx2_original_base(tmp_path, run_ckpt):
    """PEFT `transformer.` (and DiffSynth's `.default.`), OneTrainer `lora_transformer_`, SimpleTuner
    `lycoris_`: the same diffusers-named LoRA (renamed modules `proj_in`, `time_embed.linear` included) merges
    to the same tensors on a Lightricks-layout base."""
    torch.manual_seed(11)
    sd = state_dict(tiny_ltx2())
    fam = families.get("ltx2")
    save_file(original_from_pairs(fam, sd), tmp_path / "base.safetensors")
    modules = ["transformer_blocks.0.attn1.to_q", "transformer_blocks.1.audio_attn2.to_v", "proj_in",
               "time_embed.linear", "av_cross_attn_audio_v2a_gate.linear", "transformer_blocks.0.attn1.to_out.0"]
    peft = _lora_pair(sd, modules, seed=12, prefix="transformer.")
    flat = {}
    for k, v in peft.items():
        module, part = k[len("transformer."):].rsplit(".lora_", 1)
        flat[module.replace(".", "_") + (".lora_down.weight" if part.startswith("A") else ".lora_up.weight")] = v
    spellings = {"peft": peft,
                 "default": {k.replace(".lora_A.", ".lora_A.default.").replace(".lora_B.", ".lora_B.default."): v
                             for k, v in peft.items()},
                 "onetrainer": {"lora_transformer_" + k: v for k, v in flat.items()},
                 "lycoris": {"lycoris_" + k: v for k, v in flat.items()}}
    outs = {}
    for name, lora in spellings.items():
        save_file(lora, tmp_path / f"{name}.safetensors")
        code, stdout, err = run_ckpt("merge-lora", tmp_path / "base.safetensors", tmp_path / f"{name}.safetensors",
                                     "-o", tmp_path / f"{name}-out.safetensors", "-q")
        assert code == 0, (name, err)
        assert f"{len(modules)} LoRA modules matched" in stdout, (name, stdout)
        outs[name] = load_file(tmp_path / f"{name}-out.safetensors")
    first = outs["peft"]
    assert all(set(o) == set(first) and all(torch.equal(o[k], first[k]) for k in first) for o in outs.values())
