"""MiniMax-H3 (ckpt/families/minimax_h3.py) against diffusers 0.42's MiniMaxH3Transformer3DModel.

- correspondence: diffusers' `convert_minimax_h3_transformer_checkpoint_to_diffusers` (stacked qkv, the
  published single files' order) applied to the original state dict made from the family's pairs gives the
  tiny model's state dict bit for bit, and so do the pairs themselves; `rope.inv_freq` has no diffusers tensor:
  `--layout original` writes it from config.json, equal bit for bit to the buffer diffusers' model computes
  (ComfyUI, which reads it from the file, is not installed here), float32 [rope_freq_dim] as ComfyUI registers it;
- detection of both layouts, kohya-flattened LoRA names, a pruned file, the config class; LTX-2 (which has
  `audio_proj_in` too) and Wan/Cosmos (`blocks.N.`) stay themselves;
- `convert --layout diffusers` loaded strictly by `from_pretrained`, `--layout original` back to the same bytes;
- merge-lora of diffusers/PEFT, musubi-tuner (kohya) and ai-toolkit (`diffusion_model.`) LoRAs onto both layouts
  against the LoRA loader's own conversion, `load_lora_adapter` and `fuse_lora`; DiffSynth-Studio LoRAs
  (`.default.` keys, per-head interleaved qkv) on a two-head model with the releases' 128-wide heads likewise;
- `convert --to int8`: the family's high-precision layers stay as they are;
- refusals: a pruned checkpoint to the diffusers layout (diffusers refuses it too), a fused tensor that does not
  split, a head too small for the releases' rope, a config.json whose rope cannot be computed, a DiffSynth LoRA
  whose qkv rows are no whole number of 128-wide heads (diffusers refuses it too).
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from families_util import (assert_detected_both_layouts, assert_needs_config, diffusers_from_pairs, merge_onto,
                           original_from_pairs, shapes, state_dict, unique_values)
from helpers.layout_round_trips import diffusers_folder_to_original_and_round_trip, original_file_to_diffusers_folder
from helpers.refusals import assert_refused
from helpers.tiny_minimax_h3 import tiny_minimax_h3 as tiny
from ckpt import families
from ckpt.families import DIFFUSERS, ORIGINAL

diffusers = pytest.importorskip("diffusers")
pytest.importorskip("peft")
from helpers.merge_compare import compare, diffusers_fused, peft_lora_file  # noqa: E402

from diffusers.loaders.lora_pipeline import MiniMaxH3LoraLoaderMixin as H3  # noqa: E402


def convert(model):
    from diffusers.loaders.single_file_utils import convert_minimax_h3_transformer_checkpoint_to_diffusers as fn

    return lambda sd: fn(sd, config=dict(model.config))


def inv_freq(n: int):
    return 1.0 / (10000.0 ** (torch.arange(0, 2 * n, 2, dtype=torch.float32) / (2 * n)))


def test_correspondence_is_diffusers_converter_bit_for_bit():
    model = tiny()
    sd = unique_values(state_dict(model))
    fam = families.get("minimax_h3")
    original = {**original_from_pairs(fam, sd), "rope.inv_freq": inv_freq(2)}
    assert "blocks.1.attn.qkv_proj.weight" in original and "token_refiner.blocks.0.mlp.fc1.weight" in original
    assert len(original) == len(sd) - 3 * 2 + 1  # q/k/v fused in 3 blocks, plus the rope buffer
    back = convert(model)({k: v.clone() for k, v in original.items()})
    assert set(back) == set(sd) and all(torch.equal(back[k], sd[k]) for k in sd)
    ours = diffusers_from_pairs(fam, original)
    assert set(ours) == set(sd) and all(torch.equal(ours[k], sd[k]) for k in sd)
    # the gated FF's halves really swap, and the fused qkv is the stacked order
    w = sd["transformer_blocks.0.ff.net.0.proj.weight"]
    assert torch.equal(original["blocks.0.mlp.fc1.weight"], torch.cat([w[48:], w[:48]]))
    assert torch.equal(original["blocks.0.attn.qkv_proj.weight"][32:64], sd["transformer_blocks.0.attn.to_k.weight"])


def test_both_layouts_kohya_names_pruned_and_config_class():
    fam = families.get("minimax_h3")
    sd = shapes(state_dict(tiny()))
    original = shapes(original_from_pairs(fam, unique_values(state_dict(tiny()))))
    assert_detected_both_layouts("minimax_h3", original, sd, matrices_only=True)
    pruned = {k: v for k, v in original.items() if not k.startswith("time_embedder.")} | {"adaln_t_table": (1025, 20)}
    m = families.detect(pruned, pruned)
    assert (m.family_id, m.layout) == ("minimax_h3", ORIGINAL) and "pruned" in m.label
    # a musubi LoRA on the attention of the blocks only
    lora = [f"blocks_{i}_attn_{p}" for i in range(2) for p in ("qkv_proj", "out_proj")]
    assert families.detect(lora).family_id == "minimax_h3"
    assert families.from_config({"_class_name": "MiniMaxH3Transformer3DModel"}) is fam


def test_look_alikes_stay_themselves():
    from families_util import tiny_ltx2, tiny_wan

    for make, fid in ((tiny_ltx2, "ltx2"), (tiny_wan, "wan")):
        sd = shapes(state_dict(make()))
        assert families.detect(sd, sd).family_id == fid
        orig = shapes(original_from_pairs(families.get(fid), unique_values(state_dict(make()))))
        assert families.detect(orig, orig).family_id == fid


@pytest.fixture(scope="module")
def case():
    torch.manual_seed(0)
    model = tiny(head=128)
    sd = state_dict(model)
    # the reference's buffer, as the published files hold it; diffusers' model computes the same (non-persistent)
    original = {**original_from_pairs(families.get("minimax_h3"), sd), "rope.inv_freq": model.rope.inv_freq.clone()}
    back = convert(model)({k: v.clone() for k, v in original.items()})
    assert set(back) == set(sd) and all(torch.equal(back[k], sd[k]) for k in sd)
    return model, sd, original, convert(model)


@pytest.mark.parametrize("prefix", ["", "model.diffusion_model."])
def test_original_file_to_diffusers_folder(tmp_path, run_ckpt, case, prefix):
    original_file_to_diffusers_folder(tmp_path, run_ckpt, case, prefix)


def test_diffusers_folder_to_original_and_round_trip(tmp_path, run_ckpt, case):
    diffusers_folder_to_original_and_round_trip(tmp_path, run_ckpt, case)


def test_rope_buffer_is_dropped_with_a_note(tmp_path, run_ckpt, case):
    model, sd, original, conv = case
    assert torch.equal(original["rope.inv_freq"], inv_freq(16))
    save_file(original, tmp_path / "o.safetensors")
    code, out, err = run_ckpt("convert", tmp_path / "o.safetensors", "--layout", "diffusers", "-o", tmp_path / "d")
    assert code == 0, err
    assert "1 tensor exists in the original layout only and is not written: rope.inv_freq" in out + err
    got = load_file(tmp_path / "d" / "diffusion_pytorch_model.safetensors")
    assert set(got) == set(sd) and all(torch.equal(got[k], sd[k]) for k in sd)


@pytest.mark.parametrize("theta", [10000.0, 500.0])
def test_rope_buffer_is_computed_from_config_for_the_original_layout(tmp_path, run_ckpt, theta):
    """ComfyUI's MiniMaxH3Model registers `rope.inv_freq` as a float32 [rope_inv_freq_len] buffer and reads it from
    the file: the original file holds it, as diffusers' model computes it from the folder's config.json."""
    torch.manual_seed(2)
    model = diffusers.MiniMaxH3Transformer3DModel(
        num_attention_heads=1, attention_head_dim=128, hidden_size=128, num_layers=1, num_refiner_layers=1, ffn_dim=48,
        in_channels=4, audio_in_channels=6, text_dim=12, freq_dim=8, time_embed_hidden_dim=24, time_embed_dim=20,
        rope_freq_dim=16, rope_theta=theta)
    model.save_pretrained(tmp_path / "dif")
    code, out, err = run_ckpt("convert", tmp_path / "dif", "--layout", "original", "-o", tmp_path / "o.safetensors")
    assert code == 0, err
    assert ("1 tensor the diffusers model computes, written from its config.json: rope.inv_freq (rope_freq_dim, "
            "rope_theta)") in out + err
    got = load_file(tmp_path / "o.safetensors")["rope.inv_freq"]
    want = model.rope.inv_freq
    assert got.dtype == torch.float32 and got.shape == (16,) and torch.equal(got, want)
    assert torch.equal(got, inv_freq(16)) == (theta == 10000.0)  # the config's theta, not the default


@pytest.mark.parametrize("field,value", [("rope_freq_dim", 10 ** 12), ("rope_theta", "big")])
def test_rope_that_cannot_be_computed_is_refused(tmp_path, run_ckpt, field, value):
    import json

    tiny().save_pretrained(tmp_path / "dif")
    cfg = json.loads((tmp_path / "dif" / "config.json").read_text())
    cfg[field] = value
    (tmp_path / "dif" / "config.json").write_text(json.dumps(cfg))
    assert_refused(run_ckpt, tmp_path, ["convert", tmp_path / "dif", "--layout", "original", "-o",
                                        tmp_path / "o.safetensors"], "config.json", "cannot make rope.inv_freq")


# ------------------------------------------------------------------------------------------- refusals

def test_pruned_checkpoint_has_no_diffusers_layout(tmp_path, run_ckpt, case):
    _, _, original, conv = case
    pruned = {k: v for k, v in original.items() if not k.startswith("time_embedder.")}
    pruned["adaln_t_table"] = torch.zeros(1025, 20)
    with pytest.raises(ValueError, match="pruned MiniMax-H3 checkpoint"):
        conv(dict(pruned))
    save_file(pruned, tmp_path / "pruned.safetensors")
    assert_refused(run_ckpt, tmp_path, ["convert", tmp_path / "pruned.safetensors", "--layout", "diffusers", "-o",
                                        tmp_path / "d"], "adaln_t_table", "a pruned MiniMax-H3 checkpoint")


@pytest.mark.parametrize("key,rows,problem", [("blocks.0.attn.qkv_proj.weight", 385, "rows 0:128, 128:256, 256:384"),
                                              ("blocks.1.mlp.fc1.weight", 95, "95 rows cannot be split in two")])
def test_fused_tensor_that_does_not_split_is_refused(tmp_path, run_ckpt, case, key, rows, problem):
    _, _, original, _ = case
    bad = dict(original)
    bad[key] = torch.zeros(rows, original[key].shape[1])
    save_file(bad, tmp_path / "bad.safetensors")
    assert_refused(run_ckpt, tmp_path, ["convert", tmp_path / "bad.safetensors", "--layout", "diffusers", "-o",
                                        tmp_path / "d"], key, problem)


def test_head_too_small_for_the_release_rope_needs_config(tmp_path, run_ckpt):
    model = tiny()
    save_file(original_from_pairs(families.get("minimax_h3"), state_dict(model)), tmp_path / "o.safetensors")
    assert_needs_config(run_ckpt, tmp_path, model, tmp_path / "o.safetensors",
                        "rope rotates 96 channels of a head; this head has 16); pass --config REF")


# ------------------------------------------------------------------------------------------ merge-lora

def _original_lora(original: dict, kohya: bool, r: int = 4, alpha: float | None = 2.0, seed: int = 5) -> dict:
    """A LoRA in the original module names: musubi-tuner's `lora_unet_<flat>` lora_down/up with alpha, or
    ai-toolkit's `diffusion_model.<dotted>` lora_A/B without (alpha = rank)."""
    g = torch.Generator().manual_seed(seed)
    mods = ["video_patch_proj", "condition_proj", "final_layer.video_out", "final_layer.adaln_proj.linear",
            "token_refiner.blocks.0.attn.qkv_proj", "token_refiner.blocks.0.mlp.fc1"]
    mods += [f"blocks.{i}.{m}" for i in range(2)
             for m in ("attn.qkv_proj", "attn.out_proj", "mlp.fc1", "mlp.fc2", "adaln_proj.linear")]
    lora = {}
    for mod in mods:
        rows, cols = original[f"{mod}.weight"].shape
        down, up = torch.randn(r, cols, generator=g) * 0.1, torch.randn(rows, r, generator=g) * 0.1
        if kohya:
            name = "lora_unet_" + mod.replace(".", "_")
            lora |= {f"{name}.lora_down.weight": down, f"{name}.lora_up.weight": up,
                     f"{name}.alpha": torch.tensor(alpha)}
        else:
            lora |= {f"diffusion_model.{mod}.lora_A.weight": down, f"diffusion_model.{mod}.lora_B.weight": up}
    return lora


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("h3")
    torch.manual_seed(1)
    model = tiny()
    sd = state_dict(model)
    model.save_pretrained(tmp / "folder")
    original = original_from_pairs(families.get("minimax_h3"), sd)
    save_file({"model.diffusion_model." + k: v for k, v in {**original, "rope.inv_freq": inv_freq(2)}.items()},
              tmp / "orig.safetensors")
    return model, sd, original, tmp


def _without_rope(model, rope=None):
    """The merged original file in diffusers names (diffusers' converter) once its `rope.inv_freq` is taken out
    (no diffusers tensor); `rope`: what that buffer must still be."""
    def to_diffusers(got):
        buffer = got.pop("rope.inv_freq")
        if rope is not None:
            assert torch.equal(buffer, rope)
        return convert(model)(got)

    return to_diffusers


def _merge_both(tmp_path, run_ckpt, bases, lora_file, want, changed, *options, rope_checked=True):
    model, sd, original, _ = bases
    to_diffusers = _without_rope(model, inv_freq(2) if rope_checked else None)
    for layout in (DIFFUSERS, ORIGINAL):
        got = merge_onto(run_ckpt, tmp_path, model, {**original, "rope.inv_freq": inv_freq(2)}, layout, lora_file,
                         to_diffusers, *options)
        assert compare(got, want, sd) == changed


@pytest.mark.parametrize("kohya", [True, False], ids=["musubi-kohya", "ai-toolkit"])
def test_original_named_lora_onto_both_layouts(tmp_path, run_ckpt, bases, kohya):
    _, sd, original, _ = bases
    save_file(_original_lora(original, kohya), tmp_path / "l.safetensors")
    want = diffusers_fused(tiny, sd, tmp_path / "l.safetensors", H3, 1.0)
    # 4 top-level projections; the refiner's q, k, v and fc1; each block's q, k, v, out_proj, fc1, fc2, adaln
    _merge_both(tmp_path, run_ckpt, bases, tmp_path / "l.safetensors", want, 4 + 4 + 2 * 7)


def test_diffusers_peft_lora_onto_both_layouts(tmp_path, run_ckpt, bases):
    _, sd, _, _ = bases
    targets = ["to_q", "to_v", "to_out.0", "ff.net.0.proj", "adaln_proj.linear", "proj_in", "context_embedder"]
    lora_file = peft_lora_file(tiny(), targets, tmp_path / "peft", H3)
    want = diffusers_fused(tiny, sd, lora_file, H3, 0.7)
    # to_q, to_v, to_out.0, ff.net.0.proj in 3 blocks; adaln_proj.linear in 2; proj_in, context_embedder
    _merge_both(tmp_path, run_ckpt, bases, lora_file, want, 3 * 4 + 2 + 2, "--ratio", 0.7, rope_checked=False)


def _diffsynth_lora(base: dict, mods, r: int = 4, seed: int = 7, default: bool = True) -> dict:
    """A DiffSynth-Studio LoRA: bare original names, peft's `.default.` infix, alpha-less (alpha = rank)."""
    g = torch.Generator().manual_seed(seed)
    infix = ".default" if default else ""
    lora = {}
    for mod in mods:
        rows, cols = base[f"{mod}.weight"].shape
        lora[f"{mod}.lora_A{infix}.weight"] = torch.randn(r, cols, generator=g) * 0.1
        lora[f"{mod}.lora_B{infix}.weight"] = torch.randn(rows, r, generator=g) * 0.1
    return lora


def tiny_two_heads():
    """Two heads of the releases' 128 channels: what makes per-head interleaved and stacked qkv differ."""
    return diffusers.MiniMaxH3Transformer3DModel(
        num_attention_heads=2, attention_head_dim=128, hidden_size=256, num_layers=2, num_refiner_layers=1, ffn_dim=48,
        in_channels=4, audio_in_channels=6, text_dim=12, freq_dim=8, time_embed_hidden_dim=24, time_embed_dim=20,
        rope_freq_dim=16)


def test_diffsynth_lora_interleaved_qkv_onto_both_layouts(tmp_path, run_ckpt):
    torch.manual_seed(4)
    model = tiny_two_heads()
    sd = state_dict(model)
    original = original_from_pairs(families.get("minimax_h3"), sd)
    base = {**original, "rope.inv_freq": model.rope.inv_freq.clone()}
    mods = ["token_refiner.blocks.0.attn.qkv_proj", "blocks.0.attn.qkv_proj", "blocks.1.attn.qkv_proj",
            "blocks.1.attn.out_proj", "blocks.0.mlp.fc1"]
    lora = _diffsynth_lora(original, mods)
    save_file(lora, tmp_path / "ds.safetensors")
    want = diffusers_fused(tiny_two_heads, sd, tmp_path / "ds.safetensors", H3, 1.0)
    changed = 3 * 3 + 1 + 1  # q, k, v of three blocks; to_out.0; ff.net.0.proj
    for layout in (DIFFUSERS, ORIGINAL):  # the original file with bare names, as DiffSynth-Studio's
        got = merge_onto(run_ckpt, tmp_path, model, base, layout, tmp_path / "ds.safetensors",
                         _without_rope(model, model.rope.inv_freq), prefix="")
        assert compare(got, want, sd) == changed
    # the same factors without the infix are a stacked LoRA: diffusers and ckpt agree on it too, and it differs
    save_file(_diffsynth_lora(original, mods, default=False), tmp_path / "stacked.safetensors")
    stacked = diffusers_fused(tiny_two_heads, sd, tmp_path / "stacked.safetensors", H3, 1.0)
    assert not torch.allclose(stacked["transformer_blocks.0.attn.to_k.weight"],
                              want["transformer_blocks.0.attn.to_k.weight"])
    got = merge_onto(run_ckpt, tmp_path, model, base, DIFFUSERS, tmp_path / "stacked.safetensors", None)
    assert compare(got, stacked, sd) == changed


def test_diffsynth_lora_converted_to_diffusers_naming_is_diffusers_reading(tmp_path, run_ckpt):
    """`ckpt lora convert` reads the same de-interleaved rows: each to_q/to_k/to_v delta is diffusers' own."""
    base = {"blocks.0.attn.qkv_proj.weight": torch.zeros(768, 256),
            "blocks.0.attn.out_proj.weight": torch.zeros(256, 256)}
    save_file(_diffsynth_lora(base, [m[:-len(".weight")] for m in base], seed=9), tmp_path / "ds.safetensors")
    code, _, err = run_ckpt("lora", "convert", tmp_path / "ds.safetensors", "--format", "diffusers", "-o",
                            tmp_path / "d.safetensors", "-q")
    assert code == 0, err
    got, want = load_file(tmp_path / "d.safetensors"), H3.lora_state_dict(str(tmp_path / "ds.safetensors"))
    for p in ("to_q", "to_k", "to_v", "to_out.0"):
        b = f"transformer.transformer_blocks.0.attn.{p}.lora_B.weight"
        a = b.replace("lora_B", "lora_A")
        torch.testing.assert_close(got[b] @ got[a], want[b] @ want[a], rtol=1e-5, atol=1e-6)


def test_diffsynth_lora_whose_qkv_is_no_whole_head_is_refused(tmp_path, run_ckpt, bases):
    _, _, original, tmp = bases  # 16-wide heads: a qkv_proj of 96 rows
    save_file(_diffsynth_lora(original, ["blocks.0.attn.qkv_proj", "blocks.0.mlp.fc2"]), tmp_path / "ds.safetensors")
    with pytest.raises(ValueError, match="not a multiple of"):
        H3.lora_state_dict(str(tmp_path / "ds.safetensors"))
    for base in (tmp / "folder", tmp / "orig.safetensors"):
        assert_refused(run_ckpt, tmp_path, ["merge-lora", base, tmp_path / "ds.safetensors", "-o",
                                            tmp_path / "out.safetensors"], tmp_path / "ds.safetensors",
                       "module 'blocks.0.attn.qkv_proj' has 96 up rows, no whole number of 128-wide heads")


# --------------------------------------------------------------------------------- high precision

def test_int8_keeps_the_family_high_precision_layers(tmp_path, run_ckpt, bases):
    _, _, _, tmp = bases
    code, _, err = run_ckpt("convert", tmp / "orig.safetensors", "--to", "int8", "-o", tmp_path / "q.safetensors")
    assert code == 0, err
    assert "MiniMax-H3, original names: the family's high-precision layers kept" in err
    q = load_file(tmp_path / "q.safetensors")
    plain = load_file(tmp / "orig.safetensors")
    quantized = {k[: -len(".comfy_quant")] for k in q if k.endswith(".comfy_quant")}
    pre = "model.diffusion_model."
    assert quantized == {k[: -len(".weight")] for k, v in plain.items() if v.dim() == 2 and k.endswith(".weight")
                         and k.startswith((pre + "blocks.", pre + "token_refiner.blocks."))}
    for k in ("video_patch_proj", "audio_patch_proj", "condition_proj", "time_embedder.proj_in",
              "final_layer.adaln_proj.linear", "final_layer.video_out", "final_layer.audio_out"):
        assert torch.equal(q[f"{pre}{k}.weight"], plain[f"{pre}{k}.weight"]), k
