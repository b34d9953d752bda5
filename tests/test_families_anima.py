"""Anima: Cosmos-Predict2's DiT plus an LLM adapter in one file (ComfyUI `comfy/ldm/anima/model.py`) <-> diffusers
CosmosTransformer3DModel, with the adapter as diffusers' AnimaTextConditioner.

Oracles: diffusers' Cosmos single-file converter (`convert_cosmos_transformer_checkpoint_to_diffusers`) for the
DiT's names, bit for bit; AnimaTextConditioner's own state dict for the adapter's names (ComfyUI's LLMAdapter
names are the same); diffusers' Anima LoRA loading (`AnimaLoraLoaderMixin.lora_state_dict`, which converts
`diffusion_model.` names itself, `load_lora_adapter`, `fuse_lora`) for merge-lora; `from_pretrained` strict for
`convert --layout diffusers`; the gguf package for the GGUF write.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from families_util import assert_detected_both_layouts, merge_onto, original_from_pairs, shapes, state_dict, unique_values
from helpers.refusals import assert_refused
from helpers.tiny_anima import TEXT, tiny_conditioner, tiny_cosmos
from ckpt import families
from ckpt.families import DIFFUSERS, ORIGINAL

diffusers = pytest.importorskip("diffusers")
peft = pytest.importorskip("peft")
from helpers.merge_compare import compare, peft_lora_file  # noqa: E402

def anima_original(dit_sd: dict, adapter_sd: dict) -> dict:
    """The Anima single file: the DiT's original names (the family's pairs, checked against diffusers' converter
    in every test that uses them) and the adapter under `llm_adapter.` with the names ComfyUI's LLMAdapter has."""
    out = original_from_pairs(families.get("anima"), dit_sd)
    out.update({"llm_adapter." + k: v for k, v in adapter_sd.items()})
    return out


def converted(original: dict) -> dict:
    """diffusers' own Cosmos single-file converter on the DiT's tensors (the adapter is no transformer tensor)."""
    from diffusers.loaders.single_file_utils import convert_cosmos_transformer_checkpoint_to_diffusers

    return convert_cosmos_transformer_checkpoint_to_diffusers(
        {"net." + k: v for k, v in original.items() if not k.startswith("llm_adapter.")})


@pytest.fixture(scope="module")
def models():
    dit, cond = tiny_cosmos(), tiny_conditioner()
    dit_sd, cond_sd = unique_values(state_dict(dit)), unique_values(state_dict(cond))
    dit_sd = {k: v / 1000 for k, v in dit_sd.items()}
    cond_sd = {k: v / 1000 + 7 for k, v in cond_sd.items()}
    return dit_sd, cond_sd, anima_original(dit_sd, cond_sd)


def test_correspondence_is_diffusers_converter(models):
    dit_sd, cond_sd, original = models
    back = converted(original)
    assert set(back) == set(dit_sd) and all(torch.equal(back[k], dit_sd[k]) for k in dit_sd)
    # the converter's dropped bookkeeping is original-only here too
    fam = families.get("anima")
    extra = {"pos_embedder.seq": (256,), "blocks.0.self_attn.q_proj._extra_state": (0,), "accum_iteration": (1,)}
    one_side = {p.original for p in fam.pairs({**shapes(original), **extra}, ORIGINAL) if p.diffusers is None}
    assert one_side == set(extra) | {k for k in original if k.startswith("llm_adapter.")}


def test_detection_both_layouts_lora_names_and_look_alikes(models):
    dit_sd, _, original = models
    assert_detected_both_layouts("anima", shapes(original), shapes(dit_sd))
    assert "LLM adapter" in families.detect(shapes(original), shapes(original)).label
    # the same DiT without the adapter is Cosmos-Predict2 (ComfyUI: `llm_adapter.blocks.0.cross_attn` decides)
    plain = {k: v for k, v in shapes(original).items() if not k.startswith("llm_adapter.")}
    assert families.detect(plain, plain).family_id == "cosmos"
    # a kohya LoRA on the blocks only (sd-scripts' names)
    lora = [f"blocks_{i}_{a}_{p}" for i in range(2) for a in ("self_attn", "cross_attn")
            for p in ("q_proj", "k_proj", "v_proj", "output_proj")]
    assert (families.detect(lora).family_id, families.detect(lora).layout) == ("anima", ORIGINAL)
    # Wan's own block names stay Wan's
    wan = [f"blocks_{i}_self_attn_{p}" for i in range(2) for p in "qkvo"]
    assert families.detect(wan).family_id == "wan"
    assert families.from_config({"_class_name": "CosmosTransformer3DModel"}) is families.get("anima")


def test_diffusers_config_and_convert_both_ways(models, tmp_path, run_ckpt):
    dit_sd, _, original = models
    save_file({"model.diffusion_model." + k: v for k, v in original.items()}, tmp_path / "anima.safetensors")
    code, out, err = run_ckpt("convert", tmp_path / "anima.safetensors", "--layout", "diffusers", "-o",
                              tmp_path / "dif")
    assert code == 0, err
    assert "llm_adapter." in out + err, (out, err)  # the adapter is left out, and said so
    model, info = diffusers.CosmosTransformer3DModel.from_pretrained(tmp_path / "dif", output_loading_info=True)
    assert not any(info.values()), info
    assert all(torch.equal(model.state_dict()[k], dit_sd[k]) for k in dit_sd)
    cfg = json.loads((tmp_path / "dif" / "config.json").read_text())
    assert {k: cfg[k] for k in ("in_channels", "out_channels", "num_attention_heads", "text_embed_dim")} == \
        {"in_channels": 4, "out_channels": 4, "num_attention_heads": 2, "text_embed_dim": TEXT}

    code, _, err = run_ckpt("convert", tmp_path / "dif", "--layout", "original", "-o", tmp_path / "back.safetensors")
    assert code == 0, err
    back = load_file(tmp_path / "back.safetensors")
    dit_only = {k: v for k, v in original.items() if not k.startswith("llm_adapter.")}
    assert set(back) == set(dit_only) and all(torch.equal(back[k], dit_only[k]) for k in dit_only)


def _fused(dit_sd, cond_sd, lora_file, ratio=1.0):
    """diffusers' answer: the Anima LoRA loader's state dict, each part fused into its own fresh model."""
    sd, meta = diffusers.AnimaModularPipeline.lora_state_dict(str(lora_file), return_lora_metadata=True)
    out = {}
    for prefix, make, base in (("transformer", tiny_cosmos, dit_sd), ("text_conditioner", tiny_conditioner, cond_sd)):
        model = make()
        model.load_state_dict(base)
        part = {k: v for k, v in sd.items() if k.startswith(prefix + ".")}
        if part:
            model.load_lora_adapter(part, prefix=prefix, adapter_name="x", metadata=meta)
            model.fuse_lora(lora_scale=ratio)
        out[prefix] = {k.replace(".base_layer.", "."): v.detach().clone() for k, v in model.state_dict().items()
                       if "lora_" not in k}
    return out


def _comfy_lora(original, path, r=2):
    torch.manual_seed(5)
    lora = {}
    for mod in ("blocks.0.self_attn.q_proj", "blocks.1.cross_attn.v_proj", "blocks.0.mlp.layer1",
                "blocks.1.adaln_modulation_mlp.1", "final_layer.linear", "llm_adapter.blocks.0.cross_attn.k_proj",
                "llm_adapter.blocks.1.mlp.0", "llm_adapter.out_proj"):
        w = original[f"{mod}.weight"]
        lora[f"diffusion_model.{mod}.lora_A.weight"] = torch.randn(r, w.shape[1]) * 0.1
        lora[f"diffusion_model.{mod}.lora_B.weight"] = torch.randn(w.shape[0], r) * 0.1
    save_file(lora, path)
    return path


def test_comfy_lora_onto_original_and_diffusers(models, tmp_path, run_ckpt):
    """A ComfyUI/diffusion-pipe LoRA (`diffusion_model.` + original names, DiT and adapter) merged into the
    Anima single file and into the diffusers transformer folder, against diffusers' Anima LoRA loading."""
    dit_sd, cond_sd, original = models
    lora = _comfy_lora(original, tmp_path / "comfy.safetensors")
    want = _fused(dit_sd, cond_sd, lora)
    save_file(original, tmp_path / "anima.safetensors")
    code, out, err = run_ckpt("merge-lora", tmp_path / "anima.safetensors", lora, "-o", tmp_path / "m.safetensors",
                              "-q")
    assert code == 0, err
    got = load_file(tmp_path / "m.safetensors")
    assert compare(converted(got), want["transformer"], dit_sd) == 5
    adapter = {k[len("llm_adapter."):]: v for k, v in got.items() if k.startswith("llm_adapter.")}
    assert compare(adapter, want["text_conditioner"], cond_sd) == 3

    # the diffusers transformer holds no adapter: only the DiT's modules have a place there
    dit_lora = {k: v for k, v in load_file(lora).items() if "llm_adapter" not in k}
    save_file(dit_lora, tmp_path / "dit_lora.safetensors")
    model = tiny_cosmos()
    model.load_state_dict(dit_sd)
    got = merge_onto(run_ckpt, tmp_path, model, None, DIFFUSERS, tmp_path / "dit_lora.safetensors", None)
    assert compare(got, want["transformer"], dit_sd) == 5


def test_diffusers_lora_onto_original(models, tmp_path, run_ckpt):
    """diffusers/PEFT LoRAs on the Anima single file: a transformer adapter as `save_lora_weights` writes it
    (`transformer.` names, alpha in `lora_adapter_metadata`) and a text-conditioner one (`text_conditioner.`)."""
    dit_sd, cond_sd, original = models
    model = tiny_cosmos()
    model.load_state_dict(dit_sd)
    # AnimaLoraLoaderMixin has no save_lora_weights; any transformer pipeline's writes the same `transformer.` file
    dit_lora = peft_lora_file(model, ["to_q", "to_out.0", "ff.net.2", "linear_2"], tmp_path / "d",
                              diffusers.WanPipeline)
    torch.manual_seed(6)
    cond = {}
    for mod, (o, i) in (("blocks.0.self_attn.q_proj", (16, 16)), ("blocks.1.cross_attn.k_proj", (16, 20))):
        cond[f"text_conditioner.{mod}.lora_A.weight"] = torch.randn(4, i) * 0.1
        cond[f"text_conditioner.{mod}.lora_B.weight"] = torch.randn(o, 4) * 0.1
    save_file(cond, tmp_path / "cond.safetensors")
    want_dit = _fused(dit_sd, cond_sd, dit_lora)["transformer"]
    want_cond = _fused(dit_sd, cond_sd, tmp_path / "cond.safetensors")["text_conditioner"]
    save_file(original, tmp_path / "anima.safetensors")
    code, _, err = run_ckpt("merge-lora", tmp_path / "anima.safetensors", dit_lora, tmp_path / "cond.safetensors",
                            "-o", tmp_path / "m.safetensors", "-q")
    assert code == 0, err
    got = load_file(tmp_path / "m.safetensors")
    # per block: to_q and to_out.0 of both attentions, ff.net.2, norm1-3.linear_2; and the time embedder's and
    # norm_out's linear_2
    assert compare(converted(got), want_dit, dit_sd) == 2 * 8 + 2
    adapter = {k[len("llm_adapter."):]: v for k, v in got.items() if k.startswith("llm_adapter.")}
    assert compare(adapter, want_cond, cond_sd) == 2


def test_gguf_stores_anima_as_cosmos_with_its_high_precision_layers(models, tmp_path, run_ckpt):
    gguf = pytest.importorskip("gguf")
    _, _, original = models
    save_file({k: v.to(torch.bfloat16) for k, v in original.items()}, tmp_path / "anima.safetensors")
    code, _, err = run_ckpt("convert", tmp_path / "anima.safetensors", "--to", "gguf-q8_0", "-o",
                            tmp_path / "a.gguf")
    assert code == 0, err
    r = gguf.GGUFReader(tmp_path / "a.gguf")
    arch = r.get_field("general.architecture")
    assert bytes(arch.parts[arch.data[0]]).decode() == "cosmos"
    types = {t.name: t.tensor_type.name for t in r.tensors}
    assert types["x_embedder.proj.1.weight"] != "Q8_0" and types["final_layer.linear.weight"] != "Q8_0"
    assert types["blocks.0.self_attn.q_proj.weight"] == "Q8_0"


def test_refusals(models, tmp_path, run_ckpt):
    """What the weights cannot say is refused in one line: a patch embedder that is no (channels + padding mask)
    x 2 x 2 leaves no config.json to derive (the intact model converts: test above)."""
    dit_sd, _, _ = models
    bad = dict(dit_sd)
    bad["patch_embed.proj.weight"] = torch.zeros(32, 6)
    save_file(bad, tmp_path / "odd.safetensors")
    assert_refused(run_ckpt, tmp_path, ("convert", tmp_path / "odd.safetensors", "--layout", "diffusers",
                                        "-o", tmp_path / "o"), str(tmp_path / "odd.safetensors"),
                   "a patch embedder of 6 columns is not (channels + padding mask) x 2 x 2")
    # a width that is no whole number of heads (the q/k norm says the head size)
    bad = dict(dit_sd)
    bad["transformer_blocks.0.attn1.norm_q.weight"] = torch.zeros(12)
    save_file(bad, tmp_path / "heads.safetensors")
    assert_refused(run_ckpt, tmp_path, ("convert", tmp_path / "heads.safetensors", "--layout", "diffusers",
                                        "-o", tmp_path / "o"), str(tmp_path / "heads.safetensors"),
                   "no whole number of 12-wide heads")
